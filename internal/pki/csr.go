package pki

import (
	"crypto"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net/url"
)

// NewCSR returns a DER certificate request for id, signed by key, with the identity as its only
// URI SAN and an empty subject, as Istio's agent sends it.
func NewCSR(key crypto.Signer, id SPIFFEID) ([]byte, error) {
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{URIs: []*url.URL{id.URL()}}, key)
	if err != nil {
		return nil, fmt.Errorf("create certificate request: %w", err)
	}
	return der, nil
}

// CreateCSR is NewCSR, PEM-encoded.
func CreateCSR(key crypto.Signer, id SPIFFEID) ([]byte, error) {
	der, err := NewCSR(key, id)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: BlockCertificateRequest, Bytes: der}), nil
}

// ParseCSR decodes a PEM certificate request. The signature is not checked here.
func ParseCSR(data []byte) (*x509.CertificateRequest, error) {
	for rest := data; ; {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			return nil, fmt.Errorf("certificate request: %w", ErrNoPEM)
		}
		if block.Type != BlockCertificateRequest && block.Type != "NEW "+BlockCertificateRequest {
			continue
		}
		csr, err := x509.ParseCertificateRequest(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("parse certificate request: %w", err)
		}
		return csr, nil
	}
}
