package pki

import (
	"bytes"
	"crypto"
	"crypto/x509"
	"errors"
	"fmt"
	"time"
)

// CheckKeyPair reports why chain and key are not a usable workload key pair at now, if they are
// not: the key must match the leaf, the leaf must be valid at now, and, when spiffeID is set, the
// leaf's only URI SAN must be spiffeID.
func CheckKeyPair(chain []*x509.Certificate, key crypto.Signer, spiffeID string, now time.Time) error {
	if len(chain) == 0 {
		return errors.New("no certificate")
	}
	leaf := chain[0]
	if key == nil || !PublicKeysEqual(leaf.PublicKey, key.Public()) {
		return errors.New("the key does not match the certificate")
	}
	if now.Before(leaf.NotBefore) || !now.Before(leaf.NotAfter) {
		return fmt.Errorf("the certificate is valid from %s to %s, not at %s",
			leaf.NotBefore.UTC().Format(time.RFC3339), leaf.NotAfter.UTC().Format(time.RFC3339), now.UTC().Format(time.RFC3339))
	}
	if spiffeID != "" && (len(leaf.URIs) != 1 || leaf.URIs[0].String() != spiffeID) {
		return fmt.Errorf("the certificate does not name %s", spiffeID)
	}
	return nil
}

// IsSelfSigned reports whether c is self-signed: its issuer is its subject and its own key
// verifies its signature (a root, or a self-issued certificate standing for one).
func IsSelfSigned(c *x509.Certificate) bool {
	return bytes.Equal(c.RawIssuer, c.RawSubject) && c.CheckSignatureFrom(c) == nil
}
