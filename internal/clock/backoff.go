package clock

import (
	"time"

	"github.com/cenkalti/backoff/v4"
)

// BackoffTimer adapts c to backoff.Timer, so that retries wait on the injected clock.
func BackoffTimer(c Clock) backoff.Timer { return &backoffTimer{clock: OrReal(c)} }

type backoffTimer struct {
	clock Clock
	timer Timer
}

func (t *backoffTimer) Start(d time.Duration) {
	if t.timer != nil {
		t.timer.Stop()
	}
	t.timer = t.clock.NewTimer(d)
}

func (t *backoffTimer) Stop() {
	if t.timer != nil {
		t.timer.Stop()
	}
}

func (t *backoffTimer) C() <-chan time.Time { return t.timer.C() }
