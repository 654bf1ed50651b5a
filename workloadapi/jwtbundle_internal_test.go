package workloadapi

import (
	"context"
	"crypto"
	"errors"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/testutil"
)

// hangingIssuer's fetch waits until release is closed, and says when it has begun.
type hangingIssuer struct {
	entered, release chan struct{}
}

func (h hangingIssuer) MintJWTSVID(context.Context, []string) (JWTSVID, error) {
	return JWTSVID{}, errors.New("not minted here")
}

func (h hangingIssuer) FetchJWTBundle(ctx context.Context) (JWTBundle, error) {
	close(h.entered)
	select {
	case <-h.release:
		return JWTBundle{TrustDomain: "spiffe://cluster.local", JWKS: []byte(`{"keys":[]}`), Keys: map[string]crypto.PublicKey{"k": nil}}, nil
	case <-ctx.Done():
		return JWTBundle{}, ctx.Err()
	}
}

// A caller waiting for another's fetch leaves when its own context ends, instead of queueing
// behind a CA that does not answer; the fetch goes on for its caller.
func TestJWTBundleWaitLeavesWithItsContext(t *testing.T) {
	t.Parallel()
	iss := hangingIssuer{entered: make(chan struct{}), release: make(chan struct{})}
	j := &jwtBundles{issuer: iss, clock: testutil.NewFakeClock(time.Unix(0, 0)), maxAge: time.Minute}
	first := make(chan error, 1)
	go func() {
		_, err := j.get(t.Context())
		first <- err
	}()
	<-iss.entered
	ctx, cancel := context.WithCancel(t.Context())
	left := make(chan error, 1)
	go func() {
		_, err := j.get(ctx)
		left <- err
	}()
	cancel()
	if err := <-left; !errors.Is(err, context.Canceled) {
		t.Fatalf("the waiting caller: %v, want context.Canceled", err)
	}
	close(iss.release)
	if err := <-first; err != nil {
		t.Fatalf("the fetching caller: %v", err)
	}
}

// After a failed fetch the CA is not asked again for jwtBundleRetry: every caller meanwhile gets
// the failure (with the bundle held, if any) at once.
func TestJWTBundleRetryAfterFailure(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(time.Unix(0, 0))
	calls := 0
	failing := errors.New("CA unreachable")
	j := &jwtBundles{issuer: countingIssuer{calls: &calls, err: failing}, clock: clk, maxAge: time.Minute}
	for range 3 {
		if _, err := j.get(t.Context()); !errors.Is(err, failing) {
			t.Fatalf("get: %v, want %v", err, failing)
		}
	}
	if calls != 1 {
		t.Fatalf("%d fetches, want 1 within %s of the failure", calls, jwtBundleRetry)
	}
	clk.Advance(jwtBundleRetry)
	if _, err := j.get(t.Context()); !errors.Is(err, failing) || calls != 2 {
		t.Fatalf("after %s: %v, %d fetches; want a second fetch", jwtBundleRetry, err, calls)
	}
}

type countingIssuer struct {
	calls *int
	err   error
}

func (c countingIssuer) MintJWTSVID(context.Context, []string) (JWTSVID, error) {
	return JWTSVID{}, c.err
}

func (c countingIssuer) FetchJWTBundle(context.Context) (JWTBundle, error) {
	*c.calls++
	return JWTBundle{}, c.err
}
