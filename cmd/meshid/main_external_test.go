//go:build external

package main

import (
	"os"
	"testing"

	"github.com/meshid/meshid/ca/controller/kube/kubetest"
)

// kubeEnv is the package's real API server, for node mode's Kubernetes source.
var kubeEnv *kubetest.Env

func TestMain(m *testing.M) {
	if os.Getenv(helperProcessEnv) == "1" {
		// This binary run as meshid by a test (TestHelperProcess): it needs no API server, and
		// would leave one behind, as it ends through os.Exit.
		os.Exit(m.Run())
	}
	os.Exit(kubetest.Main(m, &kubeEnv))
}
