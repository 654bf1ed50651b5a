package controlplane_test

import (
	"crypto/x509"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

func serviceAccountManifest(ns, name string) []byte {
	return []byte("apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: " + name + "\n  namespace: " + ns + "\n")
}

// `meshid ca --manifests DIR`: every service account of a served namespace gets a secret under
// the state dir that chains to the trust bundle clients read, and a namespace not served gets none.
func TestSecretsFromManifests(t *testing.T) {
	t.Parallel()
	manifests := t.TempDir()
	testutil.WriteFiles(t, manifests, map[string][]byte{
		"ns.yaml":  append(namespaceManifest("prod", `ca.istio.io/override: "false"`), []byte("---\n")...),
		"web.yaml": serviceAccountManifest("default", "web"),
		"off.yaml": serviceAccountManifest("prod", "web"),
		"bad.yaml": []byte("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: Bad_Name\n"),
	})
	events := make(chan controller.SecretEvent, 1024)
	cfg := testConfig(t.TempDir())
	cfg.Manifests = manifests
	cfg.Secrets.OnEvent = func(ev controller.SecretEvent) { events <- ev }
	cp := start(t, cfg)

	seen := map[string]controller.SecretEventKind{}
	giveUp := time.NewTimer(30 * time.Second)
	defer giveUp.Stop()
	for seen["default/web"] != controller.SecretCreated || seen["prod/web"] != controller.SecretAbsent {
		select {
		case ev := <-events:
			seen[ev.Namespace+"/"+ev.ServiceAccount] = ev.Kind
		case <-giveUp.C:
			t.Fatalf("events so far: %v", seen)
		}
	}
	dir := filepath.Join(ca.SecretsDir(cfg.StateDir), "default", "istio.web")
	chain, err := pki.ParseCertificates([]byte(readFile(t, filepath.Join(dir, "cert-chain.pem"))))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM([]byte(readFile(t, filepath.Join(cfg.StateDir, "root-cert.pem"))))
	if _, err := chain[0].Verify(x509.VerifyOptions{Roots: roots}); err != nil {
		t.Errorf("the secret does not chain to the state dir's root-cert.pem: %v", err)
	}
	if got := chain[0].URIs[0].String(); got != "spiffe://cluster.local/ns/default/sa/web" {
		t.Errorf("identity %s", got)
	}
	if _, err := os.Stat(filepath.Join(ca.SecretsDir(cfg.StateDir), "prod")); err == nil {
		t.Error("a namespace not served got secrets")
	}
	_, metrics := get(t, "http://"+cp.MonitoringAddr()+"/metrics")
	for _, want := range []string{"meshid_ca_secrets_created_total 1", "meshid_ca_secrets_deleted_total 0",
		"meshid_ca_secrets_refreshed_total 0", "meshid_ca_secret_reconcile_errors_total 0", "meshid_ca_secret_queue_depth ",
		`meshid_ca_manifest_problems{kind="object"} 1`, `meshid_ca_manifest_problems{kind="file"} 0`} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
}
