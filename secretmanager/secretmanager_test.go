package secretmanager

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// current returns what a new subscriber to name is told at once: the zero update while nothing
// is known.
func current(t *testing.T, m *Manager, name string) update {
	t.Helper()
	var (
		mu  sync.Mutex
		got []update
	)
	cancel, err := m.Subscribe(name, func(s *Secret, err error) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, update{s, err})
	})
	if err != nil {
		t.Fatalf("Subscribe(%s) = %v", name, err)
	}
	cancel()
	mu.Lock()
	defer mu.Unlock()
	if len(got) == 0 {
		return update{}
	}
	return got[0]
}

// ready fails unless Ready answers want, with a reason containing each of why.
func ready(t *testing.T, m *Manager, want bool, why ...string) {
	t.Helper()
	ok, reason := m.Ready()
	if ok != want {
		t.Fatalf("Ready = (%v, %q), want %v", ok, reason, want)
	}
	if ok && reason != "" {
		t.Errorf("Ready with a reason %q", reason)
	}
	for _, w := range why {
		if !strings.Contains(reason, w) {
			t.Errorf("Ready's reason %q does not say %q", reason, w)
		}
	}
}

// backoffWithin fails unless the n-th wait (from 0) of a backoff from initial, ×1.5 each time up
// to max, randomized by ±50%, is wait.
func backoffWithin(t *testing.T, n int, wait, initial, limit time.Duration) {
	t.Helper()
	nominal := min(time.Duration(float64(initial)*math.Pow(1.5, float64(n))), limit)
	if wait < nominal/2 || wait > nominal*3/2+time.Nanosecond {
		t.Fatalf("retry %d after %s, want within ±50%% of %s", n+1, wait, nominal)
	}
}

// growing fails unless waits grow: every wait is longer than the one three before it (±50% of
// randomization hides less than a factor 1.5³).
func growing(t *testing.T, waits []time.Duration) {
	t.Helper()
	for i := 3; i < len(waits); i++ {
		if waits[i] <= waits[i-3] {
			t.Errorf("retry waits do not grow: %v", waits)
		}
	}
}

func TestInitialIssuance(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	otherRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "other root"})
	thirdRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "third root"})
	chainRoot := e.signer.rootCert()
	rootFile := filepath.Join(t.TempDir(), "root-cert.pem")
	// The chain's own root is in the file too, after another: ROOTCA lists it once, first.
	writeFileAtomic(t, rootFile, testutil.CertPEM(otherRoot.Cert, chainRoot))
	e.rot.RootCertFile = rootFile
	out := filepath.Join(t.TempDir(), "out")
	e.cfg.Output.Dir = out
	m := e.newManager()

	early := subscribe(t, m, WorkloadCertName)
	if got := early.seen(); len(got) != 0 {
		t.Fatalf("a subscriber was told %v before Run", got)
	}
	ready(t, m, false, "no workload certificate yet")
	if c := m.TLSCertificate(); c != nil {
		t.Fatal("TLSCertificate before any certificate")
	}
	entered, release := e.signer.blockCalls()
	r := e.run(m)
	recv(t, entered, "the first Sign")
	// The root file is read while the CA has not answered: ROOTCA serves it alone meanwhile.
	if fileOnly := r.roots.next(t); !sameCerts(fileOnly.Bundle.Roots, []*x509.Certificate{otherRoot.Cert, chainRoot}) {
		t.Fatalf("ROOTCA before the CA answered = %s, want the root file's", names(fileOnly.Bundle.Roots))
	}
	early.none(t, "before the CA answered")
	ready(t, m, false, "no workload certificate yet")
	release()
	s := early.next(t)
	if in := e.logs.matching(func(r logRecord) bool { return r.msg == "workload certificate in service" }); len(in) != 1 || in[0].attrs["reason"] != "the first since start" {
		t.Errorf("the first certificate logged as %+v, want once, as the first since start", in)
	}
	if other := r.next(t); other != s {
		t.Errorf("two subscribers were given different secrets: %s and %s", s.Version, other.Version)
	}

	if got := e.signer.TTLs(); len(got) != 1 || got[0] != time.Hour {
		t.Errorf("Sign calls asked for TTLs %v, want one of 1h", got)
	}
	// The connection is asked for before the key is made, so that the handshakes overlap it.
	if got := e.signer.Connects(); !slices.Equal(got, []int{0}) {
		t.Errorf("Connect came after %v Sign calls, want once, before the first", got)
	}
	if s.Name != WorkloadCertName || s.Source != SourceCA || s.KeyPair == nil || s.Bundle != nil || len(s.KeyPair.Chain) != 3 {
		t.Fatalf("got %s from %q (%+v), want default from ca with a chain of 3", s.Name, s.Source, s)
	}
	kp := s.KeyPair
	leaf := kp.Leaf()
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != testID.String() {
		t.Errorf("leaf names %v, want %s", leaf.URIs, testID)
	}
	if !pki.KeyMatchesCertificate(kp.Key, leaf) {
		t.Error("Key does not match the leaf")
	}
	if parsed, err := pki.ParsePrivateKey(kp.KeyPEM); err != nil || !pki.KeyMatchesCertificate(parsed, leaf) {
		t.Errorf("KeyPEM does not parse to the leaf's key (err %v)", err)
	}
	if parsed, err := pki.ParseCertificates(kp.ChainPEM); err != nil || !sameCerts(parsed, kp.Chain) {
		t.Errorf("ChainPEM does not hold Chain (err %v)", err)
	}
	if s.Version != leaf.SerialNumber.Text(16) {
		t.Errorf("Version %q, want the serial %s", s.Version, leaf.SerialNumber.Text(16))
	}
	if !s.Received.Equal(t0) || !s.NotAfter().Equal(t0.Add(time.Hour)) || !s.RenewAt.Equal(t0.Add(30*time.Minute)) {
		t.Errorf("received %s, expires %s, renews %s; want t0, t0+1h, t0+30m", s.Received, s.NotAfter(), s.RenewAt)
	}
	e.awaitOutput(s.Version)
	ready(t, m, true)
	if again := current(t, m, WorkloadCertName); again.s != s {
		t.Errorf("a new subscriber was told %s, want the secret held", again)
	}
	if e.signer.Calls() != 1 {
		t.Errorf("Sign called %d times, want 1", e.signer.Calls())
	}

	roots := r.roots.next(t)
	if want := []*x509.Certificate{chainRoot, otherRoot.Cert}; !sameCerts(roots.Bundle.Roots, want) {
		t.Fatalf("ROOTCA = %s, want %s", names(roots.Bundle.Roots), names(want))
	}
	if parsed, err := pki.ParseCertificates(roots.Bundle.PEM); err != nil || !sameCerts(parsed, roots.Bundle.Roots) {
		t.Errorf("the bundle's PEM does not hold its roots (err %v)", err)
	}
	if roots.KeyPair != nil || roots.Name != RootCertName || !roots.NotAfter().IsZero() {
		t.Errorf("ROOTCA carries a key pair or the wrong name: %+v", roots)
	}

	for _, name := range []string{"", "rootca", "Default", "file-cert:/etc/certs/cert.pem", "file-root:"} {
		if _, err := m.Subscribe(name, func(*Secret, error) { t.Errorf("a refused subscriber to %q was called", name) }); !errors.Is(err, ErrUnknownSecret) {
			t.Errorf("Subscribe(%q) = %v, want ErrUnknownSecret", name, err)
		}
	}
	if _, err := m.Subscribe("file-root:foo", func(*Secret, error) {}); !errors.Is(err, ErrForbiddenPath) {
		t.Errorf("Subscribe(file-root:foo) = %v, want ErrForbiddenPath (no resource dirs configured)", err)
	}

	// A second root in the file reaches ROOTCA, its subscribers and OUTPUT_CERTS.
	e.idle(s.RenewAt)
	mark := e.events.mark()
	writeFileAtomic(t, rootFile, testutil.CertPEM(otherRoot.Cert, chainRoot, thirdRoot.Cert))
	want := []*x509.Certificate{chainRoot, otherRoot.Cert, thirdRoot.Cert}
	u := drive(t, e.clock, r.roots.ch)
	if u.s == nil || !sameCerts(u.s.Bundle.Roots, want) {
		t.Fatalf("ROOTCA after the root file changed: %s, want %s", u, names(want))
	}
	updated := u.s
	if cached := current(t, m, RootCertName); cached.s != updated {
		t.Errorf("ROOTCA after the update = %s, want version %s", cached, updated.Version)
	}
	if updated.Version == roots.Version {
		t.Error("ROOTCA kept its version after its content changed")
	}
	e.events.wait(t, mark, "OUTPUT_CERTS written with the new roots", kind(EventOutputWritten))
	if got := readRoots(t, out); !sameCerts(got, want) {
		t.Errorf("OUTPUT_CERTS root-cert.pem = %s after the root file changed, want %s", names(got), names(want))
	}
	if leaf, _ := readPair(t, out); leaf.SerialNumber.Text(16) != s.Version {
		t.Errorf("OUTPUT_CERTS holds serial %s, want %s", leaf.SerialNumber.Text(16), s.Version)
	}
	if e.signer.Calls() != 1 {
		t.Errorf("a root file change made %d Sign calls, want none", e.signer.Calls()-1)
	}
}

func TestRenewAtWithinJitterBounds(t *testing.T) {
	t.Parallel()
	received := t0
	expires := t0.Add(24 * time.Hour)
	s := &Secret{Received: received, KeyPair: &KeyPair{Chain: []*x509.Certificate{{NotAfter: expires}}}}
	for _, c := range []struct{ ratio, jitter float64 }{{0.5, 0.01}, {0.5, 0}, {0.2, 0.1}, {0.9, 0.05}} {
		for _, r := range []float64{0, 0.25, 0.5, 0.75, 0.999999} {
			rt := &rotator{cfg: Rotation{GraceRatio: c.ratio, GraceRatioJitter: c.jitter, Rand: func() float64 { return r }}}
			got := rt.renewAt(s)
			lifetime := expires.Sub(received)
			wantRemaining := time.Duration((c.ratio + c.jitter*(2*r-1)) * float64(lifetime))
			if d := expires.Sub(got) - wantRemaining; d.Abs() > time.Microsecond {
				t.Errorf("ratio %v jitter %v r %v: %s remain at renewal, want %s", c.ratio, c.jitter, r, expires.Sub(got), wantRemaining)
			}
			lo := expires.Add(-time.Duration((c.ratio + c.jitter) * float64(lifetime)))
			hi := expires.Add(-time.Duration((c.ratio - c.jitter) * float64(lifetime)))
			if got.Before(lo.Add(-time.Microsecond)) || got.After(hi.Add(time.Microsecond)) {
				t.Errorf("ratio %v jitter %v r %v: renews at %s, outside [%s, %s]", c.ratio, c.jitter, r, got, lo, hi)
			}
		}
	}
}

func TestRotationTiming(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		r    float64
		// ratio = 0.5 + 0.01·(2r−1); RenewAt = NotAfter − ratio·1h
		want time.Duration // after receipt
	}{
		{"jitter low", 0, 30*time.Minute + 36*time.Second},              // ratio 0.49
		{"jitter none", 0.5, 30 * time.Minute},                          // ratio 0.5
		{"jitter high", 0.999, 29*time.Minute + 24072*time.Millisecond}, // ratio 0.50998
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.rot.Rand = func() float64 { return tc.r }
			r := e.start()
			s := r.next(t)
			if d := s.RenewAt.Sub(t0.Add(tc.want)); d.Abs() > time.Microsecond {
				t.Fatalf("RenewAt = t0+%s, want t0+%s", s.RenewAt.Sub(t0), tc.want)
			}
			e.idle(s.RenewAt) // the loop waits for exactly RenewAt
			if got := e.metric("meshid_agent_cert_next_renewal_timestamp_seconds"); got != float64(s.RenewAt.Unix()) {
				t.Errorf("next renewal gauge %v, want %d", got, s.RenewAt.Unix())
			}
			if got := e.metric("meshid_agent_cert_expiry_timestamp_seconds"); got != float64(s.NotAfter().Unix()) {
				t.Errorf("expiry gauge %v, want %d", got, s.NotAfter().Unix())
			}
			e.clock.Set(s.RenewAt.Add(-time.Second))
			if e.signer.Calls() != 1 {
				t.Fatalf("renewed a second before RenewAt (Sign called %d times)", e.signer.Calls())
			}
			if ev := e.attempt(s.RenewAt); ev.Kind != EventIssued {
				t.Fatalf("the renewal at RenewAt reported %+v", ev)
			}
			renewed := r.next(t)
			if !renewed.Received.Equal(s.RenewAt) || renewed.Version == s.Version || e.signer.Calls() != 2 {
				t.Fatalf("renewed at %s with serial %s after %d Sign calls; want at %s, a new serial, 2 calls",
					renewed.Received, renewed.Version, e.signer.Calls(), s.RenewAt)
			}
			if got := e.metric("meshid_agent_cert_rotations_total"); got != 2 {
				t.Errorf("rotations counter %v, want 2", got)
			}
		})
	}
}

// The CA backdates NotBefore by two minutes; with a 30 s TTL a lifetime counted from NotBefore
// would be over before it began, and the manager would renew in a loop.
func TestLifetimeCountsFromReceipt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.rot.TTL = 30 * time.Second
	r := e.start()
	s := r.next(t)
	for i := range 4 {
		e.idle(s.RenewAt)
		if e.signer.Calls() != i+1 {
			t.Fatalf("%d Sign calls for %d certificates", e.signer.Calls(), i+1)
		}
		if !s.KeyPair.Leaf().NotBefore.Equal(s.Received.Add(-2 * time.Minute)) {
			t.Fatalf("the fake CA did not backdate: NotBefore %s, received %s", s.KeyPair.Leaf().NotBefore, s.Received)
		}
		if want := s.Received.Add(15 * time.Second); !s.RenewAt.Equal(want) {
			t.Fatalf("RenewAt = received+%s, want received+15s", s.RenewAt.Sub(s.Received))
		}
		e.clock.Set(s.RenewAt.Add(-time.Nanosecond))
		if e.signer.Calls() != i+1 {
			t.Fatal("renewed before RenewAt")
		}
		if ev := e.attempt(s.RenewAt); ev.Kind != EventIssued {
			t.Fatalf("no renewal at RenewAt: %+v", ev)
		}
		s = r.next(t)
	}
}

func TestCADownAcrossRenewal(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	out := filepath.Join(t.TempDir(), "out")
	e.cfg.Output.Dir = out
	e.rot.RetryInitial = time.Second
	e.rot.RetryMax = time.Minute
	r := e.start()
	first := r.next(t)
	e.awaitOutput(first.Version)

	// The CA goes down just before the renewal point.
	e.signer.setErr(errCADown)
	ev := e.attempt(first.RenewAt)
	const failed = 9
	var waits []time.Duration
	failedAt := first.RenewAt
	for i := range failed {
		if ev.Kind != EventRenewalFailed || !errors.Is(ev.Err, errCADown) {
			t.Fatalf("attempt %d reported %+v, want a failure with the CA's error", i+1, ev)
		}
		if got := e.failures(); got != i+1 {
			t.Fatalf("failure counter %d after %d failures", got, i+1)
		}
		wait := ev.RetryAt.Sub(failedAt)
		backoffWithin(t, i, wait, e.rot.RetryInitial, e.rot.RetryMax)
		waits = append(waits, wait)

		// The current certificate keeps serving.
		r.workload.none(t, "while the CA was down and the certificate valid")
		if got := current(t, r.m, WorkloadCertName); got.s != first {
			t.Fatalf("a subscriber while the CA is down is told %s, want the current certificate", got)
		}
		ready(t, r.m, true)

		// The retry happens at RetryAt, not before.
		calls := e.signer.Calls()
		e.idle(ev.RetryAt)
		e.clock.Set(ev.RetryAt.Add(-time.Nanosecond))
		if e.signer.Calls() != calls {
			t.Fatalf("retried before RetryAt %s", ev.RetryAt)
		}
		if i == failed-1 {
			e.signer.setErr(nil) // the CA is back
		}
		failedAt = ev.RetryAt
		ev = e.attempt(ev.RetryAt)
	}
	growing(t, waits)
	// Each failure is logged with its error, its retry time and the expiry of the one serving.
	logged := e.logs.matching(func(rec logRecord) bool { return rec.attrs[logkey.RetryAt] != "" })
	if len(logged) != failed {
		t.Errorf("%d failures logged with retry_at, want %d", len(logged), failed)
	}
	for _, rec := range logged {
		if rec.level != slog.LevelWarn || rec.attrs[logkey.Error] != errCADown.Error() || rec.attrs[logkey.CurrentExpires] == "" {
			t.Errorf("failure logged as %v %q %v, want a warning with the error and current_expires", rec.level, rec.msg, rec.attrs)
		}
	}
	if n := e.errorLogs(); n != 0 {
		t.Errorf("%d errors logged while a valid certificate was held", n)
	}

	if ev.Kind != EventIssued {
		t.Fatalf("the attempt after the CA returned reported %+v", ev)
	}
	second := r.next(t)
	if second.Version == first.Version || !second.Received.Equal(failedAt) || second.Source != SourceCA {
		t.Fatalf("after the CA returned got serial %s at %s from %s; want a new one at %s", second.Version, second.Received, second.Source, failedAt)
	}
	e.awaitOutput(second.Version)
	if leaf, _ := readPair(t, out); leaf.SerialNumber.Text(16) != second.Version {
		t.Errorf("OUTPUT_CERTS holds serial %s, want %s", leaf.SerialNumber.Text(16), second.Version)
	}
	if got := e.failures(); got != failed {
		t.Errorf("failure counter %d after success, want %d", got, failed)
	}

	// Down again, this time until the certificate expires: the backoff starts over.
	e.signer.setErr(errCADown)
	ev = e.attempt(second.RenewAt)
	if wait := ev.RetryAt.Sub(second.RenewAt); ev.Kind != EventRenewalFailed || wait < time.Second/2 || wait > 3*time.Second/2 {
		t.Errorf("first retry after a success waits %s (%+v), want the initial 1s ±50%%", wait, ev)
	}
	for ev.RetryAt.Before(second.NotAfter()) {
		if wait := ev.RetryAt.Sub(e.clock.Now()); wait > e.rot.RetryMax*3/2+time.Nanosecond {
			t.Fatalf("a retry waits %s, more than RetryMax %s +50%%", wait, e.rot.RetryMax)
		}
		ev = e.attempt(ev.RetryAt)
	}
	if !ev.RetryAt.Equal(second.NotAfter()) {
		t.Fatalf("last retry at %s, want the expiry %s", ev.RetryAt, second.NotAfter())
	}
	e.idle(ev.RetryAt)
	e.clock.Set(second.NotAfter().Add(-time.Nanosecond))
	ready(t, r.m, true)
	if got := current(t, r.m, WorkloadCertName); got.s != second {
		t.Fatalf("a nanosecond before expiry a subscriber is told %s", got)
	}
	ev = e.attempt(second.NotAfter())
	ready(t, r.m, false, ErrExpired.Error(), errCADown.Error())
	err := r.workload.nextErr(t)
	if !errors.Is(err, ErrExpired) || !errors.Is(err, errCADown) {
		t.Fatalf("after expiry subscribers are told %v, want ErrExpired and the last failure", err)
	}
	if got := current(t, r.m, RootCertName); got.s == nil {
		t.Errorf("ROOTCA unavailable once the certificate expired: %v", got.err)
	}

	// A subscriber waiting for a valid certificate gets the one issued when the CA returns.
	e.signer.setErr(nil)
	if ev = e.attempt(ev.RetryAt); ev.Kind != EventIssued {
		t.Fatalf("the attempt after the CA returned reported %+v", ev)
	}
	third := r.next(t)
	if third.Version == second.Version || !third.NotAfter().After(e.clock.Now()) {
		t.Fatalf("got serial %s expiring %s after the CA returned", third.Version, third.NotAfter())
	}
	ready(t, r.m, true)
}

func TestSignerErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		respond func(chain []*x509.Certificate) ([]*x509.Certificate, error)
		want    string
	}{
		{"token refused", func([]*x509.Certificate) ([]*x509.Certificate, error) {
			return nil, errors.New("CA rejected the token: token is expired")
		}, "CA rejected the token"},
		{"empty chain", func([]*x509.Certificate) ([]*x509.Certificate, error) { return nil, nil }, "no certificate"},
		{"leaf for another key", func(chain []*x509.Certificate) ([]*x509.Certificate, error) {
			return chain[1:], nil // the intermediate has its own key
		}, "does not match"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.signer.setRespond(tc.respond)
			r := e.start()
			ev := e.failure(0)
			if err := r.workload.nextErr(t); !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("subscribers are told %v, want an error mentioning %q", err, tc.want)
			}
			for i := range 4 {
				if ev.Kind != EventRenewalFailed || !strings.Contains(ev.Err.Error(), tc.want) {
					t.Fatalf("attempt %d reported %+v, want a failure mentioning %q", i+1, ev, tc.want)
				}
				if got := e.failures(); got != i+1 {
					t.Fatalf("failure counter %d after %d attempts", got, i+1)
				}
				select {
				case err := <-r.done:
					t.Fatalf("Run returned %v after a refusal", err)
				default:
				}
				ready(t, r.m, false, tc.want)
				if i == 3 {
					e.signer.setRespond(nil)
				}
				ev = e.attempt(ev.RetryAt)
			}
			if ev.Kind != EventIssued {
				t.Fatalf("no certificate once the CA behaved: %+v", ev)
			}
			if s := r.next(t); s.Source != SourceCA {
				t.Fatalf("got a certificate from %s", s.Source)
			}
			ready(t, r.m, true)
			if got := r.workload.seen(); len(got) != 2 {
				t.Errorf("subscribers were told %v, want one error (the same each time) and then the certificate", got)
			}
			if logged := e.logs.matching(func(rec logRecord) bool { return rec.attrs[logkey.CurrentExpires] != "" }); len(logged) != 0 {
				t.Errorf("a failure without a current certificate logged current_expires: %v", logged[0].attrs)
			}
		})
	}
}

func TestRestartWithOutputCerts(t *testing.T) {
	t.Parallel()
	otherID := pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "other"}
	for _, tc := range []struct {
		name      string
		writtenBy pki.SPIFFEID
		mtime     time.Time // of cert-chain.pem
		now       time.Time // when the new manager starts
		tamper    func(t *testing.T, dir string)
		caChanged bool      // the CA root configured at restart is not the one that issued the pair
		wantRenew time.Time // zero: not used, a Sign at once
	}{
		{name: "written 10m after issue", writtenBy: testID, mtime: t0.Add(10 * time.Minute), now: t0.Add(20 * time.Minute),
			wantRenew: t0.Add(35 * time.Minute)}, // 1h − 0.5·50m
		{name: "mtime before NotBefore", writtenBy: testID, mtime: t0.Add(-time.Hour), now: t0.Add(20 * time.Minute),
			wantRenew: t0.Add(29 * time.Minute)}, // from NotBefore = t0−2m: 1h − 0.5·62m
		{name: "mtime in the future", writtenBy: testID, mtime: t0.Add(2 * time.Hour), now: t0.Add(20 * time.Minute),
			wantRenew: t0.Add(40 * time.Minute)}, // from now: 1h − 0.5·40m
		{name: "another identity", writtenBy: otherID, mtime: t0, now: t0.Add(time.Minute)},
		{name: "expired", writtenBy: testID, mtime: t0, now: t0.Add(time.Hour)},
		// The attack: a VM restarted after its CA was replaced kept serving the old CA's pair, and
		// its root joined ROOTCA, until the next renewal hours later.
		{name: "issued by another CA than the configured root", writtenBy: testID, mtime: t0, now: t0.Add(time.Minute), caChanged: true},
		{name: "mismatched key", writtenBy: testID, mtime: t0, now: t0.Add(time.Minute), tamper: func(t *testing.T, dir string) {
			other, err := pki.GenerateKey(pki.ECDSA, 0)
			if err != nil {
				t.Fatal(err)
			}
			chainPEM, _ := os.ReadFile(filepath.Join(dir, CertChainFile))
			rootsPEM, _ := os.ReadFile(filepath.Join(dir, RootCertFile))
			if err := writeGeneration(dir, testutil.KeyPEM(t, other), chainPEM, rootsPEM); err != nil {
				t.Fatal(err)
			}
		}},
		{name: "key missing", writtenBy: testID, mtime: t0, now: t0.Add(time.Minute), tamper: func(t *testing.T, dir string) {
			target, err := filepath.EvalSymlinks(filepath.Join(dir, KeyFile))
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(target); err != nil {
				t.Fatal(err)
			}
		}},
		{name: "garbage chain", writtenBy: testID, mtime: t0, now: t0.Add(time.Minute), tamper: func(t *testing.T, dir string) {
			keyPEM, _ := os.ReadFile(filepath.Join(dir, KeyFile))
			if err := writeGeneration(dir, keyPEM, []byte("not a certificate"), nil); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := filepath.Join(t.TempDir(), "out")

			// An earlier run writes OUTPUT_CERTS.
			earlier := newEnv(t)
			earlier.cfg.Output.Dir = dir
			earlier.rot.Identity = tc.writtenBy
			er := earlier.start()
			old := er.next(t)
			earlier.awaitOutput(old.Version)
			if err := er.stop(t); err != nil {
				t.Fatal(err)
			}
			if tc.tamper != nil {
				tc.tamper(t, dir)
			}
			target, err := filepath.EvalSymlinks(filepath.Join(dir, CertChainFile))
			if err == nil {
				err = os.Chtimes(target, tc.mtime, tc.mtime)
			}
			if err != nil {
				t.Fatal(err)
			}
			dataBefore, err := os.Readlink(filepath.Join(dir, dataLink))
			if err != nil {
				t.Fatal(err)
			}

			e := newEnv(t)
			e.cfg.Output.Dir = dir
			e.succeeds(t, earlier)
			if tc.caChanged {
				e.signer.rotateCA(t)
				e.trustSignerRoot(t)
			}
			e.clock.Set(tc.now)
			r := e.start()
			s := r.next(t)
			e.awaitOutput(s.Version)

			if tc.wantRenew.IsZero() {
				if s.Source != SourceCA || s.Version == old.Version || e.signer.Calls() != 1 {
					t.Fatalf("used the certificate in OUTPUT_CERTS (source %s, serial %s, %d Sign calls)", s.Source, s.Version, e.signer.Calls())
				}
				if leaf, _ := readPair(t, dir); leaf.SerialNumber.Text(16) != s.Version {
					t.Errorf("OUTPUT_CERTS not replaced: serial %s, want %s", leaf.SerialNumber.Text(16), s.Version)
				}
				if logged := e.logs.matching(func(rec logRecord) bool { return rec.attrs[logkey.Dir] == dir && rec.attrs[logkey.Reason] != "" }); len(logged) == 0 {
					t.Error("the reason for not using OUTPUT_CERTS was not logged")
				}
				return
			}

			if s.Source != SourceOutputCerts || s.Version != old.Version || string(s.KeyPair.KeyPEM) != string(old.KeyPair.KeyPEM) {
				t.Fatalf("served %s serial %s, want output-certs serial %s", s.Source, s.Version, old.Version)
			}
			ready(t, r.m, true)
			if !s.RenewAt.Equal(tc.wantRenew) {
				t.Fatalf("RenewAt = t0+%s, want t0+%s", s.RenewAt.Sub(t0), tc.wantRenew.Sub(t0))
			}
			if e.signer.Calls() != 0 {
				t.Fatalf("%d Sign calls before the renewal point", e.signer.Calls())
			}
			if connects := e.signer.Connects(); len(connects) != 0 {
				t.Errorf("connected to the CA at start-up with a certificate in service (%v)", connects)
			}
			if got := e.metric("meshid_agent_cert_rotations_total"); got != 0 {
				t.Errorf("rotations counter %v for a certificate from disk, want 0", got)
			}
			if after, _ := os.Readlink(filepath.Join(dir, dataLink)); after != dataBefore {
				t.Error("OUTPUT_CERTS rewritten on start-up with the certificate read from it")
			}
			e.idle(s.RenewAt)
			e.clock.Set(s.RenewAt.Add(-time.Nanosecond))
			if e.signer.Calls() != 0 {
				t.Fatal("renewed before the renewal point")
			}
			if ev := e.attempt(s.RenewAt); ev.Kind != EventIssued {
				t.Fatalf("no renewal at the renewal point: %+v", ev)
			}
			renewed := r.next(t)
			if renewed.Source != SourceCA || renewed.Version == old.Version || e.signer.Calls() != 1 {
				t.Fatalf("renewal gave %s serial %s after %d Sign calls", renewed.Source, renewed.Version, e.signer.Calls())
			}
			e.awaitOutput(renewed.Version)
			if leaf, _ := readPair(t, dir); leaf.SerialNumber.Text(16) != renewed.Version {
				t.Errorf("OUTPUT_CERTS holds serial %s after renewal, want %s", leaf.SerialNumber.Text(16), renewed.Version)
			}
		})
	}
}

func TestKeyAlgorithms(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		alg   pki.KeyAlgorithm
		bits  int
		check func(pub any) bool
	}{
		{"default is ECDSA P-256", "", 0, isP256},
		{"ECDSA", pki.ECDSA, 0, isP256},
		{"RSA 2048", pki.RSA, 2048, func(pub any) bool {
			k, ok := pub.(*rsa.PublicKey)
			return ok && k.N.BitLen() == 2048
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.rot.KeyAlgorithm, e.rot.RSAKeySize = tc.alg, tc.bits
			s := e.start().next(t)
			parsed, err := pki.ParsePrivateKey(s.KeyPair.KeyPEM)
			if err != nil {
				t.Fatal(err)
			}
			for what, pub := range map[string]any{"leaf": s.KeyPair.Leaf().PublicKey, "Key": s.KeyPair.Key.Public(), "KeyPEM": parsed.Public()} {
				if !tc.check(pub) {
					t.Errorf("%s key is %T", what, pub)
				}
			}
		})
	}
}

func isP256(pub any) bool {
	k, ok := pub.(*ecdsa.PublicKey)
	return ok && k.Curve == elliptic.P256()
}

// TestRotationDefaults runs a Rotation that sets nothing but its signer and identity: Istio's
// TTL, grace ratio and jitter, and a backoff from 1 s to 5 min.
func TestRotationDefaults(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.cfg.Workload = &Rotation{Signer: e.signer, Identity: testID}
	r := e.start()
	s := r.next(t)
	if got := e.signer.TTLs(); len(got) != 1 || got[0] != DefaultTTL {
		t.Errorf("asked for TTLs %v, want %s", got, DefaultTTL)
	}
	if !isP256(s.KeyPair.Leaf().PublicKey) {
		t.Errorf("default key is %T", s.KeyPair.Leaf().PublicKey)
	}
	lifetime := s.NotAfter().Sub(s.Received)
	lo := s.NotAfter().Add(-time.Duration((DefaultGraceRatio + DefaultGraceRatioJitter) * float64(lifetime)))
	hi := s.NotAfter().Add(-time.Duration((DefaultGraceRatio - DefaultGraceRatioJitter) * float64(lifetime)))
	if s.RenewAt.Before(lo) || s.RenewAt.After(hi) {
		t.Errorf("renews at %s, outside [%s, %s]", s.RenewAt, lo, hi)
	}
	e.signer.setErr(errCADown)
	ev := e.attempt(s.RenewAt)
	failedAt := s.RenewAt
	for i := range 18 {
		if ev.Kind != EventRenewalFailed {
			t.Fatalf("attempt %d reported %+v", i+1, ev)
		}
		backoffWithin(t, i, ev.RetryAt.Sub(failedAt), DefaultRetryInitial, DefaultRetryMax)
		failedAt = ev.RetryAt
		ev = e.attempt(ev.RetryAt)
	}
}

// TestSubscribeDeliversStateThenChanges: a subscriber is told the state held when it subscribes
// (before Subscribe returns) and then every change, in the order they happened, whichever
// subscriber it is; after cancel it is told nothing more.
func TestSubscribeDeliversStateThenChanges(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.rot.RetryInitial, e.rot.RetryMax = 10*time.Minute, 10*time.Minute
	m := e.newManager()
	a := subscribe(t, m, WorkloadCertName) // before anything is known: told nothing yet
	if got := a.seen(); len(got) != 0 {
		t.Fatalf("told %v before Run", got)
	}
	r := e.run(m)
	s1 := a.next(t)
	e.idle(s1.RenewAt)

	b := subscribe(t, m, WorkloadCertName)
	if got := b.seen(); len(got) != 1 || got[0].s != s1 {
		t.Fatalf("a subscriber told %v when Subscribe returned, want the secret held (%s)", got, s1.Version)
	}
	b.next(t)
	rootsNow := current(t, m, RootCertName).s
	roots := subscribe(t, m, RootCertName)
	if got := roots.seen(); len(got) != 1 || got[0].s != rootsNow {
		t.Fatalf("a ROOTCA subscriber told %v when Subscribe returned, want version %s", got, rootsNow.Version)
	}
	roots.next(t)

	// A renewal from a new CA: both names change.
	e.signer.rotateCA(t)
	e.attempt(s1.RenewAt)
	s2 := a.next(t)
	roots2 := roots.next(t)
	if b.next(t) != s2 || roots2.Version == rootsNow.Version {
		t.Fatal("the subscribers were not all told of the renewal")
	}

	// The CA is down until the certificate expires.
	e.signer.setErr(errCADown)
	ev := e.attempt(s2.RenewAt)
	for ev.RetryAt.Before(s2.NotAfter()) {
		ev = e.attempt(ev.RetryAt)
	}
	ev = e.attempt(ev.RetryAt)
	expired := a.nextErr(t)
	if !errors.Is(expired, ErrExpired) || b.nextErr(t) == nil {
		t.Fatalf("told %v at expiry, want ErrExpired", expired)
	}
	c := subscribe(t, m, WorkloadCertName)
	if got := c.seen(); len(got) != 1 || got[0].err == nil || got[0].err.Error() != expired.Error() {
		t.Fatalf("a subscriber told %v when Subscribe returned, want the expiry (%v)", got, expired)
	}
	if err := c.nextErr(t); !errors.Is(err, ErrExpired) {
		t.Fatalf("told %v, want ErrExpired", err)
	}

	// The CA is back.
	e.signer.setErr(nil)
	e.attempt(ev.RetryAt)
	s3 := a.next(t)
	if b.next(t) != s3 || c.next(t) != s3 {
		t.Fatal("the subscribers were not all told of the new certificate")
	}
	b.cancel()
	b.cancel() // twice is harmless

	e.signer.rotateCA(t)
	e.attempt(s3.RenewAt)
	s4 := a.next(t)
	if c.next(t) != s4 {
		t.Fatal("a subscriber was not told of the renewal")
	}
	roots4 := roots.next(t)
	if roots4.Version == roots2.Version {
		t.Error("ROOTCA kept its version after a renewal from a new CA")
	}

	// Every subscriber saw the same changes in the same order as they were reported.
	var changes []string
	for _, ev := range e.events.since(0, changedName(WorkloadCertName)) {
		changes = append(changes, update{s: &Secret{Version: ev.Version}, err: ev.Err}.key())
	}
	keys := func(us []update) []string {
		var out []string
		for _, u := range us {
			out = append(out, u.key())
		}
		return out
	}
	want := []string{"secret " + s1.Version, "secret " + s2.Version, "error " + expired.Error(), "secret " + s3.Version, "secret " + s4.Version}
	for _, check := range []struct {
		name string
		got  []string
		want []string
	}{
		{"reported", changes, want},
		{"first subscriber", keys(a.seen()), want},
		{"another subscriber from before Run", keys(r.workload.seen()), want},
		{"cancelled subscriber", keys(b.seen()), want[:4]},
		{"subscriber during the expiry", keys(c.seen()), want[2:]},
	} {
		if strings.Join(check.got, "\n") != strings.Join(check.want, "\n") {
			t.Errorf("%s: %q, want %q", check.name, check.got, check.want)
		}
	}
	var rootChanges []string
	for _, ev := range e.events.since(0, changedName(RootCertName)) {
		rootChanges = append(rootChanges, ev.Version)
	}
	var rootsSeen []string
	for _, u := range roots.seen() {
		rootsSeen = append(rootsSeen, u.s.Version)
	}
	if len(rootChanges) != 3 || strings.Join(rootsSeen, " ") != strings.Join(rootChanges, " ") {
		t.Errorf("ROOTCA subscriber saw %q, reported changes %q", rootsSeen, rootChanges)
	}
}

// key is what tells states apart: the secret's version or the error's text.
func (u update) key() string {
	if u.err != nil {
		return "error " + u.err.Error()
	}
	return "secret " + u.s.Version
}

// TestNoValidCertificate: without a valid certificate (the CA refusing from the start, or the
// one held expiring while the CA is down), subscribers are told why, Ready says it,
// meshid_agent_cert_valid is 0, and the change is reported and logged once, however many attempts
// fail; when the CA recovers all of it flips back.
func TestNoValidCertificate(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.rot.RetryInitial, e.rot.RetryMax = 10*time.Minute, 10*time.Minute
	e.signer.setErr(errCADown)
	m := e.newManager()
	early := subscribe(t, m, WorkloadCertName)
	r := e.run(m)

	// Refused from the start.
	if err := early.nextErr(t); !errors.Is(err, errCADown) {
		t.Fatalf("subscribers told %v, want the CA's error", err)
	}
	if err := r.roots.nextErr(t); !errors.Is(err, errCADown) {
		t.Fatalf("ROOTCA subscribers told %v, want the CA's error", err)
	}
	ev := e.failure(0)
	for range 3 {
		ready(t, m, false, errCADown.Error())
		if got := e.certValid(); got != 0 {
			t.Fatalf("meshid_agent_cert_valid = %v without a certificate", got)
		}
		ev = e.attempt(ev.RetryAt)
		if ev.Kind != EventRenewalFailed {
			t.Fatalf("an attempt reported %+v", ev)
		}
	}
	late := subscribe(t, m, WorkloadCertName)
	if got := late.seen(); len(got) != 1 || !errors.Is(got[0].err, errCADown) {
		t.Fatalf("a subscriber told %v when Subscribe returned, want the CA's error", got)
	}
	for _, sub := range []*subscription{late, r.workload} {
		if err := sub.nextErr(t); !errors.Is(err, errCADown) {
			t.Fatalf("told %v, want the CA's error", err)
		}
	}

	// The CA recovers.
	e.signer.setErr(nil)
	if ev = e.attempt(ev.RetryAt); ev.Kind != EventIssued {
		t.Fatalf("the attempt after the CA recovered reported %+v", ev)
	}
	first := early.next(t)
	if late.next(t) != first || r.next(t) != first || r.roots.next(t) == nil {
		t.Fatal("the subscribers were not all told of the certificate")
	}
	ready(t, m, true)
	if got := e.certValid(); got != 1 {
		t.Fatalf("meshid_agent_cert_valid = %v with a certificate", got)
	}
	if got := e.failures(); got != 4 {
		t.Errorf("%d failures counted, want 4", got)
	}
	if got := len(e.events.since(0, changedName(WorkloadCertName))); got != 2 {
		t.Errorf("%d changes of default reported for 4 failures and a success, want 2", got)
	}

	// Down again across the renewal: nothing changes while the certificate is valid.
	e.signer.setErr(errCADown)
	ev = e.attempt(first.RenewAt)
	for ev.RetryAt.Before(first.NotAfter()) {
		ready(t, m, true)
		if got := e.certValid(); got != 1 {
			t.Fatalf("meshid_agent_cert_valid = %v while the certificate is valid", got)
		}
		ev = e.attempt(ev.RetryAt)
	}
	early.none(t, "while the certificate was valid")
	if n := e.errorLogs(); n != 1 {
		t.Errorf("%d errors logged before the certificate expired, want 1 (the refusal at start)", n)
	}

	// It expires.
	ev = e.attempt(first.NotAfter())
	expired := early.nextErr(t)
	if !errors.Is(expired, ErrExpired) || !errors.Is(expired, errCADown) {
		t.Fatalf("subscribers told %v at expiry, want ErrExpired and the CA's error", expired)
	}
	if late.nextErr(t).Error() != expired.Error() || r.workload.nextErr(t).Error() != expired.Error() {
		t.Fatal("the subscribers were not all told of the expiry")
	}
	for range 3 {
		ready(t, m, false, ErrExpired.Error(), errCADown.Error())
		if got := e.certValid(); got != 0 {
			t.Fatalf("meshid_agent_cert_valid = %v after expiry", got)
		}
		if c := m.TLSCertificate(); c != nil {
			t.Fatal("TLSCertificate returned an expired certificate")
		}
		if ev = e.attempt(ev.RetryAt); ev.Kind != EventRenewalFailed {
			t.Fatalf("an attempt reported %+v", ev)
		}
	}
	if got := current(t, m, RootCertName); got.s == nil {
		t.Errorf("ROOTCA not served after the certificate expired: %v", got.err)
	}

	// The CA recovers again.
	e.signer.setErr(nil)
	if ev = e.attempt(ev.RetryAt); ev.Kind != EventIssued {
		t.Fatalf("the attempt after the CA recovered reported %+v", ev)
	}
	second := early.next(t)
	var reasons []string
	for _, r := range e.logs.matching(func(r logRecord) bool { return r.msg == "workload certificate in service" }) {
		reasons = append(reasons, r.attrs["reason"])
	}
	if !slices.Equal(reasons, []string{"the first since start", "a valid certificate is held again"}) {
		t.Errorf("certificates in service logged with reasons %q, want the first, then again after the expiry", reasons)
	}
	late.next(t)
	r.next(t)
	ready(t, m, true)
	if got := e.certValid(); got != 1 {
		t.Fatalf("meshid_agent_cert_valid = %v with a certificate again", got)
	}

	// Each change was told and reported once: not once per failed attempt.
	var changes []string
	for _, ev := range e.events.since(0, changedName(WorkloadCertName)) {
		changes = append(changes, update{s: &Secret{Version: ev.Version}, err: ev.Err}.key())
	}
	want := []string{"error " + errCADown.Error(), "secret " + first.Version, "error " + expired.Error(), "secret " + second.Version}
	if strings.Join(changes, "\n") != strings.Join(want, "\n") {
		t.Errorf("changes of default reported: %q, want %q", changes, want)
	}
	if got := early.seen(); len(got) != len(want) {
		t.Errorf("a subscriber was told %v, want %d changes", got, len(want))
	}
	errs := e.logs.matching(func(rec logRecord) bool { return rec.level >= slog.LevelError })
	if len(errs) != 2 {
		t.Fatalf("%d errors logged, want one per loss of a valid certificate (2)", len(errs))
	}
	for _, rec := range errs {
		if !strings.Contains(rec.attrs[logkey.Reason], errCADown.Error()) {
			t.Errorf("logged %q with %v, want the reason", rec.msg, rec.attrs)
		}
	}
}

// TestTLSCertificate: the workload key pair is presented (to the CA, for mTLS renewal) while it
// is valid, whichever source it comes from, and never once it has expired.
func TestTLSCertificate(t *testing.T) {
	t.Parallel()
	check := func(t *testing.T, m *Manager, want *Secret) {
		t.Helper()
		c := m.TLSCertificate()
		if want == nil {
			if c != nil {
				t.Fatalf("TLSCertificate returned serial %s, want none", c.Leaf.SerialNumber.Text(16))
			}
			return
		}
		if c == nil {
			t.Fatalf("TLSCertificate returned nothing, want serial %s", want.KeyPair.Leaf().SerialNumber.Text(16))
		}
		if !c.Leaf.Equal(want.KeyPair.Leaf()) || len(c.Certificate) != len(want.KeyPair.Chain) {
			t.Fatalf("TLSCertificate has leaf %s and %d certificates, want %s and %d",
				c.Leaf.SerialNumber.Text(16), len(c.Certificate), want.KeyPair.Leaf().SerialNumber.Text(16), len(want.KeyPair.Chain))
		}
		for i, der := range c.Certificate {
			if string(der) != string(want.KeyPair.Chain[i].Raw) {
				t.Fatalf("TLSCertificate's certificate %d is not the chain's", i)
			}
		}
		if key, ok := c.PrivateKey.(crypto.Signer); !ok || !pki.KeyMatchesCertificate(key, c.Leaf) {
			t.Fatal("TLSCertificate's key does not match its leaf")
		}
	}

	t.Run("from the CA", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		m := e.newManager()
		check(t, m, nil)
		r := e.run(m)
		s := r.next(t)
		check(t, m, s)

		e.signer.setErr(errCADown)
		ev := e.attempt(s.RenewAt)
		for ev.RetryAt.Before(s.NotAfter()) {
			check(t, m, s) // the CA is down, the certificate valid
			ev = e.attempt(ev.RetryAt)
		}
		e.idle(s.NotAfter())
		e.clock.Set(s.NotAfter().Add(-time.Nanosecond))
		check(t, m, s)
		ev = e.attempt(s.NotAfter())
		check(t, m, nil)

		e.signer.setErr(nil)
		e.attempt(ev.RetryAt)
		if err := r.workload.nextErr(t); !errors.Is(err, ErrExpired) {
			t.Fatalf("told %v at expiry, want ErrExpired", err)
		}
		renewed := r.next(t)
		check(t, m, renewed)
	})

	t.Run("from mounted files", func(t *testing.T) {
		t.Parallel()
		ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "files root"})
		kp := validPair(t, ca)
		e, vol := fileModeEnv(t, ca, kp)
		m := e.newManager()
		check(t, m, nil)
		r := e.run(m)
		s := r.next(t)
		check(t, m, s)

		// The loader reads the files again when the pair expires, and says so.
		waitArmed(t, e.clock, s.NotAfter())
		e.clock.Set(s.NotAfter().Add(-time.Nanosecond))
		check(t, m, s)
		e.clock.Set(s.NotAfter())
		check(t, m, nil)
		if err := r.workload.nextErr(t); !errors.Is(err, ErrExpired) {
			t.Fatalf("subscribers told %v when the files' pair expired, want ErrExpired", err)
		}
		if got := e.certValid(); got != 0 {
			t.Errorf("meshid_agent_cert_valid = %v with an expired pair", got)
		}

		next := newKeyPair(t, ca, s.NotAfter().Add(-time.Hour), s.NotAfter().Add(24*time.Hour))
		vol.Update(next.files(testutil.CertPEM(ca.Cert)))
		u := drive(t, e.clock, r.workload.ch)
		if u.s == nil {
			t.Fatalf("told %v after a valid pair was mounted", u)
		}
		checkServes(t, u.s, WorkloadCertName, next)
		check(t, m, u.s)
		if got := e.certValid(); got != 1 {
			t.Errorf("meshid_agent_cert_valid = %v with a valid pair", got)
		}
	})
}

func TestNewRefuses(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, tc := range []struct {
		name   string
		edit   func(*Config, *Rotation)
		reject bool
		want   string // in the error
	}{
		{"valid", func(*Config, *Rotation) {}, false, ""},
		{"zero ratio means the default", func(_ *Config, r *Rotation) { r.GraceRatio = 0 }, false, ""},
		{"no jitter", func(_ *Config, r *Rotation) { r.GraceRatioJitter = 0 }, false, ""},
		{"no workload source", func(c *Config, _ *Rotation) { c.Workload = nil }, true, "workload source"},
		{"nil signer", func(_ *Config, r *Rotation) { r.Signer = nil }, true, "signer"},
		{"empty identity", func(_ *Config, r *Rotation) { r.Identity = pki.SPIFFEID{} }, true, ""},
		{"upper-case namespace", func(_ *Config, r *Rotation) { r.Identity.Namespace = "Shop" }, true, "namespace"},
		{"bad trust domain", func(_ *Config, r *Rotation) { r.Identity.TrustDomain = "cluster local" }, true, ""},
		{"ratio 1.5", func(_ *Config, r *Rotation) { r.GraceRatio = 1.5 }, true, "grace period ratio 1.5"},
		{"ratio 1", func(_ *Config, r *Rotation) { r.GraceRatio = 1 }, true, ""},
		{"ratio 1 without jitter", func(_ *Config, r *Rotation) { r.GraceRatio, r.GraceRatioJitter = 1, 0 }, true, "grace period ratio 1 "},
		{"negative ratio without jitter", func(_ *Config, r *Rotation) { r.GraceRatio, r.GraceRatioJitter = -0.5, 0 }, true, "grace period ratio -0.5"},
		{"negative ratio", func(_ *Config, r *Rotation) { r.GraceRatio = -0.5 }, true, ""},
		{"negative jitter", func(_ *Config, r *Rotation) { r.GraceRatioJitter = -0.01 }, true, "jitter -0.01"},
		{"jitter down to 0", func(_ *Config, r *Rotation) { r.GraceRatio, r.GraceRatioJitter = 0.1, 0.1 }, true, ""},
		{"jitter up to 1", func(_ *Config, r *Rotation) { r.GraceRatio, r.GraceRatioJitter = 0.95, 0.05 }, true, ""},
		{"jitter just inside", func(_ *Config, r *Rotation) { r.GraceRatio, r.GraceRatioJitter = 0.9, 0.09 }, false, ""},
		{"RSA 1024", func(_ *Config, r *Rotation) { r.KeyAlgorithm, r.RSAKeySize = pki.RSA, 1024 }, true, "1024"},
		{"RSA 16384", func(_ *Config, r *Rotation) { r.KeyAlgorithm, r.RSAKeySize = pki.RSA, 16384 }, true, "16384"},
		{"RSA default size", func(_ *Config, r *Rotation) { r.KeyAlgorithm = pki.RSA }, false, ""},
		{"DSA", func(_ *Config, r *Rotation) { r.KeyAlgorithm = "DSA" }, true, "DSA"},
		{"mounted files without a key", func(c *Config, _ *Rotation) {
			c.Workload = &MountedFiles{CertChain: "/etc/certs/cert-chain.pem", Root: "/etc/certs/root-cert.pem"}
		}, true, "a key"},
		{"mounted files", func(c *Config, _ *Rotation) {
			c.Workload = &MountedFiles{CertChain: "/etc/certs/cert-chain.pem", Key: "/etc/certs/key.pem", Root: "/etc/certs/root-cert.pem"}
		}, false, ""},
		{"group-readable key in private directories", func(c *Config, _ *Rotation) { c.Output = Output{Dir: "/out", KeyGroupRead: true} }, true, "group-readable"},
		{"group-readable key and directories", func(c *Config, _ *Rotation) { c.Output = Output{Dir: "/out", GroupRead: true, KeyGroupRead: true} }, false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, rot := e.cfg, *e.rot
			cfg.Workload, cfg.Registerer = &rot, nil
			tc.edit(&cfg, &rot)
			_, err := New(cfg)
			if tc.reject != (err != nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("New = %v, want rejected %v (saying %q)", err, tc.reject, tc.want)
			}
		})
	}
	// Two managers cannot register the same metrics.
	reg := prometheus.NewRegistry()
	cfg := e.cfg
	cfg.Registerer = reg
	if _, err := New(cfg); err != nil {
		t.Fatal(err)
	}
	if _, err := New(cfg); err == nil {
		t.Error("a second manager registered the same metrics")
	}
}

func TestRunStopsWhenCancelled(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// reach puts the manager in the state to be cancelled in, after the first certificate.
		reach func(t *testing.T, e *env, first *Secret)
	}{
		{"waiting to renew", func(*testing.T, *env, *Secret) {}},
		{"waiting to retry", func(t *testing.T, e *env, first *Secret) {
			e.signer.setErr(errCADown)
			ev := e.attempt(first.RenewAt)
			if ev.Kind != EventRenewalFailed || e.failures() != 1 {
				t.Fatalf("no failed renewal: %+v", ev)
			}
			e.idle(ev.RetryAt)
		}},
		{"inside Sign", func(t *testing.T, e *env, first *Secret) {
			entered, release := e.signer.blockCalls()
			t.Cleanup(release)
			e.idle(first.RenewAt)
			e.clock.Set(first.RenewAt)
			recv(t, entered, "the renewal's Sign call")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			out := filepath.Join(t.TempDir(), "out")
			e.cfg.Output.Dir = out
			e.rot.RootCertFile = filepath.Join(t.TempDir(), "root-cert.pem")
			writeFileAtomic(t, e.rot.RootCertFile, testutil.CertPEM(e.signer.rootCert()))
			r := e.start()
			first := r.next(t)
			e.awaitOutput(first.Version)
			e.idle(first.RenewAt)
			keyBefore, _ := os.ReadFile(filepath.Join(out, KeyFile))
			chainBefore, _ := os.ReadFile(filepath.Join(out, CertChainFile))
			tc.reach(t, e, first)
			failuresBefore := e.failures()

			if err := r.stop(t); err != nil {
				t.Fatalf("Run = %v, want nil", err)
			}
			if n := e.clock.PendingTimers(); n != 0 {
				t.Errorf("%d timers left pending after Run returned", n)
			}
			if e.failures() != failuresBefore {
				t.Errorf("the cancellation counted as a renewal failure")
			}
			keyAfter, _ := os.ReadFile(filepath.Join(out, KeyFile))
			chainAfter, _ := os.ReadFile(filepath.Join(out, CertChainFile))
			if string(keyAfter) != string(keyBefore) || string(chainAfter) != string(chainBefore) {
				t.Error("OUTPUT_CERTS changed on shutdown")
			}
			if leaf, _ := readPair(t, out); leaf.SerialNumber.Text(16) != first.Version {
				t.Errorf("OUTPUT_CERTS holds serial %s, want %s", leaf.SerialNumber.Text(16), first.Version)
			}
			if got := generations(t, out); len(got) != 1 {
				t.Errorf("generations left: %v", got)
			}
		})
	}
}

// A failing renewal is retried no later than the moment the certificate in service expires,
// however long the backoff has grown, so that a CA that came back in the meantime is used in time.
func TestRetryNoLaterThanExpiry(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.rot.RetryInitial, e.rot.RetryMax = 2*time.Hour, 2*time.Hour // any backoff outlasts the certificate
	r := e.start()
	first := r.next(t)
	e.signer.setErr(errors.New("CA down"))
	ev := e.attempt(first.RenewAt)
	if ev.Kind != EventRenewalFailed || e.failures() != 1 {
		t.Fatalf("the renewal reported %+v with %d failures counted, want 1 failure", ev, e.failures())
	}
	if !ev.RetryAt.Equal(first.NotAfter()) {
		t.Fatalf("retry at %s, want at the expiry %s at the latest", ev.RetryAt, first.NotAfter())
	}
	calls := e.signer.Calls()
	e.idle(first.NotAfter())
	e.clock.Set(first.NotAfter().Add(-time.Second))
	if e.signer.Calls() != calls {
		t.Fatal("retried before the certificate expired, with a 2h backoff")
	}
	e.signer.setErr(nil)
	if ev := e.attempt(first.NotAfter()); ev.Kind != EventIssued || e.signer.Calls() != calls+1 {
		t.Fatalf("no retry at the moment the certificate in service expires: %+v", ev)
	}
	// It expired the moment the retry began: subscribers are told so, then given the new one.
	if err := r.workload.nextErr(t); !errors.Is(err, ErrExpired) {
		t.Fatalf("told %v, want ErrExpired", err)
	}
	if got := r.next(t); got.Version == first.Version {
		t.Fatal("the retry at expiry did not put a new certificate in service")
	}
}

// The wait before each retry is spread ±50% around the backoff's interval by Rotation.Rand, the
// one source of the rotation's randomness: agents that failed together do not retry together,
// and a test (or the storm benchmark's baseline) can take the spread away.
func TestRetryWaitsAreSpreadByRand(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		rand  float64
		waits []time.Duration // the first two retries
	}{
		{0, []time.Duration{5 * time.Second, 7500 * time.Millisecond}},
		{0.5, []time.Duration{10 * time.Second, 15 * time.Second}},
		{0.75, []time.Duration{12500 * time.Millisecond, 18750 * time.Millisecond}},
	} {
		t.Run(fmt.Sprint(tc.rand), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.rot.RetryInitial, e.rot.RetryMax = 10*time.Second, time.Minute
			e.rot.Rand = func() float64 { return tc.rand }
			e.signer.setErr(errCADown)
			e.start()
			failedAt := t0
			ev := e.failure(0)
			for i, want := range tc.waits {
				if got := ev.RetryAt.Sub(failedAt); got != want {
					t.Fatalf("retry %d waits %s, want %s", i+1, got, want)
				}
				failedAt = ev.RetryAt
				if ev = e.attempt(ev.RetryAt); ev.Kind != EventRenewalFailed {
					t.Fatalf("attempt %d: %+v, want a failure", i+2, ev)
				}
			}
		})
	}
}

// A CA that accepts the renewal and never answers (a stopped process) holds the request until the
// client's deadlines, which may outlast a short-lived certificate in service: its expiry is told
// when it comes (subscribers, meshid_agent_cert_valid), not when the request ends.
func TestExpiryDuringAHungRenewal(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.rot.TTL = time.Minute // renewed with 30 s left: within the CA client's deadlines
	r := e.start()
	first := r.next(t)
	entered, release := e.signer.blockCalls()
	defer release()
	e.idle(first.RenewAt)
	e.clock.Set(first.RenewAt)
	recv(t, entered, "the renewal's call to the CA")

	e.clock.Set(first.NotAfter())
	if err := r.workload.nextErr(t); !errors.Is(err, ErrExpired) {
		t.Fatalf("told %v at expiry, the renewal still under way; want ErrExpired", err)
	}
	if got := e.certValid(); got != 0 {
		t.Fatalf("meshid_agent_cert_valid = %v after expiry, the renewal still under way", got)
	}
	release()
	if got := r.next(t); got.Version == first.Version {
		t.Fatal("the renewal that ended after expiry did not put a new certificate in service")
	}
	if got := e.certValid(); got != 1 {
		t.Fatalf("meshid_agent_cert_valid = %v with a new certificate", got)
	}
}
