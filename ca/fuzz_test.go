package ca

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"net/url"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// FuzzCheckCSR feeds arbitrary bytes, as PEM and as raw DER, through the CSR policy. Whatever
// CheckCSR accepts must really satisfy the policy, and must then be signable.
func FuzzCheckCSR(f *testing.F) {
	now := time.Date(2031, time.March, 14, 15, 9, 26, 0, time.UTC)
	id := pki.SPIFFEID{TrustDomain: "example.org", Namespace: "default", ServiceAccount: "web"}
	root := testutil.NewRootCA(f, testutil.CAOptions{CommonName: "fuzz root", NotBefore: now.Add(-time.Hour), NotAfter: now.Add(365 * 24 * time.Hour)})
	bundle, err := NewBundle(BundleParams{SigningCert: root.Cert, SigningKey: root.Key, Source: SourceSelfSigned, Now: now})
	if err != nil {
		f.Fatal(err)
	}
	authority := New(Config{Clock: testutil.NewFakeClock(now)}, bundle)

	// Seeds are generated here, never committed: they carry (throwaway) keys' signatures.
	seed := func(key crypto.Signer, tmpl *x509.CertificateRequest) []byte {
		der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
		if err != nil {
			f.Fatal(err)
		}
		return der
	}
	p256, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		f.Fatal(err)
	}
	rsa2048, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		f.Fatal(err)
	}
	other := pki.SPIFFEID{TrustDomain: "example.org", Namespace: "default", ServiceAccount: "admin"}
	validDER := seed(p256, &x509.CertificateRequest{URIs: []*url.URL{id.URL()}})
	for _, der := range [][]byte{
		validDER,
		seed(rsa2048, &x509.CertificateRequest{URIs: []*url.URL{id.URL()}}),
		seed(p256, &x509.CertificateRequest{URIs: []*url.URL{id.URL()}, DNSNames: []string{"web.default.svc"}}),
		seed(p256, &x509.CertificateRequest{URIs: []*url.URL{other.URL()}}),
		seed(p256, &x509.CertificateRequest{}),
		seed(p256, &x509.CertificateRequest{URIs: []*url.URL{id.URL()}, SignatureAlgorithm: x509.ECDSAWithSHA1}),
	} {
		f.Add(pem.EncodeToMemory(&pem.Block{Type: pki.BlockCertificateRequest, Bytes: der}))
	}
	f.Add(validDER)

	f.Fuzz(func(t *testing.T, data []byte) {
		var csrs []*x509.CertificateRequest
		csr, err := ParseCSR(data)
		switch {
		case err == nil:
			csrs = append(csrs, csr)
		case !errors.Is(err, ErrMalformedCSR):
			t.Fatalf("ParseCSR error %v is not ErrMalformedCSR", err)
		}
		if raw, err := x509.ParseCertificateRequest(data); err == nil {
			wrapped, err := ParseCSR(pem.EncodeToMemory(&pem.Block{Type: pki.BlockCertificateRequest, Bytes: raw.Raw}))
			if err != nil {
				t.Fatalf("DER parses as a CSR but its PEM does not: %v", err)
			}
			csrs = append(csrs, wrapped)
		}
		for _, csr := range csrs {
			checkFuzzedCSR(t, authority, csr, id)
		}
	})
}

func checkFuzzedCSR(t *testing.T, a *Authority, csr *x509.CertificateRequest, id pki.SPIFFEID) {
	err := CheckCSR(csr, id)
	if err != nil {
		for _, sentinel := range []error{ErrUnsupportedKey, ErrCSRSignature, ErrCSRSignatureAlgorithm, ErrForbiddenSAN, ErrIdentityMismatch} {
			if errors.Is(err, sentinel) {
				return
			}
		}
		t.Fatalf("CheckCSR refused with %v, which is none of the policy errors", err)
	}

	if err := csr.CheckSignature(); err != nil {
		t.Fatalf("CheckCSR accepted a request whose signature does not verify: %v", err)
	}
	switch csr.SignatureAlgorithm {
	case x509.SHA1WithRSA, x509.ECDSAWithSHA1, x509.MD5WithRSA, x509.MD2WithRSA, x509.DSAWithSHA1, x509.UnknownSignatureAlgorithm:
		t.Fatalf("CheckCSR accepted a request signed with %s", csr.SignatureAlgorithm)
	}
	if len(csr.DNSNames) != 0 || len(csr.IPAddresses) != 0 || len(csr.EmailAddresses) != 0 {
		t.Fatalf("CheckCSR accepted DNS %q, IP %v, email %q", csr.DNSNames, csr.IPAddresses, csr.EmailAddresses)
	}
	for _, u := range csr.URIs {
		if u.String() != id.String() {
			t.Fatalf("CheckCSR accepted URI %q for caller %q", u, id)
		}
	}
	switch k := csr.PublicKey.(type) {
	case *rsa.PublicKey:
		if bits := k.N.BitLen(); bits < 2048 || bits > 8192 {
			t.Fatalf("CheckCSR accepted RSA %d", bits)
		}
	case *ecdsa.PublicKey:
		if k.Curve != elliptic.P256() && k.Curve != elliptic.P384() {
			t.Fatalf("CheckCSR accepted ECDSA %s", k.Curve.Params().Name)
		}
	default:
		t.Fatalf("CheckCSR accepted a %T key", csr.PublicKey)
	}

	issued, err := a.SignWorkload(t.Context(), WorkloadRequest{CSR: csr, Identity: id})
	if err != nil {
		t.Fatalf("CheckCSR accepted the request but SignWorkload failed: %v", err)
	}
	leaf := issued.Leaf
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != id.String() {
		t.Fatalf("leaf names %v, want [%s]", leaf.URIs, id)
	}
	if len(leaf.DNSNames)+len(leaf.IPAddresses)+len(leaf.EmailAddresses) != 0 || leaf.IsCA {
		t.Fatalf("leaf carries DNS %q IP %v email %q, IsCA %v", leaf.DNSNames, leaf.IPAddresses, leaf.EmailAddresses, leaf.IsCA)
	}
	if !pki.PublicKeysEqual(csr.PublicKey, leaf.PublicKey) {
		t.Fatal("leaf does not carry the request's key")
	}
}
