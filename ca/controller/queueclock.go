package controller

import (
	"time"

	kclock "k8s.io/utils/clock"

	"github.com/meshid/meshid/internal/clock"
)

// queueClock is the clock the secret queue's delays run on: client-go's real clock, heartbeat
// included, when none is injected; else the injected one, through injectedClock.
func queueClock(c clock.Clock) kclock.WithTicker {
	if c == nil || c == clock.Real() {
		return kclock.RealClock{}
	}
	return injectedClock{c}
}

// injectedClock is an injected clock as client-go's delaying workqueue takes it. The queue arms a
// timer, on this clock, for the earliest item it holds, which is all it needs. Its one ticker is a
// heartbeat every ten seconds, "insurance against weird things happening" (a timer missed): here
// tickers never tick, because a test's fake clock would have to be stepped around it, and a
// missed timer on a fake clock is a bug for the test to find, not for a heartbeat to hide.
type injectedClock struct{ c clock.Clock }

func (k injectedClock) Now() time.Time { return k.c.Now() }

func (k injectedClock) Since(t time.Time) time.Duration { return k.c.Now().Sub(t) }

func (k injectedClock) NewTimer(d time.Duration) kclock.Timer {
	return &injectedTimer{c: k.c, t: k.c.NewTimer(d)}
}

func (k injectedClock) After(d time.Duration) <-chan time.Time { return k.c.NewTimer(d).C() }

func (k injectedClock) Sleep(d time.Duration) { <-k.c.NewTimer(d).C() }

func (injectedClock) Tick(time.Duration) <-chan time.Time { return nil }

func (injectedClock) NewTicker(time.Duration) kclock.Ticker { return silentTicker{} }

// injectedTimer is a timer of the injected clock; Reset arms a new one, whose channel C returns
// from then on.
type injectedTimer struct {
	c clock.Clock
	t clock.Timer
}

func (t *injectedTimer) C() <-chan time.Time { return t.t.C() }

func (t *injectedTimer) Stop() bool { return t.t.Stop() }

func (t *injectedTimer) Reset(d time.Duration) bool {
	active := t.t.Stop()
	t.t = t.c.NewTimer(d)
	return active
}

// silentTicker never ticks.
type silentTicker struct{}

func (silentTicker) C() <-chan time.Time { return nil }

func (silentTicker) Stop() {}
