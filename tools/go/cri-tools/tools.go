//go:build tools

// Package tools pins the Go programs the test bed drives (scripts/gotools.sh builds them):
// crictl, and critest, which cri-tools builds as the test binary of cmd/critest.
package tools

import (
	_ "github.com/onsi/ginkgo/v2"
	_ "github.com/onsi/gomega"
	_ "sigs.k8s.io/cri-tools/cmd/crictl"
	_ "sigs.k8s.io/cri-tools/pkg/benchmark"
	_ "sigs.k8s.io/cri-tools/pkg/common"
	_ "sigs.k8s.io/cri-tools/pkg/framework"
	_ "sigs.k8s.io/cri-tools/pkg/validate"
)
