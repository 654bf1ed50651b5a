package pki_test

import (
	"bytes"
	"crypto/x509"
	"encoding/asn1"
	"encoding/pem"
	"errors"
	"testing"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

func TestCreateCSR(t *testing.T) {
	t.Parallel()
	id := pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "default", ServiceAccount: "sleep"}
	for _, alg := range []pki.KeyAlgorithm{pki.ECDSA, pki.RSA} {
		t.Run(string(alg), func(t *testing.T) {
			t.Parallel()
			key := newKey(t, alg)
			data, err := pki.CreateCSR(key, id)
			if err != nil {
				t.Fatal(err)
			}
			block, rest := pem.Decode(data)
			if block == nil || block.Type != "CERTIFICATE REQUEST" || len(bytes.TrimSpace(rest)) != 0 {
				t.Fatalf("CreateCSR() PEM = %q, want one CERTIFICATE REQUEST block", data)
			}
			csr, err := x509.ParseCertificateRequest(block.Bytes)
			if err != nil {
				t.Fatal(err)
			}
			if err := csr.CheckSignature(); err != nil {
				t.Fatalf("CSR signature: %v", err)
			}
			if !pki.PublicKeysEqual(csr.PublicKey, key.Public()) {
				t.Fatal("CSR carries a different public key")
			}
			if len(csr.URIs) != 1 || csr.URIs[0].String() != id.String() {
				t.Fatalf("CSR URIs = %v, want exactly [%s]", csr.URIs, id)
			}
			if len(csr.DNSNames)+len(csr.EmailAddresses)+len(csr.IPAddresses) != 0 {
				t.Fatalf("CSR has extra SANs: DNS %v, email %v, IP %v", csr.DNSNames, csr.EmailAddresses, csr.IPAddresses)
			}
			var subject asn1.RawValue
			if _, err := asn1.Unmarshal(csr.RawSubject, &subject); err != nil || len(subject.Bytes) != 0 {
				t.Fatalf("CSR subject = %q (%x), want an empty name", csr.Subject.String(), csr.RawSubject)
			}
			parsed, err := pki.ParseCSR(data)
			if err != nil || !bytes.Equal(parsed.Raw, csr.Raw) {
				t.Fatalf("ParseCSR(CreateCSR()) = %v, want the same request", err)
			}
		})
	}
}

func TestParseCSR(t *testing.T) {
	t.Parallel()
	key := newKey(t, pki.ECDSA)
	id := pki.SPIFFEID{TrustDomain: "td", Namespace: "ns", ServiceAccount: "sa"}
	data, err := pki.CreateCSR(key, id)
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(data)
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	tests := []struct {
		name      string
		data      []byte
		wantNoPEM bool
		wantErr   bool
	}{
		{name: "CERTIFICATE REQUEST", data: data},
		{name: "NEW CERTIFICATE REQUEST", data: pemBlock("NEW CERTIFICATE REQUEST", block.Bytes)},
		{name: "after a key and a certificate", data: concat(testutil.KeyPEM(t, key), pki.EncodeCertificate(root.Cert), data)},
		{name: "empty", data: nil, wantNoPEM: true},
		{name: "not PEM", data: []byte("MIIB...garbage"), wantNoPEM: true},
		{name: "certificate only", data: pki.EncodeCertificate(root.Cert), wantNoPEM: true},
		{name: "garbage DER", data: pemBlock("CERTIFICATE REQUEST", []byte("garbage")), wantErr: true},
		{name: "certificate DER labelled as request", data: pemBlock("CERTIFICATE REQUEST", root.Cert.Raw), wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			csr, err := pki.ParseCSR(tc.data)
			if tc.wantNoPEM || tc.wantErr {
				if err == nil {
					t.Fatal("ParseCSR() succeeded, want error")
				}
				if errors.Is(err, pki.ErrNoPEM) != tc.wantNoPEM {
					t.Fatalf("ParseCSR() error %v: errors.Is(ErrNoPEM) != %v", err, tc.wantNoPEM)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseCSR() error: %v", err)
			}
			if len(csr.URIs) != 1 || csr.URIs[0].String() != id.String() {
				t.Fatalf("ParseCSR() URIs = %v, want [%s]", csr.URIs, id)
			}
		})
	}
}
