//go:build !external

package kube_test

import (
	"os"
	"path/filepath"
	"testing"
)

// Every test of this package runs on a real kube-apiserver and etcd, which hack/kube-env.sh
// builds from the module proxy: they are built with -tags external, as make test does, so that
// a plain go test needs nothing from outside.
func TestKubernetesStoreNeedsTagExternal(t *testing.T) {
	// What the message tells to run must be there to run.
	script := filepath.Join("../../..", "hack", "kube-env.sh")
	if info, err := os.Stat(script); err != nil || info.Mode().Perm()&0o100 == 0 {
		t.Fatalf("%s, which make test runs for these tests, is not an executable script: %v", script, err)
	}
	t.Skip("the tests on a real kube-apiserver are built with -tags external: run make test (or hack/kube-env.sh, then go test -tags external)")
}
