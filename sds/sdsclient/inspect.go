package sdsclient

import (
	"context"
	"crypto"
	"crypto/x509"
	"errors"
	"fmt"
	"time"

	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"

	"github.com/meshid/meshid/internal/pki"
)

// CertReport is what an SDS server hands Envoy, as `meshid certs` shows it.
type CertReport struct {
	Socket    string    `json:"socket"`
	SPIFFEID  string    `json:"spiffe_id"`
	Subject   string    `json:"subject"`
	Issuer    string    `json:"issuer"`
	Serial    string    `json:"serial"`
	NotBefore time.Time `json:"not_before"`
	NotAfter  time.Time `json:"not_after"`
	TimeLeft  string    `json:"time_left"`
	ChainLen  int       `json:"chain_length"`
	Roots     []string  `json:"roots"`
	// Verified says whether the chain of "default" verifies against "ROOTCA" now; VerifyError why not.
	Verified    bool   `json:"verified"`
	VerifyError string `json:"verify_error,omitempty"`
}

// Inspect fetches "default" and "ROOTCA" from the SDS server on socketPath and reports the
// certificate and whether its chain verifies against the trust bundle at now.
func Inspect(ctx context.Context, socketPath string, now time.Time) (*CertReport, error) {
	got, err := Get(ctx, socketPath, "meshid-certs", WorkloadCertName, RootCertName)
	if err != nil {
		return nil, err
	}
	tlsCert := got[WorkloadCertName].GetTlsCertificate()
	if tlsCert == nil {
		return nil, errors.New(`the "default" secret holds no certificate`)
	}
	chain, err := pki.ParseCertificates(tlsCert.GetCertificateChain().GetInlineBytes())
	if err != nil {
		return nil, fmt.Errorf(`the "default" secret: %w`, err)
	}
	roots, err := pki.ParseCertificates(got[RootCertName].GetValidationContext().GetTrustedCa().GetInlineBytes())
	if err != nil {
		return nil, fmt.Errorf(`the "ROOTCA" secret: %w`, err)
	}
	leaf := chain[0]
	r := &CertReport{
		Socket:    socketPath,
		Subject:   leaf.Subject.String(),
		Issuer:    leaf.Issuer.String(),
		Serial:    leaf.SerialNumber.Text(16),
		NotBefore: leaf.NotBefore,
		NotAfter:  leaf.NotAfter,
		TimeLeft:  leaf.NotAfter.Sub(now).Round(time.Second).String(),
		ChainLen:  len(chain),
	}
	if len(leaf.URIs) > 0 {
		r.SPIFFEID = leaf.URIs[0].String()
	}
	rootPool, interPool := x509.NewCertPool(), x509.NewCertPool()
	for _, root := range roots {
		rootPool.AddCert(root)
		r.Roots = append(r.Roots, root.Subject.String())
	}
	for _, c := range chain[1:] {
		interPool.AddCert(c)
	}
	_, err = leaf.Verify(x509.VerifyOptions{Roots: rootPool, Intermediates: interPool, CurrentTime: now,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}})
	r.Verified = err == nil
	if err != nil {
		r.VerifyError = err.Error()
	}
	return r, nil
}

// KeyPair returns the chain and key of a tls_certificate secret; a secret without one, or whose
// key does not match the leaf, is an error.
func KeyPair(s *tlsv3.Secret) ([]*x509.Certificate, crypto.Signer, error) {
	tc := s.GetTlsCertificate()
	if tc == nil {
		return nil, nil, fmt.Errorf("secret %s holds no tls_certificate", s.GetName())
	}
	chain, err := pki.ParseCertificates(tc.GetCertificateChain().GetInlineBytes())
	if err != nil {
		return nil, nil, fmt.Errorf("secret %s: %w", s.GetName(), err)
	}
	key, err := pki.ParsePrivateKey(tc.GetPrivateKey().GetInlineBytes())
	if err != nil {
		return nil, nil, fmt.Errorf("secret %s: %w", s.GetName(), err)
	}
	if !pki.KeyMatchesCertificate(key, chain[0]) {
		return nil, nil, fmt.Errorf("secret %s: the key does not match the leaf", s.GetName())
	}
	return chain, key, nil
}

// Roots returns the trusted roots of a validation_context secret.
func Roots(s *tlsv3.Secret) ([]*x509.Certificate, error) {
	vc := s.GetValidationContext()
	if vc == nil {
		return nil, fmt.Errorf("secret %s holds no validation_context", s.GetName())
	}
	roots, err := pki.ParseCertificates(vc.GetTrustedCa().GetInlineBytes())
	if err != nil {
		return nil, fmt.Errorf("secret %s: %w", s.GetName(), err)
	}
	return roots, nil
}
