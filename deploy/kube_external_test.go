//go:build external

package deploy_test

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/meshid/meshid/ca/controller/kube/kubetest"
)

// kubeEnv is the package's real API server: fresh, used by this file's test alone.
var kubeEnv *kubetest.Env

func TestMain(m *testing.M) { os.Exit(kubetest.Main(m, &kubeEnv)) }

// `kubectl apply -f DIR` of each directory of deploy/kubernetes on a fresh cluster: every file
// in kubectl's order and every document in order, each admitted and stored at once.
func TestKubectlApplyOnAFreshCluster(t *testing.T) {
	// What makes the order matter: the API server (NamespaceLifecycle admission) refuses an
	// object in a namespace that does not exist yet.
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	missing := filepath.Join(t.TempDir(), "missing.yaml")
	if err := os.WriteFile(missing, []byte("apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: a\n  namespace: missing-"+hex.EncodeToString(suffix)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := kubeEnv.TryApply(false, missing); !apierrors.IsNotFound(err) {
		t.Fatalf("an object in a namespace that does not exist: %v, want NotFound", err)
	}

	for _, dir := range kubeDirs {
		t.Run(dir, func(t *testing.T) {
			files := kubectlFiles(t, dir)
			var want []doc
			for _, f := range files {
				want = append(want, readDocs(t, f)...)
			}
			applied, err := kubeEnv.TryApply(false, files...)
			if err != nil {
				t.Fatalf("kubectl apply -f %s on a fresh cluster: %v", dir, err)
			}
			if len(applied) != len(want) {
				t.Fatalf("%d objects applied, the files hold %d", len(applied), len(want))
			}
			kubectlOrder(t, dir, want)
		})
	}
}

// kubectlOrder checks, with the real kubectl where there is one, that `kubectl apply -f dir`
// reads the files and documents this test applied, in the same order, and no subdirectory.
func kubectlOrder(t *testing.T, dir string, want []doc) {
	t.Helper()
	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		t.Log("no kubectl here: the order is the one kubectl documents (files in lexical order, no recursion without -R)")
		return
	}
	kubeconfig := kubetest.Kubeconfig(t, t.TempDir(), kubeEnv.Admin)
	out, err := exec.Command(kubectl, "--kubeconfig", kubeconfig, "apply", "--dry-run=server", "-o", "name", "-f", dir).Output()
	if err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			t.Fatalf("kubectl apply --dry-run=server -f %s: %v\n%s", dir, err, exit.Stderr)
		}
		t.Fatalf("kubectl apply --dry-run=server -f %s: %v", dir, err)
	}
	var got, wantNames []string
	for _, line := range strings.Fields(string(out)) {
		resource, name, _ := strings.Cut(line, "/")
		kind, _, _ := strings.Cut(resource, ".")
		got = append(got, kind+"/"+name)
	}
	for _, d := range want {
		wantNames = append(wantNames, strings.ToLower(d.meta.Kind)+"/"+d.meta.Metadata.Name)
	}
	if !slices.Equal(got, wantNames) {
		t.Errorf("kubectl apply -f %s applies %v, this test %v", dir, got, wantNames)
	}
}
