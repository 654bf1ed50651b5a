// Package tokencache keeps a bearer token the agent fetches (from the metadata server, or by
// exchanging another) until shortly before it expires: one fetch at a time, shared by the
// callers that ask meanwhile, each bounded by a timeout on an injected clock.
package tokencache

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/singleflight"

	"github.com/meshid/meshid/internal/clock"
)

// RefreshMargin is how long before its expiry a token is fetched again, as Istio's fetchers do:
// it covers a CA whose clock is ahead of ours and a call that waits in a retry. A token whose
// life is shorter than four margins is fetched again with a quarter of its life left instead, so
// that it is still reused.
const RefreshMargin = 5 * time.Minute

// Fetch gets a token and when to fetch another (RefreshAt); a zero time: do not keep it.
type Fetch func(ctx context.Context) (token string, refresh time.Time, err error)

// Cache keeps the token of a Fetch.
type Cache struct {
	fetch   Fetch
	timeout time.Duration
	clk     clock.Clock
	flight  singleflight.Group

	mu      sync.Mutex
	token   string
	refresh time.Time

	// Joined, when set (by tests), is called once a caller waits on a fetch.
	Joined func()
}

// New returns the Cache of fetch, each fetch bounded by timeout on clk (nil: the real clock).
func New(fetch Fetch, timeout time.Duration, clk clock.Clock) *Cache {
	return &Cache{fetch: fetch, timeout: timeout, clk: clock.OrReal(clk)}
}

// Token returns the kept token while it is fresh, else the token of a fetch, one at a time:
// callers that arrive during a fetch wait for it. A caller whose ctx ends stops waiting, with
// ctx's error; the fetch goes on, bounded by the timeout, for the others. A failure is not kept.
func (c *Cache) Token(ctx context.Context) (string, error) {
	if tok, ok := c.cached(); ok {
		return tok, nil
	}
	// Detached from this caller's ctx, which may end before the others': the timeout bounds it.
	ch := c.flight.DoChan("", func() (any, error) { return c.run(context.WithoutCancel(ctx)) })
	if c.Joined != nil {
		c.Joined()
	}
	select {
	case r := <-ch:
		if r.Err != nil {
			return "", r.Err
		}
		tok, _ := r.Val.(string)
		return tok, nil
	case <-ctx.Done():
		return "", ctx.Err()
	}
}

func (c *Cache) cached() (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.token, c.token != "" && c.clk.Now().Before(c.refresh)
}

// run fetches within the timeout and keeps what the fetch says to keep. The fetch's ctx is
// cancelled, with the timeout as its cause (context.Cause), when the timeout passes.
func (c *Cache) run(ctx context.Context) (string, error) {
	// A caller that found the token stale may start a flight just after another one kept a new one.
	if tok, ok := c.cached(); ok {
		return tok, nil
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	timer := c.clk.NewTimer(c.timeout)
	stopTimer := make(chan struct{})
	go func() {
		select {
		case <-timer.C():
			cancel(fmt.Errorf("%w: no answer within %s", context.DeadlineExceeded, c.timeout))
		case <-stopTimer:
		}
	}()
	tok, refresh, err := c.fetch(ctx)
	close(stopTimer)
	timer.Stop()
	if err != nil {
		return "", err
	}
	if !refresh.IsZero() {
		c.mu.Lock()
		c.token, c.refresh = tok, refresh
		c.mu.Unlock()
	}
	return tok, nil
}

// RefreshAt is when a token that expires at exp is fetched again: RefreshMargin before, or a
// quarter of its life (from iat, else from now) before when that is shorter.
func RefreshAt(exp, iat, now time.Time) time.Time {
	start := now
	if !iat.IsZero() && iat.Before(exp) {
		start = iat
	}
	return exp.Add(-min(RefreshMargin, exp.Sub(start)/4))
}

// ErrNotJWT reports a token whose times cannot be read: not three base64url parts with a JSON
// payload, or no exp.
var ErrNotJWT = errors.New("not a JWT with an exp claim")

// JWTTimes reads a JWT's exp (required) and iat claims without verifying it: the CA verifies it,
// and the agent needs only to know when to fetch another.
func JWTTimes(tok string) (exp, iat time.Time, err error) {
	parts := strings.Split(tok, ".")
	if len(parts) != 3 {
		return time.Time{}, time.Time{}, fmt.Errorf("%w: %d parts", ErrNotJWT, len(parts))
	}
	payload, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(parts[1], "="))
	if err != nil {
		return time.Time{}, time.Time{}, fmt.Errorf("%w: its payload is not base64url", ErrNotJWT)
	}
	var c struct {
		Exp *float64 `json:"exp"`
		Iat *float64 `json:"iat"`
	}
	if err := json.Unmarshal(payload, &c); err != nil {
		return time.Time{}, time.Time{}, fmt.Errorf("%w: its payload is not a JSON object", ErrNotJWT)
	}
	if c.Exp == nil || *c.Exp <= 0 {
		return time.Time{}, time.Time{}, fmt.Errorf("%w: it has no exp claim", ErrNotJWT)
	}
	exp = time.Unix(int64(*c.Exp), 0)
	if c.Iat != nil && *c.Iat > 0 {
		iat = time.Unix(int64(*c.Iat), 0)
	}
	return exp, iat, nil
}
