package testutil

import (
	"crypto"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/pki"
)

// CA is a test certificate authority: a CA certificate and its key.
type CA struct {
	Cert *x509.Certificate
	Key  crypto.Signer
}

// CAOptions adjust a test CA certificate. Zero values mean: ECDSA P-256, valid from an hour ago
// for a year, a CA that may sign certificates.
type CAOptions struct {
	CommonName string
	Key        crypto.Signer
	NotBefore  time.Time
	NotAfter   time.Time
	NotCA      bool // issue a non-CA certificate with CA-like fields otherwise
}

func (o CAOptions) template(t testing.TB) (*x509.Certificate, crypto.Signer) {
	t.Helper()
	key := o.Key
	if key == nil {
		var err error
		if key, err = pki.GenerateKey(pki.ECDSA, 0); err != nil {
			t.Fatal(err)
		}
	}
	nb, na := o.NotBefore, o.NotAfter
	if nb.IsZero() {
		nb = time.Now().Add(-time.Hour)
	}
	if na.IsZero() {
		na = nb.Add(365 * 24 * time.Hour)
	}
	tmpl := &x509.Certificate{
		Subject:               pkix.Name{CommonName: o.CommonName, Organization: []string{"meshid test"}},
		NotBefore:             nb,
		NotAfter:              na,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  !o.NotCA,
	}
	if o.NotCA {
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	}
	return tmpl, key
}

// NewRootCA creates a self-signed test root.
func NewRootCA(t testing.TB, o CAOptions) *CA {
	t.Helper()
	if o.CommonName == "" {
		o.CommonName = "test root"
	}
	tmpl, key := o.template(t)
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &CA{Cert: cert, Key: key}
}

// NewIntermediate creates a CA certificate signed by c.
func (c *CA) NewIntermediate(t testing.TB, o CAOptions) *CA {
	t.Helper()
	if o.CommonName == "" {
		o.CommonName = "test intermediate"
	}
	tmpl, key := o.template(t)
	return &CA{Cert: c.Issue(t, tmpl, key.Public()), Key: key}
}

// Issue signs tmpl for pub with c.
func (c *CA) Issue(t testing.TB, tmpl *x509.Certificate, pub crypto.PublicKey) *x509.Certificate {
	t.Helper()
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.Cert, pub, c.Key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}

// IssueWorkload signs a workload leaf for the SPIFFE ID spiffeID, valid from an hour ago for ttl,
// and returns it with its new key.
func (c *CA) IssueWorkload(t testing.TB, spiffeID string, ttl time.Duration) (*x509.Certificate, crypto.Signer) {
	t.Helper()
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(spiffeID)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	return c.Issue(t, &x509.Certificate{
		URIs:                  []*url.URL{u},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(ttl),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
	}, key.Public()), key
}

// ECDSAKey is a new ECDSA P-256 key.
func ECDSAKey(t testing.TB) crypto.Signer {
	t.Helper()
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

// KeyPEM encodes key as PKCS#8 PEM.
func KeyPEM(t testing.TB, key crypto.Signer) []byte {
	t.Helper()
	data, err := pki.EncodePrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// CertPEM encodes certificates as concatenated PEM.
func CertPEM(certs ...*x509.Certificate) []byte { return pki.EncodeCertificates(certs...) }

// WriteFiles writes name → content into dir (created if missing).
func WriteFiles(t testing.TB, dir string, files map[string][]byte) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

// ShortTempDir returns a fresh directory under the system temp dir with a short path, for Unix
// sockets (whose paths must stay under 108 bytes); it is removed when the test ends.
func ShortTempDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "mid")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}
