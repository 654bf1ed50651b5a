//go:build external

package main

import (
	"os"
	"testing"

	"github.com/meshid/meshid/ca/controller/kube/kubetest"
)

// kubeEnv is the package's real API server, for node mode's Kubernetes source.
var kubeEnv *kubetest.Env

func TestMain(m *testing.M) { os.Exit(kubetest.Main(m, &kubeEnv)) }
