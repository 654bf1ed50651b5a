package agent_test

import (
	"context"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds/sdstest"
	"github.com/meshid/meshid/secretmanager"
)

// newSkewedEnv is a CA whose clock runs skew ahead of the agent's (behind when skew is negative).
// Its root was made two days earlier, as a CA's root is in service long before an agent asks: a
// root made at the CA's start would itself lie in the future of an agent behind it.
func newSkewedEnv(t *testing.T, skew time.Duration) (e *env, caClock *testutil.FakeClock) {
	t.Helper()
	e = newEnv(t, func(c *controlplane.Config) {
		caClock = testutil.NewFakeClock(c.Clock.Now().Add(-48 * time.Hour))
		c.Clock = caClock
	})
	caClock.Set(e.clock.Now().Add(skew))
	return e, caClock
}

// tokenFileAt writes a token for default/demo minted at now (the cluster's clock, which the CA
// shares) and returns its path.
func (e *env) tokenFileAt(t *testing.T, now time.Time) string {
	t.Helper()
	tok := controlplanetest.Token(t, e.stateDir, "default", "demo", now, 24*time.Hour)
	path := filepath.Join(e.dir, "istio-token")
	if err := os.WriteFile(path, []byte(tok), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// advanceBoth moves the agent's clock and the CA's by d, once the agent waits on a timer.
func advanceBoth(t *testing.T, agentClock, caClock *testutil.FakeClock, d time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	if err := agentClock.WaitForTimers(ctx, 1); err != nil {
		t.Fatalf("the agent waits on no timer: %v", err)
	}
	caClock.Advance(d)
	agentClock.Advance(d)
}

// awaitWritten waits until s is in OUTPUT_CERTS: the agent is ready only then.
func awaitWritten(t *testing.T, ev *events, s *secretmanager.Secret) {
	t.Helper()
	ev.await(t, "OUTPUT_CERTS written", func(x secretmanager.Event) bool {
		return x.Kind == secretmanager.EventOutputWritten && x.Version == s.Version
	})
}

func checkReady(t *testing.T, a *agent.Agent) {
	t.Helper()
	if code, body := httpGet(t, "http://"+a.StatusAddr()+"/healthz/ready"); code != http.StatusOK {
		t.Fatalf("/healthz/ready = %d %q, want 200", code, body)
	}
}

// An agent whose clock is minutes behind the CA's gets a certificate whose NotBefore may lie in
// its future. It serves it all the same, as Istio's agent does (Envoy serves what SDS gives it;
// peers judge validity on their own clocks), and renews it when GraceRatio of the lifetime the
// CA gave it is left, counted from receipt: not at once, and not so late that it has expired on
// the CA's clock.
func TestAgentBehindTheCAServesAndRenews(t *testing.T) {
	t.Parallel()
	const ttl = 30 * time.Minute // e.config's SECRET_TTL; the grace ratio is Istio's 0.5, no jitter
	for _, skew := range []time.Duration{time.Minute, 5 * time.Minute, 30 * time.Minute, 23 * time.Hour} {
		t.Run(skew.String(), func(t *testing.T) {
			t.Parallel()
			e, caClock := newSkewedEnv(t, skew)
			ev := newEvents()
			cfg := e.config(t, e.tokenFileAt(t, caClock.Now()), ev)
			cfg.Logger = newLogSink(t).logger()
			a := newAgent(t, cfg)
			certs := issued(t, a)
			runAgent(t, a)
			first := receive(t, certs, "first certificate")
			awaitWritten(t, ev, first)

			envoy := sdstest.Dial(t, a.SocketPath())
			sotw := envoy.StreamSecrets()
			sotw.Subscribe(secretNames...)
			last, got := sotw.RecvAll(secretNames...)
			sotw.Ack(last, secretNames...)
			chain := workloadChain(t, got["default"])
			if serialOf(chain) != first.Version {
				t.Fatalf("SDS serves %s, want %s", serialOf(chain), first.Version)
			}
			// Valid on the CA's clock, which its peers share.
			checkVerifies(t, chain, sdstest.Roots(t, got["ROOTCA"]), demoID, caClock.Now())
			checkReady(t, a)

			leaf := first.KeyPair.Leaf()
			if skew > ca2min && !leaf.NotBefore.After(e.clock.Now()) {
				t.Fatalf("NotBefore %s is not in the agent's future (%s): the test tests nothing", leaf.NotBefore, e.clock.Now())
			}
			if after := first.RenewAt.Sub(first.Received); after < ttl/2-time.Minute || after > ttl/2+time.Minute {
				t.Errorf("renewal scheduled %s after receipt, want about half the %s lifetime", after, ttl)
			}
			if left := leaf.NotAfter.Sub(first.RenewAt.Add(skew)); left < ttl/2-time.Minute {
				t.Errorf("renewal leaves %s of the certificate on the CA's clock, want about half the %s lifetime", left, ttl)
			}

			advanceBoth(t, e.clock, caClock, first.RenewAt.Sub(e.clock.Now()))
			second := receive(t, certs, "renewed certificate")
			if second.Version == first.Version {
				t.Fatal("renewal kept the same serial")
			}
			if p := sotw.Recv(); p.Secrets["default"] == nil || serialOf(workloadChain(t, p.Secrets["default"])) != second.Version {
				t.Fatalf("the renewal pushed %v, not default %s", p.Names(), second.Version)
			}
			awaitWritten(t, ev, second)
			checkReady(t, a)
		})
	}
}

// ca2min is ca.Backdate: a CA ahead by less leaves NotBefore in the agent's past.
const ca2min = 2 * time.Minute

// A certificate whose NotBefore lies days in the agent's future speaks of a wrong clock rather
// than skew: the agent says so and stays not ready, retrying.
func TestAgentFarBehindTheCASaysItsClockIsWrong(t *testing.T) {
	t.Parallel()
	e, caClock := newSkewedEnv(t, 25*time.Hour)
	ev := newEvents()
	a := newAgent(t, e.config(t, e.tokenFileAt(t, caClock.Now()), ev))
	failures := ev.channel(t, func(x secretmanager.Event) bool { return x.Kind == secretmanager.EventRenewalFailed })
	runAgent(t, a)
	// The CA's own certificate is refused first, and the CA client retries that a few times.
	failed := testutil.Drive(t, e.clock, time.Second, 0, failures)
	if !strings.Contains(failed.Err.Error(), "clock") {
		t.Errorf("the failure %q does not name the clock", failed.Err)
	}
	code, body := httpGet(t, "http://"+a.StatusAddr()+"/healthz/ready")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "clock") {
		t.Fatalf("/healthz/ready = %d %q, want 503 naming the clock", code, body)
	}
}

// An agent whose clock is ahead of the CA's sees NotAfter nearer than the CA meant it: a one-hour
// certificate with the agent 30 minutes ahead has 30 minutes left on the agent's clock, and is
// renewed within them, never found expired in between.
func TestAgentAheadOfTheCARenewsInTime(t *testing.T) {
	t.Parallel()
	const skew = -30 * time.Minute
	e, caClock := newSkewedEnv(t, skew)
	ev := newEvents()
	cfg := e.config(t, e.tokenFileAt(t, caClock.Now()), ev)
	cfg.Certificate.TTL = time.Hour
	a := newAgent(t, cfg)
	certs := issued(t, a)
	runAgent(t, a)
	first := receive(t, certs, "first certificate")
	awaitWritten(t, ev, first)
	checkReady(t, a)
	notAfter := first.NotAfter()
	if left := notAfter.Sub(e.clock.Now()); left > 31*time.Minute {
		t.Fatalf("the certificate has %s left on the agent's clock, want 30m: the test tests nothing", left)
	}
	if !first.RenewAt.After(first.Received) || !first.RenewAt.Before(notAfter) {
		t.Fatalf("renewal at %s, want between receipt %s and expiry %s", first.RenewAt, first.Received, notAfter)
	}
	if left := notAfter.Sub(first.RenewAt); left < 14*time.Minute {
		t.Errorf("renewal leaves %s on the agent's clock, want about half of the 30m it had", left)
	}
	advanceBoth(t, e.clock, caClock, first.RenewAt.Sub(e.clock.Now()))
	second := receive(t, certs, "renewed certificate")
	if second.Version == first.Version {
		t.Fatal("renewal kept the same serial")
	}
	awaitWritten(t, ev, second)
	checkReady(t, a)
	for _, x := range ev.snapshot() {
		if x.Kind == secretmanager.EventChanged && x.Name == "default" && x.Err != nil {
			t.Errorf("default was reported invalid before the renewal: %v", x.Err)
		}
	}
}

// snapshot returns the events seen so far.
func (e *events) snapshot() []secretmanager.Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]secretmanager.Event(nil), e.seen...)
}

// A jump of the injected clock past RenewAt, and past NotAfter, in one step renews at once: the
// renewal timer is due, and nothing waits on a deadline computed from the old time. Nothing
// expired is pushed meanwhile.
func TestClockJumpRenewsAtOnce(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		past func(s *secretmanager.Secret) time.Time
	}{
		{"past RenewAt", func(s *secretmanager.Secret) time.Time { return s.RenewAt.Add(time.Minute) }},
		{"past NotAfter", func(s *secretmanager.Secret) time.Time { return s.NotAfter().Add(time.Minute) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ev := newEvents()
			a := newAgent(t, e.config(t, e.tokenFile(t, "default", "demo"), ev))
			certs := issued(t, a)
			runAgent(t, a)
			first := receive(t, certs, "first certificate")
			awaitWritten(t, ev, first)
			envoy := sdstest.Dial(t, a.SocketPath())
			sotw := envoy.StreamSecrets()
			sotw.Subscribe(secretNames...)
			last, _ := sotw.RecvAll(secretNames...)
			sotw.Ack(last, secretNames...)

			ctx, cancel := context.WithTimeout(t.Context(), wait)
			defer cancel()
			if err := e.clock.WaitForTimers(ctx, 2); err != nil { // the renewal and the CA's root check
				t.Fatal(err)
			}
			e.clock.Set(tc.past(first)) // one step; the clock stays there
			second := receive(t, certs, "certificate renewed after the jump")
			if second.Version == first.Version || !second.Received.Equal(e.clock.Now()) {
				t.Fatalf("renewed %s at %s, want a new serial at %s", second.Version, second.Received, e.clock.Now())
			}
			p := sotw.Recv()
			chain := workloadChain(t, p.Secrets["default"])
			if serialOf(chain) != second.Version || !e.clock.Now().Before(chain[0].NotAfter) {
				t.Fatalf("pushed %s valid until %s after the jump to %s, want %s", serialOf(chain), chain[0].NotAfter, e.clock.Now(), second.Version)
			}
			awaitWritten(t, ev, second)
			checkReady(t, a)
		})
	}
}

// A jump past NotAfter while no renewal can be had leaves the agent not ready, saying its
// certificate expired, and pushes nothing; it renews as soon as it can again.
func TestClockJumpPastExpiryWhileTheCAIsOutOfReach(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ev := newEvents()
	tokenPath := e.tokenFile(t, "default", "demo")
	a := newAgent(t, e.config(t, tokenPath, ev))
	certs := issued(t, a)
	runAgent(t, a)
	first := receive(t, certs, "first certificate")
	awaitWritten(t, ev, first)
	envoy := sdstest.Dial(t, a.SocketPath())
	sotw := envoy.StreamSecrets()
	sotw.Subscribe(secretNames...)
	last, _ := sotw.RecvAll(secretNames...)
	sotw.Ack(last, secretNames...)

	// Without the token, and with the certificate that would authenticate over mTLS expired,
	// the agent has nothing to ask the CA with.
	if err := os.Remove(tokenPath); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	if err := e.clock.WaitForTimers(ctx, 2); err != nil {
		t.Fatal(err)
	}
	e.clock.Set(first.NotAfter().Add(time.Minute))
	ev.await(t, "default reported expired", func(x secretmanager.Event) bool {
		return x.Kind == secretmanager.EventChanged && x.Name == "default" && errors.Is(x.Err, secretmanager.ErrExpired)
	})
	code, body := httpGet(t, "http://"+a.StatusAddr()+"/healthz/ready")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "expired") {
		t.Fatalf("/healthz/ready = %d %q, want 503 saying the certificate expired", code, body)
	}

	e.tokenFile(t, "default", "demo") // minted at the new time
	second := testutil.Drive(t, e.clock, time.Second, 1, certs)
	if second.Version == first.Version {
		t.Fatal("no new certificate")
	}
	// The first push since the jump is the new certificate: the expired one was not pushed again.
	p := sotw.Recv()
	chain := workloadChain(t, p.Secrets["default"])
	if serialOf(chain) != second.Version || !e.clock.Now().Before(chain[0].NotAfter) {
		t.Fatalf("pushed %s valid until %s at %s, want %s", serialOf(chain), chain[0].NotAfter, e.clock.Now(), second.Version)
	}
	awaitWritten(t, ev, second)
	checkReady(t, a)
}

// After a step of the wall clock past RenewAt (a resume from sleep), the renewal does not wait
// for its timer, which counts monotonic time: the agent looks at the wall clock once a minute.
func TestWallClockStepRenewsWithinAMinute(t *testing.T) {
	t.Parallel()
	// The CA's clock is a clock of its own, not stepped: it did not sleep. It starts at the
	// agent's time.
	e, caClock := newSkewedEnv(t, 0)
	ev := newEvents()
	cfg := e.config(t, e.tokenFile(t, "default", "demo"), ev)
	logs := newLogSink(t)
	cfg.Logger = logs.logger()
	clk := e.clock // the agent's: its wall time steps (NTP correcting it, or a resume from sleep) without firing its timers
	a := newAgent(t, cfg)
	certs := issued(t, a)
	runAgent(t, a)
	first := receive(t, certs, "first certificate")
	awaitWritten(t, ev, first)

	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	if err := clk.WaitForTimers(ctx, 2); err != nil { // the renewal and its wall-clock check
		t.Fatal(err)
	}
	// Past RenewAt on the wall clock, with 10 minutes of the CA's 30 left: the agent is now 20
	// minutes ahead of the CA.
	clk.Step(first.RenewAt.Sub(clk.Now()) + 5*time.Minute)
	advanceBoth(t, clk, caClock, time.Minute)
	second := receive(t, certs, "certificate renewed within a minute of the step")
	if second.Version == first.Version {
		t.Fatal("no new certificate")
	}
	if !second.RenewAt.Before(second.NotAfter()) || !second.RenewAt.After(clk.Now()) {
		t.Fatalf("the new certificate is renewed at %s, want after now %s and before its expiry %s", second.RenewAt, clk.Now(), second.NotAfter())
	}
	if got := logs.records(t, wallClockPassed); len(got) != 1 {
		t.Errorf("%d records %q, want 1", len(got), wallClockPassed)
	}
	awaitWritten(t, ev, second)
	checkReady(t, a)
}

const wallClockPassed = "the wall clock passed the renewal time before the timer did (a clock step, or the machine slept): renewing now"
