package clock_test

import (
	"context"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/testutil"
)

// Sleep passes when its time has passed on the clock it is given, and gives up when its context
// ends, leaving no timer behind.
func TestSleep(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(time.Unix(0, 0))
	passed := make(chan bool)
	go func() { passed <- clock.Sleep(t.Context(), clk, time.Minute) }()
	if err := clk.WaitForTimers(t.Context(), 1); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Minute)
	if !<-passed {
		t.Fatal("Sleep gave up, want the minute passed")
	}

	ctx, cancel := context.WithCancel(t.Context())
	go func() { passed <- clock.Sleep(ctx, clk, time.Minute) }()
	if err := clk.WaitForTimers(t.Context(), 1); err != nil {
		t.Fatal(err)
	}
	cancel()
	if <-passed {
		t.Fatal("Sleep passed with its context ended, want it to give up")
	}
	if n := clk.PendingTimers(); n != 0 {
		t.Fatalf("%d timers left after Sleep gave up, want 0", n)
	}
}
