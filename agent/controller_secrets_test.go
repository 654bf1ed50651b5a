package agent_test

import (
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// A service-account secret written by `meshid ca --manifests` is a credentials dir an agent serves
// as it is.
func TestAgentServesAControllerSecret(t *testing.T) {
	t.Parallel()
	manifests := t.TempDir()
	testutil.WriteFiles(t, manifests, map[string][]byte{
		"sa.yaml": []byte("apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: cart\n  namespace: shop\n"),
	})
	created := make(chan struct{})
	var once sync.Once
	cpCfg := controlplanetest.Config(t)
	cpCfg.Manifests = manifests
	cpCfg.Secrets.OnEvent = func(ev controller.SecretEvent) {
		if ev.Kind == controller.SecretCreated && ev.Namespace == "shop" && ev.ServiceAccount == "cart" {
			once.Do(func() { close(created) })
		}
	}
	controlplanetest.Start(t, cpCfg)
	receive(t, created, "the secret of shop/cart")
	dir := filepath.Join(ca.SecretsDir(cpCfg.StateDir), "shop", "istio.cart")
	chainPEM, err := os.ReadFile(filepath.Join(dir, "cert-chain.pem"))
	if err != nil {
		t.Fatal(err)
	}
	chain, err := pki.ParseCertificates(chainPEM)
	if err != nil {
		t.Fatal(err)
	}

	cfg := testConfig(t, newFakeClock(), nil, nil)
	cfg.SDS.CredentialsDir = dir
	cfg.CA.Address = closedAddress(t) // never contacted: the files are served
	cfg.Identity.Namespace, cfg.Identity.ServiceAccount = "shop", "cart"
	a := newAgent(t, cfg)
	runAgent(t, a)
	got := sdsGet(t, a.SocketPath(), "default", "ROOTCA")
	if serial := serialOf(workloadChain(t, got["default"])); serial != serialOf(chain) {
		t.Fatalf("the agent serves %s, want the secret's %s", serial, serialOf(chain))
	}
	roots := readRoots(t, filepath.Join(cpCfg.StateDir, "root-cert.pem"))
	checkVerifies(t, workloadChain(t, got["default"]), roots, "spiffe://cluster.local/ns/shop/sa/cart", time.Now())
}
