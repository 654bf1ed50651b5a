package secretmanager

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/x509"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

func TestInitialIssuance(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	otherRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "other root"})
	thirdRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "third root"})
	chainRoot := e.signer.rootCert()
	rootFile := filepath.Join(t.TempDir(), "root-cert.pem")
	// The chain's own root is in the file too, after another: ROOTCA lists it once, first.
	writeFileAtomic(t, rootFile, testutil.CertPEM(otherRoot.Cert, chainRoot))
	e.cfg.RootCertFile = rootFile
	e.cfg.OutputDir = filepath.Join(t.TempDir(), "out")
	m := e.newManager()

	if _, err := m.GenerateSecret(cancelledCtx(), WorkloadCertName); !errors.Is(err, context.Canceled) {
		t.Fatalf("GenerateSecret before Run = %v, want context.Canceled", err)
	}
	if m.Ready() {
		t.Fatal("Ready before any certificate")
	}
	type result struct {
		s   *Secret
		err error
	}
	early := make(chan result, 1)
	go func() {
		s, err := m.GenerateSecret(t.Context(), WorkloadCertName)
		early <- result{s, err}
	}()
	entered, release := e.signer.blockCalls()
	r := e.run(m)
	recv(t, entered, "the first Sign")
	select {
	case res := <-early:
		t.Fatalf("GenerateSecret returned (%v, %v) before the CA answered", res.s, res.err)
	default:
	}
	release()
	res := recv(t, early, "GenerateSecret to return once the certificate exists")
	if res.err != nil {
		t.Fatal(res.err)
	}
	s := res.s

	if got := e.signer.TTLs(); len(got) != 1 || got[0] != time.Hour {
		t.Errorf("Sign calls asked for TTLs %v, want one of 1h", got)
	}
	if s.Name != WorkloadCertName || s.Source != "ca" || len(s.Chain) != 3 {
		t.Fatalf("got %s from %q with %d certificates, want default from ca with 3", s.Name, s.Source, len(s.Chain))
	}
	leaf := s.Chain[0]
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != testID.String() {
		t.Errorf("leaf names %v, want %s", leaf.URIs, testID)
	}
	if !pki.KeyMatchesCertificate(s.Key, leaf) {
		t.Error("Key does not match the leaf")
	}
	if parsed, err := pki.ParsePrivateKey(s.KeyPEM); err != nil || !pki.KeyMatchesCertificate(parsed, leaf) {
		t.Errorf("KeyPEM does not parse to the leaf's key (err %v)", err)
	}
	if parsed, err := pki.ParseCertificates(s.ChainPEM); err != nil || !sameCerts(parsed, s.Chain) {
		t.Errorf("ChainPEM does not hold Chain (err %v)", err)
	}
	if s.Version != leaf.SerialNumber.Text(16) {
		t.Errorf("Version %q, want the serial %s", s.Version, leaf.SerialNumber.Text(16))
	}
	if !s.CreatedAt.Equal(t0) || !s.ExpiresAt.Equal(t0.Add(time.Hour)) || !s.RenewAt.Equal(t0.Add(30*time.Minute)) {
		t.Errorf("created %s, expires %s, renews %s; want t0, t0+1h, t0+30m", s.CreatedAt, s.ExpiresAt, s.RenewAt)
	}
	if !m.Ready() {
		t.Error("not Ready with a valid certificate")
	}
	if again, err := m.GenerateSecret(cancelledCtx(), WorkloadCertName); err != nil || again != s {
		t.Errorf("a second GenerateSecret = (%v, %v), want the cached secret", again, err)
	}
	if e.signer.Calls() != 1 {
		t.Errorf("Sign called %d times, want 1", e.signer.Calls())
	}

	roots, err := m.GenerateSecret(cancelledCtx(), RootCertName)
	if err != nil {
		t.Fatal(err)
	}
	if want := []*x509.Certificate{chainRoot, otherRoot.Cert}; !sameCerts(roots.Roots, want) {
		t.Fatalf("ROOTCA = %s, want %s", names(roots.Roots), names(want))
	}
	if parsed, err := pki.ParseCertificates(roots.RootsPEM); err != nil || !sameCerts(parsed, roots.Roots) {
		t.Errorf("RootsPEM does not hold Roots (err %v)", err)
	}
	if roots.Chain != nil || roots.Key != nil || roots.Name != RootCertName {
		t.Errorf("ROOTCA secret carries a key pair or the wrong name: %+v", roots)
	}

	for _, name := range []string{"", "rootca", "Default", "file-cert:/etc/certs/cert.pem", "file-root:"} {
		if _, err := m.GenerateSecret(cancelledCtx(), name); !errors.Is(err, ErrUnknownSecret) {
			t.Errorf("GenerateSecret(%q) = %v, want ErrUnknownSecret", name, err)
		}
	}
	if _, err := m.GenerateSecret(cancelledCtx(), "file-root:foo"); !errors.Is(err, ErrForbiddenPath) {
		t.Errorf("GenerateSecret(file-root:foo) = %v, want ErrForbiddenPath (no resource dirs configured)", err)
	}

	// A second root in the file reaches ROOTCA, its subscribers and OUTPUT_CERTS.
	e.idle()
	for len(r.roots) > 0 {
		<-r.roots
	}
	writeFileAtomic(t, rootFile, testutil.CertPEM(otherRoot.Cert, chainRoot, thirdRoot.Cert))
	want := []*x509.Certificate{chainRoot, otherRoot.Cert, thirdRoot.Cert}
	// Drive fails only when the test's context ends; give up sooner with a nil.
	updates, stop := make(chan *Secret), make(chan struct{})
	defer close(stop)
	go func() {
		timeout := time.After(waitLimit)
		for {
			var s *Secret
			select {
			case s = <-r.roots:
			case <-timeout:
			case <-stop:
				return
			}
			select {
			case updates <- s:
			case <-stop:
				return
			}
		}
	}()
	var updated *Secret
	for updated == nil || !sameCerts(updated.Roots, want) {
		// The renewal timer is the one timer that stays pending; the watcher's debounce comes and goes.
		if updated = testutil.Drive(t, e.clock, 100*time.Millisecond, 1, updates); updated == nil {
			t.Fatal("no ROOTCA update after the root file changed")
		}
	}
	if cached, err := m.GenerateSecret(cancelledCtx(), RootCertName); err != nil || cached.Version != updated.Version {
		t.Errorf("GenerateSecret(ROOTCA) after the update = (%v, %v), want version %s", cached, err, updated.Version)
	}
	if updated.Version == roots.Version {
		t.Error("ROOTCA kept its version after its content changed")
	}
	if got := readRoots(t, e.cfg.OutputDir); !sameCerts(got, want) {
		t.Errorf("OUTPUT_CERTS root-cert.pem = %s after the root file changed, want %s", names(got), names(want))
	}
	if leaf, _ := readPair(t, e.cfg.OutputDir); leaf.SerialNumber.Text(16) != s.Version {
		t.Errorf("OUTPUT_CERTS holds serial %s, want %s", leaf.SerialNumber.Text(16), s.Version)
	}
	if e.signer.Calls() != 1 {
		t.Errorf("a root file change made %d Sign calls, want none", e.signer.Calls()-1)
	}
}

func TestRenewAtWithinJitterBounds(t *testing.T) {
	t.Parallel()
	created := t0
	expires := t0.Add(24 * time.Hour)
	for _, c := range []struct{ ratio, jitter float64 }{{0.5, 0.01}, {0.5, 0}, {0.2, 0.1}, {0.9, 0.05}} {
		for _, r := range []float64{0, 0.25, 0.5, 0.75, 0.999999} {
			m := &Manager{cfg: Config{GraceRatio: c.ratio, GraceRatioJitter: c.jitter, Rand: func() float64 { return r }}}
			got := m.renewAt(&Secret{CreatedAt: created, ExpiresAt: expires})
			lifetime := expires.Sub(created)
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
		// ratio = 0.5 + 0.01·(2r−1); RenewAt = ExpiresAt − ratio·1h
		want time.Duration // after receipt
	}{
		{"jitter low", 0, 30*time.Minute + 36*time.Second},              // ratio 0.49
		{"jitter none", 0.5, 30 * time.Minute},                          // ratio 0.5
		{"jitter high", 0.999, 29*time.Minute + 24072*time.Millisecond}, // ratio 0.50998
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.cfg.Rand = func() float64 { return tc.r }
			r := e.start()
			s := r.next(t)
			if d := s.RenewAt.Sub(t0.Add(tc.want)); d.Abs() > time.Microsecond {
				t.Fatalf("RenewAt = t0+%s, want t0+%s", s.RenewAt.Sub(t0), tc.want)
			}
			e.idle()
			if got := e.metric("meshid_agent_cert_next_renewal_timestamp_seconds"); got != float64(s.RenewAt.Unix()) {
				t.Errorf("next renewal gauge %v, want %d", got, s.RenewAt.Unix())
			}
			if fired := e.set(s.RenewAt.Add(-time.Second)); fired || e.signer.Calls() != 1 {
				t.Fatalf("renewed a second before RenewAt (Sign called %d times)", e.signer.Calls())
			}
			if !e.set(s.RenewAt) {
				t.Fatal("no renewal at RenewAt")
			}
			renewed := r.next(t)
			if !renewed.CreatedAt.Equal(s.RenewAt) || renewed.Version == s.Version || e.signer.Calls() != 2 {
				t.Fatalf("renewed at %s with serial %s after %d Sign calls; want at %s, a new serial, 2 calls",
					renewed.CreatedAt, renewed.Version, e.signer.Calls(), s.RenewAt)
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
	e.cfg.TTL = 30 * time.Second
	r := e.start()
	s := r.next(t)
	for i := range 4 {
		e.idle()
		if e.signer.Calls() != i+1 {
			t.Fatalf("%d Sign calls for %d certificates", e.signer.Calls(), i+1)
		}
		if !s.Chain[0].NotBefore.Equal(s.CreatedAt.Add(-2 * time.Minute)) {
			t.Fatalf("the fake CA did not backdate: NotBefore %s, received %s", s.Chain[0].NotBefore, s.CreatedAt)
		}
		if want := s.CreatedAt.Add(15 * time.Second); !s.RenewAt.Equal(want) {
			t.Fatalf("RenewAt = received+%s, want received+15s", s.RenewAt.Sub(s.CreatedAt))
		}
		if e.set(s.RenewAt.Add(-time.Nanosecond)) {
			t.Fatal("renewed before RenewAt")
		}
		if !e.set(s.RenewAt) {
			t.Fatal("no renewal at RenewAt")
		}
		s = r.next(t)
	}
}

func TestCADownAcrossRenewal(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.cfg.OutputDir = filepath.Join(t.TempDir(), "out")
	e.cfg.RetryInitial = time.Second
	e.cfg.RetryMax = time.Minute
	r := e.start()
	first := r.next(t)
	e.idle()

	// The CA goes down just before the renewal point.
	e.signer.setErr(errCADown)
	if !e.set(first.RenewAt) {
		t.Fatal("no renewal attempt at RenewAt")
	}
	const failed = 9
	var waits []time.Duration
	failedAt := first.RenewAt
	for i := range failed {
		if got := e.failures(); got != i+1 {
			t.Fatalf("failure counter %d after %d failures", got, i+1)
		}
		retries := e.retryTimes()
		if len(retries) != i+1 {
			t.Fatalf("%d failures logged with retry_at, want %d", len(retries), i+1)
		}
		retryAt := retries[i]
		wait := retryAt.Sub(failedAt)
		// backoff: initial·1.5^i capped at RetryMax, randomized by ±50%.
		nominal := min(time.Duration(float64(time.Second)*math.Pow(1.5, float64(i))), e.cfg.RetryMax)
		if wait < nominal/2 || wait > nominal*3/2+time.Nanosecond {
			t.Fatalf("retry %d after %s, want within ±50%% of %s", i+1, wait, nominal)
		}
		waits = append(waits, wait)

		// The current certificate keeps serving.
		if s, err := r.m.GenerateSecret(cancelledCtx(), WorkloadCertName); err != nil || s.Version != first.Version {
			t.Fatalf("GenerateSecret while the CA is down = (%v, %v), want the current certificate", s, err)
		}
		if !r.m.Ready() {
			t.Fatal("not Ready while the current certificate is valid")
		}

		// The retry happens at retry_at, not before.
		calls := e.signer.Calls()
		if e.set(retryAt.Add(-time.Nanosecond)) || e.signer.Calls() != calls {
			t.Fatalf("retried before the logged retry_at %s", retryAt)
		}
		if i == failed-1 {
			e.signer.setErr(nil) // the CA is back
		}
		if !e.set(retryAt) {
			t.Fatalf("no retry at the logged retry_at %s", retryAt)
		}
		failedAt = retryAt
	}
	for i := 3; i < len(waits); i++ {
		if waits[i] <= waits[i-3] {
			t.Errorf("retry waits do not grow: %v", waits)
		}
	}
	logs := e.logs.String()
	if n := strings.Count(logs, "renewal failed"); n != failed {
		t.Errorf("%d renewal failures logged, want %d", n, failed)
	}
	if !strings.Contains(logs, errCADown.Error()) || !strings.Contains(logs, "current_expires=") {
		t.Errorf("failures logged without the error or the current expiry:\n%s", logs)
	}

	second := r.next(t)
	if second.Version == first.Version || !second.CreatedAt.Equal(failedAt) || second.Source != "ca" {
		t.Fatalf("after the CA returned got serial %s at %s from %s; want a new one at %s", second.Version, second.CreatedAt, second.Source, failedAt)
	}
	if leaf, _ := readPair(t, e.cfg.OutputDir); leaf.SerialNumber.Text(16) != second.Version {
		t.Errorf("OUTPUT_CERTS holds serial %s, want %s", leaf.SerialNumber.Text(16), second.Version)
	}
	if got := e.failures(); got != failed {
		t.Errorf("failure counter %d after success, want %d", got, failed)
	}

	// Down again, this time until the certificate expires: the backoff starts over.
	e.signer.setErr(errCADown)
	if !e.set(second.RenewAt) {
		t.Fatal("no renewal attempt at RenewAt")
	}
	retries := e.retryTimes()
	if wait := retries[len(retries)-1].Sub(second.RenewAt); wait < time.Second/2 || wait > 3*time.Second/2 {
		t.Errorf("first retry after a success waits %s, want the initial 1s ±50%%", wait)
	}
	for e.clock.Now().Before(second.ExpiresAt.Add(-time.Nanosecond)) {
		at := retries[len(retries)-1]
		if wait := at.Sub(e.clock.Now()); wait > e.cfg.RetryMax*3/2+time.Nanosecond {
			t.Fatalf("a retry waits %s, more than RetryMax %s +50%%", wait, e.cfg.RetryMax)
		}
		if !at.Before(second.ExpiresAt) {
			at = second.ExpiresAt.Add(-time.Nanosecond)
		}
		e.set(at)
		retries = e.retryTimes()
	}
	if !r.m.Ready() {
		t.Fatal("not Ready a nanosecond before expiry")
	}
	if s, err := r.m.GenerateSecret(cancelledCtx(), WorkloadCertName); err != nil || s.Version != second.Version {
		t.Fatalf("GenerateSecret a nanosecond before expiry = (%v, %v)", s, err)
	}
	e.set(second.ExpiresAt)
	if r.m.Ready() {
		t.Error("Ready with an expired certificate")
	}
	_, err := r.m.GenerateSecret(cancelledCtx(), WorkloadCertName)
	if !errors.Is(err, errCADown) || !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), errCADown.Error()) {
		t.Fatalf("GenerateSecret after expiry = %v, want the context's error and the last failure", err)
	}
	if _, err := r.m.GenerateSecret(cancelledCtx(), RootCertName); err != nil {
		t.Errorf("ROOTCA unavailable once the certificate expired: %v", err)
	}

	// A caller waiting for a valid certificate gets the one issued when the CA returns.
	waiting := make(chan *Secret, 1)
	go func() {
		s, err := r.m.GenerateSecret(t.Context(), WorkloadCertName)
		if err != nil {
			t.Error(err)
		}
		waiting <- s
	}()
	e.signer.setErr(nil)
	retries = e.retryTimes()
	e.set(retries[len(retries)-1])
	third := recv(t, waiting, "a certificate once the CA returned")
	if third.Version == second.Version || !third.ExpiresAt.After(e.clock.Now()) || !r.m.Ready() {
		t.Fatalf("got serial %s expiring %s after the CA returned", third.Version, third.ExpiresAt)
	}
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
			for i := range 4 {
				e.idle()
				if got := e.failures(); got != i+1 {
					t.Fatalf("failure counter %d after %d attempts", got, i+1)
				}
				select {
				case err := <-r.done:
					t.Fatalf("Run returned %v after a refusal", err)
				default:
				}
				if r.m.Ready() {
					t.Fatal("Ready without a certificate")
				}
				_, err := r.m.GenerateSecret(cancelledCtx(), WorkloadCertName)
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("GenerateSecret = %v, want an error mentioning %q", err, tc.want)
				}
				retries := e.retryTimes()
				if len(retries) != i+1 {
					t.Fatalf("%d failures logged with retry_at, want %d", len(retries), i+1)
				}
				if i == 3 {
					e.signer.setRespond(nil)
				}
				if !e.set(retries[i]) {
					t.Fatalf("no retry at %s", retries[i])
				}
			}
			if s := r.next(t); s.Source != "ca" || !r.m.Ready() {
				t.Fatalf("no certificate once the CA behaved")
			}
			if strings.Contains(e.logs.String(), "current_expires") {
				t.Error("a failure without a current certificate logged current_expires")
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
		{name: "mismatched key", writtenBy: testID, mtime: t0, now: t0.Add(time.Minute), tamper: func(t *testing.T, dir string) {
			other, err := pki.GenerateKey(pki.ECDSA, 0)
			if err != nil {
				t.Fatal(err)
			}
			chainPEM, _ := os.ReadFile(filepath.Join(dir, CertChainFile))
			rootsPEM, _ := os.ReadFile(filepath.Join(dir, RootCertFile))
			if err := writeOutput(dir, testutil.KeyPEM(t, other), chainPEM, rootsPEM); err != nil {
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
			if err := writeOutput(dir, keyPEM, []byte("not a certificate"), nil); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := filepath.Join(t.TempDir(), "out")

			// An earlier run writes OUTPUT_CERTS.
			earlier := newEnv(t)
			earlier.cfg.OutputDir = dir
			earlier.cfg.Identity = tc.writtenBy
			er := earlier.start()
			old := er.next(t)
			earlier.idle()
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
			e.cfg.OutputDir = dir
			e.clock.Set(tc.now)
			r := e.start()
			s := r.next(t)
			e.idle()

			if tc.wantRenew.IsZero() {
				if s.Source != "ca" || s.Version == old.Version || e.signer.Calls() != 1 {
					t.Fatalf("used the certificate in OUTPUT_CERTS (source %s, serial %s, %d Sign calls)", s.Source, s.Version, e.signer.Calls())
				}
				if leaf, _ := readPair(t, dir); leaf.SerialNumber.Text(16) != s.Version {
					t.Errorf("OUTPUT_CERTS not replaced: serial %s, want %s", leaf.SerialNumber.Text(16), s.Version)
				}
				if !strings.Contains(e.logs.String(), "not using the certificate in OUTPUT_CERTS") {
					t.Error("the reason for not using OUTPUT_CERTS was not logged")
				}
				return
			}

			if s.Source != "output-certs" || s.Version != old.Version || string(s.KeyPEM) != string(old.KeyPEM) {
				t.Fatalf("served %s serial %s, want output-certs serial %s", s.Source, s.Version, old.Version)
			}
			if got, err := r.m.GenerateSecret(cancelledCtx(), WorkloadCertName); err != nil || got.Version != old.Version || !r.m.Ready() {
				t.Fatalf("not served at once: (%v, %v)", got, err)
			}
			if !s.RenewAt.Equal(tc.wantRenew) {
				t.Fatalf("RenewAt = t0+%s, want t0+%s", s.RenewAt.Sub(t0), tc.wantRenew.Sub(t0))
			}
			if e.signer.Calls() != 0 {
				t.Fatalf("%d Sign calls before the renewal point", e.signer.Calls())
			}
			if got := e.metric("meshid_agent_cert_rotations_total"); got != 0 {
				t.Errorf("rotations counter %v for a certificate from disk, want 0", got)
			}
			if after, _ := os.Readlink(filepath.Join(dir, dataLink)); after != dataBefore {
				t.Error("OUTPUT_CERTS rewritten on start-up with the certificate read from it")
			}
			if e.set(s.RenewAt.Add(-time.Nanosecond)) || e.signer.Calls() != 0 {
				t.Fatal("renewed before the renewal point")
			}
			if !e.set(s.RenewAt) {
				t.Fatal("no renewal at the renewal point")
			}
			renewed := r.next(t)
			if renewed.Source != "ca" || renewed.Version == old.Version || e.signer.Calls() != 1 {
				t.Fatalf("renewal gave %s serial %s after %d Sign calls", renewed.Source, renewed.Version, e.signer.Calls())
			}
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
			e.cfg.KeyAlgorithm, e.cfg.RSAKeySize = tc.alg, tc.bits
			s := e.start().next(t)
			parsed, err := pki.ParsePrivateKey(s.KeyPEM)
			if err != nil {
				t.Fatal(err)
			}
			for what, pub := range map[string]any{"leaf": s.Chain[0].PublicKey, "Key": s.Key.Public(), "KeyPEM": parsed.Public()} {
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

func TestSubscribe(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.cfg.OutputDir = filepath.Join(t.TempDir(), "out")
	m := e.newManager()

	type seen struct {
		name, version string
		cached        bool // GenerateSecret returned it while fn ran
		written       bool // OUTPUT_CERTS held it while fn ran (default only)
	}
	var got []seen // only appended to from the manager's goroutine; read after it is idle
	unsubscribe := m.Subscribe(func(s *Secret) {
		cur, err := m.GenerateSecret(cancelledCtx(), s.Name)
		v := seen{name: s.Name, version: s.Version, cached: err == nil && cur.Version == s.Version, written: true}
		if s.Name == WorkloadCertName {
			v.written = diskSerial(e.cfg.OutputDir) == s.Version
		}
		got = append(got, v)
	})
	r := e.run(m)

	// Each renewal comes from a new CA, so ROOTCA changes with it.
	var want []seen
	expect := func(s *Secret) {
		roots, err := m.GenerateSecret(cancelledCtx(), RootCertName)
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, seen{WorkloadCertName, s.Version, true, true}, seen{RootCertName, roots.Version, true, true})
	}
	s := r.next(t)
	e.idle()
	expect(s)
	e.signer.rotateCA(t)
	e.set(s.RenewAt)
	s = r.next(t)
	expect(s)
	if len(got) != len(want) {
		t.Fatalf("subscriber saw %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("notification %d = %+v, want %+v", i, got[i], want[i])
		}
	}

	unsubscribe()
	unsubscribe() // twice is harmless
	e.signer.rotateCA(t)
	e.set(s.RenewAt)
	r.next(t) // the other subscriber saw it; e.set waited until every notification was done
	if len(got) != len(want) {
		t.Errorf("an unsubscribed function saw %+v", got[len(want):])
	}
}

func TestNewRefuses(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, tc := range []struct {
		name   string
		edit   func(*Config)
		reject bool
		want   string // in the error
	}{
		{"valid", func(*Config) {}, false, ""},
		{"zero ratio means the default", func(c *Config) { c.GraceRatio = 0 }, false, ""},
		{"no jitter", func(c *Config) { c.GraceRatioJitter = 0 }, false, ""},
		{"nil signer", func(c *Config) { c.Signer = nil }, true, "signer"},
		{"empty identity", func(c *Config) { c.Identity = pki.SPIFFEID{} }, true, ""},
		{"upper-case namespace", func(c *Config) { c.Identity.Namespace = "Shop" }, true, "namespace"},
		{"bad trust domain", func(c *Config) { c.Identity.TrustDomain = "cluster local" }, true, ""},
		{"ratio 1.5", func(c *Config) { c.GraceRatio = 1.5 }, true, "grace period ratio 1.5"},
		{"ratio 1", func(c *Config) { c.GraceRatio = 1 }, true, ""},
		{"ratio 1 without jitter", func(c *Config) { c.GraceRatio, c.GraceRatioJitter = 1, 0 }, true, "grace period ratio 1 "},
		{"negative ratio without jitter", func(c *Config) { c.GraceRatio, c.GraceRatioJitter = -0.5, 0 }, true, "grace period ratio -0.5"},
		{"negative ratio", func(c *Config) { c.GraceRatio = -0.5 }, true, ""},
		{"negative jitter", func(c *Config) { c.GraceRatioJitter = -0.01 }, true, "jitter -0.01"},
		{"jitter down to 0", func(c *Config) { c.GraceRatio, c.GraceRatioJitter = 0.1, 0.1 }, true, ""},
		{"jitter up to 1", func(c *Config) { c.GraceRatio, c.GraceRatioJitter = 0.95, 0.05 }, true, ""},
		{"jitter just inside", func(c *Config) { c.GraceRatio, c.GraceRatioJitter = 0.9, 0.09 }, false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := e.cfg
			cfg.Registerer = nil
			tc.edit(&cfg)
			m, err := New(cfg)
			if tc.reject != (err != nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("New = %v, want rejected %v (saying %q)", err, tc.reject, tc.want)
			}
			if err == nil && (m.cfg.GraceRatio <= 0 || m.cfg.GraceRatio >= 1) {
				t.Errorf("accepted with ratio %v", m.cfg.GraceRatio)
			}
		})
	}
	if m, err := New(Config{Signer: e.signer, Identity: testID}); err != nil {
		t.Fatal(err)
	} else if c := m.cfg; c.GraceRatio != DefaultGraceRatio || c.TTL != DefaultTTL || c.KeyAlgorithm != pki.ECDSA ||
		c.RetryInitial != DefaultRetryInitial || c.RetryMax != DefaultRetryMax {
		t.Errorf("defaults not applied: %+v", c)
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
			if !e.set(first.RenewAt) || e.failures() != 1 {
				t.Fatal("no failed renewal")
			}
		}},
		{"inside Sign", func(t *testing.T, e *env, first *Secret) {
			entered, release := e.signer.blockCalls()
			t.Cleanup(release)
			e.clock.Set(first.RenewAt)
			recv(t, entered, "the renewal's Sign call")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.cfg.OutputDir = filepath.Join(t.TempDir(), "out")
			e.cfg.RootCertFile = filepath.Join(t.TempDir(), "root-cert.pem")
			writeFileAtomic(t, e.cfg.RootCertFile, testutil.CertPEM(e.signer.rootCert()))
			r := e.start()
			first := r.next(t)
			e.idle()
			keyBefore, _ := os.ReadFile(filepath.Join(e.cfg.OutputDir, KeyFile))
			chainBefore, _ := os.ReadFile(filepath.Join(e.cfg.OutputDir, CertChainFile))
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
			keyAfter, _ := os.ReadFile(filepath.Join(e.cfg.OutputDir, KeyFile))
			chainAfter, _ := os.ReadFile(filepath.Join(e.cfg.OutputDir, CertChainFile))
			if string(keyAfter) != string(keyBefore) || string(chainAfter) != string(chainBefore) {
				t.Error("OUTPUT_CERTS changed on shutdown")
			}
			if leaf, _ := readPair(t, e.cfg.OutputDir); leaf.SerialNumber.Text(16) != first.Version {
				t.Errorf("OUTPUT_CERTS holds serial %s, want %s", leaf.SerialNumber.Text(16), first.Version)
			}
			if got := generations(t, e.cfg.OutputDir); len(got) != 1 {
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
	e.cfg.RetryInitial, e.cfg.RetryMax = 2*time.Hour, 2*time.Hour // any backoff outlasts the certificate
	r := e.start()
	first := r.next(t)
	e.idle()
	e.signer.setErr(errors.New("CA down"))
	if !e.set(first.RenewAt) {
		t.Fatal("no renewal attempt at the renewal point")
	}
	if e.failures() != 1 {
		t.Fatalf("%d failures, want 1", e.failures())
	}
	calls := e.signer.Calls()
	if e.set(first.ExpiresAt.Add(-time.Second)) {
		t.Fatal("retried before the certificate expired, with a 2h backoff")
	}
	e.signer.setErr(nil)
	if !e.set(first.ExpiresAt) || e.signer.Calls() != calls+1 {
		t.Fatal("no retry at the moment the certificate in service expires")
	}
	if got := r.next(t); got.Version == first.Version {
		t.Fatal("the retry at expiry did not put a new certificate in service")
	}
}

func TestNewRefusesBadKeySettings(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, c := range []struct {
		alg  pki.KeyAlgorithm
		size int
	}{{pki.RSA, 1024}, {pki.RSA, 16384}, {"DSA", 0}} {
		cfg := e.cfg
		cfg.KeyAlgorithm, cfg.RSAKeySize = c.alg, c.size
		if _, err := New(cfg); err == nil {
			t.Errorf("New accepted key %s/%d", c.alg, c.size)
		}
	}
}
