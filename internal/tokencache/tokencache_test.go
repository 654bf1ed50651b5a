package tokencache_test

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/internal/tokencache"
)

var t0 = time.Unix(1e9, 0)

func TestRefreshAt(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name          string
		exp, iat, now time.Time
		want          time.Time
	}{
		{"an hour's token: five minutes ahead", t0.Add(time.Hour), t0, t0, t0.Add(55 * time.Minute)},
		{"a ten minutes' token: a quarter of its life ahead", t0.Add(10 * time.Minute), t0, t0, t0.Add(7*time.Minute + 30*time.Second)},
		{"no iat: its life from now", t0.Add(8 * time.Minute), time.Time{}, t0, t0.Add(6 * time.Minute)},
	} {
		if got := tokencache.RefreshAt(tc.exp, tc.iat, tc.now); !got.Equal(tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got.Sub(t0), tc.want.Sub(t0))
		}
	}
}

func jwt(payload string) string {
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(`{"alg":"none"}`)) + "." + enc([]byte(payload)) + ".sig"
}

func TestJWTTimes(t *testing.T) {
	t.Parallel()
	exp, iat, err := tokencache.JWTTimes(jwt(`{"exp":1000003600,"iat":1000000000}`))
	if err != nil || !exp.Equal(t0.Add(time.Hour)) || !iat.Equal(t0) {
		t.Fatalf("JWTTimes: %v %v %v", exp, iat, err)
	}
	for _, bad := range []string{"opaque", "a.b", "a.!!!.c", jwt(`[1]`), jwt(`{"iat":1}`), jwt(`{"exp":0}`)} {
		if _, _, err := tokencache.JWTTimes(bad); !errors.Is(err, tokencache.ErrNotJWT) {
			t.Errorf("JWTTimes(%q): %v, want ErrNotJWT", bad, err)
		}
	}
}

// A token is kept until its refresh time, one without a refresh time not at all, a failure not
// at all; a fetch that does not answer ends at the timeout, with the timeout as its cause.
func TestCache(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(t0)
	fetches := 0
	var refresh time.Time
	var fail error
	c := tokencache.New(func(ctx context.Context) (string, time.Time, error) {
		fetches++
		if fail != nil {
			return "", time.Time{}, fail
		}
		return fmt.Sprint("token-", fetches), refresh, nil
	}, time.Second, clk)
	ctx := t.Context()

	refresh = t0.Add(time.Minute)
	if tok, err := c.Token(ctx); err != nil || tok != "token-1" {
		t.Fatalf("first: %q %v", tok, err)
	}
	if tok, _ := c.Token(ctx); tok != "token-1" || fetches != 1 {
		t.Fatalf("before the refresh: %q after %d fetches, want the kept token-1", tok, fetches)
	}
	clk.Step(time.Minute)
	refresh = time.Time{}
	if tok, _ := c.Token(ctx); tok != "token-2" {
		t.Fatalf("at the refresh: %q, want a new token", tok)
	}
	if tok, _ := c.Token(ctx); tok != "token-3" {
		t.Fatalf("after a token without a refresh time: %q, want another fetch", tok)
	}
	fail = errors.New("down")
	if _, err := c.Token(ctx); err == nil {
		t.Fatal("a failed fetch gave a token")
	}
	fail = nil
	if tok, _ := c.Token(ctx); tok != "token-5" {
		t.Fatalf("after a failure: %q, want a new fetch", tok)
	}

	hung := tokencache.New(func(ctx context.Context) (string, time.Time, error) {
		<-ctx.Done()
		return "", time.Time{}, context.Cause(ctx)
	}, time.Second, clk)
	done := make(chan error, 1)
	go func() { _, err := hung.Token(ctx); done <- err }()
	if err := clk.WaitForTimers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Second)
	if err := <-done; !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a hung fetch: %v, want the timeout", err)
	}
}
