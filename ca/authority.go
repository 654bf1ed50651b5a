package ca

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// Issuance defaults, as in Istio.
const (
	DefaultWorkloadCertTTL    = 24 * time.Hour
	DefaultMaxWorkloadCertTTL = 90 * 24 * time.Hour
	DefaultSelfSignedRootTTL  = 10 * 365 * 24 * time.Hour
	// Backdate is how far before the signing time a certificate's NotBefore is set, so that peers
	// whose clocks run a little behind accept it at once.
	Backdate = 2 * time.Minute
)

// Config configures an Authority. Zero values take the defaults above and the real clock.
type Config struct {
	Clock      clock.Clock
	DefaultTTL time.Duration
	MaxTTL     time.Duration
	// CACertIdentities are the callers that may have a CA certificate (SignCA) for a CA of their
	// own (--sign-ca-certs --ca-cert-identities); empty: nobody.
	CACertIdentities []pki.SPIFFEID
}

// Authority signs certificates with the current Bundle. The bundle is swapped atomically: a
// signature uses exactly one generation of key material, whatever reloads happen meanwhile.
type Authority struct {
	clock      clock.Clock
	defaultTTL time.Duration
	maxTTL     time.Duration
	caCertIDs  []pki.SPIFFEID
	bundle     atomic.Pointer[Bundle]

	mu      sync.Mutex
	changed chan struct{} // closed at the next SetBundle
}

// New returns an Authority serving b. A nil b leaves it not ready until SetBundle.
func New(cfg Config, b *Bundle) *Authority {
	a := &Authority{clock: clock.OrReal(cfg.Clock), defaultTTL: cfg.DefaultTTL, maxTTL: cfg.MaxTTL, changed: make(chan struct{}),
		caCertIDs: slices.Clone(cfg.CACertIdentities)}
	if a.defaultTTL == 0 {
		a.defaultTTL = DefaultWorkloadCertTTL
	}
	if a.maxTTL == 0 {
		a.maxTTL = DefaultMaxWorkloadCertTTL
	}
	if b != nil {
		a.bundle.Store(b)
	}
	return a
}

// Bundle returns the key material in service, or nil before any was loaded.
func (a *Authority) Bundle() *Bundle { return a.bundle.Load() }

// SetBundle puts b in service for every signature that starts after the call, and tells those
// waiting on Changed.
func (a *Authority) SetBundle(b *Bundle) {
	a.bundle.Store(b)
	a.mu.Lock()
	close(a.changed)
	a.changed = make(chan struct{})
	a.mu.Unlock()
}

// Changed returns a channel that is closed at the next SetBundle (a reload, a plug-in, a root
// rotation or pruning). Take it before reading Bundle, then wait on it: no change is missed.
func (a *Authority) Changed() <-chan struct{} {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.changed
}

// WorkloadRequest asks for a workload certificate.
type WorkloadRequest struct {
	CSR *x509.CertificateRequest
	// Identity is the authenticated caller's; it is the certificate's only name.
	Identity pki.SPIFFEID
	// TTL is the requested lifetime: 0 means the default, more than the maximum is clamped.
	TTL time.Duration
}

// Issued is a signed certificate with the bundle generation that signed it.
type Issued struct {
	Leaf   *x509.Certificate
	bundle *Bundle
}

// Bundle returns the key material that signed the certificate.
func (i *Issued) Bundle() *Bundle { return i.bundle }

// Chain returns the leaf, its intermediates and the root, in that order.
func (i *Issued) Chain() []*x509.Certificate {
	return append([]*x509.Certificate{i.Leaf}, i.bundle.chain...)
}

// ChainPEM returns Chain as one PEM string per certificate, as Istio's CA protocol carries it.
func (i *Issued) ChainPEM() []string {
	return append([]string{string(pki.EncodeCertificate(i.Leaf))}, i.bundle.chainPEM...)
}

// ParseCSR decodes a PEM certificate request, wrapping failures in ErrMalformedCSR.
func ParseCSR(csrPEM []byte) (*x509.CertificateRequest, error) {
	csr, err := pki.ParseCSR(csrPEM)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrMalformedCSR, err)
	}
	return csr, nil
}

// CheckCSR applies the workload issuance policy to a request made by id: a supported key, a valid
// self-signature with SHA-2, no DNS/IP/email names, and URI names (if any) equal to id. The request is the
// client's: the errors quote it bounded (logkey.Untrusted), since they are logged and sent back.
func CheckCSR(csr *x509.CertificateRequest, id pki.SPIFFEID) error {
	if csr == nil {
		return fmt.Errorf("%w: no request", ErrMalformedCSR)
	}
	if err := checkPublicKey(csr.PublicKey); err != nil {
		return err
	}
	if !slices.Contains(csrSignatureAlgorithms(), csr.SignatureAlgorithm) {
		// x509 still verifies SHA-1 signatures on requests, for old tools: refused here.
		return fmt.Errorf("%w: %s; sign it with SHA-256 or stronger", ErrCSRSignatureAlgorithm, csr.SignatureAlgorithm)
	}
	if err := csr.CheckSignature(); err != nil {
		return fmt.Errorf("%w: %w", ErrCSRSignature, err)
	}
	if n := len(csr.DNSNames) + len(csr.IPAddresses) + len(csr.EmailAddresses); n > 0 {
		return fmt.Errorf("%w: %d DNS/IP/email names requested; workload certificates carry only the SPIFFE ID", ErrForbiddenSAN, n)
	}
	want := id.String()
	for _, u := range csr.URIs {
		if u.String() != want {
			return fmt.Errorf("%w: request names %q, caller is %q", ErrIdentityMismatch, logkey.Untrusted(u.String()), want)
		}
	}
	return nil
}

// csrSignatureAlgorithms are the only signatures accepted on a request: SHA-2, with the key kinds
// checkPublicKey accepts. Never SHA-1 or MD5.
func csrSignatureAlgorithms() []x509.SignatureAlgorithm {
	return []x509.SignatureAlgorithm{
		x509.ECDSAWithSHA256, x509.ECDSAWithSHA384, x509.ECDSAWithSHA512,
		x509.SHA256WithRSA, x509.SHA384WithRSA, x509.SHA512WithRSA,
		x509.SHA256WithRSAPSS, x509.SHA384WithRSAPSS, x509.SHA512WithRSAPSS,
	}
}

func checkPublicKey(pub crypto.PublicKey) error {
	switch k := pub.(type) {
	case *ecdsa.PublicKey:
		if k.Curve == elliptic.P256() || k.Curve == elliptic.P384() {
			return nil
		}
	case *rsa.PublicKey:
		if pki.ValidateRSAKeySize(k.N.BitLen()) == nil {
			return nil
		}
	}
	return fmt.Errorf("%w: %s (want RSA %d to %d bits, ECDSA P-256 or P-384)", ErrUnsupportedKey, pki.DescribeKey(pub), pki.MinRSAKeySize, pki.MaxRSAKeySize)
}

// Params is one certificate to issue, whoever asks: what it names, the key it certifies, how
// long it lives. Its policy says which of these it may carry.
type Params struct {
	// Identity is the SPIFFE ID, the certificate's only URI; zero for the CA's own serving
	// certificate.
	Identity pki.SPIFFEID
	// CSR, under a policy whose key comes from a request, is checked against Identity
	// (CheckCSR) and gives the public key; under another, PublicKey does.
	CSR       *x509.CertificateRequest
	PublicKey crypto.PublicKey
	// DNSNames and IPAddresses are the other names; CommonName the subject's.
	DNSNames    []string
	IPAddresses []net.IP
	CommonName  string
	// TTL is the lifetime asked for: what the policy makes of it (a default, a clamp) decides.
	TTL time.Duration
}

// policy is a kind of certificate: what it must name, what it is used for, how long it lives.
// Each Sign method is a policy over the one pipeline of issue.
type policy struct {
	what        string // in errors
	identity    bool   // a workload's: the SPIFFE ID is required and is its only URI
	fromCSR     bool   // the key comes from a request, checked against the identity
	extKeyUsage []x509.ExtKeyUsage
	ttl         func(requested time.Duration) (time.Duration, error)
	// ca: a CA certificate for a downstream CA, constrained to its identity's trust domain.
	ca bool
}

// workloadPolicy is a workload certificate's: the SPIFFE ID (and, for a secret, the DNS names
// Citadel adds), for mTLS both ways, its lifetime defaulted and clamped. A caller's key comes
// from its request; a secret's from the secret controller.
func (a *Authority) workloadPolicy(what string, fromCSR bool) policy {
	return policy{what: what, identity: true, fromCSR: fromCSR,
		extKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}, ttl: a.workloadTTL}
}

// servingPolicy is the CA endpoint's own TLS certificate: its hosts, for serving only, for the
// lifetime its caller chose.
func servingPolicy() policy {
	return policy{what: "serving certificate", extKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		ttl: func(ttl time.Duration) (time.Duration, error) { return ttl, nil }}
}

// issue is the one signing pipeline (STYLE habit 8): check the request against the policy, build
// the template from the policy and p, sign it with the bundle in service, and verify the result.
func (a *Authority) issue(pol policy, p Params) (*Issued, error) {
	b := a.bundle.Load()
	if b == nil {
		return nil, ErrNotReady
	}
	if pol.identity {
		if _, err := pki.NewSPIFFEID(p.Identity.TrustDomain, p.Identity.Namespace, p.Identity.ServiceAccount); err != nil {
			return nil, fmt.Errorf("%s identity: %w", pol.what, err)
		}
	}
	pub := p.PublicKey
	if pol.fromCSR {
		if err := CheckCSR(p.CSR, p.Identity); err != nil {
			return nil, err
		}
		pub = p.CSR.PublicKey
	} else if err := checkPublicKey(pub); err != nil {
		return nil, err
	}
	if pol.ca && b.signingCert.MaxPathLen == 0 && b.signingCert.MaxPathLenZero {
		// A CA certificate under it would verify nowhere.
		return nil, fmt.Errorf("%w: its own signing certificate has path length 0", ErrCACertsNotSigned)
	}
	ttl, err := pol.ttl(p.TTL)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		Subject:               pkix.Name{CommonName: p.CommonName},
		DNSNames:              slices.Clone(p.DNSNames),
		IPAddresses:           slices.Clone(p.IPAddresses),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:           pol.extKeyUsage,
		BasicConstraintsValid: true,
	}
	if pol.identity {
		tmpl.URIs = []*url.URL{p.Identity.URL()}
	}
	if pol.ca {
		// Path length 0: the downstream signs workloads, not further CAs. The name constraint
		// keeps the SPIFFE IDs it signs in its trust domain; DNS names are not constrained, since
		// its own serving certificate carries the CA's names (SECURITY.md says what that allows).
		tmpl.Subject = pkix.Name{Organization: []string{p.Identity.TrustDomain}, CommonName: p.Identity.Namespace + "/" + p.Identity.ServiceAccount}
		tmpl.IsCA, tmpl.MaxPathLen, tmpl.MaxPathLenZero = true, 0, true
		tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageCRLSign
		tmpl.PermittedURIDomains = []string{p.Identity.TrustDomain}
		tmpl.PermittedDNSDomainsCritical = true // marks the whole extension critical (RFC 5280)
	}
	leaf, err := a.sign(b, tmpl, pub, ttl)
	if err != nil {
		return nil, err
	}
	if pol.identity && (len(leaf.URIs) != 1 || leaf.URIs[0].String() != p.Identity.String()) {
		return nil, fmt.Errorf("issued certificate names %v, want %s", leaf.URIs, p.Identity)
	}
	return &Issued{Leaf: leaf, bundle: b}, nil
}

// SignWorkload signs a leaf for the caller's identity with the key of its request, checked
// against the workload policy, and verifies it before returning it.
func (a *Authority) SignWorkload(_ context.Context, req WorkloadRequest) (*Issued, error) {
	return a.issue(a.workloadPolicy("caller", true), Params{Identity: req.Identity, CSR: req.CSR, TTL: req.TTL})
}

// CARequest asks for a CA certificate for a downstream CA (Citadel's --sign-ca-certs).
type CARequest struct {
	CSR *x509.CertificateRequest
	// Identity is the authenticated caller's: it must be one of Config.CACertIdentities, and it is
	// the certificate's only name.
	Identity pki.SPIFFEID
	// TTL is the requested lifetime: 0 or more than the maximum (Config.MaxTTL) gives the maximum;
	// never past the signing certificate's own expiry.
	TTL time.Duration
}

// SignCA signs a CA certificate (CA:true, path length 0, certSign and cRLSign, its URIs
// constrained to the caller's trust domain) for the caller's identity with the key of its
// request, when that identity may have one.
func (a *Authority) SignCA(_ context.Context, req CARequest) (*Issued, error) {
	if len(a.caCertIDs) == 0 {
		return nil, ErrCACertsNotSigned
	}
	if !slices.Contains(a.caCertIDs, req.Identity) {
		return nil, fmt.Errorf("%w: %s is not among the identities allowed CA certificates", ErrCACertIdentity, req.Identity)
	}
	pol := policy{what: "CA certificate", identity: true, fromCSR: true, ca: true, ttl: a.caTTL}
	return a.issue(pol, Params{Identity: req.Identity, CSR: req.CSR, TTL: req.TTL})
}

func (a *Authority) caTTL(requested time.Duration) (time.Duration, error) {
	if requested < 0 {
		return 0, fmt.Errorf("%w: %s is negative", ErrInvalidTTL, requested)
	}
	if requested == 0 || requested > a.maxTTL {
		return a.maxTTL, nil
	}
	return requested, nil
}

// SecretRequest asks for the certificate of a service-account secret, whose key the CA's own
// secret controller generated: there is no caller and no CSR to check.
type SecretRequest struct {
	Identity  pki.SPIFFEID
	DNSNames  []string // extra SANs, as Citadel adds for webhooks and --custom-dns-names
	PublicKey crypto.PublicKey
	TTL       time.Duration // 0: the default; clamped to the maximum
}

// SignSecret signs a workload certificate for a service-account secret: the SPIFFE ID, then the
// DNS names, verified before it is returned.
func (a *Authority) SignSecret(_ context.Context, req SecretRequest) (*Issued, error) {
	return a.issue(a.workloadPolicy("secret", false), Params{Identity: req.Identity, DNSNames: req.DNSNames, PublicKey: req.PublicKey, TTL: req.TTL})
}

func (a *Authority) workloadTTL(requested time.Duration) (time.Duration, error) {
	switch {
	case requested < 0:
		return 0, fmt.Errorf("%w: %s is negative", ErrInvalidTTL, requested)
	case requested == 0:
		return a.defaultTTL, nil
	case requested > a.maxTTL:
		return a.maxTTL, nil
	default:
		return requested, nil
	}
}

// SignServing issues a TLS server certificate for the CA's own endpoint: hosts are DNS names or IP
// addresses. It is not reachable by callers of the CA protocol.
func (a *Authority) SignServing(pub crypto.PublicKey, hosts []string, ttl time.Duration) (*Issued, error) {
	p := Params{PublicKey: pub, TTL: ttl}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			p.IPAddresses = append(p.IPAddresses, ip)
		} else {
			p.DNSNames = append(p.DNSNames, h)
		}
	}
	if len(hosts) > 0 {
		p.CommonName = hosts[0]
	}
	return a.issue(servingPolicy(), p)
}

// sign fills in the validity, signs tmpl with b, and verifies that the leaf is valid under the
// signing certificate and carries pub. The chain above the signing certificate was verified when
// the bundle was built, so the check anchors at the signing certificate: one signature check
// instead of one per chain element, on the hot path.
func (a *Authority) sign(b *Bundle, tmpl *x509.Certificate, pub crypto.PublicKey, ttl time.Duration) (*x509.Certificate, error) {
	now := a.clock.Now()
	if !now.Before(b.notAfter) {
		return nil, fmt.Errorf("%w: the chain expired at %s", ErrNotReady, b.notAfter.UTC().Format(time.RFC3339))
	}
	if now.Before(b.notBefore) {
		return nil, fmt.Errorf("%w: the chain is not valid before %s (is the clock behind?)", ErrNotReady, b.notBefore.UTC().Format(time.RFC3339))
	}
	// Backdated for peers whose clocks lag, but never before the issuer's own validity.
	tmpl.NotBefore = now.Add(-Backdate)
	if tmpl.NotBefore.Before(b.notBefore) {
		tmpl.NotBefore = b.notBefore
	}
	// Rounded up: X.509 keeps whole seconds, and truncation would cut up to a second off the
	// lifetime, all of a one-second certificate's, which its agent would renew without end.
	tmpl.NotAfter = ceilSecond(now.Add(ttl))
	if tmpl.NotAfter.After(b.notAfter) {
		tmpl.NotAfter = b.notAfter
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, b.signingCert, pub, b.signer)
	if err != nil {
		return nil, fmt.Errorf("sign certificate: %w", err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parse issued certificate: %w", err)
	}
	if !pki.PublicKeysEqual(pub, leaf.PublicKey) {
		return nil, errors.New("issued certificate carries another public key")
	}
	if _, err := leaf.Verify(x509.VerifyOptions{
		Roots:       b.signerPool,
		CurrentTime: now,
		KeyUsages:   []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
	}); err != nil {
		return nil, fmt.Errorf("issued certificate does not verify: %w", err)
	}
	return leaf, nil
}

func ceilSecond(t time.Time) time.Time {
	if r := t.Truncate(time.Second); !r.Equal(t) {
		return r.Add(time.Second)
	}
	return t
}

// NewRootCertificate creates a self-signed CA certificate for key, valid from now (backdated) for ttl.
func NewRootCertificate(key crypto.Signer, org string, ttl time.Duration, now time.Time) (*x509.Certificate, error) {
	var subject pkix.Name
	if org != "" {
		subject.Organization = []string{org}
	}
	return selfSignRoot(&x509.Certificate{Subject: subject}, key, ttl, now)
}

// RenewRoot issues a successor to a self-signed root from the same key: same subject and subject
// key ID, new validity. Leaves signed under either verify against both while both are valid.
func RenewRoot(old *x509.Certificate, key crypto.Signer, ttl time.Duration, now time.Time) (*x509.Certificate, error) {
	if !pki.KeyMatchesCertificate(key, old) {
		return nil, errors.New("renew root: the key does not match the root")
	}
	return selfSignRoot(&x509.Certificate{RawSubject: old.RawSubject, SubjectKeyId: old.SubjectKeyId}, key, ttl, now)
}

// selfSignRoot completes tmpl (its subject set) as a root CA valid from now (backdated) for ttl,
// and signs it with key.
func selfSignRoot(tmpl *x509.Certificate, key crypto.Signer, ttl time.Duration, now time.Time) (*x509.Certificate, error) {
	if ttl <= 0 {
		ttl = DefaultSelfSignedRootTTL
	}
	tmpl.NotBefore = now.Add(-Backdate)
	tmpl.NotAfter = now.Add(ttl)
	tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature
	tmpl.BasicConstraintsValid = true
	tmpl.IsCA = true
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("create self-signed root: %w", err)
	}
	return x509.ParseCertificate(der)
}
