// Package testutil holds helpers for tests: a fake clock, short socket directories, a test CA.
// Only _test.go files import it.
package testutil

import (
	"context"
	"slices"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/clock"
)

// FakeClock is a clock.Clock that moves only when a test advances it.
//
// Like a real machine's, it keeps two times: the monotonic time that timers count, and the wall
// time that Now reads, which is the monotonic time plus the steps of Step. Advance and Set move
// both; Step moves only the wall time.
type FakeClock struct {
	mu      sync.Mutex
	now     time.Time // the monotonic time; timers' deadlines are on it
	step    time.Duration
	timers  []*fakeTimer
	armed   int           // timers made so far
	waiters chan struct{} // closed and replaced whenever a timer is created
	changed chan struct{} // closed and replaced whenever a timer is created, fires or is stopped, or the clock moves
}

// NewFakeClock starts a fake clock at now.
func NewFakeClock(now time.Time) *FakeClock {
	return &FakeClock{now: now, waiters: make(chan struct{}), changed: make(chan struct{})}
}

// Now returns the fake wall time.
func (c *FakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now.Add(c.step)
}

// Step moves the wall time by d without firing or moving any timer, as NTP stepping a machine's
// clock, or a resume from sleep, does: timers count monotonic time.
func (c *FakeClock) Step(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.step += d
	c.notifyLocked()
}

// NewTimer returns a timer that fires when the clock is advanced past now+d.
func (c *FakeClock) NewTimer(d time.Duration) clock.Timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{clock: c, deadline: c.now.Add(d), ch: make(chan time.Time, 1)}
	c.armed++
	c.notifyLocked()
	if d <= 0 {
		t.ch <- c.now.Add(c.step)
		return t
	}
	c.timers = append(c.timers, t)
	close(c.waiters)
	c.waiters = make(chan struct{})
	return t
}

func (c *FakeClock) notifyLocked() {
	close(c.changed)
	c.changed = make(chan struct{})
}

// Advance moves the clock forward by d and fires every timer that is due, earliest first.
func (c *FakeClock) Advance(d time.Duration) {
	c.advance(d)
}

func (c *FakeClock) advance(d time.Duration) (fired int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.setLocked(c.now.Add(d))
}

// Set moves the clock so that Now reads t (which may be in the past) and fires every timer that
// is due.
func (c *FakeClock) Set(t time.Time) {
	c.mu.Lock()
	c.setLocked(t.Add(-c.step))
	c.mu.Unlock()
}

func (c *FakeClock) setLocked(mono time.Time) (fired int) {
	c.now = mono
	c.notifyLocked()
	sort.Slice(c.timers, func(i, j int) bool { return c.timers[i].deadline.Before(c.timers[j].deadline) })
	kept := c.timers[:0]
	for _, timer := range c.timers {
		if timer.deadline.After(mono) {
			kept = append(kept, timer)
			continue
		}
		timer.ch <- mono.Add(c.step)
		fired++
	}
	c.timers = kept
	return fired
}

// PendingTimers counts timers that have not fired or been stopped.
func (c *FakeClock) PendingTimers() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.timers)
}

// Armed counts the timers made on the clock so far, fired, stopped and pending alike.
func (c *FakeClock) Armed() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.armed
}

// Deadlines returns when the pending timers are due, as Now will read then (unless the wall time
// steps), earliest first.
func (c *FakeClock) Deadlines() []time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]time.Time, 0, len(c.timers))
	for _, t := range c.timers {
		out = append(out, t.deadline.Add(c.step))
	}
	slices.SortFunc(out, time.Time.Compare)
	return out
}

// Changed returns a channel closed the next time a timer is created, fires or is stopped, or the
// clock moves: a test that waits for a condition on the clock looks again then.
func (c *FakeClock) Changed() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.changed
}

// WaitForDeadline blocks until a timer due at exactly at is pending: the code under test waits for
// that moment. It returns ctx's error if ctx ends first.
func (c *FakeClock) WaitForDeadline(ctx context.Context, at time.Time) error {
	for {
		changed := c.Changed()
		if slices.ContainsFunc(c.Deadlines(), at.Equal) {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// WaitForTimers blocks until at least n timers are pending, so that a test advances the clock only
// after the code under test is waiting on it. It returns ctx's error if ctx ends first.
func (c *FakeClock) WaitForTimers(ctx context.Context, n int) error {
	for {
		c.mu.Lock()
		pending, changed := len(c.timers), c.waiters
		c.mu.Unlock()
		if pending >= n {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// timerCreated returns a channel closed the next time a timer is created.
func (c *FakeClock) timerCreated() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.waiters
}

// Drive runs the clock for code that debounces, retries or waits: whenever more than baseline
// timers are pending it advances the clock by step (again at once if that fired nothing; else
// after the code reacted by arming a timer), until recv yields a value, which it returns. baseline is
// the number of long-lived timers (periodic checks, say) that must not be fired by the stepping.
// It fails the test if the value has not come after driveLimit of real time.
func Drive[T any](t testing.TB, c *FakeClock, step time.Duration, baseline int, recv <-chan T) T {
	t.Helper()
	// A real-time limit, so that a value that never comes fails the test instead of hanging it.
	giveUp := time.NewTimer(driveLimit)
	defer giveUp.Stop()
	for {
		created := c.timerCreated()
		if c.PendingTimers() > baseline && c.advance(step) == 0 {
			continue // nothing was due yet: nothing can react, step again
		}
		select {
		case v := <-recv:
			return v
		case <-created: // a timer was (re)armed: look again
		case <-giveUp.C:
			t.Fatalf("drove the fake clock to %s for %s without the awaited value", c.Now(), driveLimit)
		}
	}
}

const driveLimit = time.Minute

type fakeTimer struct {
	clock    *FakeClock
	deadline time.Time
	ch       chan time.Time
}

func (t *fakeTimer) C() <-chan time.Time { return t.ch }

func (t *fakeTimer) Stop() bool {
	t.clock.mu.Lock()
	defer t.clock.mu.Unlock()
	for i, other := range t.clock.timers {
		if other == t {
			t.clock.timers = append(t.clock.timers[:i], t.clock.timers[i+1:]...)
			t.clock.notifyLocked()
			return true
		}
	}
	return false
}
