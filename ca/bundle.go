package ca

import (
	"crypto"
	"crypto/sha256"
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
	// SourceSecret: the cacerts Secret on Kubernetes, whose writer (an operator, or the replica
	// that generated it) rotates it; see BundleFromData.
	SourceSecret Source = "secret"
)

// Bundle is one generation of the CA's key material. It is immutable: a new generation is a new
// Bundle, published with Authority.SetBundle, so that a signature never mixes two generations.
type Bundle struct {
	signer      crypto.Signer
	signingCert *x509.Certificate
	chain       []*x509.Certificate     // signing certificate first, root last (one element when self-signed)
	anchors     []*x509.Certificate     // the roots given with the key material; chain's root first
	retained    []*x509.Certificate     // earlier roots still trusted during a rotation
	retired     map[[32]byte]retirement // by fingerprint, one for each retained root
	roots       []*x509.Certificate     // anchors, then retained: everything the CA trusts
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
		if !pki.IsSelfSigned(cert) {
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
	return b.withRetained(p.Retained, nil), nil
}

// retirement is what the CA knows of a root it keeps trusting after the root stopped anchoring
// its key material.
type retirement struct {
	at    time.Time // when it stopped anchoring; zero when not known
	until time.Time // when trust in it ends, if before its expiry (the overlap); zero: at its expiry
}

// newRetirement is the retirement of a root replaced at (zero: not known) under overlap. Without
// an overlap a root is trusted until it expires, whenever it was replaced. With one, a root whose
// replacement time is not known is trusted no longer: counting the overlap from now instead could
// trust it past what the operator configured.
func newRetirement(at time.Time, overlap time.Duration, now time.Time) retirement {
	switch {
	case overlap == 0:
		return retirement{at: at}
	case at.IsZero():
		return retirement{until: now}
	default:
		return retirement{at: at, until: at.Add(overlap)}
	}
}

// withRetained returns a copy of b that also trusts retained (minus its anchors and duplicates),
// each with its retirement from retired (not known when missing: trusted until it expires).
func (b *Bundle) withRetained(retained []*x509.Certificate, retired map[[32]byte]retirement) *Bundle {
	next := *b
	next.retained = nil
	next.retired = map[[32]byte]retirement{}
	for _, r := range retained {
		if !containsCert(next.anchors, r) && !containsCert(next.retained, r) {
			next.retained = append(next.retained, r)
			next.retired[fingerprint(r.Raw)] = retired[fingerprint(r.Raw)]
		}
	}
	next.roots = append(slices.Clone(next.anchors), next.retained...)
	next.rootPool = x509.NewCertPool()
	for _, r := range next.roots {
		next.rootPool.AddCert(r)
	}
	return &next
}

// trustEnds is when trust in r, one of b's roots, ends: at its expiry, or for a retained root
// at the end of its overlap if that comes first. r is trusted strictly before that time.
func (b *Bundle) trustEnds(r *x509.Certificate) time.Time {
	end := r.NotAfter
	if ri, ok := b.retired[fingerprint(r.Raw)]; ok && !ri.until.IsZero() && ri.until.Before(end) {
		end = ri.until
	}
	return end
}

// trustedRetained returns the retained roots still trusted at now.
func (b *Bundle) trustedRetained(now time.Time) []*x509.Certificate {
	var out []*x509.Certificate
	for _, r := range b.retained {
		if now.Before(b.trustEnds(r)) {
			out = append(out, r)
		}
	}
	return out
}

// CheckRoot reports whether root, which ends a chain verified against RootPool, still anchors
// trust at now. A retained root stops at the end of its overlap, which comes before the key
// manager's next check drops it from the pool: peers must be checked per call, not only by the pool.
func (b *Bundle) CheckRoot(root *x509.Certificate, now time.Time) error {
	ri, ok := b.retired[fingerprint(root.Raw)]
	if !ok || ri.until.IsZero() || now.Before(ri.until) {
		return nil
	}
	replaced := "at an unknown time"
	if !ri.at.IsZero() {
		replaced = "at " + ri.at.UTC().Format(time.RFC3339)
	}
	return fmt.Errorf("%w: root %q was replaced %s and was trusted until %s", ErrRootRetired,
		root.Subject.String(), replaced, ri.until.UTC().Format(time.RFC3339))
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

func containsCert(certs []*x509.Certificate, c *x509.Certificate) bool {
	for _, x := range certs {
		if x.Equal(c) {
			return true
		}
	}
	return false
}

func fingerprint(der []byte) [32]byte { return sha256.Sum256(der) }

func without(certs []*x509.Certificate, c *x509.Certificate) []*x509.Certificate {
	var out []*x509.Certificate
	for _, x := range certs {
		if !x.Equal(c) && !containsCert(out, x) {
			out = append(out, x)
		}
	}
	return out
}
