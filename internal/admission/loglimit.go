package admission

import (
	"errors"
	"sync"
	"time"

	"golang.org/x/time/rate"

	"github.com/meshid/meshid/internal/clock"
)

// A client can repeat what a server logs of it as often as it likes: each kind of line is let
// through logBurst times at once, then once per logEvery.
const (
	logBurst = 10
	logEvery = time.Second
)

// LogLimiter paces log lines by kind, on an injected clock. The kinds are the server's own
// (refusal reasons), so its map stays small whatever clients send.
type LogLimiter struct {
	clock clock.Clock

	mu    sync.Mutex
	kinds map[string]*logKind
}

type logKind struct {
	limiter *rate.Limiter
	dropped int // lines held back since the last one let through
}

// NewLogLimiter returns a LogLimiter on clk (nil: the real clock).
func NewLogLimiter(clk clock.Clock) *LogLimiter {
	return &LogLimiter{clock: clock.OrReal(clk), kinds: map[string]*logKind{}}
}

// Allow reports whether a line of kind may be logged now and, if so, how many were held back
// since the last one. A clock set back refills nothing until it passes the last line's time.
func (l *LogLimiter) Allow(kind string) (ok bool, dropped int) {
	now := l.clock.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	k := l.kinds[kind]
	if k == nil {
		k = &logKind{limiter: rate.NewLimiter(rate.Every(logEvery), logBurst)}
		l.kinds[kind] = k
	}
	if !k.limiter.AllowN(now, 1) {
		k.dropped++
		return false, 0
	}
	dropped, k.dropped = k.dropped, 0
	return true, dropped
}

// ErrLogged marks a refusal already logged (and counted) where it was decided, such as by the
// attestor that gave a caller no identity: a server that passes it on to its client counts it
// too, but does not log the same refusal a second time.
var ErrLogged = errors.New("refusal logged where it was decided")

// Logged returns err marked with ErrLogged; its message is err's.
func Logged(err error) error { return loggedError{err} }

type loggedError struct{ error }

func (e loggedError) Unwrap() []error { return []error{e.error, ErrLogged} }
