package sds

import (
	"sync"
	"time"

	"github.com/meshid/meshid/internal/clock"
)

// A client can repeat what the server logs as often as it likes: each kind of line is let
// through logBurst times at once, then once per logEvery.
const (
	logBurst = 10
	logEvery = time.Second
)

// logLimiter is a token bucket per kind of line, on the server's clock. The kinds are the
// server's own (refusal reasons, "nack"), so the map stays small whatever clients send.
type logLimiter struct {
	clock clock.Clock

	mu    sync.Mutex
	kinds map[string]*logBucket
}

type logBucket struct {
	tokens  float64
	at      time.Time
	dropped int // lines held back since the last one let through
}

func newLogLimiter(clk clock.Clock) *logLimiter {
	return &logLimiter{clock: clk, kinds: map[string]*logBucket{}}
}

// allow reports whether a line of this kind may be logged now, and how many were held back
// since the last one.
func (l *logLimiter) allow(kind string) (ok bool, dropped int) {
	now := l.clock.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.kinds[kind]
	if b == nil {
		b = &logBucket{tokens: logBurst, at: now}
		l.kinds[kind] = b
	}
	if now.After(b.at) {
		b.tokens = min(logBurst, b.tokens+float64(now.Sub(b.at))/float64(logEvery))
		b.at = now
	}
	if b.tokens < 1 {
		b.dropped++
		return false, 0
	}
	b.tokens--
	dropped, b.dropped = b.dropped, 0
	return true, dropped
}
