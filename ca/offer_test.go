package ca_test

import (
	"bytes"
	"crypto/x509"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

const where = "secret istio-system/cacerts"

func TestBundleFromDataLayouts(t *testing.T) {
	t.Parallel()
	now := baseTime()
	root := testutil.NewRootCA(t, caOpts("corp root", now, 3*year))
	inter := root.NewIntermediate(t, caOpts("mesh intermediate", now, year))
	selfSigned := testutil.NewRootCA(t, caOpts("generated root", now, year))
	tests := []struct {
		name         string
		data         map[string][]byte
		signer, anch *x509.Certificate
	}{
		{"istio layout", istioFiles(t, inter, root), inter.Cert, root.Cert},
		{"tls layout", map[string][]byte{
			ca.TLSCertFile: testutil.CertPEM(inter.Cert), ca.TLSKeyFile: testutil.KeyPEM(t, inter.Key), ca.TLSCAFile: testutil.CertPEM(root.Cert),
		}, inter.Cert, root.Cert},
		// What istiod writes to istio-ca-secret: the chain and root empty.
		{"istio layout, self-signed, chain and root empty", map[string][]byte{
			ca.CACertFile: testutil.CertPEM(selfSigned.Cert), ca.CAKeyFile: testutil.KeyPEM(t, selfSigned.Key),
			ca.CertChainFile: nil, ca.RootCertFile: nil,
		}, selfSigned.Cert, selfSigned.Cert},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b, err := ca.BundleFromData(tt.data, where, now)
			if err != nil {
				t.Fatal(err)
			}
			if !b.SigningCert().Equal(tt.signer) || !b.Root().Equal(tt.anch) {
				t.Fatalf("signing %q under %q, want %q under %q", b.SigningCert().Subject, b.Root().Subject, tt.signer.Subject, tt.anch.Subject)
			}
			if b.Source() != ca.SourceSecret {
				t.Fatalf("source %q, want %q", b.Source(), ca.SourceSecret)
			}
		})
	}
}

func TestBundleFromDataRefusalsNameTheSecret(t *testing.T) {
	t.Parallel()
	now := baseTime()
	root := testutil.NewRootCA(t, caOpts("corp root", now, 3*year))
	inter := root.NewIntermediate(t, caOpts("mesh intermediate", now, year))
	other := testutil.NewRootCA(t, caOpts("other", now, year))
	files := istioFiles(t, inter, root)
	incomplete := map[string][]byte{ca.CACertFile: files[ca.CACertFile]}
	wrongKey := istioFiles(t, inter, root)
	wrongKey[ca.CAKeyFile] = testutil.KeyPEM(t, other.Key)
	for name, data := range map[string]map[string][]byte{
		"empty": {}, "incomplete": incomplete, "key of another certificate": wrongKey,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			_, err := ca.BundleFromData(data, where, now)
			if err == nil || !strings.Contains(err.Error(), where) {
				t.Fatalf("error %v, want one naming %q", err, where)
			}
			if bytes.Contains([]byte(err.Error()), []byte("PRIVATE KEY")) {
				t.Fatal("the error quotes the key")
			}
		})
	}
}

func TestGenerateSelfSignedRootPersistsNothing(t *testing.T) {
	t.Parallel()
	now := baseTime()
	root, key, err := ca.GenerateSelfSignedRoot(ca.SelfSignedConfig{KeyAlgorithm: pki.ECDSA, Org: "example.org", TTL: year}, now)
	if err != nil {
		t.Fatal(err)
	}
	switch {
	case !root.IsCA || root.Subject.Organization[0] != "example.org":
		t.Fatalf("root %q is not a CA of example.org", root.Subject)
	case !pki.KeyMatchesCertificate(key, root):
		t.Fatal("the key does not match the root")
	case !root.NotAfter.Equal(now.Add(year)):
		t.Fatalf("root expires at %s, want %s", root.NotAfter, now.Add(year))
	}
	// The threshold counts from the issue time, not from the backdated NotBefore.
	if got, want := ca.RootRenewalTime(root, 0.25), now.Add(year-year/4); !got.Equal(want) {
		t.Fatalf("renewal time %s, want %s", got, want)
	}
}

// secretBundle is key material as the cacerts Secret would give it.
func secretBundle(t *testing.T, signer, root *testutil.CA, now time.Time) *ca.Bundle {
	t.Helper()
	b, err := ca.BundleFromData(istioFiles(t, signer, root), where, now)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestKeyManagerStartsFromInitialBundle(t *testing.T) {
	t.Parallel()
	now := baseTime()
	cfg := keyManagerConfig(t)
	// A previous run of this state dir served a self-signed root.
	previous := newKeyManager(t, cfg, now)
	oldRoot := previous.authority.Bundle().SigningCert()
	if err := os.WriteFile(filepath.Join(cfg.StateDir, ".root-cert.pem.tmp-123"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}

	root := testutil.NewRootCA(t, caOpts("corp root", now, 3*year))
	inter := root.NewIntermediate(t, caOpts("mesh intermediate", now, year))
	cfg.Initial = secretBundle(t, inter, root, now)
	cfg.InitialOrigin = ca.OriginCACertsSecret
	cfg.SelfSigned.TTL = time.Hour // would make a self-signed root due at once
	h := newKeyManager(t, cfg, now)
	if h.Origin() != ca.OriginCACertsSecret {
		t.Fatalf("origin %q, want %q", h.Origin(), ca.OriginCACertsSecret)
	}
	if evs := h.drain(); len(evs) != 1 || evs[0].Kind != ca.EventTempFileRemoved {
		t.Fatalf("events %v, want the leftover temp file removed", kinds(evs))
	}
	requireIssuedBy(t, h.sign(t), inter.Cert, root.Cert, now)
	want := []*x509.Certificate{root.Cert, oldRoot}
	if got := h.authority.Bundle().Roots(); !sameCerts(got, want) {
		t.Fatalf("trusted roots %v, want the Secret's root then the previous one", names(got))
	}
	if got := readCerts(t, h.rootFile()); !sameCerts(got, want) {
		t.Fatalf("root-cert.pem holds %v, want the Secret's root then the previous one", names(got))
	}

	// The self-signed rotator leaves the Secret's material alone, even with a root past due.
	h.run(t)
	if evs := h.checkAt(t, h.nextCheck); len(evs) != 0 {
		t.Fatalf("root check reported %v, want nothing", kinds(evs))
	}
	requireIssuedBy(t, h.sign(t), inter.Cert, root.Cert, h.clock.Now())
}

func TestOffer(t *testing.T) {
	t.Parallel()
	const reloads = "meshid_ca_key_material_reloads_total"
	now := baseTime()
	generated := testutil.NewRootCA(t, caOpts("generated root", now, year))
	cfg := keyManagerConfig(t)
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	cfg.Initial = secretBundle(t, generated, generated, now)
	cfg.InitialOrigin = ca.OriginGeneratedSecret
	h := newKeyManager(t, cfg, now)
	before := h.sign(t)

	if ev := h.Offer(secretBundle(t, generated, generated, now), where); ev.Kind != ca.EventUnchanged {
		t.Fatalf("offer of the same material: %s, want unchanged", ev.Kind)
	}
	if ev := h.Offer(nil, where); ev.Kind != ca.EventRejected || ev.Err == nil {
		t.Fatalf("offer of nothing: %s (%v), want rejected", ev.Kind, ev.Err)
	}

	// An operator plugs in an intermediate: it takes over, the generated root stays trusted.
	root := testutil.NewRootCA(t, caOpts("corp root", now, 3*year))
	inter := root.NewIntermediate(t, caOpts("mesh intermediate", now, year))
	if ev := h.Offer(secretBundle(t, inter, root, now), where); ev.Kind != ca.EventReloaded {
		t.Fatalf("offer of new material: %s (%v), want reloaded", ev.Kind, ev.Err)
	}
	requireIssuedBy(t, h.sign(t), inter.Cert, root.Cert, now)
	want := []*x509.Certificate{root.Cert, generated.Cert}
	if got := h.authority.Bundle().Roots(); !sameCerts(got, want) {
		t.Fatalf("trusted roots %v, want the new root then the generated one", names(got))
	}
	if got := readCerts(t, h.rootFile()); !sameCerts(got, want) {
		t.Fatalf("root-cert.pem holds %v, want the new root then the generated one", names(got))
	}
	verifyPath(t, before.Chain(), h.authority.Bundle().Roots(), now)

	for outcome, want := range map[ca.EventKind]float64{ca.EventUnchanged: 1, ca.EventRejected: 1, ca.EventReloaded: 1} {
		if got := counterValue(t, reg, reloads, "outcome", string(outcome)); got != want {
			t.Errorf("%s{outcome=%q} = %v, want %v", reloads, outcome, got, want)
		}
	}
	// drain leaves unchanged reloads out.
	if got := kinds(h.drain()); len(got) != 2 || got[0] != ca.EventRejected || got[1] != ca.EventReloaded {
		t.Fatalf("events %v, want [rejected reloaded]", got)
	}
}
