package server

import (
	"strconv"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/meshid/meshid/internal/clock"
)

// A refusal needs no credentials and costs the client one request, so its log lines are bounded:
// per reason, a burst of refusalLogBurst lines, then one per refusalLogInterval. Every refusal is
// still counted in requests_refused_total, and the next line logged for a reason says how many
// of its refusals were left out before it. Keyed by reason, a fixed set, so that a flood of one
// kind of refusal does not hide the others.
const (
	refusalLogBurst    = 10
	refusalLogInterval = time.Second
)

// refusalLog decides which refusals are logged: a token bucket per reason on the injected clock.
type refusalLog struct {
	clock clock.Clock

	mu      sync.Mutex
	reasons map[string]*refusalBucket
}

type refusalBucket struct {
	tokens  float64
	last    time.Time
	skipped int // refusals not logged since the last line
}

func newRefusalLog(clk clock.Clock) *refusalLog {
	return &refusalLog{clock: clk, reasons: map[string]*refusalBucket{}}
}

// allow reports whether a refusal for reason is logged now and, if so, how many were left out
// since the last one logged.
func (l *refusalLog) allow(reason string) (bool, int) {
	now := l.clock.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	b, ok := l.reasons[reason]
	if !ok {
		b = &refusalBucket{tokens: refusalLogBurst, last: now}
		l.reasons[reason] = b
	}
	if now.After(b.last) { // a clock set back refills nothing
		b.tokens = min(refusalLogBurst, b.tokens+float64(now.Sub(b.last))/float64(refusalLogInterval))
		b.last = now
	}
	if b.tokens < 1 {
		b.skipped++
		return false, 0
	}
	b.tokens--
	skipped := b.skipped
	b.skipped = 0
	return true, skipped
}

// maxErrorText bounds a refusal's text, in the log and in the status sent back. The strings a
// client controls are bounded where they are quoted (logkey.Untrusted), but a library's error may
// quote more: x509's names the subject of a certificate the client presented.
const maxErrorText = 1024

func boundErrorText(s string) string {
	if len(s) <= maxErrorText {
		return s
	}
	cut := maxErrorText
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…(" + strconv.Itoa(len(s)) + " bytes)"
}
