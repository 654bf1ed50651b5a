package ca_test

import (
	"crypto"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"path/filepath"
	"testing"
	"time"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// baseTime is the fixed "now" of these tests. It has whole seconds because X.509 validity does.
func baseTime() time.Time { return time.Date(2031, time.March, 14, 15, 9, 26, 0, time.UTC) }

const year = 365 * 24 * time.Hour

// lifetimes sets the validity of a test hierarchy relative to now: each certificate is valid
// from an hour before now for the given duration after now.
type lifetimes struct{ root, int1, int2 time.Duration }

func defaultLifetimes() lifetimes { return lifetimes{root: 3 * year, int1: 2 * year, int2: year} }

// hierarchy is root -> int1 -> int2, all ECDSA P-256.
type hierarchy struct {
	root, int1, int2 *testutil.CA
}

func newHierarchy(t *testing.T, now time.Time, l lifetimes) hierarchy {
	t.Helper()
	root := testutil.NewRootCA(t, caOpts("root", now, l.root))
	int1 := root.NewIntermediate(t, caOpts("int1", now, l.int1))
	int2 := int1.NewIntermediate(t, caOpts("int2", now, l.int2))
	return hierarchy{root: root, int1: int1, int2: int2}
}

func caOpts(name string, now time.Time, life time.Duration) testutil.CAOptions {
	return testutil.CAOptions{CommonName: name, NotBefore: now.Add(-time.Hour), NotAfter: now.Add(life)}
}

func testID(t *testing.T, ns, sa string) pki.SPIFFEID {
	t.Helper()
	id, err := pki.NewSPIFFEID("example.org", ns, sa)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func newKey(t *testing.T) crypto.Signer {
	t.Helper()
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

// csrDER signs tmpl with key.
func csrDER(t *testing.T, key crypto.Signer, tmpl *x509.CertificateRequest) []byte {
	t.Helper()
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
	if err != nil {
		t.Fatal(err)
	}
	return der
}

func csrPEM(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: pki.BlockCertificateRequest, Bytes: der})
}

// workloadCSR is what an agent sends for id: a fresh P-256 key, the identity as the only URI SAN.
func workloadCSR(t *testing.T, id pki.SPIFFEID) (*x509.CertificateRequest, crypto.Signer) {
	t.Helper()
	key := newKey(t)
	data, err := pki.CreateCSR(key, id)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := ca.ParseCSR(data)
	if err != nil {
		t.Fatal(err)
	}
	return csr, key
}

func writeDir(t *testing.T, files map[string][]byte) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "cacerts")
	testutil.WriteFiles(t, dir, files)
	return dir
}

func names(certs []*x509.Certificate) []string {
	var out []string
	for _, c := range certs {
		out = append(out, c.Subject.CommonName)
	}
	return out
}

func sameCerts(a, b []*x509.Certificate) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !a[i].Equal(b[i]) {
			return false
		}
	}
	return true
}

func pool(certs ...*x509.Certificate) *x509.CertPool {
	p := x509.NewCertPool()
	for _, c := range certs {
		p.AddCert(c)
	}
	return p
}

// verifyPath checks with x509.Verify that path[0] chains through path[1:] to one of roots at now,
// and that every certificate of path is signed by the next one.
func verifyPath(t *testing.T, path []*x509.Certificate, roots []*x509.Certificate, now time.Time) {
	t.Helper()
	if len(path) == 0 {
		t.Fatal("empty chain")
	}
	if _, err := path[0].Verify(x509.VerifyOptions{
		Roots:         pool(roots...),
		Intermediates: pool(path[1:]...),
		CurrentTime:   now,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
	}); err != nil {
		t.Fatalf("chain %v does not verify against roots %v: %v", names(path), names(roots), err)
	}
	for i := 0; i+1 < len(path); i++ {
		if err := path[i].CheckSignatureFrom(path[i+1]); err != nil {
			t.Fatalf("chain %v: certificate %d is not signed by the next one: %v", names(path), i, err)
		}
	}
}

// parseChainPEM parses a response chain, requiring exactly one certificate per element.
func parseChainPEM(t *testing.T, chain []string) []*x509.Certificate {
	t.Helper()
	var out []*x509.Certificate
	for i, s := range chain {
		certs, err := pki.ParseCertificates([]byte(s))
		if err != nil {
			t.Fatalf("chain element %d: %v", i, err)
		}
		if len(certs) != 1 {
			t.Fatalf("chain element %d holds %d certificates, want 1", i, len(certs))
		}
		out = append(out, certs[0])
	}
	return out
}

func newBundle(t *testing.T, signer *testutil.CA, intermediates []*x509.Certificate, roots []*x509.Certificate, now time.Time) *ca.Bundle {
	t.Helper()
	b, err := ca.NewBundle(ca.BundleParams{
		SigningCert:   signer.Cert,
		SigningKey:    signer.Key,
		Intermediates: intermediates,
		Roots:         roots,
		Source:        ca.SourcePluggedIn,
		Now:           now,
	})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// hierarchyBundle signs with int2 and chains through int1 to root.
func hierarchyBundle(t *testing.T, h hierarchy, now time.Time) *ca.Bundle {
	t.Helper()
	return newBundle(t, h.int2, []*x509.Certificate{h.int1.Cert}, []*x509.Certificate{h.root.Cert}, now)
}
