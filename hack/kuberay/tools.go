//go:build tools

// Package tools pins the KubeRay operator command this module builds, so `go mod tidy` keeps it.
package tools

import _ "github.com/ray-project/kuberay/ray-operator"
