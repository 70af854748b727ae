//go:build tools

// Package tools pins the commands this module builds, so `go mod tidy` keeps them: Kubernetes'
// six, Kueue's controller and CoreDNS, one dependency graph compiled once (README.md).
package tools

import (
	_ "github.com/coredns/coredns"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "sigs.k8s.io/kueue/cmd/kueue"
)
