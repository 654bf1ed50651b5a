package secretmanager

import (
	"crypto"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"time"
)

// Names of the secrets, as Envoy asks for them over SDS.
const (
	WorkloadCertName = "default"
	RootCertName     = "ROOTCA"
)

// Errors a subscription reports; test with errors.Is.
var (
	// ErrUnknownSecret reports a secret name the manager does not serve.
	ErrUnknownSecret = errors.New("unknown secret")
	// ErrForbiddenPath reports a file resource outside the directories files may be served from.
	ErrForbiddenPath = errors.New("path outside the directories files may be served from")
	// ErrTooManyFiles reports a file resource past MaxFileSecrets: each is watched and kept while
	// subscribed to, so clients may not hold names without end.
	ErrTooManyFiles = errors.New("too many file secrets")
	// ErrExpired reports a key pair that expired before a new one could be had.
	ErrExpired = errors.New("the certificate has expired")
	// ErrRenewalUnderWay reports a request to the CA not answered when the certificate expired.
	ErrRenewalUnderWay = errors.New("a renewal under way")
)

// Source says where a secret came from.
type Source string

// Where secrets come from.
const (
	SourceCA          Source = "ca"           // issued by the CA
	SourceOutputCerts Source = "output-certs" // left in OUTPUT_CERTS by an earlier run, still valid
	SourceFiles       Source = "files"        // read from files
)

// KeyPair is a certificate chain, leaf first, and the private key of its leaf.
type KeyPair struct {
	Chain    []*x509.Certificate
	ChainPEM []byte
	Key      crypto.Signer
	KeyPEM   []byte
}

// Leaf returns the chain's first certificate.
func (k *KeyPair) Leaf() *x509.Certificate { return k.Chain[0] }

// TLSCertificate returns the pair as crypto/tls presents it.
func (k *KeyPair) TLSCertificate() *tls.Certificate {
	cert := &tls.Certificate{PrivateKey: k.Key, Leaf: k.Chain[0]}
	for _, c := range k.Chain {
		cert.Certificate = append(cert.Certificate, c.Raw)
	}
	return cert
}

// TrustBundle is a set of trusted roots.
type TrustBundle struct {
	Roots []*x509.Certificate
	PEM   []byte
}

// Secret is one named secret as it is served: a key pair (KeyPair is set) or a trust bundle
// (Bundle is set).
type Secret struct {
	Name    string
	KeyPair *KeyPair
	Bundle  *TrustBundle
	// Version changes whenever the content does.
	Version string
	Source  Source
	// Received is when a key pair was obtained; RenewAt is when it will be renewed (zero unless
	// the CA renews it).
	Received, RenewAt time.Time
}

// NotAfter is when a key pair's leaf expires; zero for a trust bundle.
func (s *Secret) NotAfter() time.Time {
	if s.KeyPair == nil {
		return time.Time{}
	}
	return s.KeyPair.Leaf().NotAfter
}

// validAt reports whether s may be served at now: a trust bundle always, a key pair until its
// leaf expires.
func (s *Secret) validAt(now time.Time) bool {
	return s.KeyPair == nil || now.Before(s.NotAfter())
}

func contentVersion(parts ...[]byte) string {
	h := sha256.New()
	for _, p := range parts {
		h.Write(p)
	}
	return hex.EncodeToString(h.Sum(nil)[:8])
}
