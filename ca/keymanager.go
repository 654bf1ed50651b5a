package ca

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"path/filepath"
	"sync"
	"time"

	"github.com/meshid/meshid/internal/logkey"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/pki"
)

// Defaults of the key manager, as in Istio's self-signed root rotator.
const (
	DefaultRootCheckInterval     = time.Hour
	DefaultRootRotationThreshold = 0.2
)

// ValidateRootRotationThreshold checks a root rotation threshold: the share of a self-signed
// root's lifetime left when it is renewed, strictly between 0 and 1. NaN, which every comparison
// would let through and which would renew the root at every check, is refused too.
func ValidateRootRotationThreshold(threshold float64) error {
	if !(threshold > 0 && threshold < 1) {
		return fmt.Errorf("root rotation threshold %v must be above 0 and below 1 (the share of the root's lifetime left when it is renewed)", threshold)
	}
	return nil
}

// EventKind names what the key manager did.
type EventKind string

// Key manager events.
const (
	// EventReloaded: new plugged-in files, or key material offered (Offer), replaced the bundle
	// in service.
	EventReloaded EventKind = "reloaded"
	// EventUnchanged: the plugged-in files changed on disk, or key material was offered, but they
	// hold the key material in service.
	EventUnchanged EventKind = "unchanged"
	// EventRejected: the plugged-in files are incomplete or invalid; the bundle in service stays.
	EventRejected EventKind = "rejected"
	// EventIgnored: key material was offered while the plugged-in files are in service, which
	// come first.
	EventIgnored EventKind = "ignored"
	// EventRotated: the self-signed root neared its end and was renewed from the same key.
	EventRotated EventKind = "rotated"
	// EventRotationFailed: the self-signed root is due for renewal but could not be renewed.
	EventRotationFailed EventKind = "rotation_failed"
	// EventAdopted: another replica sharing the state dir rotated the root; this one loaded it.
	EventAdopted EventKind = "adopted"
	// EventPruned: retained roots expired or outlived the overlap and left the trust bundle.
	EventPruned EventKind = "pruned"
	// EventTempFileRemoved: at start-up, a temporary file left in the state dir by an interrupted
	// write was removed.
	EventTempFileRemoved EventKind = "temp_file_removed"
)

// Event reports one thing the key manager did.
type Event struct {
	Kind EventKind
	Err  error  // why files were rejected, or what failed
	Path string // the file removed (EventTempFileRemoved)
}

// KeyManagerConfig configures a KeyManager. Zero durations take the defaults.
type KeyManagerConfig struct {
	// Authority receives every new bundle.
	Authority  *Authority
	CACertsDir string // optional; must exist (empty is fine), see CheckCACertsDir; watched
	StateDir   string
	SelfSigned SelfSignedConfig

	// RootCheckInterval is how often the self-signed root's remaining life is checked (±5%).
	RootCheckInterval time.Duration
	// RootRotationThreshold is the share of a self-signed root's lifetime left at which it is
	// renewed; the lifetime is the one the root was issued with, its backdating not counted.
	RootRotationThreshold float64
	// TrustBundleOverlap is how long a replaced root stays trusted, counted from its replacement
	// across restarts (see RetiredRootsFile); 0 keeps it until it expires.
	TrustBundleOverlap time.Duration
	// Debounce is how quiet the cacerts files must be before they are reloaded.
	Debounce time.Duration

	Clock clock.Clock
	// Jitter returns a number in [0, 1) that spreads the root checks of replicas; nil is random.
	Jitter     func() float64
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
	// OnEvent, when set, is told of every reload attempt, rotation and pruning, after the fact.
	OnEvent func(Event)

	// Initial, when set, is the key material to start from, found outside the state dir (the
	// cacerts Secret) by the step InitialOrigin names, instead of LoadOrCreate's own steps. The
	// state dir still keeps the trust bundle and the roots it replaced (see LoadOrCreate).
	Initial       *Bundle
	InitialOrigin Origin

	// Upstream, when set, issued Initial; Run renews it from the upstream at its grace point
	// and puts each renewal in service as Offer does.
	Upstream *Upstream
}

// KeyManager keeps the CA's key material current while it runs: it reloads plugged-in files when
// they change, renews a self-signed root before it expires, and keeps replaced roots trusted for
// the overlap. Every change is published to the Authority at once and written to the state dir's
// root-cert.pem, after the record of when replaced roots were replaced.
type KeyManager struct {
	cfg     KeyManagerConfig
	clock   clock.Clock
	log     *slog.Logger
	origin  Origin
	ready   chan struct{}
	reloads *prometheus.CounterVec
	rotates *prometheus.CounterVec

	mu sync.Mutex // one change of the key material at a time
}

// NewKeyManager loads or creates the key material in Istio's start-up order (see LoadOrCreate)
// and puts it in service on cfg.Authority. It starts no goroutine; call Run.
func NewKeyManager(cfg KeyManagerConfig) (*KeyManager, error) {
	if cfg.Authority == nil {
		return nil, errors.New("key manager needs an authority")
	}
	if cfg.RootCheckInterval <= 0 {
		cfg.RootCheckInterval = DefaultRootCheckInterval
	}
	if cfg.RootRotationThreshold == 0 {
		cfg.RootRotationThreshold = DefaultRootRotationThreshold
	}
	if err := ValidateRootRotationThreshold(cfg.RootRotationThreshold); err != nil {
		return nil, err
	}
	// Checked now: GenerateKey would refuse the size only after the state dir was made.
	if cfg.SelfSigned.KeyAlgorithm == pki.RSA && cfg.SelfSigned.RSAKeySize != 0 {
		if err := pki.ValidateRSAKeySize(cfg.SelfSigned.RSAKeySize); err != nil {
			return nil, fmt.Errorf("self-signed root key: %w", err)
		}
	}
	if cfg.TrustBundleOverlap < 0 {
		return nil, fmt.Errorf("trust bundle overlap %s must not be negative", cfg.TrustBundleOverlap)
	}
	if cfg.Jitter == nil {
		cfg.Jitter = rand.Float64
	}
	m := &KeyManager{
		cfg:   cfg,
		clock: clock.OrReal(cfg.Clock),
		log:   cfg.Logger,
		ready: make(chan struct{}),
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "key_material_reloads_total",
			Help: "Reloads of the plugged-in CA files and offers of key material (the cacerts Secret), by outcome (reloaded, unchanged, rejected).",
		}, []string{"outcome"}),
		rotates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "root_rotations_total",
			Help: "Self-signed root renewals done here (rotated) or picked up from a replica (adopted).",
		}, []string{"outcome"}),
	}
	if m.log == nil {
		m.log = slog.New(slog.DiscardHandler)
	}
	now := m.clock.Now()
	b, origin, err := LoadOrCreate(StartupConfig{
		CACertsDir:         cfg.CACertsDir,
		StateDir:           cfg.StateDir,
		SelfSigned:         cfg.SelfSigned,
		TrustBundleOverlap: cfg.TrustBundleOverlap,
		Now:                now,
		Logger:             m.log,
		OnTempFileRemoved:  func(path string) { m.emit(Event{Kind: EventTempFileRemoved, Path: path}) },
		Initial:            cfg.Initial,
		InitialOrigin:      cfg.InitialOrigin,
	})
	if err != nil {
		return nil, err
	}
	m.origin = origin
	if cfg.Registerer != nil {
		for _, c := range []prometheus.Collector{m.reloads, m.rotates} {
			if err := cfg.Registerer.Register(c); err != nil {
				return nil, err
			}
		}
	}
	cfg.Authority.SetBundle(b)
	return m, nil
}

// Origin says which start-up step produced the key material.
func (m *KeyManager) Origin() Origin { return m.origin }

// Ready is closed once the cacerts files are being watched (at once when there are none).
func (m *KeyManager) Ready() <-chan struct{} { return m.ready }

// Run watches the plugged-in files and checks the root until ctx ends.
func (m *KeyManager) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	if m.cfg.CACertsDir != "" {
		w, err := filewatch.New(filewatch.Config{
			Paths:    []string{m.cfg.CACertsDir},
			Debounce: m.cfg.Debounce,
			Clock:    m.clock,
			Logger:   m.log,
		})
		if err != nil {
			return err
		}
		g.Go(func() error { return w.Run(ctx, func([]string) { m.reloadPluggedIn() }) })
		g.Go(func() error {
			select {
			case <-w.Ready():
				close(m.ready)
			case <-ctx.Done():
			}
			return nil
		})
	} else {
		close(m.ready)
	}
	g.Go(func() error { return m.runRootChecks(ctx) })
	if m.cfg.Upstream != nil {
		g.Go(func() error { return m.runUpstreamRenewals(ctx) })
	}
	return g.Wait()
}

func (m *KeyManager) runRootChecks(ctx context.Context) error {
	for {
		m.checkRoot()
		// ±5% so that replicas started together do not check in lockstep.
		wait := time.Duration(float64(m.cfg.RootCheckInterval) * (0.95 + 0.1*m.cfg.Jitter()))
		if !clock.Sleep(ctx, m.clock, wait) {
			return nil
		}
	}
}

// runUpstreamRenewals renews the upstream-signed signing certificate at its grace point, for as
// long as ctx lasts. The bundle in service keeps signing until a renewal verifies; the renewal
// then replaces it as an Offer does.
func (m *KeyManager) runUpstreamRenewals(ctx context.Context) error {
	up := m.cfg.Upstream
	for {
		current := m.cfg.Authority.Bundle()
		at := up.renewAt(current)
		up.log.Info("next renewal of the signing certificate from the upstream CA", logkey.RenewAt, at, logkey.NotAfter, current.notAfter)
		if wait := at.Sub(m.clock.Now()); wait > 0 && !clock.Sleep(ctx, m.clock, wait) {
			return nil
		}
		next, err := up.renew(ctx, current)
		if err != nil {
			return nil //nolint:nilerr // renew gives up only when ctx ends
		}
		if ev := m.Offer(next, "upstream CA "+up.cfg.Address); ev.Kind != EventReloaded {
			// Not in service, so the same certificate would be due again at once: wait a
			// retry's longest before asking again rather than call the upstream in a loop.
			up.log.Error("the renewed signing certificate was not put in service", logkey.Reason, string(ev.Kind))
			if !clock.Sleep(ctx, m.clock, upstreamRetryMax) {
				return nil
			}
		}
	}
}

func (m *KeyManager) emit(ev Event) {
	if m.cfg.OnEvent != nil {
		m.cfg.OnEvent(ev)
	}
}

// reloadPluggedIn applies the cacerts files as they are now: a complete, valid bundle replaces
// the one in service (a self-signed one included); anything else is logged and ignored.
func (m *KeyManager) reloadPluggedIn() {
	ev := m.reload()
	m.reloads.WithLabelValues(string(ev.Kind)).Inc()
	m.emit(ev)
}

func (m *KeyManager) reload() Event {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.clock.Now()
	current := m.cfg.Authority.Bundle()
	next, err := LoadPluggedIn(m.cfg.CACertsDir, now)
	switch {
	case errors.Is(err, ErrNoPluggedInCA) && current.Source() != SourcePluggedIn:
		// Nothing was loaded from the files, so their absence changes nothing.
		return Event{Kind: EventUnchanged}
	case errors.Is(err, ErrNoPluggedInCA):
		m.log.Warn("the plugged-in CA files are gone; the loaded CA keeps serving until they return", logkey.CACertsDir, m.cfg.CACertsDir)
		return Event{Kind: EventRejected, Err: err}
	case err != nil:
		m.log.Warn("plugged-in CA files not loaded; the CA in service keeps serving", logkey.CACertsDir, m.cfg.CACertsDir, logkey.Error, err.Error())
		return Event{Kind: EventRejected, Err: err}
	case next.sameMaterial(current):
		return Event{Kind: EventUnchanged}
	}
	m.install(next, now)
	m.log.Info("plugged-in CA reloaded",
		logkey.CACertsDir, m.cfg.CACertsDir,
		logkey.Subject, next.signingCert.Subject.String(),
		logkey.Root, next.Root().Subject.String(),
		logkey.NotAfter, next.notAfter,
		logkey.TookOverFrom, string(current.Source()))
	return Event{Kind: EventReloaded}
}

// Offer puts key material from outside the state dir (the cacerts Secret, named by from) in
// service as a reload of plugged-in files would: the same material changes nothing, other
// material replaces the bundle in service, whose roots stay trusted for the overlap. While
// plugged-in files are in service, offers are ignored. A bundle whose Source is not
// SourceSelfSigned is never renewed by this manager's rotator.
func (m *KeyManager) Offer(b *Bundle, from string) Event {
	ev := m.offer(b, from)
	m.reloads.WithLabelValues(string(ev.Kind)).Inc()
	m.emit(ev)
	return ev
}

func (m *KeyManager) offer(next *Bundle, from string) Event {
	if next == nil {
		return Event{Kind: EventRejected, Err: errors.New("no key material offered")}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.clock.Now()
	current := m.cfg.Authority.Bundle()
	if current.Source() == SourcePluggedIn {
		// The watched files come first (seed 001's first step); when they mount the offered
		// Secret, its versions arrive through them, and taking both would let a lagging copy
		// undo a newer one.
		return Event{Kind: EventIgnored}
	}
	if next.sameMaterial(current) {
		return Event{Kind: EventUnchanged}
	}
	m.install(next, now)
	m.log.Info("new key material put in service",
		logkey.From, from,
		logkey.Subject, next.signingCert.Subject.String(),
		logkey.Root, next.Root().Subject.String(),
		logkey.NotAfter, next.notAfter,
		logkey.TookOverFrom, string(current.Source()))
	return Event{Kind: EventReloaded}
}

// install puts next in service, keeping the roots of the bundle it replaces trusted as long as
// the overlap allows, and writes the trust bundle for clients first.
func (m *KeyManager) install(next *Bundle, now time.Time) {
	current := m.cfg.Authority.Bundle()
	var keep []*x509.Certificate
	retired := map[[32]byte]retirement{}
	var (
		record *retiredRecord
		read   bool
	)
	for _, r := range current.roots {
		if containsCert(next.anchors, r) {
			continue
		}
		fp := fingerprint(r.Raw)
		ri, wasRetained := current.retired[fp]
		if !wasRetained {
			// It anchored current until now, unless a replica sharing the state dir replaced it
			// first and recorded when.
			at := now
			if !read {
				record, _ = readRetiredRecord(m.cfg.StateDir) // unreadable: from now
				read = true
			}
			if t, ok := record.retiredAt(fp); ok && !t.IsZero() && t.Before(now) {
				at = t
			}
			ri = newRetirement(at, m.cfg.TrustBundleOverlap, now)
		}
		keep = append(keep, r)
		retired[fp] = ri
	}
	next = next.withRetained(keep, retired)
	m.publish(next.withRetained(next.trustedRetained(now), next.retired))
}

// publish puts b in service after writing the record of its replaced roots and then its trust
// bundle for clients (see writeRetiredRecord for the order).
func (m *KeyManager) publish(b *Bundle) {
	if err := writeRetiredRecord(m.cfg.StateDir, b); err != nil {
		// A restart then knows less of when roots were replaced, and trusts them no longer than
		// the overlap from when they were (see newRetirement).
		m.log.Error("cannot write the record of replaced roots", logkey.Error, err.Error())
	}
	if err := WriteTrustBundle(m.cfg.StateDir, b); err != nil {
		m.log.Error("cannot write the trust bundle; clients reading it keep the old roots", logkey.Error, err.Error())
	}
	m.cfg.Authority.SetBundle(b)
}

// checkRoot renews a self-signed root that nears its end and drops retained roots past their time.
func (m *KeyManager) checkRoot() {
	var events []Event
	m.mu.Lock()
	now := m.clock.Now()
	if m.cfg.Authority.Bundle().Source() == SourceSelfSigned {
		events = m.rotateIfDue(now)
	}
	current := m.cfg.Authority.Bundle()
	if kept := current.trustedRetained(now); len(kept) != len(current.retained) {
		next := current.withRetained(kept, current.retired)
		m.publish(next)
		m.log.Info("retained roots left the trust bundle", logkey.Dropped, len(current.retained)-len(kept), logkey.TrustedRoots, len(next.roots))
		events = append(events, Event{Kind: EventPruned})
	}
	m.mu.Unlock()
	for _, ev := range events {
		m.emit(ev)
	}
}

// rotateIfDue renews the self-signed root from the same key when less than the threshold of its
// lifetime is left. Replicas sharing the state dir take turns under its lock; one that finds the
// persisted root changed adopts it instead of rotating again.
func (m *KeyManager) rotateIfDue(now time.Time) []Event {
	unlock, err := fsutil.Lock(filepath.Join(m.cfg.StateDir, lockFile))
	if err != nil {
		m.log.Error("cannot lock the state dir to check the root", logkey.Error, err.Error())
		return nil
	}
	defer unlock()

	var events []Event
	current := m.cfg.Authority.Bundle()
	// The persisted root is checked for validity only when it is not the one in service, so that
	// a root that expired while the CA ran (suspended past the rotation window, say) is renewed
	// below, as LoadOrCreate renews it at start-up, instead of failing every check.
	cert, key, err := readSelfSigned(m.cfg.StateDir)
	var persisted *Bundle
	if err == nil && cert != nil && !cert.Equal(current.signingCert) {
		persisted, err = NewBundle(BundleParams{SigningCert: cert, SigningKey: key, Source: SourceSelfSigned, Now: now})
	}
	switch {
	case err != nil:
		m.log.Error("cannot read the persisted self-signed CA", logkey.Error, err.Error())
		return nil
	case persisted != nil:
		m.install(persisted, now)
		m.rotates.WithLabelValues(string(EventAdopted)).Inc()
		m.log.Info("adopted the self-signed root rotated by another replica", logkey.NotAfter, persisted.notAfter)
		events = append(events, Event{Kind: EventAdopted})
		current = m.cfg.Authority.Bundle()
	}

	root := current.signingCert
	if now.Before(RootRenewalTime(root, m.cfg.RootRotationThreshold)) {
		return events
	}
	left := root.NotAfter.Sub(now)
	renewed, err := RenewRoot(root, current.signer, m.cfg.SelfSigned.TTL, now)
	if err != nil {
		m.log.Error("cannot renew the self-signed root", logkey.Error, err.Error())
		return append(events, Event{Kind: EventRotationFailed, Err: err})
	}
	next, err := NewBundle(BundleParams{SigningCert: renewed, SigningKey: current.signer, Source: SourceSelfSigned, Now: now})
	if err == nil && cert == nil {
		// The state files are gone: put both back, as one unit, so that a restart finds a pair.
		err = persistPair(m.cfg.StateDir, current.signer, renewed)
	} else if err == nil {
		err = persistRoot(m.cfg.StateDir, renewed)
	}
	if err != nil {
		m.log.Error("cannot put the renewed self-signed root in place", logkey.Error, err.Error())
		return append(events, Event{Kind: EventRotationFailed, Err: err})
	}
	m.install(next, now)
	m.rotates.WithLabelValues(string(EventRotated)).Inc()
	m.log.Info("self-signed root rotated; the old root stays trusted",
		logkey.OldNotAfter, root.NotAfter, logkey.NotAfter, renewed.NotAfter, logkey.Left, left.Round(time.Second))
	return append(events, Event{Kind: EventRotated})
}

// RootRenewalTime is when only threshold of root's lifetime is left. The lifetime counts from when
// the root was issued, not from its NotBefore, which selfSignRoot backdates: with the backdate
// counted, a root whose TTL is short next to the backdate would be due as soon as it is made, and
// its successor too, at every check.
func RootRenewalTime(root *x509.Certificate, threshold float64) time.Time {
	issued := root.NotBefore.Add(Backdate)
	if !issued.Before(root.NotAfter) {
		issued = root.NotBefore // not backdated by us: its whole validity is its lifetime
	}
	lifetime := root.NotAfter.Sub(issued)
	return root.NotAfter.Add(-time.Duration(threshold * float64(lifetime)))
}
