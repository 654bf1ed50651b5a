package controller

import (
	"testing"
	"time"

	kclock "k8s.io/utils/clock"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/testutil"
)

func TestQueueClock(t *testing.T) {
	t.Parallel()
	for _, c := range []clock.Clock{nil, clock.Real()} {
		if _, ok := queueClock(c).(kclock.RealClock); !ok {
			t.Errorf("queueClock(%v) is not client-go's real clock", c)
		}
	}
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	fake := testutil.NewFakeClock(start)
	q := queueClock(fake)
	timer := q.NewTimer(time.Minute)
	if got := q.Since(start.Add(-time.Second)); got != time.Second {
		t.Fatalf("Since = %s, want 1s", got)
	}
	if !timer.Reset(time.Hour) {
		t.Fatal("Reset of a pending timer reported it inactive")
	}
	fake.Advance(time.Minute)
	select {
	case <-timer.C():
		t.Fatal("the timer fired at its old duration after Reset")
	default:
	}
	fake.Advance(time.Hour)
	select {
	case got := <-timer.C():
		if !got.Equal(q.Now()) {
			t.Fatalf("fired with %s, want %s", got, q.Now())
		}
	default:
		t.Fatal("the timer did not fire at its new duration")
	}
	if ticker := q.NewTicker(time.Second); ticker.C() != nil {
		t.Fatal("the heartbeat ticker ticks on an injected clock")
	}
	if n := fake.PendingTimers(); n != 0 {
		t.Fatalf("%d timers pending, want none: the ticker must not arm one", n)
	}
}
