// Package admission is the one shape of every server a client can reach (STYLE habit 13): the
// streams and connections it holds are counted against caps, overall and per key (a credential);
// gRPC's transport enforces the sizes and the keepalive policy; the peer of a Unix connection is
// named from the kernel; and what the server logs of its refusals is paced so that a client
// cannot flood the log.
package admission

import (
	"errors"
	"fmt"
	"sync"
)

// Refusals of a Gate; servers map them to ResourceExhausted.
var (
	ErrTooManyStreams     = errors.New("too many streams open")
	ErrTooManyForKey      = errors.New("too many streams open with one credential")
	ErrTooManyConnections = errors.New("too many connections open")
)

// Limits are a Gate's caps. Zero means no cap.
type Limits struct {
	// Streams bounds the streams (and unary calls, where a server counts them) open at once.
	Streams int
	// StreamsPerKey bounds the streams open at once under one key (a credential).
	StreamsPerKey int
	// Connections bounds the connections open at once.
	Connections int
}

// Gate counts the streams and connections admitted and not yet released.
type Gate struct {
	limits Limits

	mu      sync.Mutex
	streams int
	conns   int
	perKey  map[string]int // only keys with a stream open
}

// NewGate returns a Gate with limits; a negative limit is a programming error.
func NewGate(limits Limits) (*Gate, error) {
	if limits.Streams < 0 || limits.StreamsPerKey < 0 || limits.Connections < 0 {
		return nil, fmt.Errorf("admission limits must not be negative: %+v", limits)
	}
	return &Gate{limits: limits, perKey: map[string]int{}}, nil
}

// Limits returns the gate's caps.
func (g *Gate) Limits() Limits { return g.limits }

// Admit lets a stream in under key ("" counts toward the overall cap only), or says which cap
// it would pass. An admitted stream is released with Release and the same key.
func (g *Gate) Admit(key string) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.limits.Streams > 0 && g.streams >= g.limits.Streams {
		return fmt.Errorf("%w: %d, the limit", ErrTooManyStreams, g.streams)
	}
	if key != "" && g.limits.StreamsPerKey > 0 && g.perKey[key] >= g.limits.StreamsPerKey {
		return fmt.Errorf("%w: %d, the limit", ErrTooManyForKey, g.perKey[key])
	}
	g.streams++
	if key != "" {
		g.perKey[key]++
	}
	return nil
}

// Release counts out a stream Admit let in under key.
func (g *Gate) Release(key string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.streams--
	if key == "" {
		return
	}
	if n := g.perKey[key] - 1; n > 0 {
		g.perKey[key] = n
	} else {
		delete(g.perKey, key)
	}
}

// Streams returns the streams open.
func (g *Gate) Streams() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.streams
}

// AdmitConnection counts a new connection in, or refuses it past the cap: one that carries no
// stream serves nothing, and each holds buffers. It returns the function that counts it out,
// which may be called more than once.
func (g *Gate) AdmitConnection() (closed func(), err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.limits.Connections > 0 && g.conns >= g.limits.Connections {
		return nil, fmt.Errorf("%w: %d, the limit", ErrTooManyConnections, g.conns)
	}
	g.conns++
	return sync.OnceFunc(func() {
		g.mu.Lock()
		g.conns--
		g.mu.Unlock()
	}), nil
}
