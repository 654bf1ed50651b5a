// Package secretmanager holds the workload's certificate and trust bundle at every moment: it
// obtains the certificate from a Signer (the CA client), renews it proactively at a share of its
// lifetime whether or not anyone is asking, retries failed renewals with backoff while the current
// certificate keeps serving, writes every new secret to OUTPUT_CERTS, and tells subscribers (the
// SDS server) of each change.
package secretmanager

import (
	"context"
	"crypto"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/meshid/meshid/internal/logkey"

	"github.com/cenkalti/backoff/v4"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/pki"
)

// Names of the secrets, as Envoy asks for them over SDS.
const (
	WorkloadCertName = "default"
	RootCertName     = "ROOTCA"
)

// Defaults, as in Istio's agent.
const (
	DefaultTTL              = 24 * time.Hour
	DefaultGraceRatio       = 0.5
	DefaultGraceRatioJitter = 0.01
	DefaultRetryInitial     = time.Second
	DefaultRetryMax         = 5 * time.Minute
)

// ErrUnknownSecret reports a secret name the manager does not serve.
var ErrUnknownSecret = errors.New("unknown secret")

// Signer turns a CSR into a certificate chain, leaf first. The CA client is one.
type Signer interface {
	Sign(ctx context.Context, csrDER []byte, ttl time.Duration) ([]*x509.Certificate, error)
}

// Secret is one resource as served: the workload key pair ("default") or the trust bundle ("ROOTCA").
type Secret struct {
	Name string
	// The workload key pair: Chain is leaf first; both are nil for ROOTCA.
	Chain    []*x509.Certificate
	ChainPEM []byte
	Key      crypto.Signer
	KeyPEM   []byte
	// The trusted roots: set for ROOTCA.
	Roots    []*x509.Certificate
	RootsPEM []byte

	// Version changes whenever the content does.
	Version string
	// CreatedAt is when the certificate was received; ExpiresAt is the leaf's NotAfter; RenewAt is
	// when it will be renewed. Zero for ROOTCA.
	CreatedAt, ExpiresAt, RenewAt time.Time
	// Source says where the certificate came from: "ca" or "output-certs".
	Source string
}

// Config configures a Manager. It obtains the workload certificate from Signer (CA mode) or, when
// WorkloadFiles is set, serves "default" and "ROOTCA" from those files (file mode).
type Config struct {
	Signer        Signer
	WorkloadFiles *FilePaths
	// FileResourceDirs are the directories "file-cert:" and "file-root:" resources may read.
	FileResourceDirs []string

	Identity     pki.SPIFFEID
	KeyAlgorithm pki.KeyAlgorithm
	RSAKeySize   int
	// TTL is the validity asked of the CA (SECRET_TTL).
	TTL time.Duration
	// GraceRatio is the share of a certificate's lifetime left when it is renewed
	// (SECRET_GRACE_PERIOD_RATIO), moved by up to ±GraceRatioJitter at random.
	GraceRatio       float64
	GraceRatioJitter float64
	// OutputDir, when set, receives every new key pair and trust bundle (OUTPUT_CERTS); a valid
	// certificate already there for Identity is used at start-up.
	OutputDir string
	// RootCertFile is the CA root file, watched; ROOTCA is the union of its certificates and the
	// root that ends the CA's chain.
	RootCertFile string
	// RetryInitial and RetryMax bound the backoff between failed renewals.
	RetryInitial, RetryMax time.Duration

	Clock      clock.Clock
	Rand       func() float64 // in [0, 1), for the jitter; nil is random
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

// Manager is the caching, self-renewing holder of the workload's secrets.
type Manager struct {
	cfg     Config
	clock   clock.Clock
	log     *slog.Logger
	metrics *metrics

	// publishMu serializes the changes of secrets (a new certificate, a reloaded root file), each
	// from computing it to writing OUTPUT_CERTS and telling subscribers, so that when the two
	// happen at once the disk and the subscribers still end with the latest of each.
	publishMu sync.Mutex

	mu          sync.Mutex
	workload    *Secret
	roots       *Secret
	fileRoots   []*x509.Certificate
	lastErr     error
	changed     chan struct{} // closed and replaced whenever a secret changes
	subscribers map[int]func(*Secret)
	nextSub     int
	files       map[string]*fileSecret // file resources, and default/ROOTCA in file mode

	watcher *filewatch.Watcher
}

// New returns a Manager; call Run to obtain and renew certificates.
func New(cfg Config) (*Manager, error) {
	if (cfg.Signer == nil) == (cfg.WorkloadFiles == nil) {
		return nil, errors.New("secret manager needs either a signer or workload files")
	}
	if cfg.Signer != nil {
		if _, err := pki.NewSPIFFEID(cfg.Identity.TrustDomain, cfg.Identity.Namespace, cfg.Identity.ServiceAccount); err != nil {
			return nil, fmt.Errorf("workload identity: %w", err)
		}
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
		if cfg.RSAKeySize < pki.MinRSAKeySize || cfg.RSAKeySize > pki.MaxRSAKeySize {
			return nil, fmt.Errorf("workload RSA key size %d out of range [%d, %d]", cfg.RSAKeySize, pki.MinRSAKeySize, pki.MaxRSAKeySize)
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
	if cfg.GraceRatio <= 0 || cfg.GraceRatio >= 1 {
		return nil, fmt.Errorf("grace period ratio %v must be between 0 and 1", cfg.GraceRatio)
	}
	if cfg.GraceRatioJitter < 0 || cfg.GraceRatioJitter >= cfg.GraceRatio || cfg.GraceRatio+cfg.GraceRatioJitter >= 1 {
		return nil, fmt.Errorf("grace period jitter %v must keep the ratio %v within (0, 1)", cfg.GraceRatioJitter, cfg.GraceRatio)
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
	m := &Manager{
		cfg:         cfg,
		clock:       clock.OrReal(cfg.Clock),
		log:         cfg.Logger,
		metrics:     newMetrics(),
		changed:     make(chan struct{}),
		subscribers: map[int]func(*Secret){},
		files:       map[string]*fileSecret{},
	}
	if m.log == nil {
		m.log = slog.New(slog.DiscardHandler)
	}
	var err error
	if m.watcher, err = filewatch.New(filewatch.Config{Clock: m.clock, Logger: m.log}); err != nil {
		return nil, err
	}
	var watched []string
	if cfg.RootCertFile != "" {
		watched = append(watched, cfg.RootCertFile)
	}
	if wf := cfg.WorkloadFiles; wf != nil {
		m.files[WorkloadCertName] = &fileSecret{name: WorkloadCertName, certChain: wf.CertChain, key: wf.Key}
		m.files[RootCertName] = &fileSecret{name: RootCertName, root: wf.Root}
		watched = append(watched, wf.CertChain, wf.Key, wf.Root)
	}
	for _, p := range watched {
		if err := m.watcher.Add(context.Background(), p); err != nil { // not running: records the path
			return nil, err
		}
	}
	if cfg.Registerer != nil {
		if err := m.metrics.register(cfg.Registerer); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Subscribe registers fn to be told of every new secret, after it is cached and written out.
// fn is called from the manager's goroutines and must not block. The returned func unsubscribes.
func (m *Manager) Subscribe(fn func(*Secret)) (unsubscribe func()) {
	m.mu.Lock()
	defer m.mu.Unlock()
	id := m.nextSub
	m.nextSub++
	m.subscribers[id] = fn
	return func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		delete(m.subscribers, id)
	}
}

// GenerateSecret returns the named secret, waiting (until ctx ends) for a valid one if there is
// none yet. It never returns an expired certificate. Names: "default", "ROOTCA",
// "file-cert:<cert-chain>~<key>" and "file-root:<roots>" (paths inside FileResourceDirs).
func (m *Manager) GenerateSecret(ctx context.Context, name string) (*Secret, error) {
	var file *fileSecret
	if m.cfg.WorkloadFiles != nil && (name == WorkloadCertName || name == RootCertName) {
		m.mu.Lock() // fileSecretFor adds to m.files from other streams' goroutines
		file = m.files[name]
		m.mu.Unlock()
	} else if name != WorkloadCertName && name != RootCertName {
		f, err := m.fileSecretFor(ctx, name)
		if err != nil {
			return nil, err
		}
		file = f
	}
	for {
		m.mu.Lock()
		var (
			s       *Secret
			lastErr error
		)
		switch {
		case file != nil:
			s, lastErr = file.current, file.lastErr
		case name == WorkloadCertName:
			s, lastErr = m.workload, m.lastErr
		default:
			s, lastErr = m.roots, m.lastErr
		}
		changed := m.changed
		m.mu.Unlock()
		if s != nil && (s.Chain == nil || m.clock.Now().Before(s.ExpiresAt)) {
			return s, nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			if lastErr != nil {
				return nil, fmt.Errorf("no valid %s secret yet: %w (last attempt: %w)", name, ctx.Err(), lastErr)
			}
			return nil, fmt.Errorf("no valid %s secret yet: %w", name, ctx.Err())
		}
	}
}

// Ready reports whether a valid workload certificate is held.
func (m *Manager) Ready() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.workload
	if f, fileMode := m.files[WorkloadCertName]; fileMode {
		s = f.current
	}
	return s != nil && m.clock.Now().Before(s.ExpiresAt)
}

// Run obtains the workload certificate and renews it until ctx ends (CA mode), or serves it from
// its files (file mode); it watches the CA root file and every file a secret is read from. When
// ctx ends it returns at once, leaving OUTPUT_CERTS as it is.
func (m *Manager) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return m.watcher.Run(ctx, m.onFilesChanged) })
	// Read the files only once they are watched: a change made between a read and the watch
	// would otherwise go unseen until the next one.
	select {
	case <-m.watcher.Ready():
	case <-ctx.Done():
		return g.Wait()
	}
	if m.cfg.RootCertFile != "" {
		m.reloadRootFile()
	}
	// Every file secret known so far (the workload's in file mode, and any requested before Run)
	// is read now that its files are watched.
	m.reloadAllFiles()
	if m.cfg.WorkloadFiles == nil {
		g.Go(func() error { return m.renewLoop(ctx) })
	}
	return g.Wait()
}

func (m *Manager) onFilesChanged(changed []string) {
	if m.cfg.RootCertFile != "" && slices.Contains(changed, filepath.Clean(m.cfg.RootCertFile)) {
		m.reloadRootFile()
	}
	m.filesChanged(changed)
}

func (m *Manager) renewLoop(ctx context.Context) error {
	if m.cfg.OutputDir != "" {
		m.loadOutput()
	}
	retry := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(m.cfg.RetryInitial),
		backoff.WithMaxInterval(m.cfg.RetryMax),
		backoff.WithMaxElapsedTime(0), // a workload without a certificate keeps trying
		backoff.WithClockProvider(m.clock),
	)
	for {
		m.mu.Lock()
		current := m.workload
		m.mu.Unlock()
		now := m.clock.Now()
		var wait time.Duration
		if current != nil && now.Before(current.RenewAt) {
			wait = current.RenewAt.Sub(now)
		} else if err := m.issue(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			wait = retry.NextBackOff()
			if current != nil && now.Before(current.ExpiresAt) && current.ExpiresAt.Sub(now) < wait {
				wait = current.ExpiresAt.Sub(now) // one more try before the certificate in service expires
			}
			m.renewalFailed(err, current, now.Add(wait))
		} else {
			retry.Reset()
			continue
		}
		timer := m.clock.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil
		case <-timer.C():
		}
	}
}

func (m *Manager) renewalFailed(err error, current *Secret, retryAt time.Time) {
	m.metrics.failures.Inc()
	m.mu.Lock()
	m.lastErr = err
	m.mu.Unlock()
	attrs := []any{logkey.Error, err.Error(), logkey.RetryAt, retryAt}
	if current != nil {
		attrs = append(attrs, logkey.CurrentExpires, current.ExpiresAt)
	}
	m.log.Warn("workload certificate renewal failed; the current one keeps serving", attrs...)
}

// issue generates a key, has the CSR signed, and installs the result.
func (m *Manager) issue(ctx context.Context) error {
	key, err := pki.GenerateKey(m.cfg.KeyAlgorithm, m.cfg.RSAKeySize)
	if err != nil {
		return err
	}
	csr, err := pki.NewCSR(key, m.cfg.Identity)
	if err != nil {
		return err
	}
	chain, err := m.cfg.Signer.Sign(ctx, csr, m.cfg.TTL)
	if err != nil {
		return err
	}
	received := m.clock.Now()
	if err := pki.CheckKeyPair(chain, key, m.cfg.Identity.String(), received); err != nil {
		return fmt.Errorf("the CA returned an unusable certificate: %w", err)
	}
	keyPEM, err := pki.EncodePrivateKey(key)
	if err != nil {
		return err
	}
	m.install(m.newWorkloadSecret(chain, key, keyPEM, received, "ca"), true)
	return nil
}

func (m *Manager) newWorkloadSecret(chain []*x509.Certificate, key crypto.Signer, keyPEM []byte, received time.Time, source string) *Secret {
	leaf := chain[0]
	s := &Secret{
		Name:      WorkloadCertName,
		Chain:     chain,
		ChainPEM:  pki.EncodeCertificates(chain...),
		Key:       key,
		KeyPEM:    keyPEM,
		Version:   leaf.SerialNumber.Text(16),
		CreatedAt: received,
		ExpiresAt: leaf.NotAfter,
		Source:    source,
	}
	s.RenewAt = m.renewAt(s)
	return s
}

// renewAt is when GraceRatio (± jitter) of the lifetime remains. The lifetime counts from when
// the certificate was received, not from NotBefore: CAs backdate NotBefore by minutes, which for
// a short TTL would put the renewal in the past at once.
func (m *Manager) renewAt(s *Secret) time.Time {
	ratio := m.cfg.GraceRatio + m.cfg.GraceRatioJitter*(2*m.cfg.Rand()-1)
	lifetime := s.ExpiresAt.Sub(s.CreatedAt)
	return s.ExpiresAt.Add(-time.Duration(ratio * float64(lifetime)))
}

// install caches a new workload secret, recomputes ROOTCA, writes OUTPUT_CERTS and tells
// subscribers.
func (m *Manager) install(s *Secret, write bool) {
	m.publishMu.Lock()
	defer m.publishMu.Unlock()
	m.mu.Lock()
	m.workload = s
	m.lastErr = nil
	roots := m.rebuildRootsLocked()
	var rootsPEM []byte
	if m.roots != nil {
		rootsPEM = m.roots.RootsPEM
	}
	m.mu.Unlock()

	m.metrics.expiry.Set(float64(s.ExpiresAt.Unix()))
	m.metrics.nextRenewal.Set(float64(s.RenewAt.Unix()))
	if s.Source == "ca" {
		m.metrics.rotations.Inc()
	}
	m.log.Info("workload certificate in service",
		logkey.Identity, m.cfg.Identity.String(),
		logkey.Serial, s.Version,
		logkey.Source, s.Source,
		logkey.NotAfter, s.ExpiresAt,
		logkey.RenewAt, s.RenewAt)
	if write && m.cfg.OutputDir != "" {
		if err := writeOutput(m.cfg.OutputDir, s.KeyPEM, s.ChainPEM, rootsPEM); err != nil {
			m.log.Error("cannot write OUTPUT_CERTS; the certificate is still served", logkey.Dir, m.cfg.OutputDir, logkey.Error, err.Error())
		}
	}
	m.notify(s)
	if roots != nil {
		m.notify(roots)
	}
}

// rebuildRootsLocked recomputes ROOTCA and returns it when it changed.
func (m *Manager) rebuildRootsLocked() *Secret {
	var roots []*x509.Certificate
	if m.workload != nil {
		if chain := m.workload.Chain; len(chain) > 1 {
			roots = append(roots, chain[len(chain)-1])
		}
	}
	for _, r := range m.fileRoots {
		if !slices.ContainsFunc(roots, r.Equal) {
			roots = append(roots, r)
		}
	}
	if len(roots) == 0 {
		return nil
	}
	pemBytes := pki.EncodeCertificates(roots...)
	sum := sha256.Sum256(pemBytes)
	version := hex.EncodeToString(sum[:8])
	if m.roots != nil && m.roots.Version == version {
		return nil
	}
	m.roots = &Secret{Name: RootCertName, Roots: roots, RootsPEM: pemBytes, Version: version, Source: "ca"}
	return m.roots
}

func (m *Manager) reloadRootFile() {
	m.publishMu.Lock()
	defer m.publishMu.Unlock()
	data, err := os.ReadFile(m.cfg.RootCertFile)
	var certs []*x509.Certificate
	if err == nil {
		certs, err = pki.ParseCertificates(data)
	}
	if err != nil {
		m.log.Warn("cannot read the CA root file; ROOTCA keeps the roots it had", logkey.Path, m.cfg.RootCertFile, logkey.Error, err.Error())
		return
	}
	m.mu.Lock()
	m.fileRoots = certs
	roots := m.rebuildRootsLocked()
	workload := m.workload
	m.mu.Unlock()
	if roots == nil {
		return
	}
	m.log.Info("trust bundle changed", logkey.Roots, len(roots.Roots), logkey.Version, roots.Version)
	// OUTPUT_CERTS carries the trust bundle too.
	if workload != nil && m.cfg.OutputDir != "" {
		if err := writeOutput(m.cfg.OutputDir, workload.KeyPEM, workload.ChainPEM, roots.RootsPEM); err != nil {
			m.log.Error("cannot write OUTPUT_CERTS; the trust bundle is still served", logkey.Dir, m.cfg.OutputDir, logkey.Error, err.Error())
		}
	}
	m.notify(roots)
}

func (m *Manager) notify(s *Secret) {
	m.mu.Lock()
	close(m.changed)
	m.changed = make(chan struct{})
	subs := make([]func(*Secret), 0, len(m.subscribers))
	for _, fn := range m.subscribers {
		subs = append(subs, fn)
	}
	m.mu.Unlock()
	for _, fn := range subs {
		fn(s)
	}
}

// loadOutput puts in service a valid certificate for our identity left in OUTPUT_CERTS by an
// earlier run (a VM that rebooted), so that it is served at once and renewed on schedule.
func (m *Manager) loadOutput() {
	dir := m.cfg.OutputDir
	chainPEM, err := os.ReadFile(filepath.Join(dir, CertChainFile))
	if errors.Is(err, os.ErrNotExist) {
		return
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
	now := m.clock.Now()
	if err == nil {
		err = pki.CheckKeyPair(chain, key, m.cfg.Identity.String(), now)
	}
	if err == nil {
		info, err = os.Stat(filepath.Join(dir, CertChainFile))
	}
	if err != nil {
		m.log.Info("not using the certificate in OUTPUT_CERTS", logkey.Dir, dir, logkey.Reason, err.Error())
		return
	}
	// It was received when it was written, as far as we can tell.
	received := info.ModTime()
	if received.After(now) {
		received = now
	}
	if received.Before(chain[0].NotBefore) {
		received = chain[0].NotBefore
	}
	m.install(m.newWorkloadSecret(chain, key, keyPEM, received, "output-certs"), false)
}

// Snapshot returns every secret held now (workload, trust bundle, file resources), by name.
func (m *Manager) Snapshot() []*Secret {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []*Secret
	if m.workload != nil {
		out = append(out, m.workload)
	}
	if m.roots != nil {
		out = append(out, m.roots)
	}
	for _, name := range slices.Sorted(maps.Keys(m.files)) {
		if s := m.files[name].current; s != nil {
			out = append(out, s)
		}
	}
	return out
}
