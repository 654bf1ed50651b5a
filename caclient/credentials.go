package caclient

import (
	"crypto/tls"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/istio"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// ProvisionedCertificate returns a ClientCertificate source that reads the key pair in dir
// (PROV_CERT: cert-chain.pem and key.pem) before every call and presents it while the key matches
// the leaf and the leaf is valid; it returns nil otherwise, saying why at debug level.
func ProvisionedCertificate(dir string, clk clock.Clock, log *slog.Logger) func() *tls.Certificate {
	clk = clock.OrReal(clk)
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return func() *tls.Certificate {
		cert, err := LoadKeyPair(dir, "", clk)
		if err != nil {
			log.Debug("the provisioned certificate is not usable", logkey.Dir, dir, logkey.Reason, err.Error())
			return nil
		}
		return cert
	}
}

// LoadKeyPair reads the key pair in dir and checks it: the key matches the leaf, the leaf is
// valid now and, when spiffeID is set, names it.
func LoadKeyPair(dir, spiffeID string, clk clock.Clock) (*tls.Certificate, error) {
	certPEM, err := os.ReadFile(filepath.Join(dir, istio.CertChainFile))
	if err != nil {
		return nil, err
	}
	keyPEM, err := os.ReadFile(filepath.Join(dir, istio.KeyFile))
	if err != nil {
		return nil, err
	}
	chain, err := pki.ParseCertificates(certPEM)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, istio.CertChainFile), err)
	}
	key, err := pki.ParsePrivateKey(keyPEM)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, istio.KeyFile), err)
	}
	if err := pki.CheckKeyPair(chain, key, spiffeID, clock.OrReal(clk).Now()); err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	cert := &tls.Certificate{PrivateKey: key, Leaf: chain[0]}
	for _, c := range chain {
		cert.Certificate = append(cert.Certificate, c.Raw)
	}
	return cert, nil
}
