package ca_test

import (
	"context"
	"crypto/x509"
	"errors"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// upstreamCA is an upstream CA in process: an authority over a self-signed root that signs CA
// certificates for downstreamIdentity. Its answers can be made to fail or to be wrong, one call
// at a time.
type upstreamCA struct {
	t         *testing.T
	root      *testutil.CA
	authority *ca.Authority
	other     *ca.Authority // another root's, for answers that chain elsewhere

	mu      sync.Mutex
	answers []string // how the next calls answer: see Sign; then correctly
	calls   int
	// onCall, when set, is called at each request, before it is answered.
	onCall func()
}

func downstreamIdentity() pki.SPIFFEID {
	return pki.SPIFFEID{TrustDomain: "example.org", Namespace: "site-a", ServiceAccount: "meshid-ca"}
}

func newUpstreamCA(t *testing.T, clk *testutil.FakeClock) *upstreamCA {
	t.Helper()
	now := clk.Now()
	authorityOf := func(root *testutil.CA) *ca.Authority {
		b, err := ca.NewBundle(ca.BundleParams{SigningCert: root.Cert, SigningKey: root.Key, Source: ca.SourceSelfSigned, Now: now})
		if err != nil {
			t.Fatal(err)
		}
		return ca.New(ca.Config{Clock: clk, MaxTTL: 30 * 24 * time.Hour, CACertIdentities: []pki.SPIFFEID{downstreamIdentity()}}, b)
	}
	root := testutil.NewRootCA(t, caOpts("upstream root", now, 3*year))
	other := testutil.NewRootCA(t, caOpts("another root", now, 3*year))
	return &upstreamCA{t: t, root: root, authority: authorityOf(root), other: authorityOf(other)}
}

// Sign answers as the upstream would, or as the next of answers says: "unavailable" fails,
// "wrong key" certifies another key, "not CA" gives a workload certificate, "wrong root" a CA
// certificate under another root.
func (u *upstreamCA) Sign(ctx context.Context, csrDER []byte, ttl time.Duration) ([]*x509.Certificate, error) {
	u.mu.Lock()
	answer := ""
	if len(u.answers) > 0 {
		answer, u.answers = u.answers[0], u.answers[1:]
	}
	u.calls++
	onCall := u.onCall
	u.mu.Unlock()
	if onCall != nil {
		onCall()
	}
	csr, err := x509.ParseCertificateRequest(csrDER)
	if err != nil {
		return nil, err
	}
	signer := u.authority
	switch answer {
	case "unavailable":
		return nil, errors.New("connection refused")
	case "wrong key":
		if csr, err = x509.ParseCertificateRequest(caCSR(u.t)); err != nil {
			return nil, err
		}
	case "not CA":
		issued, err := u.authority.SignWorkload(ctx, ca.WorkloadRequest{CSR: csr, Identity: downstreamIdentity(), TTL: ttl})
		if err != nil {
			return nil, err
		}
		return issued.Chain(), nil
	case "wrong root":
		signer = u.other
	}
	issued, err := signer.SignCA(ctx, ca.CARequest{CSR: csr, Identity: downstreamIdentity(), TTL: ttl})
	if err != nil {
		return nil, err
	}
	return issued.Chain(), nil
}

func (u *upstreamCA) answerNext(answers ...string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.answers = append(u.answers, answers...)
}

func (u *upstreamCA) callCount() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.calls
}

func caCSR(t *testing.T) []byte {
	t.Helper()
	der, err := ca.NewCACSR(newKey(t))
	if err != nil {
		t.Fatal(err)
	}
	return der
}

// downstream is a CA whose signing certificate comes from an upstreamCA.
type downstream struct {
	stateDir string
	rootFile string
	clock    *testutil.FakeClock
	registry *prometheus.Registry
	upstream *ca.Upstream
}

func newDownstream(t *testing.T, clk *testutil.FakeClock, up *upstreamCA, stateDir string) *downstream {
	t.Helper()
	rootFile := filepath.Join(t.TempDir(), "upstream-root.pem")
	if err := os.WriteFile(rootFile, testutil.CertPEM(up.root.Cert), 0o600); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	u, err := ca.NewUpstream(ca.UpstreamConfig{
		Signer: up, Address: "upstream.test:15012", RootCertFile: rootFile, StateDir: stateDir,
		TTL: 10 * 24 * time.Hour, Clock: clk, Rand: func() float64 { return 0.5 }, Registerer: reg,
	})
	if err != nil {
		t.Fatal(err)
	}
	return &downstream{stateDir: stateDir, rootFile: rootFile, clock: clk, registry: reg, upstream: u}
}

// The answer is checked before it is used or saved: a certificate for another key, one that is
// not a CA's, or one under another root is refused, and nothing is written.
func TestUpstreamObtainRefusesBadAnswers(t *testing.T) {
	t.Parallel()
	for _, answer := range []string{"unavailable", "wrong key", "not CA", "wrong root"} {
		t.Run(answer, func(t *testing.T) {
			t.Parallel()
			clk := testutil.NewFakeClock(baseTime())
			up := newUpstreamCA(t, clk)
			d := newDownstream(t, clk, up, filepath.Join(t.TempDir(), "state"))
			up.answerNext(answer)
			if b, _, err := d.upstream.Load(t.Context()); err == nil {
				t.Fatalf("Load took %q from a %q answer", b.SigningCert().Subject, answer)
			}
			if _, err := os.Stat(ca.UpstreamPath(d.stateDir)); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("%s written after a %q answer: %v", ca.UpstreamCAFile, answer, err)
			}
			if got := counterValue(t, d.registry, "meshid_ca_upstream_renewals_total", "outcome", "failed"); got != 1 {
				t.Fatalf("failed renewals %v, want 1", got)
			}
		})
	}
}

// The key and chain are kept in the state dir (0600) and reused at the next start while they are
// valid; once expired, the upstream is asked again.
func TestUpstreamLoadReusesPersistedState(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(baseTime())
	up := newUpstreamCA(t, clk)
	stateDir := filepath.Join(t.TempDir(), "state")
	first, origin, err := newDownstream(t, clk, up, stateDir).upstream.Load(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if origin != ca.OriginUpstreamObtained || first.Source() != ca.SourceUpstream {
		t.Fatalf("origin %q, source %q; want obtained from the upstream", origin, first.Source())
	}
	if !first.Root().Equal(up.root.Cert) || len(first.Chain()) != 2 {
		t.Fatalf("chain %v, want the signing certificate then the upstream root", names(first.Chain()))
	}
	info, err := os.Stat(ca.UpstreamPath(stateDir))
	if err != nil {
		t.Fatal(err)
	}
	if info.Mode().Perm() != 0o600 {
		t.Fatalf("%s mode %v, want 0600", ca.UpstreamCAFile, info.Mode().Perm())
	}

	restarted, origin, err := newDownstream(t, clk, up, stateDir).upstream.Load(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if origin != ca.OriginUpstreamPersisted || !restarted.SigningCert().Equal(first.SigningCert()) || up.callCount() != 1 {
		t.Fatalf("restart: origin %q, same certificate %v, upstream asked %d times; want the persisted one reused",
			origin, restarted.SigningCert().Equal(first.SigningCert()), up.callCount())
	}

	clk.Set(first.NotAfter())
	renewed, origin, err := newDownstream(t, clk, up, stateDir).upstream.Load(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if origin != ca.OriginUpstreamObtained || renewed.SigningCert().Equal(first.SigningCert()) {
		t.Fatalf("restart past expiry: origin %q; want a new certificate from the upstream", origin)
	}
}

// rotation runs a key manager over a downstream's bundle.
type rotation struct {
	*downstream
	authority *ca.Authority
	events    chan ca.Event
}

func startRotation(t *testing.T, clk *testutil.FakeClock, up *upstreamCA) *rotation {
	t.Helper()
	d := newDownstream(t, clk, up, filepath.Join(t.TempDir(), "state"))
	initial, origin, err := d.upstream.Load(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	r := &rotation{downstream: d, authority: ca.New(ca.Config{Clock: clk}, nil), events: make(chan ca.Event, 64)}
	m, err := ca.NewKeyManager(ca.KeyManagerConfig{
		Authority: r.authority, StateDir: d.stateDir, Clock: clk, Jitter: func() float64 { return 0.5 },
		OnEvent: func(ev ca.Event) { r.events <- ev }, Initial: initial, InitialOrigin: origin, Upstream: d.upstream,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return r
}

// gracePoint is when half of b's lifetime is left (the jitter fixed at its middle).
func gracePoint(b *ca.Bundle) time.Time {
	return b.NotAfter().Add(-b.NotAfter().Sub(b.SigningCert().NotBefore) / 2)
}

// The signing certificate is renewed at its grace point: not before, and the renewal replaces it
// in service, in the trust bundle's file and in the state dir.
func TestUpstreamRenewsAtGracePoint(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(baseTime())
	up := newUpstreamCA(t, clk)
	r := startRotation(t, clk, up)
	first := r.authority.Bundle()
	at := gracePoint(first)
	if err := clk.WaitForDeadline(t.Context(), at); err != nil {
		t.Fatal(err)
	}
	clk.Set(at.Add(-time.Second))
	if up.callCount() != 1 {
		t.Fatalf("upstream asked %d times before the grace point, want once (at start)", up.callCount())
	}
	clk.Set(at)
	ev := <-r.events
	if ev.Kind != ca.EventReloaded {
		t.Fatalf("event %s (%v), want reloaded", ev.Kind, ev.Err)
	}
	next := r.authority.Bundle()
	if next.SigningCert().Equal(first.SigningCert()) || next.Source() != ca.SourceUpstream || !next.Root().Equal(up.root.Cert) {
		t.Fatalf("bundle after the grace point: %q under %q, want a new upstream-signed one", next.SigningCert().Subject, next.Root().Subject)
	}
	data, err := os.ReadFile(ca.UpstreamPath(r.stateDir))
	if err != nil {
		t.Fatal(err)
	}
	persisted, err := pki.ParseCertificates(data)
	if err != nil || !persisted[0].Equal(next.SigningCert()) {
		t.Fatalf("state dir holds another certificate than the one in service (%v)", err)
	}
	if got := readCerts(t, ca.RootCertPath(r.stateDir)); len(got) != 1 || !got[0].Equal(up.root.Cert) {
		t.Fatalf("root-cert.pem holds %v, want the upstream root", names(got))
	}
	// The next renewal is at the new certificate's grace point.
	if err := clk.WaitForDeadline(t.Context(), gracePoint(next)); err != nil {
		t.Fatal(err)
	}
}

// While the upstream fails, or answers with what does not verify, the current certificate keeps
// signing and stays in service; the renewal is retried with backoff until one verifies, and each
// failure is counted.
func TestUpstreamRenewalRetriesUntilAnAnswerVerifies(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{"unavailable", "wrong key", "not CA", "wrong root"} {
		t.Run(bad, func(t *testing.T) {
			t.Parallel()
			clk := testutil.NewFakeClock(baseTime())
			up := newUpstreamCA(t, clk)
			r := startRotation(t, clk, up)
			first := r.authority.Bundle()
			var stale []string
			up.onCall = func() {
				if b := r.authority.Bundle(); !b.SigningCert().Equal(first.SigningCert()) {
					stale = append(stale, b.SigningCert().Subject.String())
				}
				id := testID(t, "default", "demo")
				csr, _ := workloadCSR(t, id)
				if _, err := r.authority.SignWorkload(t.Context(), ca.WorkloadRequest{CSR: csr, Identity: id}); err != nil {
					t.Errorf("the current certificate stopped signing during the renewal: %v", err)
				}
			}
			up.answerNext(bad, bad, bad)
			at := gracePoint(first)
			if err := clk.WaitForDeadline(t.Context(), at); err != nil {
				t.Fatal(err)
			}
			clk.Set(at)
			// Timers pending besides the retries: the root check.
			ev := testutil.Drive(t, clk, time.Second, 1, r.events)
			if ev.Kind != ca.EventReloaded {
				t.Fatalf("event %s (%v), want reloaded", ev.Kind, ev.Err)
			}
			if len(stale) > 0 {
				t.Fatalf("the bundle in service changed before an answer verified: %v", stale)
			}
			if up.callCount() != 5 { // at start, three bad answers, the good one
				t.Fatalf("upstream asked %d times, want 5", up.callCount())
			}
			if got := counterValue(t, r.registry, "meshid_ca_upstream_renewals_total", "outcome", "failed"); got != 3 {
				t.Fatalf("failed renewals %v, want 3", got)
			}
			if got := counterValue(t, r.registry, "meshid_ca_upstream_renewals_total", "outcome", "ok"); got != 2 {
				t.Fatalf("successful renewals %v, want 2", got)
			}
			if b := r.authority.Bundle(); b.SigningCert().Equal(first.SigningCert()) || !b.Root().Equal(up.root.Cert) {
				t.Fatalf("the renewal is not in service: %q under %q", b.SigningCert().Subject, b.Root().Subject)
			}
		})
	}
}

// A CA certificate is signed only for a listed identity, CA:true with path length 0, certSign and
// cRLSign, its URIs constrained to the caller's trust domain, and clamped like a workload's.
func TestSignCAPolicy(t *testing.T) {
	t.Parallel()
	now := baseTime()
	h := newHierarchy(t, now, defaultLifetimes())
	bundle, err := ca.NewBundle(ca.BundleParams{SigningCert: h.int1.Cert, SigningKey: h.int1.Key, Intermediates: []*x509.Certificate{h.root.Cert},
		Roots: []*x509.Certificate{h.root.Cert}, Source: ca.SourcePluggedIn, Now: now})
	if err != nil {
		t.Fatal(err)
	}
	clk := testutil.NewFakeClock(now)
	listed := downstreamIdentity()
	key := newKey(t)
	der, err := ca.NewCACSR(key)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		ids     []pki.SPIFFEID
		caller  pki.SPIFFEID
		maxTTL  time.Duration
		ttl     time.Duration
		wantErr error
		wantTTL time.Duration
	}{
		{name: "listed", ids: []pki.SPIFFEID{listed}, caller: listed, maxTTL: 48 * time.Hour, ttl: time.Hour, wantTTL: time.Hour},
		{name: "clamped to the maximum", ids: []pki.SPIFFEID{listed}, caller: listed, maxTTL: 48 * time.Hour, ttl: year, wantTTL: 48 * time.Hour},
		{name: "no TTL asked", ids: []pki.SPIFFEID{listed}, caller: listed, maxTTL: 48 * time.Hour, wantTTL: 48 * time.Hour},
		{name: "clamped to the signing certificate", ids: []pki.SPIFFEID{listed}, caller: listed, maxTTL: 5 * year, ttl: 5 * year, wantTTL: 2 * year},
		{name: "unlisted", ids: []pki.SPIFFEID{listed}, caller: testID(t, "default", "demo"), wantErr: ca.ErrCACertIdentity},
		{name: "none listed", caller: listed, wantErr: ca.ErrCACertsNotSigned},
	}
	// A CA whose own certificate has path length 0 (a downstream's) signs no CA certificate.
	t.Run("signing certificate of path length 0", func(t *testing.T) {
		t.Parallel()
		up := ca.New(ca.Config{Clock: clk, CACertIdentities: []pki.SPIFFEID{listed}}, bundle)
		issued, err := up.SignCA(t.Context(), ca.CARequest{CSR: csr, Identity: listed, TTL: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		down, err := ca.NewBundle(ca.BundleParams{SigningCert: issued.Leaf, SigningKey: key, Intermediates: []*x509.Certificate{h.int1.Cert},
			Roots: []*x509.Certificate{h.root.Cert}, Source: ca.SourceUpstream, Now: now})
		if err != nil {
			t.Fatal(err)
		}
		other, err := x509.ParseCertificateRequest(caCSR(t))
		if err != nil {
			t.Fatal(err)
		}
		_, err = ca.New(ca.Config{Clock: clk, CACertIdentities: []pki.SPIFFEID{listed}}, down).SignCA(t.Context(), ca.CARequest{CSR: other, Identity: listed})
		if !errors.Is(err, ca.ErrCACertsNotSigned) {
			t.Fatalf("err = %v, want %v", err, ca.ErrCACertsNotSigned)
		}
	})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			a := ca.New(ca.Config{Clock: clk, MaxTTL: tt.maxTTL, CACertIdentities: tt.ids}, bundle)
			issued, err := a.SignCA(t.Context(), ca.CARequest{CSR: csr, Identity: tt.caller, TTL: tt.ttl})
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("err = %v, want %v", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			c := issued.Leaf
			if !c.IsCA || c.MaxPathLen != 0 || !c.MaxPathLenZero || c.KeyUsage != x509.KeyUsageCertSign|x509.KeyUsageCRLSign {
				t.Fatalf("IsCA %v, MaxPathLen %d (zero %v), KeyUsage %v", c.IsCA, c.MaxPathLen, c.MaxPathLenZero, c.KeyUsage)
			}
			if len(c.PermittedURIDomains) != 1 || c.PermittedURIDomains[0] != "example.org" {
				t.Fatalf("PermittedURIDomains %v, want [example.org]", c.PermittedURIDomains)
			}
			if got := c.NotAfter.Sub(now); got != tt.wantTTL {
				t.Fatalf("lifetime %s, want %s", got, tt.wantTTL)
			}
			verifyPath(t, issued.Chain(), []*x509.Certificate{h.root.Cert}, now)
			// What it signs for its trust domain verifies; for another, it does not.
			sub := &testutil.CA{Cert: c, Key: key}
			for uri, ok := range map[string]bool{"spiffe://example.org/ns/a/sa/b": true, "spiffe://other.org/ns/a/sa/b": false} {
				u, err := url.Parse(uri)
				if err != nil {
					t.Fatal(err)
				}
				leaf := sub.Issue(t, &x509.Certificate{URIs: []*url.URL{u}, NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)}, newKey(t).Public())
				_, err = leaf.Verify(x509.VerifyOptions{Roots: certPool(h.root.Cert), Intermediates: certPool(c, h.int1.Cert), CurrentTime: now})
				if (err == nil) != ok {
					t.Errorf("leaf for %s under the CA certificate: verify error %v, want it to verify: %v", uri, err, ok)
				}
			}
		})
	}
}

func certPool(certs ...*x509.Certificate) *x509.CertPool {
	p := x509.NewCertPool()
	for _, c := range certs {
		p.AddCert(c)
	}
	return p
}
