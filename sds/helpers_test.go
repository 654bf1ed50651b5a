package sds_test

import (
	"bytes"
	"context"
	"crypto"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/sds/sdstest"
	"github.com/meshid/meshid/secretmanager"
)

// waitLimit only bounds how long a broken test hangs (a push that never comes fails the test when
// the stream's deadline passes); no test waits on the real clock otherwise.
const waitLimit = sdstest.WaitLimit

const (
	nodeID     = sdstest.NodeID
	dflt       = secretmanager.WorkloadCertName
	rootCA     = secretmanager.RootCertName
	workloadID = "spiffe://cluster.local/ns/shop/sa/cart"
	// fileCert is a file resource name as Envoy sends it; the fake serves it like any other name.
	fileCert = "file-cert:/etc/certs/cert.pem~/etc/certs/key.pem"
	// spare is one more name the fake serves, to subscribe to something new.
	spare = "file-root:/etc/certs/root.pem"
)

// fakeSecrets is the secret manager behind the server, as the one-method sds.Secrets sees it:
// the test publishes secrets (valid or not) and failures, refuses the names it chooses, and reads
// how many subscriptions each name got. Like the real manager, it tells each subscriber the
// current state before Subscribe returns, then every change, one call at a time and in order.
type fakeSecrets struct {
	// publishMu orders the calls to subscribers, as the manager's does: a subscriber's first
	// call and every later one happen one at a time, in the order of the publications.
	publishMu sync.Mutex

	mu      sync.Mutex
	states  map[string]fakeState
	subs    map[string]map[int]func(*secretmanager.Secret, error)
	nextSub int
	calls   map[string]int // Subscribe calls per name, refused ones included
	refuse  map[string]error
	hold    map[string]*heldSubscribe
	changed chan struct{} // closed and replaced whenever a subscription begins or ends
}

// fakeState is what the fake says of a name: a secret, or why there is none.
type fakeState struct {
	secret *secretmanager.Secret
	err    error
}

// heldSubscribe makes one Subscribe wait, once it has told the current state, until released.
type heldSubscribe struct {
	inside  chan struct{}
	release chan struct{}
}

func newFakeSecrets() *fakeSecrets {
	return &fakeSecrets{
		states:  map[string]fakeState{},
		subs:    map[string]map[int]func(*secretmanager.Secret, error){},
		calls:   map[string]int{},
		refuse:  map[string]error{},
		hold:    map[string]*heldSubscribe{},
		changed: make(chan struct{}),
	}
}

var _ sds.Secrets = (*fakeSecrets)(nil)

// Publish makes s the current secret of its name and tells the subscribers at once, as the secret
// manager does after a rotation.
func (f *fakeSecrets) Publish(s *secretmanager.Secret) { f.set(s.Name, fakeState{secret: s}) }

// Fail says that name has no valid secret, and why, as the manager does when a renewal fails and
// the last certificate has expired.
func (f *fakeSecrets) Fail(name string, err error) { f.set(name, fakeState{err: err}) }

func (f *fakeSecrets) set(name string, st fakeState) {
	f.publishMu.Lock()
	defer f.publishMu.Unlock()
	f.mu.Lock()
	f.states[name] = st
	subs := slices.Collect(maps.Values(f.subs[name]))
	f.mu.Unlock()
	for _, fn := range subs {
		fn(st.secret, st.err)
	}
}

// Refuse makes Subscribe refuse name with err (ErrUnknownSecret, ErrForbiddenPath or
// ErrTooManyFiles).
func (f *fakeSecrets) Refuse(name string, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.refuse[name] = err
}

// Hold makes the next Subscribe of name, once it has told the current state, close inside and
// wait for release before it returns. The test ends by releasing it.
func (f *fakeSecrets) Hold(t *testing.T, name string) (inside <-chan struct{}, release func()) {
	t.Helper()
	h := &heldSubscribe{inside: make(chan struct{}), release: make(chan struct{})}
	f.mu.Lock()
	f.hold[name] = h
	f.mu.Unlock()
	release = sync.OnceFunc(func() { close(h.release) })
	t.Cleanup(release)
	return h.inside, release
}

// Subscribe implements sds.Secrets.
func (f *fakeSecrets) Subscribe(name string, fn func(*secretmanager.Secret, error)) (func(), error) {
	f.mu.Lock()
	f.calls[name]++
	refused, held := f.refuse[name], f.hold[name]
	delete(f.hold, name)
	f.mu.Unlock()
	if refused != nil {
		return nil, fmt.Errorf("%w: %q", refused, name)
	}

	f.publishMu.Lock()
	f.mu.Lock()
	id := f.nextSub
	f.nextSub++
	if f.subs[name] == nil {
		f.subs[name] = map[int]func(*secretmanager.Secret, error){}
	}
	f.subs[name][id] = fn
	st, known := f.states[name]
	f.changedLocked()
	f.mu.Unlock()
	if known {
		fn(st.secret, st.err)
	}
	f.publishMu.Unlock()

	if held != nil {
		close(held.inside)
		<-held.release
	}
	return sync.OnceFunc(func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		delete(f.subs[name], id)
		f.changedLocked()
	}), nil
}

func (f *fakeSecrets) changedLocked() {
	close(f.changed)
	f.changed = make(chan struct{})
}

// Calls counts the Subscribe calls of name so far, refused ones included.
func (f *fakeSecrets) Calls(name string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[name]
}

// Active counts the subscriptions of name that are not cancelled.
func (f *fakeSecrets) Active(name string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.subs[name])
}

// awaitActive waits until name has n subscriptions that are not cancelled: from then on, what is
// published reaches the server. It wakes on every subscription and cancellation, and fails the
// test after waitLimit.
func (f *fakeSecrets) awaitActive(t *testing.T, name string, n int) {
	t.Helper()
	limit := time.NewTimer(waitLimit)
	defer limit.Stop()
	for {
		f.mu.Lock()
		got, changed := len(f.subs[name]), f.changed
		f.mu.Unlock()
		if got == n {
			return
		}
		select {
		case <-changed:
		case <-limit.C:
			t.Fatalf("%s has %d subscriptions, want %d", name, got, n)
		}
	}
}

// testPKI makes the secrets: workload key pairs issued by one test root, and trust bundles.
type testPKI struct {
	root *testutil.CA
}

func newPKI(t testing.TB) *testPKI {
	t.Helper()
	return &testPKI{root: testutil.NewRootCA(t, testutil.CAOptions{})}
}

// workload returns a new, valid "default" key pair.
func (p *testPKI) workload(t testing.TB) *secretmanager.Secret {
	t.Helper()
	return p.workloadFor(t, time.Hour)
}

// workloadFor returns a new "default" key pair valid from an hour ago until ttl from now.
func (p *testPKI) workloadFor(t testing.TB, ttl time.Duration) *secretmanager.Secret {
	t.Helper()
	leaf, key := p.root.IssueWorkload(t, workloadID, ttl)
	return keyPair(t, dflt, []*x509.Certificate{leaf, p.root.Cert}, key)
}

// roots returns a new trust bundle of one fresh root, named name.
func (p *testPKI) roots(t testing.TB, name string) *secretmanager.Secret {
	t.Helper()
	cert := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "root " + name}).Cert
	return &secretmanager.Secret{
		Name:    name,
		Bundle:  &secretmanager.TrustBundle{Roots: []*x509.Certificate{cert}, PEM: testutil.CertPEM(cert)},
		Version: cert.SerialNumber.Text(16),
		Source:  secretmanager.SourceCA,
	}
}

// keyPair builds a key-pair secret as the secret manager does; Version is the leaf's serial.
// A nil key or an empty chain makes an invalid one, for the tests that the server never sends it.
func keyPair(t testing.TB, name string, chain []*x509.Certificate, key crypto.Signer) *secretmanager.Secret {
	t.Helper()
	kp := &secretmanager.KeyPair{Chain: chain, ChainPEM: testutil.CertPEM(chain...), Key: key}
	if key != nil {
		kp.KeyPEM = testutil.KeyPEM(t, key)
	}
	s := &secretmanager.Secret{Name: name, KeyPair: kp, Source: secretmanager.SourceCA, Received: time.Now()}
	if len(chain) > 0 {
		s.Version = chain[0].SerialNumber.Text(16)
	}
	return s
}

// harness is a running SDS server on a Unix socket in a short temp dir, and an Envoy connected to
// it.
type harness struct {
	socket string
	server *sds.Server
	reg    *prometheus.Registry
	logs   *testutil.SyncBuffer
	envoy  *sdstest.Envoy
	cancel context.CancelFunc // ends Run's context
	done   chan error         // Run's result
}

func startServer(t *testing.T, secrets sds.Secrets, adjust ...func(*sds.Config)) *harness {
	t.Helper()
	h := newHarness(t, secrets, adjust...)
	h.start(t)
	return h
}

// newHarness makes the server of a harness, which start runs.
func newHarness(t *testing.T, secrets sds.Secrets, adjust ...func(*sds.Config)) *harness {
	t.Helper()
	h := &harness{
		socket: filepath.Join(testutil.ShortTempDir(t), "sds", sds.SocketName),
		reg:    prometheus.NewRegistry(),
		logs:   &testutil.SyncBuffer{},
		done:   make(chan error, 1),
	}
	cfg := sds.Config{
		SocketPath: h.socket,
		Secrets:    secrets,
		Logger:     slog.New(slog.NewTextHandler(h.logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		Registerer: h.reg,
	}
	for _, fn := range adjust {
		fn(&cfg)
	}
	var err error
	if h.server, err = sds.New(cfg); err != nil {
		t.Fatal(err)
	}
	return h
}

// start runs the harness's server and connects its Envoy.
func (h *harness) start(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	go func() { h.done <- h.server.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := h.wait(); err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	h.envoy = sdstest.Dial(t, h.socket)
}

// wait returns Run's result, failing after waitLimit.
func (h *harness) wait() error {
	limit := time.NewTimer(waitLimit)
	defer limit.Stop()
	select {
	case err := <-h.done:
		h.done <- err // for the next caller
		return err
	case <-limit.C:
		return errors.New("Run did not return")
	}
}

// stop ends Run's context and waits for Run to return.
func (h *harness) stop(t *testing.T) {
	t.Helper()
	h.cancel()
	if err := h.wait(); err != nil {
		t.Fatalf("Run: %v", err)
	}
}

func (h *harness) sotw() *sdstest.Stream       { return h.envoy.StreamSecrets() }
func (h *harness) delta() *sdstest.DeltaStream { return h.envoy.DeltaSecrets() }

// counter reads a counter (or gauge) of the server's registry: its value for each label set, keyed
// by the label values joined with "/"; an unlabelled metric is keyed "".
func (h *harness) counter(t *testing.T, name string) map[string]float64 {
	t.Helper()
	families, err := h.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetValue())
			}
			v := m.GetCounter().GetValue()
			if m.GetGauge() != nil {
				v = m.GetGauge().GetValue()
			}
			out[strings.Join(labels, "/")] = v
		}
	}
	return out
}

// nacks reads meshid_sds_nacks_total.
func (h *harness) nacks(t *testing.T) float64 {
	t.Helper()
	return h.counter(t, "meshid_sds_nacks_total")[""]
}

// refusals reads meshid_sds_refusals_total, keyed "reason/code" (the registry sorts labels by
// name, code first).
func (h *harness) refusals(t *testing.T) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for key, v := range h.counter(t, "meshid_sds_refusals_total") {
		code, reason, _ := strings.Cut(key, "/")
		out[reason+"/"+code] = v
	}
	return out
}

// checkRefusals fails unless meshid_sds_refusals_total holds exactly want ("reason/code" → count).
func checkRefusals(t *testing.T, h *harness, want map[string]float64) {
	t.Helper()
	if got := h.refusals(t); !maps.Equal(got, want) {
		t.Fatalf("meshid_sds_refusals_total = %v, want %v", got, want)
	}
}

// checkSecret reports how got differs from the secret want, as Envoy would read it.
func checkSecret(got *tlsv3.Secret, want *secretmanager.Secret) error {
	if got == nil {
		return fmt.Errorf("secret %s missing", want.Name)
	}
	if got.GetName() != want.Name {
		return fmt.Errorf("secret named %q, want %q", got.GetName(), want.Name)
	}
	if want.Bundle != nil {
		vc := got.GetValidationContext()
		if vc == nil {
			return fmt.Errorf("secret %s: no validation_context in %v", want.Name, got)
		}
		if !bytes.Equal(vc.GetTrustedCa().GetInlineBytes(), want.Bundle.PEM) {
			return fmt.Errorf("secret %s: trusted_ca is not the published roots (version %s)", want.Name, want.Version)
		}
		return nil
	}
	tc := got.GetTlsCertificate()
	if tc == nil {
		return fmt.Errorf("secret %s: no tls_certificate in %v", want.Name, got)
	}
	if !bytes.Equal(tc.GetCertificateChain().GetInlineBytes(), want.KeyPair.ChainPEM) {
		return fmt.Errorf("secret %s: certificate_chain is not the published chain (version %s)", want.Name, want.Version)
	}
	if !bytes.Equal(tc.GetPrivateKey().GetInlineBytes(), want.KeyPair.KeyPEM) {
		return fmt.Errorf("secret %s: private_key is not the published key (version %s)", want.Name, want.Version)
	}
	return nil
}

// expect fails unless p carries exactly want, each with its content and version.
func expect(t *testing.T, p sdstest.Push, want ...*secretmanager.Secret) {
	t.Helper()
	var names []string
	for _, s := range want {
		names = append(names, s.Name)
	}
	slices.Sort(names)
	if !slices.Equal(p.Names(), names) {
		t.Fatalf("pushed %v (version %q), want %v", p.Names(), p.Version, names)
	}
	for _, s := range want {
		if err := checkSecret(p.Secrets[s.Name], s); err != nil {
			t.Fatal(err)
		}
		if p.Versions != nil && p.Versions[s.Name] != s.Version {
			t.Fatalf("secret %s pushed as version %q, want %q", s.Name, p.Versions[s.Name], s.Version)
		}
	}
	if p.Nonce == "" {
		t.Fatal("response without a nonce")
	}
	if p.Version == "" {
		t.Fatal("response without a version")
	}
	for _, s := range want {
		if !strings.Contains(p.Version, s.Version) {
			t.Fatalf("version %q does not carry %s's version %s", p.Version, s.Name, s.Version)
		}
	}
}

// checkAll fails unless got holds exactly want.
func checkAll(t *testing.T, got map[string]*tlsv3.Secret, want ...*secretmanager.Secret) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("got secrets %v, want %d", slices.Sorted(maps.Keys(got)), len(want))
	}
	for _, s := range want {
		if err := checkSecret(got[s.Name], s); err != nil {
			t.Fatal(err)
		}
	}
}

// receive returns the next value from ch, failing after waitLimit.
func receive[T any](t *testing.T, ch <-chan T) T {
	t.Helper()
	limit := time.NewTimer(waitLimit)
	defer limit.Stop()
	select {
	case v := <-ch:
		return v
	case <-limit.C:
		t.Fatal("nothing came")
		panic("unreachable")
	}
}
