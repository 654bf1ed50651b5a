//go:build external

package controlplane_test

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller/kube/kubetest"
	"github.com/meshid/meshid/controlplane"
)

// A downstream CA runs on Kubernetes as on files: its signing certificate comes from the upstream
// and is kept in its state dir, no cacerts Secret is made, and a workload's TokenRequest token
// gets a chain up to the upstream's root.
func TestDownstreamCAOnKubernetes(t *testing.T) {
	t.Parallel()
	ns := kubeEnv.Namespace(t, nil)
	dir := t.TempDir()
	upCfg := testConfig(filepath.Join(dir, "upstream"))
	upCfg.SignCACerts = true
	upCfg.CACertIdentities = []string{"spiffe://cluster.local/ns/" + ns + "/sa/meshid-ca"}
	up := start(t, upCfg)
	upRoot := ca.RootCertPath(upCfg.StateDir)
	tokenFile := filepath.Join(dir, "upstream-token")
	if err := os.WriteFile(tokenFile, []byte(mint(t, upCfg.StateDir, ns, "meshid-ca")), 0o600); err != nil {
		t.Fatal(err)
	}

	r := startReplica(t, "downstream", func(cfg *controlplane.Config) {
		cfg.CANamespace = ns
		cfg.Kubernetes.Kubeconfig = kubetest.Kubeconfig(t, t.TempDir(), kubeEnv.Admin)
		cfg.Upstream = controlplane.UpstreamConfig{Address: up.GRPCAddr(), RootCertFile: upRoot, TokenPath: tokenFile, RequestedTTL: 48 * time.Hour}
	})
	if b := r.cp.Authority().Bundle(); b.Source() != ca.SourceUpstream || !b.Root().Equal(up.Authority().Bundle().Root()) {
		t.Fatalf("signing with %q (%s), want an upstream-signed certificate under the upstream root", b.SigningCert().Subject, b.Source())
	}
	if _, err := kubeEnv.Core().Secrets(ns).Get(t.Context(), "cacerts", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("a cacerts Secret beside an upstream CA: %v", err)
	}
	app := kubeEnv.Namespace(t, nil)
	kubeEnv.ServiceAccount(t, app, "web")
	tok := kubeEnv.Token(t, app, "web", time.Hour, "istio-ca")
	chain, err := createCertificate(t, r.cp.GRPCAddr(), upRoot, tok, "spiffe://cluster.local/ns/"+app+"/sa/web")
	if err != nil {
		t.Fatal(err)
	}
	if len(chain) != 3 || !chain[1].Equal(r.cp.Authority().Bundle().SigningCert()) {
		t.Fatalf("chain of %d certificates, want leaf, the downstream's intermediate, the upstream root", len(chain))
	}
}
