// Command argocd-local is Argo CD's application controller and repo server in one binary, for
// `tpuft cluster up --argocd` (the two components that sync and judge Applications; no API server,
// UI, Dex or ApplicationSet controller), plus `health`, which judges objects with Argo CD's own
// health code path. Like Argo CD's own image, it runs the component its name says (a link named
// argocd-application-controller or argocd-repo-server), or the one its first argument names.
//
//	argocd-application-controller [flags]       # Argo CD's own command and flags
//	argocd-repo-server [flags]                  # Argo CD's own command and flags
//	argocd-local health ARGOCD_CM.yaml FILE...  # one JSON line per object
//
// `health` reads the argocd-cm ConfigMap as a user installs it (through Argo CD's SettingsManager,
// over a fake clientset holding only that ConfigMap) and calls gitops-engine's
// health.GetResourceHealth with Argo CD's Lua overrides, as the controller does for every live
// resource (controller/health.go). A FILE holds one object, or a test fixture whose `object` key
// holds it.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"github.com/argoproj/argo-cd/gitops-engine/v3/pkg/health"
	controller "github.com/argoproj/argo-cd/v3/cmd/argocd-application-controller/commands"
	reposerver "github.com/argoproj/argo-cd/v3/cmd/argocd-repo-server/commands"
	"github.com/argoproj/argo-cd/v3/pkg/apis/application/v1alpha1"
	"github.com/argoproj/argo-cd/v3/util/lua"
	"github.com/argoproj/argo-cd/v3/util/settings"
	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/kubernetes/fake"
	"sigs.k8s.io/yaml"
)

const usage = "usage: argocd-local argocd-application-controller|argocd-repo-server [flags] | health ARGOCD_CM.yaml FILE..."

func main() {
	name, args := filepath.Base(os.Args[0]), os.Args[1:]
	if name == "argocd-local" {
		if len(args) == 0 {
			fmt.Fprintln(os.Stderr, usage)
			os.Exit(2)
		}
		name, args = args[0], args[1:]
	}
	switch name {
	case "argocd-application-controller":
		os.Exit(execute(controller.NewCommand(), args))
	case "argocd-repo-server":
		os.Exit(execute(reposerver.NewCommand(), args))
	case "health":
		os.Exit(judge(args))
	default:
		fmt.Fprintf(os.Stderr, "argocd-local: unknown command %q\n%s\n", name, usage)
		os.Exit(2)
	}
}

func execute(cmd *cobra.Command, args []string) int {
	cmd.SetArgs(args)
	if err := cmd.Execute(); err != nil {
		return 1
	}
	return 0
}

type verdict struct {
	File    string `json:"file"`
	Status  string `json:"status,omitempty"`
	Message string `json:"message"`
	Error   string `json:"error,omitempty"`
}

func judge(args []string) int {
	if len(args) < 2 {
		fmt.Fprintln(os.Stderr, usage)
		return 2
	}
	overrides, err := resourceOverrides(args[0])
	if err != nil {
		fmt.Fprintf(os.Stderr, "argocd-local health: %s: %v\n", args[0], err)
		return 1
	}
	out := json.NewEncoder(os.Stdout)
	for _, file := range args[1:] {
		v := verdict{File: file}
		obj, err := readObject(file)
		if err == nil {
			var hs *health.HealthStatus
			hs, err = health.GetResourceHealth(obj, lua.ResourceHealthOverrides(overrides))
			if hs != nil {
				v.Status, v.Message = string(hs.Status), hs.Message
			}
		}
		if err != nil {
			v.Error = err.Error()
		}
		if err := out.Encode(v); err != nil {
			return 1
		}
	}
	return 0
}

// resourceOverrides reads argocd-cm the way Argo CD does: its SettingsManager, which finds the
// ConfigMap only by its name, namespace and the app.kubernetes.io/part-of=argocd label.
func resourceOverrides(path string) (map[string]v1alpha1.ResourceOverride, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var cm corev1.ConfigMap
	if err := yaml.UnmarshalStrict(raw, &cm); err != nil {
		return nil, err
	}
	mgr := settings.NewSettingsManager(context.Background(), fake.NewClientset(&cm), cm.Namespace)
	return mgr.GetResourceOverrides()
}

func readObject(path string) (*unstructured.Unstructured, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var doc map[string]any
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		return nil, err
	}
	if inner, ok := doc["object"].(map[string]any); ok {
		doc = inner
	}
	return &unstructured.Unstructured{Object: doc}, nil
}
