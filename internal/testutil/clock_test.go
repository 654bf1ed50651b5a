package testutil

import (
	"context"
	"testing"
	"time"
)

func TestFakeClockTimers(t *testing.T) {
	t.Parallel()
	start := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	c := NewFakeClock(start)
	late, early, stopped := c.NewTimer(2*time.Hour), c.NewTimer(time.Hour), c.NewTimer(time.Hour)
	if !stopped.Stop() || stopped.Stop() {
		t.Fatal("Stop should report true once, then false")
	}
	if err := c.WaitForTimers(t.Context(), 2); err != nil {
		t.Fatal(err)
	}
	c.Advance(90 * time.Minute)
	select {
	case got := <-early.C():
		if !got.Equal(start.Add(90 * time.Minute)) {
			t.Fatalf("fired with %s", got)
		}
	default:
		t.Fatal("a due timer did not fire")
	}
	select {
	case <-late.C():
		t.Fatal("a timer fired early")
	case <-stopped.C():
		t.Fatal("a stopped timer fired")
	default:
	}
	if c.PendingTimers() != 1 {
		t.Fatalf("%d timers pending, want 1", c.PendingTimers())
	}
	if fired := c.NewTimer(0); len(fired.C()) != 1 {
		t.Fatal("a zero-duration timer did not fire at once")
	}
}

func TestFakeClockWaitForTimersWakesOnNewTimer(t *testing.T) {
	t.Parallel()
	c := NewFakeClock(time.Now())
	done := make(chan error, 1)
	go func() { done <- c.WaitForTimers(context.Background(), 1) }()
	c.NewTimer(time.Minute)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := c.WaitForTimers(ctx, 5); err == nil {
		t.Fatal("WaitForTimers returned nil for a cancelled context")
	}
}
