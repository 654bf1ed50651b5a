//go:build external

package kube_test

import (
	"os"
	"testing"

	"github.com/meshid/meshid/ca/controller/kube/kubetest"
)

// env is the package's API server: one per package, not per test (it costs ≈ 300 MB idle).
var env *kubetest.Env

func TestMain(m *testing.M) { os.Exit(kubetest.Main(m, &env)) }
