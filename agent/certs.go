package agent

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"time"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/secretmanager"
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

// InspectSDS fetches "default" and "ROOTCA" from the SDS server on socketPath, as Envoy does, and
// reports the certificate and whether its chain verifies against the trust bundle at now.
func InspectSDS(ctx context.Context, socketPath string, now time.Time) (*CertReport, error) {
	got, err := sds.Get(ctx, socketPath, "meshid-certs", secretmanager.WorkloadCertName, secretmanager.RootCertName)
	if err != nil {
		return nil, err
	}
	tlsCert := got[secretmanager.WorkloadCertName].GetTlsCertificate()
	if tlsCert == nil {
		return nil, errors.New(`the "default" secret holds no certificate`)
	}
	chain, err := pki.ParseCertificates(tlsCert.GetCertificateChain().GetInlineBytes())
	if err != nil {
		return nil, fmt.Errorf(`the "default" secret: %w`, err)
	}
	roots, err := pki.ParseCertificates(got[secretmanager.RootCertName].GetValidationContext().GetTrustedCa().GetInlineBytes())
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
