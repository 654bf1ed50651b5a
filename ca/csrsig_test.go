package ca_test

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/md5" // to build the MD5-signed request the CA must refuse
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"errors"
	"net/url"
	"strings"
	"testing"

	"github.com/meshid/meshid/ca"
)

// md5CSR re-signs a request of key with MD5, which x509 no longer does.
func md5CSR(t *testing.T, key *rsa.PrivateKey, tmpl *x509.CertificateRequest) []byte {
	t.Helper()
	var req struct {
		TBS       asn1.RawValue
		Algorithm pkix.AlgorithmIdentifier
		Signature asn1.BitString
	}
	if _, err := asn1.Unmarshal(csrDER(t, key, tmpl), &req); err != nil {
		t.Fatal(err)
	}
	sum := md5.Sum(req.TBS.FullBytes)
	sig, err := rsa.SignPKCS1v15(rand.Reader, key, crypto.MD5, sum[:])
	if err != nil {
		t.Fatal(err)
	}
	req.Algorithm = pkix.AlgorithmIdentifier{Algorithm: asn1.ObjectIdentifier{1, 2, 840, 113549, 1, 1, 4}, Parameters: asn1.NullRawValue}
	req.Signature = asn1.BitString{Bytes: sig, BitLength: 8 * len(sig)}
	der, err := asn1.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	return der
}

// Attack: a request signed with SHA-1 was accepted (x509 still verifies SHA-1 on requests, for old
// tools), so a SHA-1 collision could get a key certified that never signed the request. Requests
// signed with SHA-1 or MD5 are refused, with InvalidArgument at the gRPC front.
func TestCSRSignedWithSHA1OrMD5IsRefused(t *testing.T) {
	t.Parallel()
	id := testID(t, "default", "web")
	tmpl := func(alg x509.SignatureAlgorithm) *x509.CertificateRequest {
		return &x509.CertificateRequest{URIs: []*url.URL{id.URL()}, SignatureAlgorithm: alg}
	}
	ec, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		der     []byte
		refused string // the algorithm named in the refusal; "" when accepted
	}{
		{"ECDSA with SHA-1", csrDER(t, ec, tmpl(x509.ECDSAWithSHA1)), "ECDSA-SHA1"},
		{"RSA with SHA-1", csrDER(t, rsaKey, tmpl(x509.SHA1WithRSA)), "SHA1-RSA"},
		{"RSA with MD5", md5CSR(t, rsaKey, tmpl(x509.SHA256WithRSA)), "MD5-RSA"},
		{"ECDSA with SHA-256", csrDER(t, ec, tmpl(x509.ECDSAWithSHA256)), ""},
		{"ECDSA with SHA-512", csrDER(t, ec, tmpl(x509.ECDSAWithSHA512)), ""},
		{"RSA with SHA-384", csrDER(t, rsaKey, tmpl(x509.SHA384WithRSA)), ""},
		{"RSA-PSS with SHA-256", csrDER(t, rsaKey, tmpl(x509.SHA256WithRSAPSS)), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			csr, err := ca.ParseCSR(csrPEM(tc.der))
			if err != nil {
				t.Fatal(err)
			}
			err = ca.CheckCSR(csr, id)
			if tc.refused == "" {
				if err != nil {
					t.Fatalf("CheckCSR: %v, want it accepted", err)
				}
				return
			}
			if !errors.Is(err, ca.ErrCSRSignatureAlgorithm) || !strings.Contains(err.Error(), tc.refused) {
				t.Fatalf("CheckCSR: %v, want ErrCSRSignatureAlgorithm naming %s", err, tc.refused)
			}
		})
	}
}
