package ca

import (
	"context"
	"crypto"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"errors"
	"fmt"
	"log/slog"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// A CA whose signing certificate comes from an upstream CA (Citadel's --upstream-ca-address)
// keeps it in its state dir as UpstreamCAFile: the key, then the chain from the signing
// certificate to the upstream's root. One file, so that one rename replaces key and chain
// together and a restart never finds a key beside another key's certificate.

// UpstreamCAFile is the upstream-signed CA's key and chain in the state dir (0600).
const UpstreamCAFile = "upstream-ca.pem"

// Defaults of the upstream renewal: Citadel's grace percentage (50) and the agent's jitter.
const (
	DefaultUpstreamGraceRatio       = 0.5
	DefaultUpstreamGraceRatioJitter = 0.01
	// DefaultRequestedCACertTTL is Citadel's --requested-ca-cert-ttl.
	DefaultRequestedCACertTTL = 365 * 24 * time.Hour
	upstreamRetryInitial      = time.Second
	upstreamRetryMax          = 5 * time.Minute
)

// SourceUpstream: the signing certificate was issued by an upstream CA (UpstreamCAFile).
const SourceUpstream Source = "upstream"

// Origins of upstream-signed key material.
const (
	OriginUpstreamPersisted Origin = "persisted upstream-signed CA"
	OriginUpstreamObtained  Origin = "new upstream-signed CA"
)

// UpstreamPath is where the CA whose state dir is stateDir keeps its upstream-signed key and chain.
func UpstreamPath(stateDir string) string { return filepath.Join(stateDir, UpstreamCAFile) }

// UpstreamSigner sends a CSR to the upstream CA: caclient.Client's Sign.
type UpstreamSigner interface {
	Sign(ctx context.Context, csrDER []byte, ttl time.Duration) ([]*x509.Certificate, error)
}

// UpstreamConfig configures an Upstream. Zero values take the defaults above.
type UpstreamConfig struct {
	Signer UpstreamSigner
	// Address names the upstream in logs.
	Address string
	// RootCertFile holds the upstream's roots: an answer must chain to one of them. It is read at
	// every check, so that a root rotated upstream is followed.
	RootCertFile string
	StateDir     string
	// TTL is the lifetime asked for (--requested-ca-cert-ttl); the upstream may give less.
	TTL          time.Duration
	KeyAlgorithm pki.KeyAlgorithm
	RSAKeySize   int
	// The signing certificate is renewed when GraceRatio ± GraceRatioJitter of its lifetime is left.
	GraceRatio       float64
	GraceRatioJitter float64

	Clock clock.Clock
	// Rand returns a number in [0, 1) for the jitter; nil is random.
	Rand       func() float64
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

// Upstream obtains the CA's signing certificate from an upstream CA, checks it, and keeps it in
// the state dir. The key manager renews it (KeyManagerConfig.Upstream); it starts no goroutine.
type Upstream struct {
	cfg      UpstreamConfig
	clock    clock.Clock
	log      *slog.Logger
	renewals *prometheus.CounterVec
}

// NewUpstream returns an Upstream; it reads nothing and sends nothing.
func NewUpstream(cfg UpstreamConfig) (*Upstream, error) {
	switch {
	case cfg.Signer == nil:
		return nil, errors.New("upstream CA: no signer")
	case cfg.RootCertFile == "":
		return nil, errors.New("upstream CA: no root certificate file")
	case cfg.StateDir == "":
		return nil, errors.New("upstream CA: no state dir")
	}
	if cfg.TTL <= 0 {
		cfg.TTL = DefaultRequestedCACertTTL
	}
	if cfg.KeyAlgorithm == "" {
		cfg.KeyAlgorithm = pki.ECDSA
	}
	if cfg.GraceRatio == 0 {
		cfg.GraceRatio = DefaultUpstreamGraceRatio
	}
	if cfg.GraceRatioJitter == 0 {
		cfg.GraceRatioJitter = DefaultUpstreamGraceRatioJitter
	}
	if !(cfg.GraceRatio > 0 && cfg.GraceRatio < 1) || cfg.GraceRatioJitter < 0 || cfg.GraceRatioJitter >= min(cfg.GraceRatio, 1-cfg.GraceRatio) {
		return nil, fmt.Errorf("upstream CA: grace ratio %g ± %g must stay between 0 and 1", cfg.GraceRatio, cfg.GraceRatioJitter)
	}
	if cfg.Rand == nil {
		cfg.Rand = mrand.Float64
	}
	u := &Upstream{
		cfg:   cfg,
		clock: clock.OrReal(cfg.Clock),
		log:   cfg.Logger,
		renewals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "upstream_renewals_total",
			Help: "Requests for the CA's signing certificate to the upstream CA, by outcome (ok, failed).",
		}, []string{"outcome"}),
	}
	if u.log == nil {
		u.log = slog.New(slog.DiscardHandler)
	}
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(u.renewals); err != nil {
			return nil, err
		}
	}
	return u, nil
}

// Load returns the persisted upstream-signed key material when it is still valid and chains to
// the upstream's roots, else obtains new material from the upstream (Obtain).
func (u *Upstream) Load(ctx context.Context) (*Bundle, Origin, error) {
	if err := fsutil.EnsureOwnedDir(u.cfg.StateDir, fsutil.PrivateDirMode); err != nil {
		return nil, "", err
	}
	b, err := u.loadPersisted()
	switch {
	case err == nil && b != nil:
		return b, OriginUpstreamPersisted, nil
	case err != nil:
		u.log.Warn("the persisted upstream-signed CA is not usable; asking the upstream for a new one",
			logkey.Path, UpstreamPath(u.cfg.StateDir), logkey.Error, err.Error())
	}
	b, err = u.Obtain(ctx)
	if err != nil {
		return nil, "", err
	}
	return b, OriginUpstreamObtained, nil
}

// loadPersisted reads UpstreamCAFile: (nil, nil) when there is none.
func (u *Upstream) loadPersisted() (*Bundle, error) {
	path := UpstreamPath(u.cfg.StateDir)
	if err := fsutil.CheckKeyFile(path); err != nil {
		return nil, err
	}
	data, ok, err := fsutil.ReadOptional(path)
	if err != nil || !ok {
		return nil, err
	}
	key, err := pki.ParsePrivateKey(data)
	if err != nil {
		return nil, err
	}
	chain, err := pki.ParseCertificates(data)
	if err != nil {
		return nil, err
	}
	return u.verify(key, chain)
}

// Obtain makes a new key, asks the upstream for a CA certificate for it, checks the answer
// (verify) and persists key and chain. Nothing is written when the answer does not verify.
func (u *Upstream) Obtain(ctx context.Context) (*Bundle, error) {
	b, err := u.obtain(ctx)
	if err != nil {
		u.renewals.WithLabelValues("failed").Inc()
		return nil, err
	}
	u.renewals.WithLabelValues("ok").Inc()
	u.log.Info("signing certificate obtained from the upstream CA", logkey.CAAddress, u.cfg.Address,
		logkey.Subject, b.signingCert.Subject.String(), logkey.Root, b.Root().Subject.String(), logkey.NotAfter, b.notAfter)
	return b, nil
}

func (u *Upstream) obtain(ctx context.Context) (*Bundle, error) {
	key, err := pki.GenerateKey(u.cfg.KeyAlgorithm, u.cfg.RSAKeySize)
	if err != nil {
		return nil, fmt.Errorf("upstream CA: generate key: %w", err)
	}
	csr, err := NewCACSR(key)
	if err != nil {
		return nil, fmt.Errorf("upstream CA: %w", err)
	}
	chain, err := u.cfg.Signer.Sign(ctx, csr, u.cfg.TTL)
	if err != nil {
		return nil, fmt.Errorf("upstream CA %s: %w", u.cfg.Address, err)
	}
	b, err := u.verify(key, chain)
	if err != nil {
		return nil, fmt.Errorf("upstream CA %s answered with a certificate that does not verify: %w", u.cfg.Address, err)
	}
	if err := persistUpstream(u.cfg.StateDir, key, b.chain); err != nil {
		return nil, fmt.Errorf("upstream CA: persist: %w", err)
	}
	return b, nil
}

// verify checks an answer: its first certificate is a CA certificate for key, valid now, that
// chains through the rest to one of the roots in RootCertFile.
func (u *Upstream) verify(key crypto.Signer, chain []*x509.Certificate) (*Bundle, error) {
	if len(chain) == 0 {
		return nil, errors.New("empty chain")
	}
	data, err := os.ReadFile(u.cfg.RootCertFile)
	if err != nil {
		return nil, fmt.Errorf("upstream root: %w", err)
	}
	roots, err := pki.ParseCertificates(data)
	if err != nil {
		return nil, fmt.Errorf("upstream root %s: %w", u.cfg.RootCertFile, err)
	}
	return NewBundle(BundleParams{
		SigningCert:   chain[0],
		SigningKey:    key,
		Intermediates: chain[1:],
		Roots:         roots,
		Source:        SourceUpstream,
		Now:           u.clock.Now(),
	})
}

// persistUpstream writes key and chain (signing certificate first) as UpstreamCAFile, 0600, in
// one atomic, synced write.
func persistUpstream(stateDir string, key crypto.Signer, chain []*x509.Certificate) error {
	keyPEM, err := pki.EncodePrivateKey(key)
	if err != nil {
		return err
	}
	return fsutil.WritePrivateFile(UpstreamPath(stateDir), append(keyPEM, pki.EncodeCertificates(chain...)...))
}

// renewAt is when GraceRatio (± jitter) of b's lifetime is left; the lifetime runs from the
// signing certificate's NotBefore to the earliest expiry along its chain.
func (u *Upstream) renewAt(b *Bundle) time.Time {
	ratio := u.cfg.GraceRatio + u.cfg.GraceRatioJitter*(2*u.cfg.Rand()-1)
	lifetime := b.notAfter.Sub(b.signingCert.NotBefore)
	return b.notAfter.Add(-time.Duration(ratio * float64(lifetime)))
}

// renew obtains a new bundle, retrying with backoff until it has one or ctx ends; the bundle in
// service (current) keeps signing meanwhile. Every failure is logged as an error and counted.
func (u *Upstream) renew(ctx context.Context, current *Bundle) (*Bundle, error) {
	policy := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(upstreamRetryInitial),
		backoff.WithMaxInterval(upstreamRetryMax),
		backoff.WithMaxElapsedTime(0), // until it works: past the expiry the CA signs nothing anyway
		backoff.WithClockProvider(u.clock),
	)
	return backoff.RetryNotifyWithTimerAndData(func() (*Bundle, error) {
		return u.Obtain(ctx)
	}, backoff.WithContext(policy, ctx), func(err error, next time.Duration) {
		msg := "cannot renew the signing certificate from the upstream CA; the current one keeps signing"
		if !u.clock.Now().Before(current.notAfter) {
			msg = "cannot renew the signing certificate from the upstream CA, and the current one has expired: no certificate is issued"
		}
		u.log.Error(msg, logkey.CAAddress, u.cfg.Address, logkey.Error, err.Error(),
			logkey.CurrentExpires, current.notAfter, logkey.RetryIn, next)
	}, clock.BackoffTimer(u.clock))
}

// oidBasicConstraints is X.509's basicConstraints extension.
func oidBasicConstraints() asn1.ObjectIdentifier { return asn1.ObjectIdentifier{2, 5, 29, 19} }

type basicConstraints struct {
	IsCA       bool `asn1:"optional"`
	MaxPathLen int  `asn1:"optional,default:-1"`
}

// NewCACSR returns a DER request for a CA certificate for key: its extension request holds
// basicConstraints with cA TRUE, which is how WantsCA tells it from a workload's. It names
// nothing: the upstream names the certificate after the caller's authenticated identity.
func NewCACSR(key crypto.Signer) ([]byte, error) {
	ext, err := asn1.Marshal(basicConstraints{IsCA: true, MaxPathLen: -1})
	if err != nil {
		return nil, err
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject:         pkix.Name{Organization: []string{"meshid"}},
		ExtraExtensions: []pkix.Extension{{Id: oidBasicConstraints(), Critical: true, Value: ext}},
	}, key)
	if err != nil {
		return nil, fmt.Errorf("create CA certificate request: %w", err)
	}
	return der, nil
}

// WantsCA reports whether csr asks for a CA certificate: its extension request holds
// basicConstraints with cA TRUE. A malformed basicConstraints is a malformed request.
func WantsCA(csr *x509.CertificateRequest) (bool, error) {
	for _, e := range csr.Extensions {
		if !e.Id.Equal(oidBasicConstraints()) {
			continue
		}
		var bc basicConstraints
		if rest, err := asn1.Unmarshal(e.Value, &bc); err != nil || len(rest) > 0 {
			return false, fmt.Errorf("%w: basicConstraints does not parse", ErrMalformedCSR)
		}
		return bc.IsCA, nil
	}
	return false, nil
}
