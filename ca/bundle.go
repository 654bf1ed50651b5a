package ca

import (
	"bytes"
	"crypto"
	"crypto/x509"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/meshid/meshid/internal/pki"
)

// Source says where a bundle's key material came from.
type Source string

// Sources of key material.
const (
	SourcePluggedIn  Source = "plugged-in"
	SourceSelfSigned Source = "self-signed"
)

// Bundle is one generation of the CA's key material. It is immutable: a new generation is a new
// Bundle, published with Authority.SetBundle, so that a signature never mixes two generations.
type Bundle struct {
	signer      crypto.Signer
	signingCert *x509.Certificate
	chain       []*x509.Certificate // signing certificate first, root last (one element when self-signed)
	anchors     []*x509.Certificate // the roots given with the key material; chain's root first
	retained    []*x509.Certificate // earlier roots still trusted during a rotation
	roots       []*x509.Certificate // anchors, then retained: everything the CA trusts
	rootPool    *x509.CertPool
	signerPool  *x509.CertPool // the signing certificate alone, as the anchor for checking new leaves
	chainPEM    []string       // what follows a leaf in a response: intermediates, then the root
	notBefore   time.Time      // the latest NotBefore along the chain
	notAfter    time.Time      // the earliest NotAfter along the chain
	source      Source
}

// BundleParams is the input to NewBundle.
type BundleParams struct {
	SigningCert *x509.Certificate
	SigningKey  crypto.Signer
	// Intermediates are candidates for the path from SigningCert to a root, in any order; the
	// signing certificate and roots may appear among them.
	Intermediates []*x509.Certificate
	// Roots are the trust anchors. Empty means SigningCert must be a self-signed root.
	Roots []*x509.Certificate
	// Retained are earlier roots that stay trusted (for peers) but anchor no new chain.
	Retained []*x509.Certificate
	Source   Source
	// Now is the time against which validity is checked.
	Now time.Time
}

// NewBundle validates key material and builds a Bundle: the signing certificate must be a CA
// certificate, valid at Now, matching the key, and must chain through Intermediates to one of Roots.
func NewBundle(p BundleParams) (*Bundle, error) {
	cert := p.SigningCert
	switch {
	case cert == nil:
		return nil, errors.New("no signing certificate")
	case p.SigningKey == nil:
		return nil, errors.New("no signing key")
	case !cert.BasicConstraintsValid || !cert.IsCA:
		return nil, fmt.Errorf("signing certificate %q is not a CA certificate", cert.Subject)
	case cert.KeyUsage != 0 && cert.KeyUsage&x509.KeyUsageCertSign == 0:
		return nil, fmt.Errorf("signing certificate %q may not sign certificates (no certSign key usage)", cert.Subject)
	case !pki.KeyMatchesCertificate(p.SigningKey, cert):
		return nil, fmt.Errorf("signing key does not match signing certificate %q", cert.Subject)
	case p.Now.Before(cert.NotBefore):
		return nil, fmt.Errorf("signing certificate %q is not valid before %s", cert.Subject, cert.NotBefore.UTC().Format(time.RFC3339))
	case !p.Now.Before(cert.NotAfter):
		return nil, fmt.Errorf("signing certificate %q expired at %s", cert.Subject, cert.NotAfter.UTC().Format(time.RFC3339))
	}

	roots := p.Roots
	if len(roots) == 0 {
		if !isSelfSigned(cert) {
			return nil, fmt.Errorf("no root certificate given and signing certificate %q is not self-signed", cert.Subject)
		}
		roots = []*x509.Certificate{cert}
	}
	anchorPool := x509.NewCertPool()
	for _, r := range roots {
		anchorPool.AddCert(r)
	}
	interPool := x509.NewCertPool()
	for _, c := range p.Intermediates {
		if !containsCert(roots, c) {
			interPool.AddCert(c)
		}
	}
	chains, err := cert.Verify(x509.VerifyOptions{
		Roots:         anchorPool,
		Intermediates: interPool,
		CurrentTime:   p.Now,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
	})
	if err != nil {
		return nil, fmt.Errorf("signing certificate %q does not chain to the root certificates: %w", cert.Subject, err)
	}
	chain := chains[0]
	root := chain[len(chain)-1]

	b := &Bundle{
		signer:      p.SigningKey,
		signingCert: cert,
		chain:       chain,
		anchors:     append([]*x509.Certificate{root}, without(roots, root)...),
		signerPool:  x509.NewCertPool(),
		source:      p.Source,
		notBefore:   chain[0].NotBefore,
		notAfter:    chain[0].NotAfter,
	}
	for _, c := range chain {
		if c.NotAfter.Before(b.notAfter) {
			b.notAfter = c.NotAfter
		}
		if c.NotBefore.After(b.notBefore) {
			b.notBefore = c.NotBefore
		}
		b.chainPEM = append(b.chainPEM, string(pki.EncodeCertificate(c)))
	}
	b.signerPool.AddCert(cert)
	return b.withRetained(p.Retained), nil
}

// withRetained returns a copy of b that also trusts retained (minus its anchors and duplicates).
func (b *Bundle) withRetained(retained []*x509.Certificate) *Bundle {
	next := *b
	next.retained = nil
	for _, r := range retained {
		if !containsCert(next.anchors, r) && !containsCert(next.retained, r) {
			next.retained = append(next.retained, r)
		}
	}
	next.roots = append(slices.Clone(next.anchors), next.retained...)
	next.rootPool = x509.NewCertPool()
	for _, r := range next.roots {
		next.rootPool.AddCert(r)
	}
	return &next
}

// sameMaterial reports whether b and o sign with the same certificate, chain and anchors.
func (b *Bundle) sameMaterial(o *Bundle) bool {
	return o != nil && sameCerts(b.chain, o.chain) && sameCerts(b.anchors, o.anchors)
}

func sameCerts(a, b []*x509.Certificate) bool {
	return slices.EqualFunc(a, b, func(x, y *x509.Certificate) bool { return x.Equal(y) })
}

// SigningCert returns the certificate that signs leaves.
func (b *Bundle) SigningCert() *x509.Certificate { return b.signingCert }

// Chain returns the path from the signing certificate to its root, both included.
func (b *Bundle) Chain() []*x509.Certificate { return slices.Clone(b.chain) }

// Root returns the root that the signing certificate chains to.
func (b *Bundle) Root() *x509.Certificate { return b.chain[len(b.chain)-1] }

// Roots returns every trusted root: the signing root first, then the other anchors, then roots
// retained from before a rotation.
func (b *Bundle) Roots() []*x509.Certificate { return slices.Clone(b.roots) }

// Retained returns the roots kept from before a rotation.
func (b *Bundle) Retained() []*x509.Certificate { return slices.Clone(b.retained) }

// RootPool returns every trusted root as a pool, for verifying peers.
func (b *Bundle) RootPool() *x509.CertPool { return b.rootPool }

// RootsPEM returns every trusted root as concatenated PEM: the content of root-cert.pem.
func (b *Bundle) RootsPEM() []byte { return pki.EncodeCertificates(b.roots...) }

// Source says where the key material came from.
func (b *Bundle) Source() Source { return b.source }

// NotAfter is the earliest expiry along the chain: no leaf is issued past it.
func (b *Bundle) NotAfter() time.Time { return b.notAfter }

func isSelfSigned(c *x509.Certificate) bool {
	return bytes.Equal(c.RawIssuer, c.RawSubject) && c.CheckSignatureFrom(c) == nil
}

func containsCert(certs []*x509.Certificate, c *x509.Certificate) bool {
	for _, x := range certs {
		if x.Equal(c) {
			return true
		}
	}
	return false
}

func without(certs []*x509.Certificate, c *x509.Certificate) []*x509.Certificate {
	var out []*x509.Certificate
	for _, x := range certs {
		if !x.Equal(c) && !containsCert(out, x) {
			out = append(out, x)
		}
	}
	return out
}
