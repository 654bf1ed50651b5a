package e2e_test

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/sds/sdsclient"
)

// startCAArgs runs `meshid ca` on stateDir and loopback ports of its choosing, with args.
func startCAArgs(t *testing.T, label, stateDir string, args ...string) *caProcess {
	t.Helper()
	c := &caProcess{stateDir: stateDir}
	c.process = start(t, label, "meshid", append([]string{"ca", "--state-dir", stateDir,
		"--grpc-addr", "127.0.0.1:0", "--monitoring-addr", "127.0.0.1:0"}, args...)...)
	started := c.awaitLog(t, "CA started", nil)
	c.addr, c.monitoringAddr = started["address"].(string), started["monitoring_address"].(string)
	return c
}

// signingSerial is the serial of the certificate the CA signs with, as its /debug/ca shows it.
func (ca *caProcess) signingSerial(t *testing.T) string {
	t.Helper()
	var doc struct {
		Source  string `json:"source"`
		Signing struct {
			Serial string `json:"serial"`
		} `json:"signing_cert"`
	}
	body := httpGet(t, "http://"+ca.monitoringAddr+"/debug/ca")
	if err := json.Unmarshal([]byte(body), &doc); err != nil || doc.Source != "upstream" {
		t.Fatalf("/debug/ca: %v, want an upstream-signed certificate:\n%s", err, body)
	}
	return doc.Signing.Serial
}

// agentSecrets is what an Envoy gets from a's SDS socket: default and ROOTCA.
func agentSecrets(t *testing.T, a *agentProcess) (chain, roots []*x509.Certificate) {
	t.Helper()
	client, err := sdsclient.Dial(a.sdsSocket(), sdsclient.WithNode(sdsNode(0)))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = client.Close() }()
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	stream, err := client.StreamSecrets(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Subscribe("default", "ROOTCA"); err != nil {
		t.Fatal(err)
	}
	got, err := stream.Collect("default", "ROOTCA")
	if err != nil {
		t.Fatal(err)
	}
	return chainOf(t, got["default"]), rootsOf(got["ROOTCA"])
}

// One root, two CAs: the upstream signs a CA certificate for the downstream's identity only; an
// agent of the downstream gets a chain leaf, the downstream's intermediate, the upstream root,
// and the upstream root as ROOTCA. Killed and restarted, the downstream signs with the key and
// certificate it kept, without asking the upstream again.
func TestUpstreamCA(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	upstream := startCAArgs(t, "meshid ca upstream", filepath.Join(dir, "upstream"),
		"--sign-ca-certs", "--ca-cert-identities", "spiffe://cluster.local/ns/site-a/sa/meshid-ca")
	upstreamRoot, err := pki.ParseCertificates(mustRead(t, upstream.rootFile()))
	if err != nil || len(upstreamRoot) != 1 {
		t.Fatalf("upstream root-cert.pem: %v", err)
	}
	downstreamArgs := []string{
		"--upstream-ca-address", upstream.addr,
		"--upstream-ca-root-cert", upstream.rootFile(),
		"--upstream-token-path", upstream.token(t, "site-a", "meshid-ca"),
		"--requested-ca-cert-ttl", "720h",
	}
	downstreamState := filepath.Join(dir, "downstream")
	downstream := startCAArgs(t, "meshid ca downstream", downstreamState, downstreamArgs...)
	loaded := downstream.awaitLog(t, "CA key material loaded", nil)
	if loaded["source"] != "new upstream-signed CA" {
		t.Fatalf("downstream key material from %v, want a new upstream-signed CA", loaded["source"])
	}
	serial := downstream.signingSerial(t)
	if string(mustRead(t, downstream.rootFile())) != string(mustRead(t, upstream.rootFile())) {
		t.Fatal("the downstream's root-cert.pem is not the upstream's root")
	}

	checkAgent := func(t *testing.T, name string) {
		t.Helper()
		a := startAgent(t, downstream, workload{name: name, namespace: "default", serviceAccount: name, secretTTL: time.Hour})
		chain, roots := agentSecrets(t, a)
		if len(chain) != 3 || chain[1].SerialNumber.Text(16) != serial || !chain[2].Equal(upstreamRoot[0]) {
			t.Fatalf("%s: default chain of %d certificates, want leaf, the downstream's intermediate %s, the upstream root", name, len(chain), serial)
		}
		if len(roots) != 1 || !roots[0].Equal(upstreamRoot[0]) {
			t.Fatalf("%s: ROOTCA holds %d roots, want the upstream root alone", name, len(roots))
		}
		rootPool, intermediates := x509.NewCertPool(), x509.NewCertPool()
		rootPool.AddCert(upstreamRoot[0])
		intermediates.AddCert(chain[1])
		if _, err := chain[0].Verify(x509.VerifyOptions{Roots: rootPool, Intermediates: intermediates}); err != nil {
			t.Fatalf("%s: default does not verify up to the upstream root: %v", name, err)
		}
	}
	checkAgent(t, "web")

	issued := metric(t, upstream.monitoringAddr, `meshid_ca_certificates_issued_total{auth_method="jwt"}`)
	downstream.kill(t)
	downstream = startCAArgs(t, "meshid ca downstream (restarted)", downstreamState, downstreamArgs...)
	if loaded := downstream.awaitLog(t, "CA key material loaded", nil); loaded["source"] != "persisted upstream-signed CA" {
		t.Fatalf("restarted downstream's key material from %v, want the persisted upstream-signed CA", loaded["source"])
	}
	if got := downstream.signingSerial(t); got != serial {
		t.Fatalf("restarted downstream signs with %s, want the kept %s", got, serial)
	}
	if got := metric(t, upstream.monitoringAddr, `meshid_ca_certificates_issued_total{auth_method="jwt"}`); got != issued {
		t.Fatalf("the upstream issued %v certificates across the restart, want none", got-issued)
	}
	checkAgent(t, "api")
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}
