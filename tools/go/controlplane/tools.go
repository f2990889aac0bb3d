//go:build tools

// Package tools pins the control plane the cluster test bed runs (testbed/cluster.py;
// scripts/gotools.sh builds it). go.mod replaces each staging module k8s.io/kubernetes points at a
// local path with its v0.37.2 release, as tools/go/kubelet/go.mod does.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
