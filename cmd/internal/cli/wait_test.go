package cli

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/testutil"
)

// readyAfter serves /healthz/ready: 503 with a reason for the first n asks, then 200.
func readyAfter(t *testing.T, n int32) (addr string, asks *atomic.Int32) {
	t.Helper()
	asks = new(atomic.Int32)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/healthz/ready" {
			http.NotFound(w, r)
			return
		}
		if asks.Add(1) <= n {
			http.Error(w, "no certificate yet", http.StatusServiceUnavailable)
		}
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://"), asks
}

// Wait asks again every period until the agent is ready, and returns then.
func TestWaitReturnsOnceReady(t *testing.T) {
	t.Parallel()
	addr, asks := readyAfter(t, 2)
	clk := testutil.NewFakeClock(time.Now())
	done := make(chan error, 1)
	go func() {
		done <- Wait(t.Context(), clk, addr, "/healthz/ready", time.Minute, time.Second, 5*time.Second)
	}()
	for range 2 { // the deadline's timer and the period's
		if err := clk.WaitForTimers(t.Context(), 2); err != nil {
			t.Fatal(err)
		}
		clk.Advance(time.Second)
	}
	if err := <-done; err != nil {
		t.Fatalf("Wait: %v", err)
	}
	if n := asks.Load(); n != 3 {
		t.Errorf("asked %d times, want 3: two 503s, then 200", n)
	}
}

// When the timeout passes first, Wait says so, with the agent's last reason.
func TestWaitTimesOutWithTheReason(t *testing.T) {
	t.Parallel()
	addr, _ := readyAfter(t, 1<<30)
	clk := testutil.NewFakeClock(time.Now())
	done := make(chan error, 1)
	go func() {
		done <- Wait(t.Context(), clk, addr, "/healthz/ready", 3*time.Second, time.Second, 5*time.Second)
	}()
	err := testutil.Drive(t, clk, time.Second, 0, done)
	if err == nil || !strings.Contains(err.Error(), "not ready after 3s") || !strings.Contains(err.Error(), "no certificate yet") {
		t.Fatalf("Wait: %v, want the timeout and the agent's reason", err)
	}
}

// A caller that gives up ends the wait, saying why.
func TestWaitEndsWithItsContext(t *testing.T) {
	t.Parallel()
	addr, _ := readyAfter(t, 1<<30)
	clk := testutil.NewFakeClock(time.Now())
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- Wait(ctx, clk, addr, "/healthz/ready", time.Minute, time.Second, 5*time.Second) }()
	if err := clk.WaitForTimers(t.Context(), 2); err != nil {
		t.Fatal(err)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait after its context ended: %v", err)
	}
}

// Called wrongly, wait exits 2 and names what is wrong; ready, it exits 0.
func TestWaitCommand(t *testing.T) {
	t.Parallel()
	addr, _ := readyAfter(t, 0)
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"wait", "--addr", addr}, 0, "the agent is ready"},
		{[]string{"wait", "--addr", "15020"}, 2, `--addr "15020"`},
		{[]string{"wait", "--addr", addr, "--period", "0s"}, 2, "--period 0s must be positive"},
		{[]string{"wait", "--addr", addr, "--timeout", "-1s"}, 2, "--timeout -1s must be positive"},
	} {
		code, out := runWait(t, tc.args)
		if code != tc.code || !strings.Contains(out, tc.want) {
			t.Errorf("%v: exit %d, %q; want exit %d saying %q", tc.args, code, out, tc.code, tc.want)
		}
	}
}

// runWait runs the command as main does and returns its exit code and what it printed.
func runWait(t *testing.T, args []string) (int, string) {
	t.Helper()
	root := NewRoot("meshid-agent", "short", "long", &Globals{})
	root.AddCommand(NewWaitCommand())
	var out strings.Builder
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs(args)
	code := Main(root)
	return code, out.String()
}
