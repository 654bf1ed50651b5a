package nodemode

import (
	"context"
	"crypto/x509"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/secretmanager"
)

// csrSigner signs each CSR for the identity it asks, with a test root: a CA that trusts the node
// agent for every identity.
type csrSigner struct {
	t    *testing.T
	root *testutil.CA
}

func (s csrSigner) Sign(_ context.Context, der []byte, ttl time.Duration) ([]*x509.Certificate, error) {
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	leaf := s.root.Issue(s.t, &x509.Certificate{
		URIs: csr.URIs, NotBefore: now.Add(-time.Hour), NotAfter: now.Add(ttl),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}, csr.PublicKey)
	return []*x509.Certificate{leaf, s.root.Cert}, nil
}

// identitySeries returns the identities of the series of the metric named name in reg.
func identitySeries(t *testing.T, reg *prometheus.Registry, name string) []string {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == identityLabel {
					ids = append(ids, l.GetValue())
				}
			}
		}
	}
	slices.Sort(ids)
	return ids
}

// The registry makes a manager per identity on first ask, serves each its own "default", and
// releases an identity once no one has asked for it for IdentityIdleRelease, not before; each
// identity's metrics carry its identity as a label and leave with it.
func TestIdentitiesMadeOnDemandAndReleasedWhenIdle(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(time.Now())
	signer := csrSigner{t: t, root: testutil.NewRootCA(t, testutil.CAOptions{})}
	made := map[pki.SPIFFEID]int{}
	reg := prometheus.NewRegistry()
	r, err := newIdentities(func(id pki.SPIFFEID, reg prometheus.Registerer) (*secretmanager.Manager, error) {
		made[id]++
		return secretmanager.New(secretmanager.Config{
			Workload:   &secretmanager.Rotation{Signer: signer, Identity: id, TTL: 24 * time.Hour},
			Clock:      clk,
			Registerer: reg,
		})
	}, reg, clk, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	sweeps := make(chan struct{}, 1)
	r.swept = func() { sweeps <- struct{}{} } // once the next sweep's timer is armed
	a := pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "a"}
	b := pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "b"}

	// Asked before Run: started when it runs.
	got := make(chan string, 4)
	cancelA, err := r.Subscribe(nodeKey(secretmanager.WorkloadCertName, a), func(s *secretmanager.Secret, _ error) {
		if s != nil {
			got <- s.Name + " " + s.KeyPair.Leaf().URIs[0].String()
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	if s := receiveWithin(t, got); s != "default "+a.String() {
		t.Fatalf("a got %q", s)
	}
	cancelB, err := r.Subscribe(nodeKey(secretmanager.WorkloadCertName, b), func(s *secretmanager.Secret, _ error) {
		if s != nil {
			got <- s.Name + " " + s.KeyPair.Leaf().URIs[0].String()
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer cancelB()
	if s := receiveWithin(t, got); s != "default "+b.String() {
		t.Fatalf("b got %q", s)
	}
	// A second ask of a shares its manager.
	cancelA2, err := r.Subscribe(nodeKey(secretmanager.RootCertName, a), func(*secretmanager.Secret, error) {})
	if err != nil {
		t.Fatal(err)
	}
	if made[a] != 1 || made[b] != 1 {
		t.Fatalf("managers made: %v, want one each", made)
	}
	for _, name := range []string{"meshid_agent_cert_valid", "meshid_agent_cert_rotations_total", "meshid_agent_cert_expiry_timestamp_seconds"} {
		if got := identitySeries(t, reg, name); !slices.Equal(got, []string{a.String(), b.String()}) {
			t.Errorf("%s of identities %v, want %s and %s", name, got, a, b)
		}
	}
	for _, key := range []string{"file-root:/etc/certs/root.pem", "default", "default@not-an-id", "other@" + a.String()} {
		if _, err := r.Subscribe(key, func(*secretmanager.Secret, error) {}); !errors.Is(err, secretmanager.ErrUnknownSecret) {
			t.Errorf("Subscribe(%q): %v, want ErrUnknownSecret", key, err)
		}
	}

	cancelA()
	cancelA2()
	waitCtx, stop := context.WithTimeout(t.Context(), 30*time.Second)
	defer stop()
	idleFrom := clk.Now()
	for clk.Now().Sub(idleFrom) < IdentityIdleRelease {
		if !slices.Equal(r.held(), []string{a.String(), b.String()}) {
			t.Fatalf("held %v after %s idle, want both", r.held(), clk.Now().Sub(idleFrom))
		}
		if err := clk.WaitForDeadline(waitCtx, clk.Now().Add(identitySweep)); err != nil {
			t.Fatal(err)
		}
		clk.Advance(identitySweep)
		select {
		case <-sweeps:
		case <-waitCtx.Done():
			t.Fatal("no sweep")
		}
	}
	// The sweep at IdentityIdleRelease released a, not b, which is still asked for.
	if held := r.held(); !slices.Equal(held, []string{b.String()}) {
		t.Fatalf("held %v, want only %s", held, b)
	}
	// Its series went with it; b's stay.
	for _, name := range []string{"meshid_agent_cert_valid", "meshid_agent_cert_rotations_total", "meshid_agent_cert_expiry_timestamp_seconds"} {
		if got := identitySeries(t, reg, name); !slices.Equal(got, []string{b.String()}) {
			t.Errorf("%s of identities %v after %s's release, want only %s", name, got, a, b)
		}
	}
	// Asked again, a is made again.
	cancelA3, err := r.Subscribe(nodeKey(secretmanager.WorkloadCertName, a), func(*secretmanager.Secret, error) {})
	if err != nil {
		t.Fatal(err)
	}
	defer cancelA3()
	if made[a] != 2 {
		t.Fatalf("a made %d times, want 2", made[a])
	}
}

func receiveWithin(t *testing.T, ch <-chan string) string {
	t.Helper()
	select {
	case s := <-ch:
		return s
	case <-time.After(30 * time.Second):
		t.Fatal("nothing came")
		return ""
	}
}

// A manager whose Run fails (here, on a file watcher hub that has stopped) is dropped: its
// subscribers are told why, the failure is counted and reported once, and the manager is made
// again once its backoff has passed, for the subscription still open, which is then served.
func TestIdentityWhoseManagerFailsIsMadeAgain(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(time.Now())
	signer := csrSigner{t: t, root: testutil.NewRootCA(t, testutil.CAOptions{})}
	stopped := filewatch.NewHub(filewatch.HubConfig{})
	hubCtx, stopHub := context.WithCancel(t.Context())
	stopHub()
	if err := stopped.Run(hubCtx); err != nil {
		t.Fatal(err)
	}
	made := 0
	reg := prometheus.NewRegistry()
	r, err := newIdentities(func(id pki.SPIFFEID, reg prometheus.Registerer) (*secretmanager.Manager, error) {
		made++
		cfg := secretmanager.Config{
			Workload:   &secretmanager.Rotation{Signer: signer, Identity: id, TTL: 24 * time.Hour},
			Clock:      clk,
			Registerer: reg,
		}
		if made == 1 {
			cfg.FileWatch = stopped
		}
		return secretmanager.New(cfg)
	}, reg, clk, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	failed := make(chan error, 4)
	r.failed = func(_ pki.SPIFFEID, why error) { failed <- why }
	a := pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "a"}
	type told struct {
		s   *secretmanager.Secret
		err error
	}
	got := make(chan told, 16)
	cancelA, err := r.Subscribe(nodeKey(secretmanager.WorkloadCertName, a), func(s *secretmanager.Secret, err error) { got <- told{s, err} })
	if err != nil {
		t.Fatal(err)
	}
	defer cancelA()
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()

	// Told why (a certificate may come before the failure ends the manager's Run).
	var why error
	for why == nil {
		select {
		case u := <-got:
			why = u.err
		case <-time.After(30 * time.Second):
			t.Fatal("the subscriber was not told of the failure")
		}
	}
	if !errors.Is(why, errIdentityFailed) || !errors.Is(why, filewatch.ErrHubStopped) {
		t.Fatalf("told %v, want the identity's failure and its cause", why)
	}
	if reported := receiveWithin(t, errStrings(failed)); reported != why.Error() {
		t.Fatalf("failed was told %q, want %q", reported, why)
	}
	if got := promtest.ToFloat64(r.failures.WithLabelValues(managerFailedRun)); got != 1 {
		t.Fatalf("run failures %v, want 1", got)
	}
	if series := identitySeries(t, reg, "meshid_agent_cert_valid"); len(series) != 0 {
		t.Fatalf("the failed manager's series stay: %v", series)
	}

	// Made again at its retry, the open subscription gets a certificate.
	r.mu.Lock()
	retryAt := r.entries[a].retryAt
	r.mu.Unlock()
	waitCtx, stop := context.WithTimeout(t.Context(), 30*time.Second)
	defer stop()
	if err := clk.WaitForDeadline(waitCtx, retryAt); err != nil {
		t.Fatal(err)
	}
	clk.Set(retryAt)
	for {
		select {
		case u := <-got:
			if u.s == nil {
				continue
			}
			r.mu.Lock()
			n := made // newManager runs under r.mu
			r.mu.Unlock()
			if n != 2 {
				t.Fatalf("managers made: %d, want 2", n)
			}
			if r.failure(a) != nil {
				t.Fatalf("the identity is still failed: %v", r.failure(a))
			}
			return
		case <-time.After(30 * time.Second):
			t.Fatal("no certificate after the retry")
		}
	}
}

// errStrings relays the errors of ch as strings.
func errStrings(ch <-chan error) <-chan string {
	out := make(chan string, 1)
	go func() { out <- (<-ch).Error() }()
	return out
}

// A manager that cannot be made is not made again before its backoff has passed, however often
// it is asked for, and the backoff grows while it keeps failing: no hot loop of attempts.
func TestIdentityThatCannotStartIsRetriedWithBackoff(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(time.Now())
	made := 0
	r, err := newIdentities(func(pki.SPIFFEID, prometheus.Registerer) (*secretmanager.Manager, error) {
		made++
		return nil, errors.New("too many open files (test)")
	}, nil, clk, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	id := pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "a"}
	ask := func() error {
		t.Helper()
		var told error
		cancel, err := r.Subscribe(nodeKey(secretmanager.WorkloadCertName, id), func(s *secretmanager.Secret, err error) {
			if s != nil {
				t.Error("a failed identity served a secret")
			}
			told = err
		})
		if err != nil {
			t.Fatal(err)
		}
		cancel()
		return told
	}
	var waits []time.Duration
	const attempts = 6
	for attempt := 1; attempt <= attempts; attempt++ {
		for range 5 {
			if why := ask(); !errors.Is(why, errIdentityFailed) || !strings.Contains(why.Error(), "too many open files") {
				t.Fatalf("told %v, want the failure and its cause", why)
			}
		}
		if made != attempt {
			t.Fatalf("attempt %d: the manager was made %d times, want once per backoff", attempt, made)
		}
		r.mu.Lock()
		retryAt := r.entries[id].retryAt
		r.mu.Unlock()
		waits = append(waits, retryAt.Sub(clk.Now()))
		clk.Set(retryAt)
	}
	if got := promtest.ToFloat64(r.failures.WithLabelValues(managerFailedStart)); got != attempts {
		t.Errorf("start failures %v, want %d", got, attempts)
	}
	// Each wait is drawn within ±50% of an interval that grows by half each time: the sixth
	// (at least 7.6 s × 0.5) is past anything the first could be (1 s × 1.5), as no wait
	// would be if the backoff started over at each failure.
	if last, firstMax := waits[attempts-1], identityRetryInitial*3/2; last <= firstMax {
		t.Fatalf("backoffs %v: want them to grow past %s", waits, firstMax)
	}
}
