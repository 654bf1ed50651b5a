package secretmanager

import (
	"context"
	"crypto"
	"crypto/rand"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// waitLimit only bounds how long a broken test hangs; no test waits on the real clock otherwise.
const waitLimit = 10 * time.Second

// t0 is when every test's fake clock starts: whole seconds, because certificates carry no more.
var t0 = time.Date(2031, 3, 14, 9, 26, 0, 0, time.UTC)

var testID = pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "cart"}

var errCADown = errors.New("CA unreachable at 127.0.0.1:15012: connection refused")

// fakeSigner is the CA: it signs CSRs with a test intermediate, from the fake clock's now
// (NotBefore backdated by two minutes, as the real CA does) for the TTL asked.
type fakeSigner struct {
	clock *testutil.FakeClock

	mu      sync.Mutex
	root    *testutil.CA
	inter   *testutil.CA
	err     error                                                  // returned by every call while set
	block   chan struct{}                                          // every call waits for it to close while set
	entered chan struct{}                                          // told of each call that blocks
	respond func([]*x509.Certificate) ([]*x509.Certificate, error) // rewrites the answer while set
	calls   int
	ttls    []time.Duration
	// connects holds, for each Connect, how many Sign calls came before it.
	connects []int
}

func newFakeSigner(t testing.TB, clk *testutil.FakeClock) *fakeSigner {
	t.Helper()
	f := &fakeSigner{clock: clk}
	f.rotateCA(t)
	return f
}

// rotateCA makes the signer issue from a new root and intermediate from now on.
func (f *fakeSigner) rotateCA(t testing.TB) {
	t.Helper()
	// Valid around t0, the fake clock's start, for as long as any test runs it.
	notBefore, notAfter := t0.AddDate(-1, 0, 0), t0.AddDate(10, 0, 0)
	root := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "test root " + rand.Text()[:6], NotBefore: notBefore, NotAfter: notAfter})
	inter := root.NewIntermediate(t, testutil.CAOptions{CommonName: "test intermediate", NotBefore: notBefore, NotAfter: notAfter})
	f.mu.Lock()
	f.root, f.inter = root, inter
	f.mu.Unlock()
}

// useCA makes the signer issue from other's root and intermediate, as a restarted CA does.
func (f *fakeSigner) useCA(other *fakeSigner) {
	other.mu.Lock()
	root, inter := other.root, other.inter
	other.mu.Unlock()
	f.mu.Lock()
	f.root, f.inter = root, inter
	f.mu.Unlock()
}

func (f *fakeSigner) rootCert() *x509.Certificate {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.root.Cert
}

func (f *fakeSigner) setErr(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.err = err
}

func (f *fakeSigner) setRespond(fn func([]*x509.Certificate) ([]*x509.Certificate, error)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.respond = fn
}

// blockCalls makes every call wait until release; entered receives once per call that waits.
func (f *fakeSigner) blockCalls() (entered <-chan struct{}, release func()) {
	f.mu.Lock()
	defer f.mu.Unlock()
	block, in := make(chan struct{}), make(chan struct{}, 16)
	f.block, f.entered = block, in
	return in, sync.OnceFunc(func() {
		f.mu.Lock()
		f.block = nil
		f.mu.Unlock()
		close(block)
	})
}

func (f *fakeSigner) Calls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

// Connect records that the rotator asked for the connection ahead of Sign, as caclient allows.
func (f *fakeSigner) Connect() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.connects = append(f.connects, f.calls)
}

// Connects returns, for each Connect, how many Sign calls came before it.
func (f *fakeSigner) Connects() []int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.connects)
}

func (f *fakeSigner) TTLs() []time.Duration {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]time.Duration(nil), f.ttls...)
}

func (f *fakeSigner) Sign(ctx context.Context, csrDER []byte, ttl time.Duration) ([]*x509.Certificate, error) {
	f.mu.Lock()
	f.calls++
	f.ttls = append(f.ttls, ttl)
	fail, block, entered, respond, root, inter := f.err, f.block, f.entered, f.respond, f.root, f.inter
	f.mu.Unlock()
	if block != nil {
		entered <- struct{}{}
		select {
		case <-block:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if fail != nil {
		return nil, fail
	}
	csr, err := x509.ParseCertificateRequest(csrDER)
	if err != nil {
		return nil, err
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, err
	}
	now := f.clock.Now()
	der, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber:          serial,
		URIs:                  csr.URIs,
		NotBefore:             now.Add(-2 * time.Minute),
		NotAfter:              now.Add(ttl),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
	}, inter.Cert, csr.PublicKey, inter.Key)
	if err != nil {
		return nil, err
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	chain := []*x509.Certificate{leaf, inter.Cert, root.Cert}
	if respond != nil {
		return respond(chain)
	}
	return chain, nil
}

// awaitClock waits until cond holds, looking again whenever a timer on c is armed, fires or is
// stopped, or c moves; it fails the test after waitLimit.
func awaitClock(t *testing.T, c *testutil.FakeClock, what string, cond func() bool) {
	t.Helper()
	giveUp := time.NewTimer(waitLimit)
	defer giveUp.Stop()
	for {
		changed := c.Changed()
		if cond() {
			return
		}
		select {
		case <-changed:
		case <-giveUp.C:
			t.Fatalf("gave up waiting until %s (fake clock at %s)", what, c.Now())
		}
	}
}

// waitArmed waits until a timer due exactly at at is pending on c: the code under test waits for
// that moment.
func waitArmed(t *testing.T, c *testutil.FakeClock, at time.Time) {
	t.Helper()
	awaitClock(t, c, "a timer is armed for "+at.String(), func() bool { return slices.ContainsFunc(c.Deadlines(), at.Equal) })
}

// debouncing reports whether a timer due within the file watcher's debounce is pending on c.
func debouncing(c *testutil.FakeClock) bool {
	deadlines := c.Deadlines()
	return len(deadlines) > 0 && !deadlines[0].After(c.Now().Add(filewatch.DefaultDebounce))
}

// drive fires the file watcher's debounce timers as they are armed until recv yields a value,
// which it returns. Only timers due within one debounce are fired: renewals, retries and
// expiries stay where they are.
func drive[T any](t *testing.T, c *testutil.FakeClock, recv <-chan T) T {
	t.Helper()
	giveUp := time.NewTimer(waitLimit)
	defer giveUp.Stop()
	for {
		changed := c.Changed()
		if debouncing(c) {
			c.Advance(filewatch.DefaultDebounce)
			continue
		}
		select {
		case v := <-recv:
			return v
		case <-changed:
		case <-giveUp.C:
			t.Fatalf("drove the fake clock to %s without the awaited value", c.Now())
		}
	}
}

// until waits until cond holds, looking again whenever a timer is armed or stopped or an event
// is reported (the file loader re-arms its expiry timer after each look at the files). With
// debounce, it also fires the file watcher's debounce timers as they are armed.
func (e *env) until(what string, cond func() bool, debounce bool) {
	e.t.Helper()
	giveUp := time.NewTimer(waitLimit)
	defer giveUp.Stop()
	for {
		clockChanged := e.clock.Changed()
		e.events.mu.Lock()
		eventsChanged := e.events.changed
		e.events.mu.Unlock()
		if cond() {
			return
		}
		if debounce && debouncing(e.clock) {
			e.clock.Advance(filewatch.DefaultDebounce)
			continue
		}
		select {
		case <-clockChanged:
		case <-eventsChanged:
		case <-giveUp.C:
			e.t.Fatalf("gave up waiting until %s (fake clock at %s)", what, e.clock.Now())
		}
	}
}

// reread fires the file watcher's debounce timers as the files' change arms them until the file
// loader's look at the files shows in cond (for a look that changes nothing subscribers see).
// Every debounce fired makes the loader look again, after which it re-arms its expiry timer.
func (e *env) reread(what string, cond func() bool) {
	e.t.Helper()
	e.until(what, cond, true)
}

// eventLog records what the manager reports through Config.OnEvent.
type eventLog struct {
	mu      sync.Mutex
	events  []Event
	changed chan struct{}
}

func newEventLog() *eventLog { return &eventLog{changed: make(chan struct{})} }

func (l *eventLog) record(ev Event) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events = append(l.events, ev)
	close(l.changed)
	l.changed = make(chan struct{})
}

// mark is the index the next event will have.
func (l *eventLog) mark() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.events)
}

// since returns the events from index from on that match.
func (l *eventLog) since(from int, match func(Event) bool) []Event {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []Event
	for _, ev := range l.events[from:] {
		if match(ev) {
			out = append(out, ev)
		}
	}
	return out
}

// wait returns the first event from index from on that matches, and the index after it.
func (l *eventLog) wait(t *testing.T, from int, what string, match func(Event) bool) (Event, int) {
	t.Helper()
	giveUp := time.NewTimer(waitLimit)
	defer giveUp.Stop()
	for {
		l.mu.Lock()
		for i := from; i < len(l.events); i++ {
			if match(l.events[i]) {
				ev := l.events[i]
				l.mu.Unlock()
				return ev, i + 1
			}
		}
		changed := l.changed
		l.mu.Unlock()
		select {
		case <-changed:
		case <-giveUp.C:
			t.Fatalf("gave up waiting for %s", what)
		}
	}
}

func kind(kinds ...EventKind) func(Event) bool {
	return func(ev Event) bool { return slices.Contains(kinds, ev.Kind) }
}

func changedName(name string) func(Event) bool {
	return func(ev Event) bool { return ev.Kind == EventChanged && ev.Name == name }
}

// logRecord is one record the manager logged, its attributes as strings.
type logRecord struct {
	level slog.Level
	msg   string
	attrs map[string]string
}

// logRecorder keeps every record, for tests that check what is logged (never to wait on).
type logRecorder struct {
	mu      sync.Mutex
	records []logRecord
	text    *testutil.SyncBuffer
	handler slog.Handler
}

func newLogRecorder() *logRecorder {
	buf := &testutil.SyncBuffer{}
	return &logRecorder{text: buf, handler: slog.NewTextHandler(buf, &slog.HandlerOptions{Level: slog.LevelDebug})}
}

func (r *logRecorder) logger() *slog.Logger { return slog.New(recordingHandler{r: r, h: r.handler}) }

func (r *logRecorder) matching(match func(logRecord) bool) []logRecord {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []logRecord
	for _, rec := range r.records {
		if match(rec) {
			out = append(out, rec)
		}
	}
	return out
}

type recordingHandler struct {
	r     *logRecorder
	h     slog.Handler
	attrs []slog.Attr
}

func (h recordingHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h recordingHandler) Handle(ctx context.Context, rec slog.Record) error {
	lr := logRecord{level: rec.Level, msg: rec.Message, attrs: map[string]string{}}
	for _, a := range h.attrs {
		lr.attrs[a.Key] = a.Value.String()
	}
	rec.Attrs(func(a slog.Attr) bool {
		lr.attrs[a.Key] = a.Value.String()
		return true
	})
	h.r.mu.Lock()
	h.r.records = append(h.r.records, lr)
	h.r.mu.Unlock()
	return h.h.Handle(ctx, rec)
}

func (h recordingHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return recordingHandler{r: h.r, h: h.h.WithAttrs(as), attrs: append(slices.Clone(h.attrs), as...)}
}

func (h recordingHandler) WithGroup(name string) slog.Handler {
	return recordingHandler{r: h.r, h: h.h.WithGroup(name), attrs: h.attrs}
}

// env is one test's world: a fake clock, a fake CA, a metrics registry, the events and the logs.
type env struct {
	t      *testing.T
	clock  *testutil.FakeClock
	signer *fakeSigner
	reg    *prometheus.Registry
	logs   *logRecorder
	events *eventLog
	// rot is the CA rotation of CA mode (cfg.Workload); tests adjust it before the manager is built.
	rot *Rotation
	cfg Config
}

func newEnv(t *testing.T) *env {
	t.Helper()
	clk := testutil.NewFakeClock(t0)
	e := &env{t: t, clock: clk, signer: newFakeSigner(t, clk), reg: prometheus.NewRegistry(), logs: newLogRecorder(), events: newEventLog()}
	e.rot = &Rotation{
		Signer:     e.signer,
		Identity:   testID,
		TTL:        time.Hour,
		GraceRatio: 0.5,
		// The renewal's jitter sits in the middle unless a test says otherwise.
		GraceRatioJitter: 0.01,
		Rand:             func() float64 { return 0.5 },
	}
	e.cfg = Config{
		Workload:   e.rot,
		Clock:      clk,
		Logger:     e.logs.logger(),
		Registerer: e.reg,
		OnEvent:    e.events.record,
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("manager logs:\n%s", e.logs.text.String())
		}
	})
	return e
}

// succeeds makes e a restart of earlier: its CA issues from the same root, which e's rotation
// trusts through a root file, as an agent's CA_ROOT_CA does.
func (e *env) succeeds(t *testing.T, earlier *env) {
	t.Helper()
	e.signer.useCA(earlier.signer)
	e.trustSignerRoot(t)
}

// trustSignerRoot points the rotation's root file at the signer's current root.
func (e *env) trustSignerRoot(t *testing.T) {
	t.Helper()
	e.rot.RootCertFile = filepath.Join(t.TempDir(), RootCertFile)
	writeFileAtomic(t, e.rot.RootCertFile, testutil.CertPEM(e.signer.rootCert()))
}

func (e *env) newManager() *Manager {
	e.t.Helper()
	m, err := New(e.cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	return m
}

// update is one call of a subscriber: the secret to serve, or why there is none.
type update struct {
	s   *Secret
	err error
}

func (u update) String() string {
	if u.s != nil {
		return "secret " + u.s.Version
	}
	return fmt.Sprintf("error %v", u.err)
}

// subscription records what one subscriber was told, in order.
type subscription struct {
	name   string
	ch     chan update
	cancel func()

	mu  sync.Mutex
	log []update
}

// subscribe subscribes to name on m and fails the test if it is refused.
func subscribe(t *testing.T, m *Manager, name string) *subscription {
	t.Helper()
	sub, err := trySubscribe(t, m, name)
	if err != nil {
		t.Fatalf("Subscribe(%s) = %v", name, err)
	}
	return sub
}

func trySubscribe(t *testing.T, m *Manager, name string) (*subscription, error) {
	t.Helper()
	sub := &subscription{name: name, ch: make(chan update, 256)}
	var inside atomic.Int32
	cancel, err := m.Subscribe(name, func(s *Secret, err error) {
		if inside.Add(1) != 1 {
			t.Errorf("%s: a subscriber was called while it was being called", name)
		}
		defer inside.Add(-1)
		if (s == nil) == (err == nil) {
			t.Errorf("%s: a subscriber was told (%v, %v): want exactly one of them", name, s, err)
		}
		if s != nil && s.Name != name {
			t.Errorf("a subscriber of %s was given %s", name, s.Name)
		}
		sub.mu.Lock()
		sub.log = append(sub.log, update{s, err})
		sub.mu.Unlock()
		select {
		case sub.ch <- update{s, err}:
		default:
			t.Errorf("subscriber channel for %s full", name)
		}
	})
	if err != nil {
		return nil, err
	}
	sub.cancel = cancel
	return sub, nil
}

// seen returns every update so far.
func (s *subscription) seen() []update {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.log)
}

// next returns the next update, which must be a secret.
func (s *subscription) next(t *testing.T) *Secret {
	t.Helper()
	u := recv(t, s.ch, "the next "+s.name)
	if u.err != nil {
		t.Fatalf("%s: got error %v, want a secret", s.name, u.err)
	}
	return u.s
}

// nextErr returns the next update, which must be an error.
func (s *subscription) nextErr(t *testing.T) error {
	t.Helper()
	u := recv(t, s.ch, "the next "+s.name)
	if u.err == nil {
		t.Fatalf("%s: got version %s, want an error", s.name, u.s.Version)
	}
	return u.err
}

// none fails if an update is waiting.
func (s *subscription) none(t *testing.T, when string) {
	t.Helper()
	select {
	case u := <-s.ch:
		t.Fatalf("%s: %s was told %s", when, s.name, u)
	default:
	}
}

// run is a Manager under test, running, with subscriptions to "default" and "ROOTCA".
type run struct {
	m        *Manager
	workload *subscription
	roots    *subscription
	cancel   context.CancelFunc
	done     chan error
}

// start builds a Manager from e.cfg and runs it until the test ends.
func (e *env) start() *run { return e.run(e.newManager()) }

func (e *env) run(m *Manager) *run {
	t := e.t
	t.Helper()
	r := &run{m: m, workload: subscribe(t, m, WorkloadCertName), roots: subscribe(t, m, RootCertName), done: make(chan error, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go func() { r.done <- m.Run(ctx) }()
	t.Cleanup(func() { _ = r.stop(t) })
	return r
}

// stop cancels Run and returns what it returned.
func (r *run) stop(t *testing.T) error {
	t.Helper()
	r.cancel()
	select {
	case err := <-r.done:
		r.done <- err // for a second stop
		return err
	case <-time.After(waitLimit):
		t.Fatal("Run did not return after its context was cancelled")
		return nil
	}
}

// next returns the next workload key pair the manager announces.
func (r *run) next(t *testing.T) *Secret {
	t.Helper()
	return r.workload.next(t)
}

func recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(waitLimit):
		t.Fatalf("gave up waiting for %s", what)
		panic("unreachable")
	}
}

// idle waits until the renewal loop waits for at (a renewal or a retry).
func (e *env) idle(at time.Time) {
	e.t.Helper()
	waitArmed(e.t, e.clock, at)
}

// attempt moves the clock to at, which the renewal loop must be waiting for, and returns what
// its attempt reported: EventIssued or EventRenewalFailed.
func (e *env) attempt(at time.Time) Event {
	e.t.Helper()
	e.idle(at)
	mark := e.events.mark()
	e.clock.Set(at)
	ev, _ := e.events.wait(e.t, mark, "a renewal attempt at "+at.String(), kind(EventIssued, EventRenewalFailed))
	return ev
}

// failure waits for the next failed renewal from index from on.
func (e *env) failure(from int) Event {
	e.t.Helper()
	ev, _ := e.events.wait(e.t, from, "a failed renewal", kind(EventRenewalFailed))
	return ev
}

// awaitOutput waits until OUTPUT_CERTS holds the key pair of version.
func (e *env) awaitOutput(version string) {
	e.t.Helper()
	e.events.wait(e.t, 0, "OUTPUT_CERTS written with "+version, func(ev Event) bool {
		return ev.Kind == EventOutputWritten && ev.Version == version
	})
}

// metric reads a counter or gauge from the registry.
func (e *env) metric(name string) float64 {
	e.t.Helper()
	mfs, err := e.reg.Gather()
	if err != nil {
		e.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			m := mf.GetMetric()[0]
			if c := m.GetCounter(); c != nil {
				return c.GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	e.t.Fatalf("metric %s not registered", name)
	return 0
}

func (e *env) failures() int { return int(e.metric("meshid_agent_cert_renewal_failures_total")) }

func (e *env) certValid() float64 { return e.metric("meshid_agent_cert_valid") }

// errorLogs counts the records logged at Error level.
func (e *env) errorLogs() int {
	return len(e.logs.matching(func(r logRecord) bool { return r.level >= slog.LevelError }))
}

// readPair reads key.pem and cert-chain.pem through their visible names and checks they match.
func readPair(t *testing.T, dir string) (leaf *x509.Certificate, key crypto.Signer) {
	t.Helper()
	keyPEM, err := os.ReadFile(filepath.Join(dir, KeyFile))
	if err != nil {
		t.Fatal(err)
	}
	chainPEM, err := os.ReadFile(filepath.Join(dir, CertChainFile))
	if err != nil {
		t.Fatal(err)
	}
	chain, err := pki.ParseCertificates(chainPEM)
	if err != nil {
		t.Fatalf("%s: %v", CertChainFile, err)
	}
	key, err = pki.ParsePrivateKey(keyPEM)
	if err != nil {
		t.Fatalf("%s: %v", KeyFile, err)
	}
	if !pki.KeyMatchesCertificate(key, chain[0]) {
		t.Fatalf("%s does not match the leaf of %s (serial %s)", KeyFile, CertChainFile, chain[0].SerialNumber.Text(16))
	}
	return chain[0], key
}

// readRoots parses root-cert.pem read through its visible name.
func readRoots(t *testing.T, dir string) []*x509.Certificate {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, RootCertFile))
	if err != nil {
		t.Fatal(err)
	}
	roots, err := pki.ParseCertificates(data)
	if err != nil {
		t.Fatalf("%s: %v", RootCertFile, err)
	}
	return roots
}

// generations lists the ..meshid_* directories in dir.
func generations(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), versionPrefix) {
			out = append(out, e.Name())
		}
	}
	return out
}

// writeFileAtomic replaces path by a rename, so that a watcher never reads a half-written file.
func writeFileAtomic(t *testing.T, path string, data []byte) {
	t.Helper()
	tmp := filepath.Join(filepath.Dir(path), ".tmp-"+rand.Text())
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// writeGeneration writes one OUTPUT_CERTS generation with the default modes.
func writeGeneration(dir string, keyPEM, chainPEM, rootsPEM []byte) error {
	m := Output{}.modes()
	return writeOutput(nil, dir, m.dir, outputFiles(m, keyPEM, chainPEM, rootsPEM))
}

func sameCerts(a, b []*x509.Certificate) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !a[i].Equal(b[i]) {
			return false
		}
	}
	return true
}

func names(certs []*x509.Certificate) string {
	var s []string
	for _, c := range certs {
		s = append(s, c.Subject.CommonName)
	}
	return fmt.Sprintf("%q", s)
}

// status returns the Snapshot entry of name.
func status(t *testing.T, m *Manager, name string) Status {
	t.Helper()
	for _, st := range m.Snapshot() {
		if st.Name == name {
			return st
		}
	}
	t.Fatalf("%s not in the Snapshot", name)
	return Status{}
}
