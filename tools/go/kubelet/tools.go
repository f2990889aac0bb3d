//go:build tools

// Package tools pins the kubelet the test bed runs (scripts/gotools.sh builds it). go.mod replaces
// each staging module k8s.io/kubernetes points at a local path with its v0.37.2 release.
package tools

import _ "k8s.io/kubernetes/cmd/kubelet"
