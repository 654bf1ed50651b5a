package secretmanager

import (
	"context"
	"crypto"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/istio"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// Defaults of a Rotation, as in Istio's agent.
const (
	DefaultTTL              = istio.DefaultSecretTTL
	DefaultGraceRatio       = istio.DefaultGraceRatio
	DefaultGraceRatioJitter = istio.DefaultGraceRatioJitter
	DefaultRetryInitial     = time.Second
	DefaultRetryMax         = 5 * time.Minute
	// RetrySpread is the random ± share of a retry's wait around the backoff's interval (as
	// cenkalti/backoff's default randomization), so that agents that failed together, when
	// their CA went down, do not come back to it together.
	RetrySpread = 0.5
)

// wallClockCheck is how often the wall clock is looked at again while a renewal is awaited.
const wallClockCheck = time.Minute

// Signer turns a CSR into a certificate chain, leaf first. The CA client is one.
type Signer interface {
	Sign(ctx context.Context, csrDER []byte, ttl time.Duration) ([]*x509.Certificate, error)
}

// connector is a Signer that can open its connection ahead of the first Sign (caclient.Client
// can). The rotator asks it to when a certificate is needed at once, so that the handshakes
// with the CA overlap generating the key: the first certificate comes sooner.
type connector interface {
	Connect()
}

// Rotation is the workload source of CA mode: it obtains the workload key pair from a CA and
// renews it when GraceRatio of its lifetime is left, whether or not anyone is asking, retrying
// failures with backoff while the current pair keeps serving. A valid pair for Identity left in
// OUTPUT_CERTS by an earlier run is served at once. "ROOTCA" is the union of the root that ends
// the CA's chain and the certificates of RootCertFile (watched), so that both roots are trusted
// during a root rotation.
type Rotation struct {
	Signer       Signer
	Identity     pki.SPIFFEID
	KeyAlgorithm pki.KeyAlgorithm
	RSAKeySize   int
	// TTL is the validity asked of the CA (SECRET_TTL).
	TTL time.Duration
	// GraceRatio is the share of a certificate's lifetime left when it is renewed
	// (SECRET_GRACE_PERIOD_RATIO), moved by up to ±GraceRatioJitter at random.
	GraceRatio       float64
	GraceRatioJitter float64
	// RootCertFile is the CA root file (CA_ROOT_CA); empty when the system roots verify the CA.
	RootCertFile string
	// RetryInitial and RetryMax bound the backoff between failed attempts.
	RetryInitial, RetryMax time.Duration
	// Rand, in [0, 1), draws the renewal's jitter and the spread of each retry's wait
	// (RetrySpread); nil is random.
	Rand func() float64
}

// ValidateGrace checks a grace period ratio and its jitter: the renewal must fall strictly
// inside the certificate's lifetime.
func ValidateGrace(ratio, jitter float64) error {
	if ratio <= 0 || ratio >= 1 {
		return fmt.Errorf("grace period ratio %v must be between 0 and 1", ratio)
	}
	if jitter < 0 || jitter >= ratio || ratio+jitter >= 1 {
		return fmt.Errorf("grace period ratio jitter %v must keep the ratio %v within (0, 1)", jitter, ratio)
	}
	return nil
}

func (r *Rotation) start(env *sourceEnv) (func(context.Context) error, error) {
	cfg := *r
	if cfg.Signer == nil {
		return nil, errors.New("a CA rotation needs a signer")
	}
	if _, err := pki.NewSPIFFEID(cfg.Identity.TrustDomain, cfg.Identity.Namespace, cfg.Identity.ServiceAccount); err != nil {
		return nil, fmt.Errorf("workload identity: %w", err)
	}
	if cfg.KeyAlgorithm == "" {
		cfg.KeyAlgorithm = pki.ECDSA
	}
	switch cfg.KeyAlgorithm {
	case pki.ECDSA:
	case pki.RSA:
		if cfg.RSAKeySize == 0 {
			cfg.RSAKeySize = pki.DefaultRSAKeySize
		}
		if err := pki.ValidateRSAKeySize(cfg.RSAKeySize); err != nil {
			return nil, fmt.Errorf("workload key: %w", err)
		}
	default:
		return nil, fmt.Errorf("workload key algorithm %q: want ECDSA or RSA", cfg.KeyAlgorithm)
	}
	if cfg.TTL <= 0 {
		cfg.TTL = DefaultTTL
	}
	if cfg.GraceRatio == 0 {
		cfg.GraceRatio = DefaultGraceRatio
	}
	if err := ValidateGrace(cfg.GraceRatio, cfg.GraceRatioJitter); err != nil {
		return nil, err
	}
	if cfg.RetryInitial <= 0 {
		cfg.RetryInitial = DefaultRetryInitial
	}
	if cfg.RetryMax < cfg.RetryInitial {
		cfg.RetryMax = max(DefaultRetryMax, cfg.RetryInitial)
	}
	if cfg.Rand == nil {
		cfg.Rand = rand.Float64
	}
	rt := &rotator{cfg: cfg, env: env}
	if cfg.RootCertFile != "" {
		env.files.add(&fileResource{name: "CA root file " + cfg.RootCertFile, root: cfg.RootCertFile, deliver: rt.rootFileRead})
	}
	return rt.run, nil
}

// rotator is a running Rotation.
type rotator struct {
	cfg Rotation
	env *sourceEnv

	// rootsMu orders the changes of ROOTCA, which come from the renewal loop (a new chain) and the
	// file loader (a new root file), so that the last published is the union of the latest of each.
	rootsMu   sync.Mutex
	chainRoot *x509.Certificate
	fileRoots []*x509.Certificate
	roots     string // version of the last published ROOTCA
}

func (rt *rotator) run(ctx context.Context) error {
	var current *Secret
	if rt.env.outputDir != "" {
		current = rt.loadOutput()
	}
	if c, ok := rt.cfg.Signer.(connector); ok && current == nil {
		c.Connect()
	}
	retry := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(rt.cfg.RetryInitial),
		backoff.WithMaxInterval(rt.cfg.RetryMax),
		backoff.WithMaxElapsedTime(0), // a workload without a certificate keeps trying
		backoff.WithClockProvider(rt.env.clock),
		backoff.WithRandomizationFactor(0), // spread by retryWait, from cfg.Rand
	)
	var (
		lastErr error
		checked bool // woken by the wall-clock check, not by the renewal timer
	)
	for {
		now := rt.env.clock.Now()
		var wait time.Duration
		awaitRenewal := current != nil && now.Before(current.RenewAt)
		if awaitRenewal {
			wait = current.RenewAt.Sub(now)
		} else {
			if checked {
				rt.env.log.Info("the wall clock passed the renewal time before the timer did (a clock step, or the machine slept): renewing now",
					logkey.RenewAt, current.RenewAt, logkey.NotAfter, current.NotAfter())
			}
			next, err := rt.issueTellingExpiry(ctx, current)
			if err == nil {
				current, lastErr, checked = next, nil, false
				retry.Reset()
				continue
			}
			if ctx.Err() != nil {
				return nil
			}
			lastErr = err
			now = rt.env.clock.Now()
			wait = rt.retryWait(retry.NextBackOff())
			if current != nil && now.Before(current.NotAfter()) && current.NotAfter().Sub(now) < wait {
				wait = current.NotAfter().Sub(now) // one more try, and a word, when the one in service expires
			}
			rt.failed(err, current, now, now.Add(wait))
		}
		checked = false
		timer := rt.env.clock.NewTimer(wait)
		// Timers run on the monotonic clock, which ignores steps of the wall clock and, on Linux,
		// stops while the machine sleeps: after a resume, or NTP correcting a clock that was
		// behind, a timer armed for RenewAt can fire long after RenewAt (and NotAfter) on the wall
		// clock, on which certificates are judged. So while a renewal is awaited the wall clock is
		// looked at again every wallClockCheck: one cheap wakeup a minute. (Retries wait at most
		// RetryMax, and are not hurried.)
		var (
			check   clock.Timer
			recheck <-chan time.Time // nil, never ready, without a check
		)
		if awaitRenewal && wait > wallClockCheck {
			check = rt.env.clock.NewTimer(wallClockCheck)
			recheck = check.C()
		}
		select {
		case <-ctx.Done():
		case <-timer.C():
		case <-recheck:
			checked = true
		}
		timer.Stop()
		if check != nil {
			check.Stop()
		}
		if ctx.Err() != nil {
			return nil
		}
		if current != nil && lastErr != nil && !current.validAt(rt.env.clock.Now()) {
			rt.env.fail(WorkloadCertName, lastErr) // tell subscribers at once that it expired
		}
	}
}

func (rt *rotator) failed(err error, current *Secret, now, retryAt time.Time) {
	rt.env.metrics.failures.Inc()
	rt.env.fail(WorkloadCertName, err)
	// After the failure is recorded, so that whoever hears of it finds it in /debug/secrets.
	rt.env.event(Event{Kind: EventRenewalFailed, Name: WorkloadCertName, RetryAt: retryAt, Err: err})
	if current != nil && current.validAt(now) {
		rt.env.log.Warn("workload certificate renewal failed; the current one keeps serving",
			logkey.Error, err.Error(), logkey.RetryAt, retryAt, logkey.CurrentExpires, current.NotAfter())
		return
	}
	rt.env.log.Warn("cannot obtain a workload certificate", logkey.Error, err.Error(), logkey.RetryAt, retryAt)
	rt.rootsMu.Lock()
	defer rt.rootsMu.Unlock()
	if rt.roots == "" {
		rt.env.fail(RootCertName, fmt.Errorf("no trusted root yet: %w", err))
	}
}

// expiryGuardWindow: a request to the CA can outlast the certificate in service only if it starts
// this close to its expiry; the CA client gives up within it (three attempts of 10 s, and their
// backoff). Further out, no guard is armed, and no timer.
const expiryGuardWindow = time.Minute

// issueTellingExpiry is issue, and tells subscribers when current expires while the CA is still
// being asked: a CA that accepts the request and never answers (a stopped process) holds it until
// the client's deadlines, which may outlast the certificate in service.
func (rt *rotator) issueTellingExpiry(ctx context.Context, current *Secret) (*Secret, error) {
	now := rt.env.clock.Now()
	if current == nil || !now.Before(current.NotAfter()) || current.NotAfter().Sub(now) > expiryGuardWindow {
		return rt.issue(ctx) // none, its expiry already told, or the request ends before it
	}
	timer := rt.env.clock.NewTimer(current.NotAfter().Sub(now))
	done := make(chan struct{})
	told := make(chan bool, 1)
	go func() {
		select {
		case <-done:
			told <- false
		case <-timer.C():
			rt.env.fail(WorkloadCertName, fmt.Errorf("%w since %s, not answered yet", ErrRenewalUnderWay, now.UTC().Format(time.RFC3339)))
			told <- true
		}
	}()
	s, err := rt.issue(ctx)
	close(done)
	timer.Stop()
	if <-told && err == nil {
		rt.env.set(s) // clears the failure the expiry recorded, if it came after the new secret
	}
	return s, err
}

// issue generates a key, has the CSR signed, and puts the result in service.
func (rt *rotator) issue(ctx context.Context) (*Secret, error) {
	key, err := pki.GenerateKey(rt.cfg.KeyAlgorithm, rt.cfg.RSAKeySize)
	if err != nil {
		return nil, err
	}
	csr, err := pki.NewCSR(key, rt.cfg.Identity)
	if err != nil {
		return nil, err
	}
	chain, err := rt.cfg.Signer.Sign(ctx, csr, rt.cfg.TTL)
	if err != nil {
		return nil, err
	}
	received := rt.env.clock.Now()
	// A CA whose clock is ahead of ours by minutes returns a certificate not valid yet on our
	// clock. It is served all the same, as Istio's agent does: Envoy serves what it is given, and
	// peers judge it on their own clocks, which the CA's more likely matches. It must still be
	// valid from then on; one that has expired on our clock is refused.
	at, err := pki.ValidationTime(received, chain...)
	if err == nil {
		err = pki.CheckKeyPair(chain, key, rt.cfg.Identity.String(), at)
	}
	if err != nil {
		return nil, fmt.Errorf("the CA returned an unusable certificate: %w", err)
	}
	if at.After(received) {
		rt.env.log.Warn("the CA's clock is ahead of ours: its certificate is not valid yet on our clock; serving it",
			logkey.NotBefore, at, logkey.Ahead, at.Sub(received).String())
	}
	keyPEM, err := pki.EncodePrivateKey(key)
	if err != nil {
		return nil, err
	}
	s := rt.newSecret(&KeyPair{Chain: chain, ChainPEM: pki.EncodeCertificates(chain...), Key: key, KeyPEM: keyPEM}, received, SourceCA)
	rt.env.metrics.rotations.Inc()
	rt.install(s)
	rt.env.event(Event{Kind: EventIssued, Name: WorkloadCertName, Version: s.Version})
	return s, nil
}

func (rt *rotator) newSecret(kp *KeyPair, received time.Time, source Source) *Secret {
	s := &Secret{
		Name:     WorkloadCertName,
		KeyPair:  kp,
		Version:  kp.Leaf().SerialNumber.Text(16),
		Received: received,
		Source:   source,
	}
	s.RenewAt = rt.renewAt(s)
	return s
}

// retryWait spreads the backoff's interval by ±RetrySpread.
func (rt *rotator) retryWait(interval time.Duration) time.Duration {
	return time.Duration(float64(interval) * (1 + RetrySpread*(2*rt.cfg.Rand()-1)))
}

// renewAt is when GraceRatio (± jitter) of the lifetime remains, counted from when the
// certificate was received. The lifetime is the shorter of what is left on our clock at receipt
// (NotAfter−Received) and what the CA gave (NotAfter−NotBefore):
//   - CAs backdate NotBefore by minutes, which for a short TTL would put the renewal in the past
//     at once were it counted from NotBefore;
//   - a CA whose clock is ahead of ours sets NotBefore in our future and NotAfter further out on
//     our clock than it is on the CA's and its peers': counted from receipt, the lifetime the CA
//     gave ends before NotAfter does on our clock, while the certificate is still valid on theirs;
//   - a CA whose clock is behind ours leaves less on our clock than it gave, and the renewal
//     must come before NotAfter on our clock, which decides what we serve.
func (rt *rotator) renewAt(s *Secret) time.Time {
	ratio := rt.cfg.GraceRatio + rt.cfg.GraceRatioJitter*(2*rt.cfg.Rand()-1)
	lifetime := min(s.NotAfter().Sub(s.Received), s.NotAfter().Sub(s.KeyPair.Leaf().NotBefore))
	return s.Received.Add(time.Duration((1 - ratio) * float64(lifetime)))
}

// install publishes a new key pair: the trust bundle first, so that a peer that gets both trusts
// the new root before it sees a certificate chained to it.
func (rt *rotator) install(s *Secret) {
	if chain := s.KeyPair.Chain; len(chain) > 1 {
		rt.rootsMu.Lock()
		rt.chainRoot = chain[len(chain)-1]
		rt.publishRootsLocked()
		rt.rootsMu.Unlock()
	}
	rt.env.set(s)
}

func (rt *rotator) rootFileRead(s *Secret, err error) {
	if err != nil {
		return // logged by the loader; ROOTCA keeps the roots it had
	}
	rt.rootsMu.Lock()
	defer rt.rootsMu.Unlock()
	rt.fileRoots = s.Bundle.Roots
	rt.publishRootsLocked()
}

// publishRootsLocked publishes ROOTCA, the union of the chain's root and the root file's
// certificates, when it changed.
func (rt *rotator) publishRootsLocked() {
	var roots []*x509.Certificate
	if rt.chainRoot != nil {
		roots = append(roots, rt.chainRoot)
	}
	for _, r := range rt.fileRoots {
		if !slices.ContainsFunc(roots, r.Equal) {
			roots = append(roots, r)
		}
	}
	if len(roots) == 0 {
		return
	}
	pemBytes := pki.EncodeCertificates(roots...)
	sum := sha256.Sum256(pemBytes)
	version := hex.EncodeToString(sum[:8])
	if version == rt.roots {
		return
	}
	rt.roots = version
	rt.env.log.Info("trust bundle changed", logkey.Roots, len(roots), logkey.Version, version)
	rt.env.set(&Secret{Name: RootCertName, Bundle: &TrustBundle{Roots: roots, PEM: pemBytes}, Version: version, Source: SourceCA})
}

// chainsToCARoot checks that chain was issued under the roots that verify the CA now: a pair
// left by an earlier run under a CA since replaced must not be served, nor its root trusted.
func (rt *rotator) chainsToCARoot(chain []*x509.Certificate, now time.Time) error {
	var roots *x509.CertPool
	if rt.cfg.RootCertFile == "" {
		var err error
		if roots, err = x509.SystemCertPool(); err != nil {
			return fmt.Errorf("the system roots, which verify the CA: %w", err)
		}
	} else {
		data, err := os.ReadFile(rt.cfg.RootCertFile)
		if err != nil {
			return fmt.Errorf("the CA root: %w", err)
		}
		certs, err := pki.ParseCertificates(data)
		if err != nil {
			return fmt.Errorf("the CA root %s: %w", rt.cfg.RootCertFile, err)
		}
		roots = x509.NewCertPool()
		for _, c := range certs {
			roots.AddCert(c)
		}
	}
	intermediates := x509.NewCertPool()
	for _, c := range chain[1:] {
		intermediates.AddCert(c)
	}
	_, err := chain[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: intermediates, CurrentTime: now,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}})
	if err != nil {
		return fmt.Errorf("not issued under the CA's current root (%s): %w", describeRoot(rt.cfg.RootCertFile), err)
	}
	return nil
}

func describeRoot(file string) string {
	if file == "" {
		return "the system roots"
	}
	return file
}

// loadOutput puts in service a valid key pair for our identity left in OUTPUT_CERTS by an
// earlier run (a VM that rebooted), so that it is served at once and renewed on schedule.
func (rt *rotator) loadOutput() *Secret {
	dir := rt.env.outputDir
	chainPEM, err := os.ReadFile(filepath.Join(dir, CertChainFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	var (
		chain []*x509.Certificate
		key   crypto.Signer
		info  os.FileInfo
	)
	keyPEM, keyErr := os.ReadFile(filepath.Join(dir, KeyFile))
	if err = errors.Join(err, keyErr); err == nil {
		chain, err = pki.ParseCertificates(chainPEM)
	}
	if err == nil {
		key, err = pki.ParsePrivateKey(keyPEM)
	}
	now := rt.env.clock.Now()
	if err == nil {
		err = pki.CheckKeyPair(chain, key, rt.cfg.Identity.String(), now)
	}
	if err == nil {
		if err = rt.chainsToCARoot(chain, now); err != nil {
			// Not routine like an expired pair after a long shutdown: the CA was replaced.
			rt.env.log.Warn("discarding the certificate in OUTPUT_CERTS: the CA changed", logkey.Dir, dir, logkey.Reason, err.Error())
			return nil
		}
		info, err = os.Stat(filepath.Join(dir, CertChainFile))
	}
	if err != nil {
		rt.env.log.Info("not using the certificate in OUTPUT_CERTS", logkey.Dir, dir, logkey.Reason, err.Error())
		return nil
	}
	// It was received when it was written, as far as we can tell.
	received := info.ModTime()
	if received.After(now) {
		received = now
	}
	if received.Before(chain[0].NotBefore) {
		received = chain[0].NotBefore
	}
	s := rt.newSecret(&KeyPair{Chain: chain, ChainPEM: chainPEM, Key: key, KeyPEM: keyPEM}, received, SourceOutputCerts)
	rt.install(s)
	return s
}
