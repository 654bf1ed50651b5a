// Package secretmanager holds the workload's secrets at every moment and tells subscribers (the
// SDS server) of every change. The workload key pair ("default") and trust bundle ("ROOTCA") come
// from one WorkloadSource: a CA that issues the key pair and renews it proactively (Rotation), or
// mounted files that are re-read when they change (MountedFiles). Istio's file resources
// ("file-cert:", "file-root:") are read from the allowed directories and watched. Every new
// workload key pair and trust bundle can be written to OUTPUT_CERTS.
package secretmanager

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/logkey"
)

// Config configures a Manager.
type Config struct {
	// Workload is where "default" and "ROOTCA" come from: a *Rotation or a *MountedFiles.
	Workload WorkloadSource
	// FileResourceDirs are the directories "file-cert:" and "file-root:" resources may read.
	FileResourceDirs []string
	// Output, when its Dir is set, receives every new key pair and trust bundle (OUTPUT_CERTS).
	Output Output
	// FileWatch, when set, is the inotify instance shared with other managers (a node agent runs
	// one manager per identity, and the kernel allows few); it must run while the manager does.
	// Nil: the manager's own, made once a file is watched.
	FileWatch *filewatch.Hub

	Clock clock.Clock
	// ReadClock paces the wait for each file read (fsutil.DefaultReadBound: a file system that
	// does not answer in time is reported so); nil: the real clock. It is not Clock, which tests
	// drive through rotations and expiries: that must not end a read that is merely slow.
	ReadClock  clock.Clock
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
	// OnEvent, when set, is told of renewals, failures and writes as they happen (tests wait on it).
	OnEvent func(Event)
}

// WorkloadSource is where the workload key pair and the trust bundle come from. Its two
// implementations are Rotation (a CA) and MountedFiles.
type WorkloadSource interface {
	// start checks the source's settings and returns what keeps "default" and "ROOTCA" current
	// until ctx ends.
	start(env *sourceEnv) (run func(ctx context.Context) error, err error)
}

// sourceEnv is what a workload source works with: the manager's clock, logs and metrics, the file
// loader, and where it publishes.
type sourceEnv struct {
	clock   clock.Clock
	log     *slog.Logger
	metrics *metrics
	event   func(Event)
	files   *fileLoader
	// set publishes a new secret; fail records why a newer one could not be had (the last good
	// one keeps serving while it is valid).
	set  func(*Secret)
	fail func(name string, err error)
	// outputDir is OUTPUT_CERTS, where an earlier run may have left a valid key pair.
	outputDir string
}

// EventKind names what happened.
type EventKind string

// What the manager reports through Config.OnEvent.
const (
	EventIssued        EventKind = "issued"         // a key pair from the CA is in service
	EventRenewalFailed EventKind = "renewal-failed" // the CA did not give one; RetryAt says when next
	EventOutputWritten EventKind = "output-written" // OUTPUT_CERTS holds the secrets in service
	EventOutputFailed  EventKind = "output-failed"  // OUTPUT_CERTS could not be written; RetryAt
	EventChanged       EventKind = "changed"        // Name's state changed (a new secret, or none valid)
)

// Event is one thing that happened.
type Event struct {
	Kind    EventKind
	Name    string
	Version string
	RetryAt time.Time
	Err     error
}

// Manager is the caching, self-renewing holder of the workload's secrets.
type Manager struct {
	clock    clock.Clock
	log      *slog.Logger
	metrics  *metrics
	onEvent  func(Event)
	dirs     []string
	files    *fileLoader
	workload func(ctx context.Context) error
	output   *outputWriter // nil without OUTPUT_CERTS

	// publishMu orders publications, so that every subscriber sees a name's states in the order
	// they happened. Subscribers are called with it held; readers (Ready, Snapshot) never take it.
	publishMu sync.Mutex
	// workloadServed: a valid workload certificate has been held since start (under publishMu).
	workloadServed bool

	mu      sync.Mutex // guards slots; held for no I/O and no callback
	slots   map[string]*slot
	nextSub int
}

// slot is the state of one name: the last good secret and the last failure to get a newer one.
type slot struct {
	secret    *Secret
	failure   error
	subs      map[int]func(*Secret, error)
	delivered string // what subscribers were last told, to tell only changes
	valid     bool   // as last delivered
}

// state is what a subscriber is told: the secret to serve, or why there is none (both nil while
// nothing is known yet).
func (s *slot) state(now time.Time) (*Secret, error) {
	switch {
	case s.secret != nil && s.secret.validAt(now):
		return s.secret, nil
	case s.secret != nil && s.failure != nil:
		return nil, fmt.Errorf("%w at %s; the last attempt to replace it failed: %w", ErrExpired, s.secret.NotAfter().UTC().Format(time.RFC3339), s.failure)
	case s.secret != nil:
		return nil, fmt.Errorf("%w at %s", ErrExpired, s.secret.NotAfter().UTC().Format(time.RFC3339))
	default:
		return nil, s.failure
	}
}

func stateKey(s *Secret, err error) string {
	switch {
	case s != nil:
		return "secret " + s.Version
	case err != nil:
		return "error " + err.Error()
	default:
		return ""
	}
}

// New returns a Manager; call Run to obtain and renew the secrets.
func New(cfg Config) (*Manager, error) {
	if cfg.Workload == nil {
		return nil, errors.New("secret manager needs a workload source")
	}
	m := &Manager{
		clock:   clock.OrReal(cfg.Clock),
		log:     cfg.Logger,
		metrics: newMetrics(),
		onEvent: cfg.OnEvent,
		dirs:    cfg.FileResourceDirs,
		slots:   map[string]*slot{},
	}
	if m.log == nil {
		m.log = slog.New(slog.DiscardHandler)
	}
	if m.onEvent == nil {
		m.onEvent = func(Event) {}
	}
	var err error
	if m.files, err = newFileLoader(m.clock, clock.OrReal(cfg.ReadClock), cfg.FileWatch, m.log, m.metrics); err != nil {
		return nil, err
	}
	env := &sourceEnv{
		clock:   m.clock,
		log:     m.log,
		metrics: m.metrics,
		event:   m.onEvent,
		files:   m.files,
		set:     m.set,
		fail:    m.fail,
	}
	// What an earlier run left in OUTPUT_CERTS is read only from a directory found ours alone.
	if cfg.Output.Claim == nil || cfg.Output.Claim.held() {
		env.outputDir = cfg.Output.Dir
	}
	if m.workload, err = cfg.Workload.start(env); err != nil {
		return nil, err
	}
	if cfg.Output.Dir != "" {
		if m.output, err = newOutputWriter(cfg.Output, m.clock, m.log, m.metrics, m.onEvent); err != nil {
			return nil, err
		}
		// The writer follows the secrets like any subscriber; it never blocks the publisher.
		for _, name := range []string{WorkloadCertName, RootCertName} {
			if _, err := m.Subscribe(name, func(s *Secret, _ error) { m.output.offer(s) }); err != nil {
				return nil, err
			}
		}
	}
	if cfg.Registerer != nil {
		if err := m.metrics.register(cfg.Registerer); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Subscribe calls fn with the named secret's state now, if it is known, and at every change after,
// until cancel is called: the secret to serve (valid now), or nil and why there is none. fn is
// called before Subscribe returns and then from the manager's goroutines, one call at a time, in
// order; it must not block or call the manager. Names: "default", "ROOTCA",
// "file-cert:<cert-chain>~<key>" and "file-root:<roots>" (paths inside FileResourceDirs). An
// unknown name is refused with ErrUnknownSecret, a file outside the allowed directories with
// ErrForbiddenPath, a file resource past MaxFileSecrets with ErrTooManyFiles. A file resource is
// read and watched while someone subscribes to it, and forgotten when the last one cancels.
func (m *Manager) Subscribe(name string, fn func(*Secret, error)) (cancel func(), err error) {
	file := name != WorkloadCertName && name != RootCertName
	var r *fileResource
	if file {
		// Outside the locks: it looks at the file system.
		if r, err = parseFileResource(name, m.dirs); err != nil {
			return nil, err
		}
	}
	m.publishMu.Lock()
	defer m.publishMu.Unlock()
	m.mu.Lock()
	sl := m.slots[name]
	if sl == nil && file {
		// The first subscriber: the loader reads it from now on. Registered under m.mu, as it is
		// forgotten, so that a file secret has a slot exactly while the loader holds it.
		sl = newSlot()
		r.deliver = m.deliverTo(name, sl)
		if n, ok := m.files.addBounded(r, MaxFileSecrets); !ok {
			m.mu.Unlock()
			return nil, fmt.Errorf("%w: %d are served already", ErrTooManyFiles, n)
		}
		m.slots[name] = sl
	}
	sl = m.slotLocked(name)
	id := m.nextSub
	m.nextSub++
	sl.subs[id] = fn
	s, stateErr := sl.state(m.clock.Now())
	m.mu.Unlock()
	if s != nil || stateErr != nil {
		fn(s, stateErr)
	}
	return sync.OnceFunc(func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		delete(sl.subs, id)
		if file && len(sl.subs) == 0 && m.slots[name] == sl {
			// Nobody asks for it any more: not read, watched, listed or counted from now on.
			delete(m.slots, name)
			m.files.remove(name)
		}
	}), nil
}

func newSlot() *slot { return &slot{subs: map[int]func(*Secret, error){}} }

func (m *Manager) slotLocked(name string) *slot {
	sl := m.slots[name]
	if sl == nil {
		sl = newSlot()
		m.slots[name] = sl
	}
	return sl
}

// deliverTo publishes the reads of a file resource to its slot sl, not to whatever slot the name
// has by then: a read that ends after the resource was forgotten brings nothing back.
func (m *Manager) deliverTo(name string, sl *slot) func(*Secret, error) {
	return func(s *Secret, err error) {
		if err != nil {
			m.publish(name, sl, func(sl *slot) { sl.failure = err })
			return
		}
		m.publish(name, sl, func(sl *slot) { sl.secret, sl.failure = s, nil })
	}
}

// set publishes a new secret under its name.
func (m *Manager) set(s *Secret) {
	m.update(s.Name, func(sl *slot) {
		sl.secret, sl.failure = s, nil
	})
}

// fail records why a newer secret could not be had; the last good one keeps serving while it is
// valid. It also tells subscribers when the one held has expired meanwhile.
func (m *Manager) fail(name string, err error) {
	m.update(name, func(sl *slot) { sl.failure = err })
}

func (m *Manager) update(name string, change func(*slot)) { m.publish(name, nil, change) }

// publish applies change to sl (nil: the slot of name, made if missing) and tells its subscribers
// if what they would be told changed. A slot no longer the name's, forgotten, is left alone.
func (m *Manager) publish(name string, sl *slot, change func(*slot)) {
	m.publishMu.Lock()
	defer m.publishMu.Unlock()
	now := m.clock.Now()
	m.mu.Lock()
	switch {
	case sl == nil:
		sl = m.slotLocked(name)
	case m.slots[name] != sl:
		m.mu.Unlock()
		return
	}
	change(sl)
	s, err := sl.state(now)
	key := stateKey(s, err)
	changed := key != sl.delivered
	wasValid := sl.valid
	sl.delivered, sl.valid = key, s != nil
	subs := slices.Collect(maps.Values(sl.subs))
	m.mu.Unlock()
	if !changed {
		return
	}
	if name == WorkloadCertName {
		m.workloadStateChanged(wasValid, s, err)
	}
	m.onEvent(Event{Kind: EventChanged, Name: name, Version: versionOf(s), Err: err})
	for _, fn := range subs {
		fn(s, err)
	}
}

// workloadStateChanged says, once per change, whether a valid workload certificate is held.
func (m *Manager) workloadStateChanged(wasValid bool, s *Secret, err error) {
	if s == nil {
		m.metrics.valid.Set(0)
		m.log.Error("no valid workload certificate: Envoy gets none until one is obtained", logkey.Reason, err.Error())
		return
	}
	m.metrics.valid.Set(1)
	m.metrics.expiry.Set(float64(s.NotAfter().Unix()))
	if !s.RenewAt.IsZero() {
		m.metrics.nextRenewal.Set(float64(s.RenewAt.Unix()))
	}
	attrs := []any{logkey.Serial, s.KeyPair.Leaf().SerialNumber.Text(16), logkey.Source, string(s.Source), logkey.NotAfter, s.NotAfter()}
	if len(s.KeyPair.Leaf().URIs) == 1 {
		attrs = append(attrs, logkey.Identity, s.KeyPair.Leaf().URIs[0].String())
	}
	if !s.RenewAt.IsZero() {
		attrs = append(attrs, logkey.RenewAt, s.RenewAt)
	}
	if !wasValid {
		reason := "the first since start"
		if m.workloadServed {
			reason = "a valid certificate is held again"
		}
		attrs = append(attrs, logkey.Reason, reason)
	}
	m.workloadServed = true
	m.log.Info("workload certificate in service", attrs...)
}

func versionOf(s *Secret) string {
	if s == nil {
		return ""
	}
	return s.Version
}

// Run keeps the secrets current until ctx ends: the workload source, the file resources and
// OUTPUT_CERTS. When ctx ends it returns at once, leaving OUTPUT_CERTS as it is.
func (m *Manager) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return m.files.run(ctx) })
	g.Go(func() error { return m.workload(ctx) })
	if m.output != nil {
		g.Go(func() error { return m.output.run(ctx) })
	}
	return g.Wait()
}

// Ready reports whether the workload is served: a valid workload certificate is held and, with
// OUTPUT_CERTS, written there. When it is not, it says why.
func (m *Manager) Ready() (bool, string) {
	m.mu.Lock()
	var (
		s   *Secret
		err error
	)
	if sl := m.slots[WorkloadCertName]; sl != nil {
		s, err = sl.state(m.clock.Now())
	}
	m.mu.Unlock()
	switch {
	case s == nil && err != nil:
		return false, "no valid workload certificate: " + err.Error()
	case s == nil:
		return false, "no workload certificate yet"
	}
	if m.output != nil {
		if ok, why := m.output.ready(); !ok {
			return false, why
		}
	}
	return true, ""
}

// TLSCertificate returns the workload key pair held now, if it is valid, for the agent to present
// to the CA (mTLS renewal goes on after a provisioned token expires); nil when there is none.
func (m *Manager) TLSCertificate() *tls.Certificate {
	m.mu.Lock()
	defer m.mu.Unlock()
	sl := m.slots[WorkloadCertName]
	if sl == nil {
		return nil
	}
	s, _ := sl.state(m.clock.Now())
	if s == nil || s.KeyPair == nil {
		return nil
	}
	return s.KeyPair.TLSCertificate()
}

// Status is one secret as /debug/secrets shows it.
type Status struct {
	Name string
	// Secret is the last good secret (possibly expired); nil if none was ever had.
	Secret *Secret
	// Valid says whether it is served now; Error why not, or why the last attempt to replace it
	// failed.
	Valid bool
	Error string
}

// Snapshot returns the state of every secret, sorted by name.
func (m *Manager) Snapshot() []Status {
	now := m.clock.Now()
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]Status, 0, len(m.slots))
	for _, name := range slices.Sorted(maps.Keys(m.slots)) {
		sl := m.slots[name]
		s, err := sl.state(now)
		st := Status{Name: name, Secret: sl.secret, Valid: s != nil}
		if err == nil {
			err = sl.failure
		}
		if err != nil {
			st.Error = err.Error()
		}
		out = append(out, st)
	}
	return out
}
