package pki_test

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

func newKey(t *testing.T, alg pki.KeyAlgorithm) crypto.Signer {
	t.Helper()
	key, err := pki.GenerateKey(alg, 0)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

func pemBlock(typ string, der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
}

func concat(parts ...[]byte) []byte {
	var out []byte
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

func TestParseCertificates(t *testing.T) {
	t.Parallel()
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	inter := root.NewIntermediate(t, testutil.CAOptions{})
	leaf, leafKey := inter.IssueWorkload(t, "spiffe://cluster.local/ns/default/sa/sleep", time.Hour)
	tests := []struct {
		name      string
		data      []byte
		want      []*x509.Certificate
		wantNoPEM bool // error wraps ErrNoPEM
		wantErr   bool // some other error
	}{
		{name: "one", data: pki.EncodeCertificate(root.Cert), want: []*x509.Certificate{root.Cert}},
		{name: "chain in order", data: pki.EncodeCertificates(leaf, inter.Cert, root.Cert), want: []*x509.Certificate{leaf, inter.Cert, root.Cert}},
		{
			name: "other blocks and text skipped",
			data: concat([]byte("# bundle\n"), testutil.KeyPEM(t, leafKey), pki.EncodeCertificate(leaf),
				pemBlock("X509 CRL", []byte("junk")), []byte("between\n"), pki.EncodeCertificate(root.Cert)),
			want: []*x509.Certificate{leaf, root.Cert},
		},
		{name: "empty", data: nil, wantNoPEM: true},
		{name: "not PEM", data: []byte("hello"), wantNoPEM: true},
		{name: "key only", data: testutil.KeyPEM(t, leafKey), wantNoPEM: true},
		{name: "garbage DER", data: pemBlock(pki.BlockCertificate, []byte("garbage")), wantErr: true},
		{name: "garbage after good one", data: concat(pki.EncodeCertificate(root.Cert), pemBlock(pki.BlockCertificate, []byte{0x30, 0x01})), wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := pki.ParseCertificates(tc.data)
			if tc.wantNoPEM || tc.wantErr {
				if err == nil {
					t.Fatalf("ParseCertificates() = %d certs, want error", len(got))
				}
				if errors.Is(err, pki.ErrNoPEM) != tc.wantNoPEM {
					t.Fatalf("ParseCertificates() error %v: errors.Is(ErrNoPEM) = %v, want %v", err, !tc.wantNoPEM, tc.wantNoPEM)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseCertificates() error: %v", err)
			}
			if len(got) != len(tc.want) {
				t.Fatalf("ParseCertificates() = %d certs, want %d", len(got), len(tc.want))
			}
			for i := range got {
				if !got[i].Equal(tc.want[i]) {
					t.Errorf("cert %d = %q, want %q", i, got[i].Subject, tc.want[i].Subject)
				}
			}
		})
	}
}

func TestEncodeCertificatesRoundTrip(t *testing.T) {
	t.Parallel()
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	inter := root.NewIntermediate(t, testutil.CAOptions{})
	data := pki.EncodeCertificates(inter.Cert, root.Cert)
	got, err := pki.ParseCertificates(data)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || !got[0].Equal(inter.Cert) || !got[1].Equal(root.Cert) {
		t.Fatalf("round trip gave %d certs, not [intermediate, root]", len(got))
	}
	block, rest := pem.Decode(data)
	if block == nil || block.Type != "CERTIFICATE" || len(block.Headers) != 0 {
		t.Fatalf("first block = %+v, want a plain CERTIFICATE block", block)
	}
	if block, _ := pem.Decode(rest); block == nil || block.Type != "CERTIFICATE" {
		t.Fatalf("second block = %+v, want CERTIFICATE", block)
	}
	if len(pki.EncodeCertificates()) != 0 {
		t.Error("EncodeCertificates() with no certificates is not empty")
	}
}

func TestParsePrivateKey(t *testing.T) {
	t.Parallel()
	ec := newKey(t, pki.ECDSA).(*ecdsa.PrivateKey)
	rsaKey := newKey(t, pki.RSA).(*rsa.PrivateKey)
	sec1, err := x509.MarshalECPrivateKey(ec)
	if err != nil {
		t.Fatal(err)
	}
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	tests := []struct {
		name      string
		data      []byte
		want      crypto.Signer
		wantNoPEM bool
		wantErr   bool
	}{
		{name: "PKCS#8 ECDSA", data: testutil.KeyPEM(t, ec), want: ec},
		{name: "PKCS#8 RSA", data: testutil.KeyPEM(t, rsaKey), want: rsaKey},
		{name: "SEC 1", data: pemBlock("EC PRIVATE KEY", sec1), want: ec},
		{name: "PKCS#1", data: pemBlock("RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(rsaKey)), want: rsaKey},
		{name: "after a certificate", data: concat(pki.EncodeCertificate(root.Cert), pemBlock("EC PRIVATE KEY", sec1)), want: ec},
		{name: "first of two", data: concat(testutil.KeyPEM(t, rsaKey), testutil.KeyPEM(t, ec)), want: rsaKey},
		{name: "no key", data: pki.EncodeCertificate(root.Cert), wantNoPEM: true},
		{name: "empty", data: nil, wantNoPEM: true},
		{name: "garbage PKCS#8", data: pemBlock("PRIVATE KEY", []byte("garbage")), wantErr: true},
		{name: "SEC 1 bytes labelled PKCS#1", data: pemBlock("RSA PRIVATE KEY", sec1), wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := pki.ParsePrivateKey(tc.data)
			if tc.wantNoPEM || tc.wantErr {
				if err == nil {
					t.Fatalf("ParsePrivateKey() = %T, want error", got)
				}
				if errors.Is(err, pki.ErrNoPEM) != tc.wantNoPEM {
					t.Fatalf("ParsePrivateKey() error %v: errors.Is(ErrNoPEM) != %v", err, tc.wantNoPEM)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParsePrivateKey() error: %v", err)
			}
			if !pki.PublicKeysEqual(got.Public(), tc.want.Public()) {
				t.Fatalf("ParsePrivateKey() returned a different key (%s)", pki.DescribeKey(got.Public()))
			}
		})
	}
}

func TestEncodePrivateKeyRoundTrip(t *testing.T) {
	t.Parallel()
	for _, alg := range []pki.KeyAlgorithm{pki.ECDSA, pki.RSA} {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			key := newKey(t, alg)
			data, err := pki.EncodePrivateKey(key)
			if err != nil {
				t.Fatal(err)
			}
			if block, _ := pem.Decode(data); block == nil || block.Type != "PRIVATE KEY" {
				t.Fatalf("EncodePrivateKey() block = %+v, want PKCS#8 \"PRIVATE KEY\"", block)
			}
			got, err := pki.ParsePrivateKey(data)
			if err != nil {
				t.Fatal(err)
			}
			if eq, ok := got.(interface{ Equal(crypto.PrivateKey) bool }); !ok || !eq.Equal(key) {
				t.Fatalf("round trip changed the %s key", alg)
			}
		})
	}
}

func TestParsePublicKeys(t *testing.T) {
	t.Parallel()
	ec := newKey(t, pki.ECDSA)
	rsaKey := newKey(t, pki.RSA).(*rsa.PrivateKey)
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	pkix, err := x509.MarshalPKIXPublicKey(ec.Public())
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name      string
		data      []byte
		want      []crypto.PublicKey
		wantNoPEM bool
		wantErr   bool
	}{
		{name: "PUBLIC KEY", data: pemBlock("PUBLIC KEY", pkix), want: []crypto.PublicKey{ec.Public()}},
		{name: "RSA PUBLIC KEY", data: pemBlock("RSA PUBLIC KEY", x509.MarshalPKCS1PublicKey(&rsaKey.PublicKey)), want: []crypto.PublicKey{rsaKey.Public()}},
		{name: "CERTIFICATE", data: pki.EncodeCertificate(root.Cert), want: []crypto.PublicKey{root.Key.Public()}},
		{
			name: "all kinds in order, private key skipped",
			data: concat(pki.EncodeCertificate(root.Cert), testutil.KeyPEM(t, rsaKey), pemBlock("PUBLIC KEY", pkix),
				pemBlock("RSA PUBLIC KEY", x509.MarshalPKCS1PublicKey(&rsaKey.PublicKey))),
			want: []crypto.PublicKey{root.Key.Public(), ec.Public(), rsaKey.Public()},
		},
		{name: "private key only", data: testutil.KeyPEM(t, ec), wantNoPEM: true},
		{name: "empty", data: nil, wantNoPEM: true},
		{name: "garbage PUBLIC KEY", data: pemBlock("PUBLIC KEY", []byte("garbage")), wantErr: true},
		{name: "garbage CERTIFICATE", data: pemBlock("CERTIFICATE", []byte("garbage")), wantErr: true},
		// Go parses such a certificate, leaving its key nil.
		{name: "CERTIFICATE of an unknown key algorithm", data: pemBlock("CERTIFICATE", unknownKeyAlgorithm(t, root.Cert)), wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := pki.ParsePublicKeys(tc.data)
			if tc.wantNoPEM || tc.wantErr {
				if err == nil {
					t.Fatalf("ParsePublicKeys() = %d keys, want error", len(got))
				}
				if errors.Is(err, pki.ErrNoPEM) != tc.wantNoPEM {
					t.Fatalf("ParsePublicKeys() error %v: errors.Is(ErrNoPEM) != %v", err, tc.wantNoPEM)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParsePublicKeys() error: %v", err)
			}
			if len(got) != len(tc.want) {
				t.Fatalf("ParsePublicKeys() = %d keys, want %d", len(got), len(tc.want))
			}
			for i := range got {
				if !pki.PublicKeysEqual(got[i], tc.want[i]) {
					t.Errorf("key %d = %s, not the expected %s", i, pki.DescribeKey(got[i]), pki.DescribeKey(tc.want[i]))
				}
			}
		})
	}
}

// unknownKeyAlgorithm is the DER of an ECDSA cert whose subject key's algorithm is an OID
// crypto/x509 does not know (1.2.840.10045.2.127 for id-ecPublicKey, 1.2.840.10045.2.1).
func unknownKeyAlgorithm(t testing.TB, cert *x509.Certificate) []byte {
	t.Helper()
	oid := []byte{0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01}
	i := bytes.Index(cert.Raw, oid)
	if i < 0 {
		t.Fatal("not an ECDSA certificate")
	}
	der := bytes.Clone(cert.Raw)
	der[i+len(oid)-1] = 0x7f
	if parsed, err := x509.ParseCertificate(der); err != nil || parsed.PublicKeyAlgorithm != x509.UnknownPublicKeyAlgorithm {
		t.Fatalf("the edited certificate: %v", err)
	}
	return der
}

func TestKeyMatchesCertificate(t *testing.T) {
	t.Parallel()
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	leaf, leafKey := root.IssueWorkload(t, "spiffe://cluster.local/ns/a/sa/b", time.Hour)
	tests := []struct {
		name string
		key  crypto.Signer
		cert *x509.Certificate
		want bool
	}{
		{name: "root key and root", key: root.Key, cert: root.Cert, want: true},
		{name: "leaf key and leaf", key: leafKey, cert: leaf, want: true},
		{name: "root key and leaf", key: root.Key, cert: leaf, want: false},
		{name: "other ECDSA key", key: newKey(t, pki.ECDSA), cert: root.Cert, want: false},
		{name: "RSA key and ECDSA cert", key: newKey(t, pki.RSA), cert: root.Cert, want: false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if got := pki.KeyMatchesCertificate(tc.key, tc.cert); got != tc.want {
				t.Fatalf("KeyMatchesCertificate() = %v, want %v", got, tc.want)
			}
		})
	}
}
