package caclient

import (
	"crypto/tls"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/pki"
)

// Names of the files of a workload key pair (OUTPUT_CERTS, PROV_CERT).
const (
	CertChainFile = "cert-chain.pem"
	KeyFile       = "key.pem"
	RootCertFile  = "root-cert.pem"
)

// KeyPairDir is a directory that may hold a key pair (cert-chain.pem, key.pem) to present to the
// CA; when SPIFFEID is set, only a certificate naming it is used.
type KeyPairDir struct {
	Dir      string
	SPIFFEID string
}

// KeyPairFromDirs returns a ClientCertificate callback that presents the first usable key pair
// found in dirs, read afresh at each handshake: the key matches the leaf and the leaf is valid now
// (and names the SPIFFE ID, if one is given). This is how a VM keeps renewing over mTLS after its
// provisioned token has expired: OUTPUT_CERTS first, then PROV_CERT.
func KeyPairFromDirs(clk clock.Clock, dirs ...KeyPairDir) func() (*tls.Certificate, error) {
	clk = clock.OrReal(clk)
	return func() (*tls.Certificate, error) {
		var errs []error
		for _, d := range dirs {
			if d.Dir == "" {
				continue
			}
			cert, err := LoadKeyPair(d.Dir, d.SPIFFEID, clk)
			if err == nil {
				return cert, nil
			}
			errs = append(errs, err)
		}
		return nil, errors.Join(errs...)
	}
}

// LoadKeyPair reads and checks the key pair in dir (see KeyPairFromDirs).
func LoadKeyPair(dir, spiffeID string, clk clock.Clock) (*tls.Certificate, error) {
	// A directory published through a "..data" symlink (OUTPUT_CERTS, a mounted secret) is read
	// from one generation, so that a swap between the two reads cannot pair a key with another
	// generation's certificate.
	if generation, err := filepath.EvalSymlinks(filepath.Join(dir, "..data")); err == nil {
		dir = generation
	}
	certPEM, err := os.ReadFile(filepath.Join(dir, CertChainFile))
	if err != nil {
		return nil, err
	}
	keyPEM, err := os.ReadFile(filepath.Join(dir, KeyFile))
	if err != nil {
		return nil, err
	}
	chain, err := pki.ParseCertificates(certPEM)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, CertChainFile), err)
	}
	key, err := pki.ParsePrivateKey(keyPEM)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, KeyFile), err)
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
