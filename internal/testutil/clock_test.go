package testutil

import (
	"context"
	"slices"
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

func TestFakeClockStepMovesOnlyTheWallTime(t *testing.T) {
	t.Parallel()
	start := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	c := NewFakeClock(start)
	timer := c.NewTimer(time.Hour)
	changed := c.Changed()
	c.Step(2 * time.Hour)
	select {
	case <-changed:
	default:
		t.Fatal("Step did not signal a change")
	}
	if got := c.Now(); !got.Equal(start.Add(2 * time.Hour)) {
		t.Fatalf("Now = %s after a step of 2h, want %s", got, start.Add(2*time.Hour))
	}
	select {
	case <-timer.C():
		t.Fatal("a step of the wall time fired a timer")
	default:
	}
	if got := c.Deadlines(); len(got) != 1 || !got[0].Equal(start.Add(3*time.Hour)) {
		t.Fatalf("Deadlines = %v, want the timer's hour on the stepped wall time", got)
	}
	c.Advance(time.Hour)
	select {
	case got := <-timer.C():
		if !got.Equal(start.Add(3 * time.Hour)) {
			t.Fatalf("fired with %s, want the wall time %s", got, start.Add(3*time.Hour))
		}
	default:
		t.Fatal("the timer did not fire after its hour of monotonic time")
	}
	c.Set(start.Add(4 * time.Hour)) // Set speaks wall time
	if got := c.Now(); !got.Equal(start.Add(4 * time.Hour)) {
		t.Fatalf("Now = %s after Set, want %s", got, start.Add(4*time.Hour))
	}
}

func TestFakeClockDeadlinesArmedAndChanged(t *testing.T) {
	t.Parallel()
	start := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	c := NewFakeClock(start)
	for _, move := range []struct {
		name string
		do   func()
	}{
		{"a timer armed", func() { c.NewTimer(2 * time.Hour) }},
		{"a timer stopped", func() { c.NewTimer(3 * time.Hour).Stop() }},
		{"the clock advanced", func() { c.Advance(time.Minute) }},
	} {
		changed := c.Changed()
		move.do()
		select {
		case <-changed:
		default:
			t.Fatalf("%s did not signal a change", move.name)
		}
	}
	c.NewTimer(time.Hour)
	changed := c.Changed()
	c.NewTimer(0) // fires at once: armed, never pending
	select {
	case <-changed:
	default:
		t.Fatal("a timer that fired at once did not signal a change")
	}
	want := []time.Time{start.Add(time.Hour + time.Minute), start.Add(2 * time.Hour)}
	if got := c.Deadlines(); !slices.EqualFunc(got, want, time.Time.Equal) {
		t.Fatalf("Deadlines = %v, want %v", got, want)
	}
	if got := c.Armed(); got != 4 {
		t.Fatalf("Armed = %d, want 4 (stopped and fired timers count)", got)
	}
}

func TestFakeClockWaitForDeadline(t *testing.T) {
	t.Parallel()
	start := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	c := NewFakeClock(start)
	c.NewTimer(time.Minute) // due at another moment: not what is waited for
	done := make(chan error, 1)
	go func() { done <- c.WaitForDeadline(t.Context(), start.Add(time.Hour)) }()
	c.NewTimer(time.Hour)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := c.WaitForDeadline(ctx, start.Add(2*time.Hour)); err == nil {
		t.Fatal("WaitForDeadline returned nil for a cancelled context and no such timer")
	}
}
