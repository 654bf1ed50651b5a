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
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// waitLimit only bounds how long a broken test hangs; no test waits on the real clock otherwise.
const waitLimit = 10 * time.Second

// t0 is when every test's fake clock starts: whole seconds, because certificates carry no more.
var t0 = time.Date(2031, 3, 14, 9, 26, 0, 0, time.UTC)

var testID = pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "cart"}

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
}

func newFakeSigner(t *testing.T, clk *testutil.FakeClock) *fakeSigner {
	t.Helper()
	f := &fakeSigner{clock: clk}
	f.rotateCA(t)
	return f
}

// rotateCA makes the signer issue from a new root and intermediate from now on.
func (f *fakeSigner) rotateCA(t *testing.T) {
	t.Helper()
	root := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "test root " + rand.Text()[:6]})
	inter := root.NewIntermediate(t, testutil.CAOptions{CommonName: "test intermediate"})
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

// env is one test's world: a fake clock, a fake CA, a metrics registry and a log buffer.
type env struct {
	t      *testing.T
	clock  *testutil.FakeClock
	signer *fakeSigner
	reg    *prometheus.Registry
	logs   *testutil.SyncBuffer
	cfg    Config
}

func newEnv(t *testing.T) *env {
	t.Helper()
	clk := testutil.NewFakeClock(t0)
	e := &env{t: t, clock: clk, signer: newFakeSigner(t, clk), reg: prometheus.NewRegistry(), logs: &testutil.SyncBuffer{}}
	// Times are logged to the nanosecond, so that a test can find a retry's exact moment.
	logger := slog.New(slog.NewTextHandler(e.logs, &slog.HandlerOptions{
		Level: slog.LevelDebug,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Value.Kind() == slog.KindTime {
				return slog.String(a.Key, a.Value.Time().Format(time.RFC3339Nano))
			}
			return a
		},
	}))
	e.cfg = Config{
		Signer:     e.signer,
		Identity:   testID,
		TTL:        time.Hour,
		GraceRatio: 0.5,
		// The renewal's jitter sits in the middle unless a test says otherwise.
		GraceRatioJitter: 0.01,
		Rand:             func() float64 { return 0.5 },
		Clock:            clk,
		Logger:           logger,
		Registerer:       e.reg,
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("manager logs:\n%s", e.logs.String())
		}
	})
	return e
}

// run is a Manager under test, running, with its notifications split by name.
type run struct {
	m        *Manager
	workload chan *Secret
	roots    chan *Secret
	cancel   context.CancelFunc
	done     chan error
}

func (e *env) newManager() *Manager {
	e.t.Helper()
	m, err := New(e.cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	return m
}

// start builds a Manager from e.cfg and runs it until the test ends.
func (e *env) start() *run { return e.run(e.newManager()) }

func (e *env) run(m *Manager) *run {
	t := e.t
	t.Helper()
	r := &run{m: m, workload: make(chan *Secret, 64), roots: make(chan *Secret, 64), done: make(chan error, 1)}
	m.Subscribe(func(s *Secret) {
		ch := r.workload
		if s.Name == RootCertName {
			ch = r.roots
		}
		select {
		case ch <- s:
		default:
			t.Errorf("subscriber channel for %s full", s.Name)
		}
	})
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

// next returns the next workload secret the manager announces.
func (r *run) next(t *testing.T) *Secret {
	t.Helper()
	return recv(t, r.workload, "a new workload certificate")
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

// idle waits until the renewal loop waits on its timer (the renewal or the retry).
func (e *env) idle() {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(e.t.Context(), waitLimit)
	defer cancel()
	if err := e.clock.WaitForTimers(ctx, 1); err != nil {
		e.t.Fatalf("the renewal loop never went back to waiting (Sign called %d times): %v", e.signer.Calls(), err)
	}
}

// set moves the clock to at and, if that fired the loop's timer, waits until the loop waits
// again; it reports whether the timer fired. A fired timer leads to a Sign call before the loop
// arms its next timer, so the timer fired if none is pending or Sign was called since (read in
// that order).
func (e *env) set(at time.Time) (fired bool) {
	e.t.Helper()
	calls := e.signer.Calls()
	e.clock.Set(at)
	if e.clock.PendingTimers() == 0 || e.signer.Calls() != calls {
		e.idle()
		return true
	}
	return false
}

// failures reads meshid_agent_cert_renewal_failures_total from the registry.
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

var retryAtRE = regexp.MustCompile(`retry_at=(\S+)`)

// retryTimes returns the retry_at of every logged renewal failure, in order.
func (e *env) retryTimes() []time.Time {
	e.t.Helper()
	var out []time.Time
	for line := range strings.Lines(e.logs.String()) {
		if !strings.Contains(line, "renewal failed") {
			continue
		}
		m := retryAtRE.FindStringSubmatch(line)
		if m == nil {
			e.t.Fatalf("a renewal failure logged without retry_at: %s", line)
		}
		at, err := time.Parse(time.RFC3339Nano, m[1])
		if err != nil {
			e.t.Fatalf("retry_at in %q: %v", line, err)
		}
		out = append(out, at)
	}
	return out
}

func cancelledCtx() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
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

var errCADown = errors.New("CA unreachable at 127.0.0.1:15012: connection refused")

// diskSerial returns the serial of the leaf in dir's cert-chain.pem, or "" if there is none; it
// is safe to call off the test's goroutine.
func diskSerial(dir string) string {
	data, err := os.ReadFile(filepath.Join(dir, CertChainFile))
	if err != nil {
		return ""
	}
	chain, err := pki.ParseCertificates(data)
	if err != nil {
		return ""
	}
	return chain[0].SerialNumber.Text(16)
}
