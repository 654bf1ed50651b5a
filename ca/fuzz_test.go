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
	"strings"
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

// FuzzLoadCACerts feeds arbitrary contents to the files of a plugged-in CA directory, in either
// layout and with any of them missing, through what LoadPluggedIn does with them once read: what
// every start and every reload of --cacerts-dir parses. The result must be an error naming the directory, or a consistent
// authority: a CA signing certificate with the very key loaded, a chain to a root the bundle
// trusts, and leaves signed with them that verify. Never a panic.
func FuzzLoadCACerts(f *testing.F) {
	now := time.Date(2031, time.March, 14, 15, 9, 26, 0, time.UTC)
	opts := func(name string) testutil.CAOptions {
		return testutil.CAOptions{CommonName: name, NotBefore: now.Add(-time.Hour), NotAfter: now.Add(365 * 24 * time.Hour)}
	}
	root := testutil.NewRootCA(f, opts("fuzz root"))
	inter := root.NewIntermediate(f, opts("fuzz intermediate"))
	other := testutil.NewRootCA(f, opts("other root"))
	sec1, err := x509.MarshalECPrivateKey(inter.Key.(*ecdsa.PrivateKey))
	if err != nil {
		f.Fatal(err)
	}
	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		f.Fatal(err)
	}
	rsaRoot := testutil.NewRootCA(f, testutil.CAOptions{CommonName: "rsa root", Key: rsaKey, NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour)})
	pkcs1 := pem.EncodeToMemory(&pem.Block{Type: pki.BlockRSAPrivateKey, Bytes: x509.MarshalPKCS1PrivateKey(rsaKey)})

	certPEM, keyPEM := testutil.CertPEM, func(k crypto.Signer) []byte { return testutil.KeyPEM(f, k) }
	// layout: bit 0 picks tls.crt/tls.key/ca.crt over Istio's names; bits 1-4 leave out the
	// signing certificate, the key, the chain, the roots.
	for _, s := range []struct {
		layout                 uint8
		cert, key, chain, root []byte
	}{
		{0, certPEM(inter.Cert), keyPEM(inter.Key), certPEM(inter.Cert, root.Cert), certPEM(root.Cert)},
		{0, certPEM(inter.Cert), keyPEM(inter.Key), certPEM(inter.Cert), certPEM(root.Cert)},
		{0, certPEM(inter.Cert), pem.EncodeToMemory(&pem.Block{Type: pki.BlockECPrivateKey, Bytes: sec1}), nil, certPEM(root.Cert, other.Cert)},
		{0, certPEM(inter.Cert), keyPEM(other.Key), certPEM(inter.Cert, root.Cert), certPEM(root.Cert)},
		{0, certPEM(inter.Cert), keyPEM(inter.Key), certPEM(inter.Cert, root.Cert), certPEM(other.Cert)},
		{0, certPEM(root.Cert), keyPEM(root.Key), nil, certPEM(root.Cert)},
		{1, certPEM(inter.Cert, root.Cert), keyPEM(inter.Key), nil, certPEM(root.Cert)},
		{1, certPEM(rsaRoot.Cert), pkcs1, nil, nil},
		{1, certPEM(inter.Cert), keyPEM(inter.Key), nil, nil},
		{1 | 1<<4, certPEM(root.Cert), keyPEM(root.Key), nil, nil},
		{1 << 1, nil, keyPEM(inter.Key), certPEM(inter.Cert, root.Cert), certPEM(root.Cert)},
		{0, []byte("-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n"), []byte("garbage"), nil, nil},
	} {
		f.Add(s.layout, s.cert, s.key, s.chain, s.root)
	}

	f.Fuzz(func(t *testing.T, layout uint8, cert, key, chain, root []byte) {
		const dir = "/etc/cacerts" // named in errors; the files are given, not read
		names := [4]string{CACertFile, CAKeyFile, CertChainFile, RootCertFile}
		if layout&1 == 1 {
			names = [4]string{TLSCertFile, TLSKeyFile, "", TLSCAFile}
		}
		files := map[string][]byte{}
		for i, data := range [][]byte{cert, key, chain, root} {
			if names[i] != "" && layout&(1<<(i+1)) == 0 {
				files[names[i]] = data
			}
		}
		b, err := bundleFromLayouts(dir, files, now, SourcePluggedIn)
		if err != nil {
			if !strings.Contains(err.Error(), dir) {
				t.Fatalf("error %q does not name the directory", err)
			}
			return
		}
		checkFuzzedBundle(t, b, now)
	})
}

// checkFuzzedBundle fails unless b can sign: its key is its signing certificate's, a CA's, on a
// chain that verifies to one of its roots, and a leaf it signs verifies against its roots.
func checkFuzzedBundle(t *testing.T, b *Bundle, now time.Time) {
	t.Helper()
	cert := b.signingCert
	if !pki.KeyMatchesCertificate(b.signer, cert) {
		t.Fatal("the signing key does not match the signing certificate")
	}
	if !cert.IsCA || !cert.BasicConstraintsValid {
		t.Fatal("the signing certificate is not a CA certificate")
	}
	if len(b.chain) == 0 || !b.chain[0].Equal(cert) || !containsCert(b.Roots(), b.Root()) {
		t.Fatalf("chain %d long does not run from the signing certificate to a trusted root", len(b.chain))
	}
	for i := 0; i+1 < len(b.chain); i++ {
		if err := b.chain[i].CheckSignatureFrom(b.chain[i+1]); err != nil {
			t.Fatalf("chain element %d is not signed by the next: %v", i, err)
		}
	}
	id := pki.SPIFFEID{TrustDomain: "example.org", Namespace: "default", ServiceAccount: "web"}
	csrPEM, err := pki.CreateCSR(mustP256(t), id)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := ParseCSR(csrPEM)
	if err != nil {
		t.Fatal(err)
	}
	issued, err := New(Config{Clock: testutil.NewFakeClock(now)}, b).SignWorkload(t.Context(), WorkloadRequest{CSR: csr, Identity: id})
	if err != nil {
		t.Fatalf("the loaded CA cannot sign: %v", err)
	}
	chain := issued.Chain()
	inter := x509.NewCertPool()
	for _, c := range chain[1 : len(chain)-1] {
		inter.AddCert(c)
	}
	if _, err := issued.Leaf.Verify(x509.VerifyOptions{
		Roots: b.RootPool(), Intermediates: inter, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
	}); err != nil {
		t.Fatalf("a leaf of the loaded CA does not verify against its roots: %v", err)
	}
}

func mustP256(t *testing.T) crypto.Signer {
	t.Helper()
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	return key
}
