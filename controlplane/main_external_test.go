//go:build external

package controlplane_test

import (
	"os"
	"testing"

	"github.com/meshid/meshid/ca/controller/kube/kubetest"
)

// kubeEnv is the package's real API server, for the control plane on Kubernetes.
var kubeEnv *kubetest.Env

func TestMain(m *testing.M) { os.Exit(kubetest.Main(m, &kubeEnv)) }
