package agent_test

import (
	"context"
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
	cfg.SecretTTL = time.Hour
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
