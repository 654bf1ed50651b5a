//go:build !external

package deploy_test

import (
	"os"
	"path/filepath"
	"testing"
)

// kube_external_test.go applies deploy/kubernetes on a real kube-apiserver and etcd, which
// hack/kube-env.sh builds from the module proxy: it is built with -tags external, as make test
// does, so that a plain go test needs nothing from outside.
func TestOnKubernetesNeedsTagExternal(t *testing.T) {
	t.Parallel()
	script := filepath.Join(repoRoot, "hack", "kube-env.sh")
	if info, err := os.Stat(script); err != nil || info.Mode().Perm()&0o100 == 0 {
		t.Fatalf("%s, which make test runs for these tests, is not an executable script: %v", script, err)
	}
	t.Skip("applying deploy/kubernetes on a real kube-apiserver is built with -tags external: run make test (or hack/kube-env.sh, then go test -tags external)")
}
