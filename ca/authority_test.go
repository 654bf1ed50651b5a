package ca_test

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"errors"
	"net"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

var oidSubjectAltName = asn1.ObjectIdentifier{2, 5, 29, 17}

func TestSignWorkloadLeaf(t *testing.T) {
	t.Parallel()
	now := baseTime()
	h := newHierarchy(t, now, defaultLifetimes())
	b := hierarchyBundle(t, h, now)
	const ttl = 5 * time.Hour
	a := ca.New(ca.Config{Clock: testutil.NewFakeClock(now)}, b)
	id := testID(t, "prod", "web")
	csr, key := workloadCSR(t, id)

	issued, err := a.SignWorkload(t.Context(), ca.WorkloadRequest{CSR: csr, Identity: id, TTL: ttl})
	if err != nil {
		t.Fatal(err)
	}
	leaf := issued.Leaf
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != id.String() {
		t.Errorf("URI SANs = %v, want exactly [%s]", leaf.URIs, id)
	}
	if len(leaf.DNSNames)+len(leaf.IPAddresses)+len(leaf.EmailAddresses) != 0 {
		t.Errorf("leaf carries DNS %v, IP %v, email %v; want none", leaf.DNSNames, leaf.IPAddresses, leaf.EmailAddresses)
	}
	var empty pkix.RDNSequence
	if rest, err := asn1.Unmarshal(leaf.RawSubject, &empty); err != nil || len(rest) != 0 || len(empty) != 0 {
		t.Errorf("subject = %q, want empty", leaf.Subject)
	}
	sanCritical, sanFound := false, false
	for _, ext := range leaf.Extensions {
		if ext.Id.Equal(oidSubjectAltName) {
			sanFound, sanCritical = true, ext.Critical
		}
	}
	if !sanFound || !sanCritical {
		t.Errorf("SAN extension found %v, critical %v; want a critical SAN extension (the subject is empty)", sanFound, sanCritical)
	}
	if want := x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment; leaf.KeyUsage != want {
		t.Errorf("KeyUsage = %b, want %b", leaf.KeyUsage, want)
	}
	if want := []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}; !slices.Equal(leaf.ExtKeyUsage, want) {
		t.Errorf("ExtKeyUsage = %v, want %v", leaf.ExtKeyUsage, want)
	}
	if leaf.IsCA || !leaf.BasicConstraintsValid {
		t.Errorf("IsCA = %v, BasicConstraintsValid = %v; want a leaf that says it is not a CA", leaf.IsCA, leaf.BasicConstraintsValid)
	}
	if want := now.Add(-ca.Backdate); !leaf.NotBefore.Equal(want) {
		t.Errorf("NotBefore = %s, want %s", leaf.NotBefore, want)
	}
	if want := now.Add(ttl); !leaf.NotAfter.Equal(want) {
		t.Errorf("NotAfter = %s, want %s", leaf.NotAfter, want)
	}
	if !pki.PublicKeysEqual(key.Public(), leaf.PublicKey) {
		t.Error("leaf does not carry the CSR's public key")
	}
	if err := leaf.CheckSignatureFrom(h.int2.Cert); err != nil {
		t.Errorf("leaf is not signed by the signing certificate: %v", err)
	}
	wantChain := []*x509.Certificate{leaf, h.int2.Cert, h.int1.Cert, h.root.Cert}
	if !sameCerts(issued.Chain(), wantChain) {
		t.Errorf("Chain = %v, want %v", names(issued.Chain()), names(wantChain))
	}
	verifyPath(t, issued.Chain(), b.Roots(), now)
	// A peer checks the leaf for mTLS in both directions.
	for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool(h.root.Cert), Intermediates: pool(h.int1.Cert, h.int2.Cert), CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
			t.Errorf("leaf does not verify for usage %v: %v", usage, err)
		}
	}
}

func TestSignWorkloadTTL(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		cfg     ca.Config
		life    lifetimes
		ttl     time.Duration
		want    time.Duration // leaf NotAfter - now
		wantErr error
	}{
		{name: "zero takes DefaultTTL from Config", cfg: ca.Config{DefaultTTL: 3 * time.Hour}, ttl: 0, want: 3 * time.Hour},
		{name: "zero with zero Config takes the package default", ttl: 0, want: ca.DefaultWorkloadCertTTL},
		{name: "requested within the maximum", cfg: ca.Config{MaxTTL: 10 * time.Hour}, ttl: 7 * time.Hour, want: 7 * time.Hour},
		{name: "requested equal to the maximum", cfg: ca.Config{MaxTTL: 10 * time.Hour}, ttl: 10 * time.Hour, want: 10 * time.Hour},
		{name: "above MaxTTL is clamped", cfg: ca.Config{MaxTTL: 10 * time.Hour}, ttl: 11 * time.Hour, want: 10 * time.Hour},
		{name: "above the package maximum is clamped", ttl: 1000 * 24 * time.Hour, want: ca.DefaultMaxWorkloadCertTTL},
		{
			name: "clamped to the signing certificate's expiry",
			life: lifetimes{root: 3 * year, int1: 2 * year, int2: 2 * time.Hour},
			ttl:  5 * time.Hour, want: 2 * time.Hour,
		},
		{
			name: "clamped to an intermediate's expiry above the signing certificate",
			life: lifetimes{root: 3 * year, int1: 90 * time.Minute, int2: year},
			ttl:  5 * time.Hour, want: 90 * time.Minute,
		},
		{
			name: "clamped to the root's expiry",
			life: lifetimes{root: 45 * time.Minute, int1: year, int2: year},
			ttl:  5 * time.Hour, want: 45 * time.Minute,
		},
		{
			name: "default TTL is clamped to the chain too",
			cfg:  ca.Config{DefaultTTL: 24 * time.Hour},
			life: lifetimes{root: 3 * year, int1: 2 * year, int2: 30 * time.Minute},
			ttl:  0, want: 30 * time.Minute,
		},
		{name: "negative is refused", ttl: -time.Second, wantErr: ca.ErrInvalidTTL},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			now := baseTime()
			life := tc.life
			if life == (lifetimes{}) {
				life = defaultLifetimes()
			}
			h := newHierarchy(t, now, life)
			cfg := tc.cfg
			cfg.Clock = testutil.NewFakeClock(now)
			a := ca.New(cfg, hierarchyBundle(t, h, now))
			id := testID(t, "default", "web")
			csr, _ := workloadCSR(t, id)

			issued, err := a.SignWorkload(t.Context(), ca.WorkloadRequest{CSR: csr, Identity: id, TTL: tc.ttl})
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("err = %v, want %v", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := issued.Leaf.NotAfter.Sub(now); got != tc.want {
				t.Errorf("lifetime from now = %s, want %s", got, tc.want)
			}
			for _, c := range issued.Chain()[1:] {
				if issued.Leaf.NotAfter.After(c.NotAfter) {
					t.Errorf("leaf outlives %q (%s > %s)", c.Subject.CommonName, issued.Leaf.NotAfter, c.NotAfter)
				}
			}
		})
	}
}

// X.509 keeps whole seconds: a leaf signed at a fraction of a second lives at least its TTL,
// not up to a second less (a one-second certificate used to be issued already expired).
func TestSignWorkloadLifetimeIsNeverCutToTheSecond(t *testing.T) {
	t.Parallel()
	now := baseTime().Add(700 * time.Millisecond)
	h := newHierarchy(t, baseTime(), defaultLifetimes())
	a := ca.New(ca.Config{Clock: testutil.NewFakeClock(now)}, hierarchyBundle(t, h, baseTime()))
	id := testID(t, "default", "web")
	csr, _ := workloadCSR(t, id)
	issued, err := a.SignWorkload(t.Context(), ca.WorkloadRequest{CSR: csr, Identity: id, TTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if got := issued.Leaf.NotAfter.Sub(now); got < time.Second || got >= 2*time.Second {
		t.Fatalf("a one-second certificate signed at %s lives %s from then, want between 1s and 2s", now.Format(time.StampMilli), got)
	}
}

// tamperSignature flips a bit in the last byte of a CSR's DER, which lies in the signature value:
// the request still parses but its signature no longer verifies.
func tamperSignature(t *testing.T, der []byte) []byte {
	t.Helper()
	out := bytes.Clone(der)
	out[len(out)-1] ^= 0x01
	if _, err := x509.ParseCertificateRequest(out); err != nil {
		t.Fatalf("tampered CSR no longer parses: %v", err)
	}
	return out
}

func genKey(t *testing.T, gen func() (crypto.Signer, error)) crypto.Signer {
	t.Helper()
	key, err := gen()
	if err != nil {
		t.Fatal(err)
	}
	return key
}

func TestCSRPolicy(t *testing.T) {
	t.Parallel()
	id := testID(t, "default", "web")
	other := testID(t, "default", "admin")
	mustURL := func(s string) *url.URL {
		u, err := url.Parse(s)
		if err != nil {
			t.Fatal(err)
		}
		return u
	}
	withID := func(tmpl x509.CertificateRequest) *x509.CertificateRequest {
		tmpl.URIs = append([]*url.URL{id.URL()}, tmpl.URIs...)
		return &tmpl
	}
	ecKey := func(curve elliptic.Curve) func() (crypto.Signer, error) {
		return func() (crypto.Signer, error) { return ecdsa.GenerateKey(curve, rand.Reader) }
	}
	rsaKey := func(bits int) func() (crypto.Signer, error) {
		return func() (crypto.Signer, error) { return rsa.GenerateKey(rand.Reader, bits) }
	}
	p256 := ecKey(elliptic.P256())

	tests := []struct {
		name    string
		csrPEM  func(t *testing.T) ([]byte, crypto.PublicKey)
		wantErr error
	}{
		{name: "empty input", csrPEM: func(*testing.T) ([]byte, crypto.PublicKey) { return nil, nil }, wantErr: ca.ErrMalformedCSR},
		{name: "not PEM", csrPEM: func(*testing.T) ([]byte, crypto.PublicKey) { return []byte("hello, CA"), nil }, wantErr: ca.ErrMalformedCSR},
		{
			name: "raw DER instead of PEM",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				return csrDER(t, genKey(t, p256), withID(x509.CertificateRequest{})), nil
			},
			wantErr: ca.ErrMalformedCSR,
		},
		{
			name: "a certificate instead of a request",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				return testutil.CertPEM(testutil.NewRootCA(t, caOpts("x", baseTime(), year)).Cert), nil
			},
			wantErr: ca.ErrMalformedCSR,
		},
		{
			name: "truncated DER",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				der := csrDER(t, genKey(t, p256), withID(x509.CertificateRequest{}))
				return csrPEM(der[:len(der)/2]), nil
			},
			wantErr: ca.ErrMalformedCSR,
		},
		{
			name: "tampered signature",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				return csrPEM(tamperSignature(t, csrDER(t, genKey(t, p256), withID(x509.CertificateRequest{})))), nil
			},
			wantErr: ca.ErrCSRSignature,
		},
		{
			name: "another identity",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				return csrPEM(csrDER(t, genKey(t, p256), &x509.CertificateRequest{URIs: []*url.URL{other.URL()}})), nil
			},
			wantErr: ca.ErrIdentityMismatch,
		},
		{
			name: "same workload in another trust domain",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				u := mustURL("spiffe://evil.example/ns/default/sa/web")
				return csrPEM(csrDER(t, genKey(t, p256), &x509.CertificateRequest{URIs: []*url.URL{u}})), nil
			},
			wantErr: ca.ErrIdentityMismatch,
		},
		{
			name: "the identity plus another URI",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				return csrPEM(csrDER(t, genKey(t, p256), withID(x509.CertificateRequest{URIs: []*url.URL{other.URL()}}))), nil
			},
			wantErr: ca.ErrIdentityMismatch,
		},
		{
			name: "DNS SAN",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				return csrPEM(csrDER(t, genKey(t, p256), withID(x509.CertificateRequest{DNSNames: []string{"web.default.svc"}}))), nil
			},
			wantErr: ca.ErrForbiddenSAN,
		},
		{
			name: "IP SAN",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				return csrPEM(csrDER(t, genKey(t, p256), withID(x509.CertificateRequest{IPAddresses: []net.IP{net.ParseIP("10.0.0.1")}}))), nil
			},
			wantErr: ca.ErrForbiddenSAN,
		},
		{
			name: "email SAN",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				return csrPEM(csrDER(t, genKey(t, p256), withID(x509.CertificateRequest{EmailAddresses: []string{"web@example.org"}}))), nil
			},
			wantErr: ca.ErrForbiddenSAN,
		},
		{
			name: "RSA 1024 key",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				return csrPEM(csrDER(t, genKey(t, rsaKey(1024)), withID(x509.CertificateRequest{}))), nil
			},
			wantErr: ca.ErrUnsupportedKey,
		},
		{
			name: "ECDSA P-521 key",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				return csrPEM(csrDER(t, genKey(t, ecKey(elliptic.P521())), withID(x509.CertificateRequest{}))), nil
			},
			wantErr: ca.ErrUnsupportedKey,
		},
		{
			name: "ECDSA P-224 key",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				return csrPEM(csrDER(t, genKey(t, ecKey(elliptic.P224())), withID(x509.CertificateRequest{}))), nil
			},
			wantErr: ca.ErrUnsupportedKey,
		},
		{
			name: "Ed25519 key",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				_, key, err := ed25519.GenerateKey(rand.Reader)
				if err != nil {
					t.Fatal(err)
				}
				return csrPEM(csrDER(t, key, withID(x509.CertificateRequest{}))), nil
			},
			wantErr: ca.ErrUnsupportedKey,
		},
		{
			name: "ECDSA P-256 with the identity",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				key := genKey(t, p256)
				return csrPEM(csrDER(t, key, withID(x509.CertificateRequest{}))), key.Public()
			},
		},
		{
			name: "ECDSA P-384",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				key := genKey(t, ecKey(elliptic.P384()))
				return csrPEM(csrDER(t, key, withID(x509.CertificateRequest{}))), key.Public()
			},
		},
		{
			name: "RSA 2048",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				key := genKey(t, rsaKey(2048))
				return csrPEM(csrDER(t, key, withID(x509.CertificateRequest{}))), key.Public()
			},
		},
		{
			name: "no URI SAN: the identity comes from the caller",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				key := genKey(t, p256)
				return csrPEM(csrDER(t, key, &x509.CertificateRequest{})), key.Public()
			},
		},
		{
			name: "a subject in the request does not reach the leaf",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				key := genKey(t, p256)
				return csrPEM(csrDER(t, key, withID(x509.CertificateRequest{Subject: pkix.Name{CommonName: "admin", Organization: []string{"root"}}}))), key.Public()
			},
		},
		{
			name: "NEW CERTIFICATE REQUEST block type",
			csrPEM: func(t *testing.T) ([]byte, crypto.PublicKey) {
				key := genKey(t, p256)
				data := csrPEM(csrDER(t, key, withID(x509.CertificateRequest{})))
				data = bytes.ReplaceAll(data, []byte("CERTIFICATE REQUEST"), []byte("NEW CERTIFICATE REQUEST"))
				return data, key.Public()
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			now := baseTime()
			h := newHierarchy(t, now, defaultLifetimes())
			a := ca.New(ca.Config{Clock: testutil.NewFakeClock(now)}, hierarchyBundle(t, h, now))
			data, pub := tc.csrPEM(t)

			csr, err := ca.ParseCSR(data)
			if err != nil {
				if !errors.Is(tc.wantErr, ca.ErrMalformedCSR) || !errors.Is(err, ca.ErrMalformedCSR) {
					t.Fatalf("ParseCSR: %v, want error %v", err, tc.wantErr)
				}
				return
			}
			if errors.Is(tc.wantErr, ca.ErrMalformedCSR) {
				t.Fatal("ParseCSR accepted a malformed request")
			}
			if err := ca.CheckCSR(csr, id); !errors.Is(err, tc.wantErr) {
				t.Fatalf("CheckCSR: %v, want %v", err, tc.wantErr)
			}
			issued, err := a.SignWorkload(t.Context(), ca.WorkloadRequest{CSR: csr, Identity: id})
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("SignWorkload: %v, want %v", err, tc.wantErr)
			}
			if tc.wantErr != nil {
				if issued != nil {
					t.Fatal("SignWorkload returned a certificate with its error")
				}
				return
			}
			leaf := issued.Leaf
			if len(leaf.URIs) != 1 || leaf.URIs[0].String() != id.String() {
				t.Errorf("URI SANs = %v, want [%s]", leaf.URIs, id)
			}
			if len(leaf.Subject.Names) != 0 {
				t.Errorf("subject = %q, want empty", leaf.Subject)
			}
			if !pki.PublicKeysEqual(pub, leaf.PublicKey) {
				t.Errorf("leaf key is %s, not the CSR's", pki.DescribeKey(leaf.PublicKey))
			}
			verifyPath(t, issued.Chain(), []*x509.Certificate{h.root.Cert}, now)
		})
	}
}

func TestCheckCSRNil(t *testing.T) {
	t.Parallel()
	if err := ca.CheckCSR(nil, testID(t, "default", "web")); !errors.Is(err, ca.ErrMalformedCSR) {
		t.Fatalf("CheckCSR(nil) = %v, want ErrMalformedCSR", err)
	}
}

func TestSignNotReady(t *testing.T) {
	t.Parallel()
	id := testID(t, "default", "web")

	t.Run("no bundle", func(t *testing.T) {
		t.Parallel()
		a := ca.New(ca.Config{Clock: testutil.NewFakeClock(baseTime())}, nil)
		if a.Bundle() != nil {
			t.Fatal("Bundle() is not nil before any bundle was set")
		}
		csr, _ := workloadCSR(t, id)
		if _, err := a.SignWorkload(t.Context(), ca.WorkloadRequest{CSR: csr, Identity: id}); !errors.Is(err, ca.ErrNotReady) {
			t.Errorf("SignWorkload = %v, want ErrNotReady", err)
		}
		if _, err := a.SignServing(newKey(t).Public(), []string{"localhost"}, time.Hour); !errors.Is(err, ca.ErrNotReady) {
			t.Errorf("SignServing = %v, want ErrNotReady", err)
		}
		// Becomes ready once a bundle is set.
		now := baseTime()
		a.SetBundle(hierarchyBundle(t, newHierarchy(t, now, defaultLifetimes()), now))
		if _, err := a.SignWorkload(t.Context(), ca.WorkloadRequest{CSR: csr, Identity: id}); err != nil {
			t.Errorf("SignWorkload after SetBundle = %v", err)
		}
	})

	for _, tc := range []struct {
		name    string
		life    lifetimes
		advance time.Duration
	}{
		{name: "signing certificate expired", life: lifetimes{root: 3 * year, int1: 2 * year, int2: time.Hour}, advance: time.Hour},
		{name: "intermediate expired", life: lifetimes{root: 3 * year, int1: time.Hour, int2: year}, advance: 2 * time.Hour},
		{name: "root expired", life: lifetimes{root: time.Hour, int1: year, int2: year}, advance: time.Hour + time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			now := baseTime()
			clk := testutil.NewFakeClock(now)
			a := ca.New(ca.Config{Clock: clk}, hierarchyBundle(t, newHierarchy(t, now, tc.life), now))
			csr, _ := workloadCSR(t, id)
			if _, err := a.SignWorkload(t.Context(), ca.WorkloadRequest{CSR: csr, Identity: id}); err != nil {
				t.Fatalf("before expiry: %v", err)
			}
			clk.Advance(tc.advance)
			if _, err := a.SignWorkload(t.Context(), ca.WorkloadRequest{CSR: csr, Identity: id}); !errors.Is(err, ca.ErrNotReady) {
				t.Errorf("SignWorkload after expiry = %v, want ErrNotReady", err)
			}
			if _, err := a.SignServing(newKey(t).Public(), []string{"localhost"}, time.Hour); !errors.Is(err, ca.ErrNotReady) {
				t.Errorf("SignServing after expiry = %v, want ErrNotReady", err)
			}
		})
	}
}

func TestSetBundleSwap(t *testing.T) {
	t.Parallel()
	now := baseTime()
	hA, hB := newHierarchy(t, now, defaultLifetimes()), newHierarchy(t, now, defaultLifetimes())
	bA, bB := hierarchyBundle(t, hA, now), hierarchyBundle(t, hB, now)
	a := ca.New(ca.Config{Clock: testutil.NewFakeClock(now)}, bA)
	id := testID(t, "default", "web")
	sign := func() *ca.Issued {
		t.Helper()
		csr, _ := workloadCSR(t, id)
		issued, err := a.SignWorkload(t.Context(), ca.WorkloadRequest{CSR: csr, Identity: id})
		if err != nil {
			t.Fatal(err)
		}
		return issued
	}

	before := sign()
	a.SetBundle(bB)
	if a.Bundle() != bB {
		t.Fatal("Bundle() does not return the bundle just set")
	}
	after := sign()

	verifyPath(t, after.Chain(), bB.Roots(), now)
	if _, err := after.Leaf.Verify(x509.VerifyOptions{Roots: bA.RootPool(), Intermediates: pool(hA.int1.Cert, hA.int2.Cert), CurrentTime: now}); err == nil {
		t.Error("a leaf issued after SetBundle verifies against the old root")
	}
	wantBefore := []*x509.Certificate{before.Leaf, hA.int2.Cert, hA.int1.Cert, hA.root.Cert}
	if !sameCerts(before.Chain(), wantBefore) {
		t.Errorf("earlier leaf's Chain = %v, want the old chain", names(before.Chain()))
	}
	if got := parseChainPEM(t, before.ChainPEM()); !sameCerts(got, wantBefore) {
		t.Errorf("earlier leaf's ChainPEM = %v, want the old chain", names(got))
	}
	verifyPath(t, before.Chain(), bA.Roots(), now)
	wantAfter := []*x509.Certificate{after.Leaf, hB.int2.Cert, hB.int1.Cert, hB.root.Cert}
	if !sameCerts(after.Chain(), wantAfter) {
		t.Errorf("later leaf's Chain = %v, want the new chain", names(after.Chain()))
	}
}

func TestSignWorkloadConcurrentSwap(t *testing.T) {
	t.Parallel()
	now := baseTime()
	bundles := []*ca.Bundle{
		hierarchyBundle(t, newHierarchy(t, now, defaultLifetimes()), now),
		hierarchyBundle(t, newHierarchy(t, now, defaultLifetimes()), now),
	}
	a := ca.New(ca.Config{Clock: testutil.NewFakeClock(now)}, bundles[0])
	id := testID(t, "default", "web")
	const signers, swaps = 8, 100

	var (
		started sync.WaitGroup // every signer has signed once: the swaps overlap signing
		done    atomic.Bool
		wg      sync.WaitGroup
		results = make([][]*ca.Issued, signers)
		errs    = make([]error, signers)
		ctx     = t.Context()
	)
	started.Add(signers)
	for i := range signers {
		wg.Go(func() {
			first := true
			for !done.Load() || first {
				key := newKeyNoT()
				der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{URIs: []*url.URL{id.URL()}}, key)
				if err == nil {
					var csr *x509.CertificateRequest
					if csr, err = x509.ParseCertificateRequest(der); err == nil {
						var issued *ca.Issued
						if issued, err = a.SignWorkload(ctx, ca.WorkloadRequest{CSR: csr, Identity: id}); err == nil {
							results[i] = append(results[i], issued)
						}
					}
				}
				if err != nil && errs[i] == nil {
					errs[i] = err
				}
				if first {
					first = false
					started.Done()
				}
			}
		})
	}
	wg.Go(func() {
		started.Wait()
		for n := range swaps {
			a.SetBundle(bundles[(n+1)%2])
		}
		done.Store(true)
	})
	wg.Wait()

	total := 0
	for i := range signers {
		if errs[i] != nil {
			t.Errorf("signer %d: %v", i, errs[i])
		}
		for _, issued := range results[i] {
			total++
			chain := issued.Chain()
			root := chain[len(chain)-1]
			if !root.Equal(bundles[0].Root()) && !root.Equal(bundles[1].Root()) {
				t.Fatalf("signer %d: chain ends with an unknown root %q", i, root.Subject)
			}
			if _, err := issued.Leaf.Verify(x509.VerifyOptions{
				Roots:         pool(root),
				Intermediates: pool(chain[1 : len(chain)-1]...),
				CurrentTime:   now,
			}); err != nil {
				t.Fatalf("signer %d: leaf does not verify against the chain its Issued reports: %v", i, err)
			}
			if err := issued.Leaf.CheckSignatureFrom(chain[1]); err != nil {
				t.Fatalf("signer %d: leaf not signed by its reported signing certificate: %v", i, err)
			}
		}
	}
	if total < signers {
		t.Fatalf("only %d certificates issued", total)
	}
}

// newKeyNoT generates a P-256 key off the test goroutine, where t.Fatal may not be called.
func newKeyNoT() crypto.Signer {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		panic(err)
	}
	return key
}

func TestSignServing(t *testing.T) {
	t.Parallel()
	now := baseTime()
	h := newHierarchy(t, now, defaultLifetimes())
	b := hierarchyBundle(t, h, now)
	a := ca.New(ca.Config{Clock: testutil.NewFakeClock(now)}, b)
	key := newKey(t)
	hosts := []string{"istiod.istio-system.svc", "10.0.0.7", "localhost", "::1", "127.0.0.1"}
	const ttl = 12 * time.Hour

	issued, err := a.SignServing(key.Public(), hosts, ttl)
	if err != nil {
		t.Fatal(err)
	}
	leaf := issued.Leaf
	if want := []string{"istiod.istio-system.svc", "localhost"}; !slices.Equal(leaf.DNSNames, want) {
		t.Errorf("DNSNames = %q, want %q", leaf.DNSNames, want)
	}
	wantIPs := []net.IP{net.ParseIP("10.0.0.7"), net.ParseIP("::1"), net.ParseIP("127.0.0.1")}
	if len(leaf.IPAddresses) != len(wantIPs) {
		t.Fatalf("IPAddresses = %v, want %v", leaf.IPAddresses, wantIPs)
	}
	for i := range wantIPs {
		if !leaf.IPAddresses[i].Equal(wantIPs[i]) {
			t.Errorf("IPAddresses[%d] = %v, want %v", i, leaf.IPAddresses[i], wantIPs[i])
		}
	}
	if len(leaf.URIs) != 0 || len(leaf.EmailAddresses) != 0 {
		t.Errorf("URIs %v, emails %v; want none", leaf.URIs, leaf.EmailAddresses)
	}
	if want := []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}; !slices.Equal(leaf.ExtKeyUsage, want) {
		t.Errorf("ExtKeyUsage = %v, want serverAuth only", leaf.ExtKeyUsage)
	}
	if leaf.IsCA {
		t.Error("serving certificate is a CA")
	}
	if !leaf.NotBefore.Equal(now.Add(-ca.Backdate)) || !leaf.NotAfter.Equal(now.Add(ttl)) {
		t.Errorf("validity %s..%s, want %s..%s", leaf.NotBefore, leaf.NotAfter, now.Add(-ca.Backdate), now.Add(ttl))
	}
	if !pki.PublicKeysEqual(key.Public(), leaf.PublicKey) {
		t.Error("serving certificate does not carry the given key")
	}
	inter := pool(issued.Chain()[1 : len(issued.Chain())-1]...)
	for _, host := range []string{"istiod.istio-system.svc", "localhost", "10.0.0.7", "::1", "127.0.0.1"} {
		if _, err := leaf.Verify(x509.VerifyOptions{DNSName: host, Roots: b.RootPool(), Intermediates: inter, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
			t.Errorf("verify for %s: %v", host, err)
		}
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: b.RootPool(), Intermediates: inter, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err == nil {
		t.Error("serving certificate is valid for client authentication")
	}
	if _, err := leaf.Verify(x509.VerifyOptions{DNSName: "other.example", Roots: b.RootPool(), Intermediates: inter, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err == nil {
		t.Error("serving certificate is valid for a host it was not issued for")
	}
	verifyPath(t, issued.Chain(), b.Roots(), now)
}

// A clock stepped back behind the chain's start is an unready CA, not an internal error; and a
// leaf's backdating never reaches before its issuer's own validity.
func TestSignRespectsChainStart(t *testing.T) {
	t.Parallel()
	now := baseTime()
	id := testID(t, "default", "web")
	root := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "root", NotBefore: now.Add(-time.Hour), NotAfter: now.Add(year)})
	fresh := root.NewIntermediate(t, testutil.CAOptions{CommonName: "fresh", NotBefore: now.Add(-30 * time.Second), NotAfter: now.Add(year)})
	b, err := ca.NewBundle(ca.BundleParams{SigningCert: fresh.Cert, SigningKey: fresh.Key, Roots: []*x509.Certificate{root.Cert}, Source: ca.SourcePluggedIn, Now: now})
	if err != nil {
		t.Fatal(err)
	}
	clk := testutil.NewFakeClock(now)
	a := ca.New(ca.Config{Clock: clk}, b)
	csr, _ := workloadCSR(t, id)
	issued, err := a.SignWorkload(t.Context(), ca.WorkloadRequest{CSR: csr, Identity: id})
	if err != nil {
		t.Fatal(err)
	}
	if !issued.Leaf.NotBefore.Equal(fresh.Cert.NotBefore) {
		t.Fatalf("leaf NotBefore %s, want the issuer's %s rather than now-%s", issued.Leaf.NotBefore, fresh.Cert.NotBefore, ca.Backdate)
	}
	clk.Set(now.Add(-time.Minute))
	if _, err := a.SignWorkload(t.Context(), ca.WorkloadRequest{CSR: csr, Identity: id}); !errors.Is(err, ca.ErrNotReady) {
		t.Fatalf("signing before the chain is valid: %v, want ErrNotReady", err)
	}
}

func TestSignWorkloadRefusesInvalidCallerIdentity(t *testing.T) {
	t.Parallel()
	now := baseTime()
	a := ca.New(ca.Config{Clock: testutil.NewFakeClock(now)}, hierarchyBundle(t, newHierarchy(t, now, defaultLifetimes()), now))
	csr, _ := workloadCSR(t, testID(t, "default", "web"))
	if _, err := a.SignWorkload(t.Context(), ca.WorkloadRequest{CSR: csr}); err == nil {
		t.Fatal("signed a certificate for an empty identity")
	}
}

func TestNewRootCertificateWithoutOrg(t *testing.T) {
	t.Parallel()
	root, err := ca.NewRootCertificate(newKey(t), "", year, baseTime())
	if err != nil {
		t.Fatal(err)
	}
	if len(root.Subject.Organization) != 0 {
		t.Fatalf("Organization = %q, want none", root.Subject.Organization)
	}
}

func TestSignSecret(t *testing.T) {
	t.Parallel()
	now := baseTime()
	h := newHierarchy(t, now, defaultLifetimes())
	b := hierarchyBundle(t, h, now)
	a := ca.New(ca.Config{Clock: testutil.NewFakeClock(now)}, b)
	id := testID(t, "istio-system", "istio-pilot-service-account")
	key := newKey(t)
	dns := []string{"istio-pilot.istio-system.svc", "istio-pilot.istio-system"}

	issued, err := a.SignSecret(t.Context(), ca.SecretRequest{Identity: id, DNSNames: dns, PublicKey: key.Public(), TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if len(issued.Leaf.URIs) != 1 || issued.Leaf.URIs[0].String() != id.String() {
		t.Errorf("URI SANs = %v, want [%s]", issued.Leaf.URIs, id)
	}
	if !slices.Equal(issued.Leaf.DNSNames, dns) {
		t.Errorf("DNS SANs = %q, want %q", issued.Leaf.DNSNames, dns)
	}
	if got := issued.Leaf.NotAfter.Sub(now); got != time.Hour {
		t.Errorf("lifetime from now = %s, want 1h", got)
	}
	if issued.Bundle() != b {
		t.Error("Issued.Bundle is not the bundle that signed")
	}
	verifyPath(t, issued.Chain(), b.Roots(), now)

	if _, err := a.SignSecret(t.Context(), ca.SecretRequest{Identity: id}); !errors.Is(err, ca.ErrUnsupportedKey) {
		t.Errorf("no public key: err = %v, want ErrUnsupportedKey", err)
	}
}

func TestChangedClosesOnSetBundle(t *testing.T) {
	t.Parallel()
	now := baseTime()
	b := hierarchyBundle(t, newHierarchy(t, now, defaultLifetimes()), now)
	a := ca.New(ca.Config{Clock: testutil.NewFakeClock(now)}, b)
	ch := a.Changed()
	select {
	case <-ch:
		t.Fatal("Changed is closed before any SetBundle")
	default:
	}
	a.SetBundle(b)
	select {
	case <-ch:
	default:
		t.Fatal("Changed is not closed after SetBundle")
	}
	if next := a.Changed(); next == ch {
		t.Error("Changed returns the closed channel again")
	}
}
