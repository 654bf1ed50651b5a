package fsutil

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/meshid/meshid/internal/clock"
)

// DefaultReadBound is how long BoundedReads waits for a read by default: a local file, or a
// mounted one on a file system that answers, is read in well under a second.
const DefaultReadBound = 5 * time.Second

// ErrNoAnswer reports a read that did not return within the bound: the file system is likely
// hung (a dead NFS server, a FUSE daemon that stopped answering).
var ErrNoAnswer = errors.New("no answer")

// ErrTooManyReads reports a read not started because as many reads as allowed are under way,
// which only reads that do not answer can make so.
var ErrTooManyReads = errors.New("too many reads under way")

// BoundedReads reads files that may be on a file system that stops answering. A read(2) on a hung
// NFS or FUSE mount blocks, and no context can interrupt it; so each read runs on a goroutine of
// its own, and the caller stops waiting after the bound (on the injected clock) or when its
// context ends. The goroutine is still BoundedReads': it ends when the read returns, and while it
// has not, a read of the same key joins it instead of starting another, so that a stuck file
// system holds one goroutine per file, however often it is asked, and no more than a set number
// in all (when its files are named by clients, who could name ever more). Its result goes to the
// callers still waiting; the next read after it starts afresh.
type BoundedReads struct {
	clock    clock.Clock
	bound    time.Duration
	maxReads int

	mu       sync.Mutex
	inflight map[string]*boundedRead
}

// boundedRead is one read under way; data and err are set before done is closed.
type boundedRead struct {
	done chan struct{}
	data []byte
	err  error
}

// NewBoundedReads returns a BoundedReads that waits bound (0: DefaultReadBound) on clk (nil: the
// real clock), with at most maxReads reads under way (0: no limit).
func NewBoundedReads(clk clock.Clock, bound time.Duration, maxReads int) *BoundedReads {
	if bound <= 0 {
		bound = DefaultReadBound
	}
	return &BoundedReads{clock: clock.OrReal(clk), bound: bound, maxReads: maxReads, inflight: map[string]*boundedRead{}}
}

// ReadFile reads path (os.ReadFile) within the bound.
func (b *BoundedReads) ReadFile(ctx context.Context, path string) ([]byte, error) {
	return b.Read(ctx, path, path, func() ([]byte, error) { return os.ReadFile(path) })
}

// Read runs read within the bound. key names what read reads: while a read of key is under way,
// Read waits for that one rather than run read. what names it in the errors ("the CA root
// /etc/certs/root-cert.pem"). A read that does not answer in time is reported with ErrNoAnswer;
// one the caller gave up on, with ctx's error; one not started for the limit, with ErrTooManyReads.
func (b *BoundedReads) Read(ctx context.Context, key, what string, read func() ([]byte, error)) ([]byte, error) {
	b.mu.Lock()
	r := b.inflight[key]
	if r == nil && b.maxReads > 0 && len(b.inflight) >= b.maxReads {
		n := len(b.inflight)
		b.mu.Unlock()
		return nil, fmt.Errorf("reading %s: %w (%d), is the file system alive?", what, ErrTooManyReads, n)
	}
	if r == nil {
		r = &boundedRead{done: make(chan struct{})}
		b.inflight[key] = r
		go func() {
			r.data, r.err = read()
			b.mu.Lock()
			delete(b.inflight, key)
			b.mu.Unlock()
			close(r.done)
		}()
	}
	b.mu.Unlock()

	select {
	case <-r.done: // read at once, without a timer: the usual case
		return slices.Clone(r.data), r.err
	default:
	}
	timer := b.clock.NewTimer(b.bound)
	defer timer.Stop()
	select {
	case <-r.done:
		return slices.Clone(r.data), r.err // each caller its own copy: it may have joined another's read
	case <-timer.C():
		return nil, fmt.Errorf("reading %s: %w after %s, is the file system alive?", what, ErrNoAnswer, b.bound)
	case <-ctx.Done():
		return nil, fmt.Errorf("reading %s: %w", what, ctx.Err())
	}
}
