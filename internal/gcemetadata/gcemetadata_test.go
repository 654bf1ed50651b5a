package gcemetadata

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/internal/tokencache"
)

const audience = "https://ca.example/aud"

var t0 = time.Date(2026, 11, 27, 9, 0, 0, 0, time.UTC)

// jwt is an unsigned JWT with the given claims: the fetcher reads them without verifying it.
func jwt(claims map[string]any) string {
	b, _ := json.Marshal(claims)
	return base64.RawURLEncoding.EncodeToString([]byte(`{"alg":"RS256"}`)) + "." + base64.RawURLEncoding.EncodeToString(b) + ".c2ln"
}

// metadataServer follows the metadata server's protocol: it refuses a request without
// Metadata-Flavor: Google, or for another path or query, and answers with the header.
type metadataServer struct {
	*httptest.Server
	fetches atomic.Int32
	// answer writes the token's body; nil: a token of life ttl from clk's now.
	answer func(w http.ResponseWriter, r *http.Request)
}

func newMetadataServer(t *testing.T, clk *testutil.FakeClock, ttl time.Duration) *metadataServer {
	t.Helper()
	m := &metadataServer{}
	m.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Metadata-Flavor") != "Google" {
			http.Error(w, "Missing Metadata-Flavor:Google header.", http.StatusForbidden)
			return
		}
		q := r.URL.Query()
		if r.Method != http.MethodGet || r.URL.Path != "/computeMetadata/v1/instance/service-accounts/default/identity" ||
			q.Get("audience") != audience || q.Get("format") != "full" || len(q) != 2 {
			http.Error(w, "not found", http.StatusNotFound)
			return
		}
		n := m.fetches.Add(1)
		if m.answer != nil {
			m.answer(w, r)
			return
		}
		now := clk.Now()
		w.Header().Set("Metadata-Flavor", "Google")
		_, _ = fmt.Fprint(w, jwt(map[string]any{"aud": audience, "iat": now.Unix(), "exp": now.Add(ttl).Unix(), "n": n}))
	}))
	t.Cleanup(m.Close)
	return m
}

func (m *metadataServer) host() string { return strings.TrimPrefix(m.URL, "http://") }

func newFetcher(t *testing.T, clk *testutil.FakeClock, host string) *Fetcher {
	t.Helper()
	f, err := New(Config{Host: host, Audience: audience, Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func TestTokenCachedUntilShortlyBeforeExpiry(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(t0)
	srv := newMetadataServer(t, clk, time.Hour)
	f := newFetcher(t, clk, srv.host())
	ctx := t.Context()

	first, err := f.Token(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if exp, _, err := tokencache.JWTTimes(first); err != nil || !exp.Equal(t0.Add(time.Hour)) {
		t.Fatalf("token's exp %v (%v), want the server's", exp, err)
	}
	// Fresh until 5 minutes before its exp.
	clk.Step(55*time.Minute - time.Second)
	if tok, err := f.Token(ctx); err != nil || tok != first {
		t.Fatalf("at 54m59s: %v, token changed %v; want the cached one", err, tok != first)
	}
	if n := srv.fetches.Load(); n != 1 {
		t.Fatalf("%d fetches, want 1 while the token is fresh", n)
	}
	clk.Step(time.Second)
	second, err := f.Token(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if second == first || srv.fetches.Load() != 2 {
		t.Fatalf("at 55m: %d fetches, token changed %v; want a new token", srv.fetches.Load(), second != first)
	}
}

func TestShortTokenRefreshedWithAQuarterOfItsLifeLeft(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(t0)
	srv := newMetadataServer(t, clk, 8*time.Minute) // margin: 2 minutes, not 5
	f := newFetcher(t, clk, srv.host())
	if _, err := f.Token(t.Context()); err != nil {
		t.Fatal(err)
	}
	clk.Step(6*time.Minute - time.Second)
	if _, err := f.Token(t.Context()); err != nil || srv.fetches.Load() != 1 {
		t.Fatalf("at 5m59s: %d fetches (%v), want 1", srv.fetches.Load(), err)
	}
	clk.Step(time.Second)
	if _, err := f.Token(t.Context()); err != nil || srv.fetches.Load() != 2 {
		t.Fatalf("at 6m: %d fetches (%v), want 2", srv.fetches.Load(), err)
	}
}

// The test server refuses a request without the header, so the fetcher's success shows that it
// sends it.
func TestServerRefusesRequestWithoutFlavor(t *testing.T) {
	t.Parallel()
	srv := newMetadataServer(t, testutil.NewFakeClock(t0), time.Hour)
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet,
		srv.URL+"/computeMetadata/v1/instance/service-accounts/default/identity?audience="+audience+"&format=full", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden || srv.fetches.Load() != 0 {
		t.Fatalf("status %d, %d fetches: want 403 and none", resp.StatusCode, srv.fetches.Load())
	}
}

func TestConcurrentCallersShareOneFetch(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(t0)
	srv := newMetadataServer(t, clk, time.Hour)
	release := make(chan struct{})
	srv.answer = func(w http.ResponseWriter, _ *http.Request) {
		<-release
		w.Header().Set("Metadata-Flavor", "Google")
		_, _ = fmt.Fprint(w, jwt(map[string]any{"exp": t0.Add(time.Hour).Unix()}))
	}
	f := newFetcher(t, clk, srv.host())
	const callers = 8
	joined := make(chan struct{}, callers)
	f.cache.Joined = func() { joined <- struct{}{} }

	var wg sync.WaitGroup
	toks := make([]string, callers)
	errs := make([]error, callers)
	for i := range callers {
		wg.Go(func() { toks[i], errs[i] = f.Token(t.Context()) })
	}
	for range callers - 1 { // all but the one that started the fetch
		<-joined
	}
	close(release)
	wg.Wait()
	for i := range callers {
		if errs[i] != nil || toks[i] != toks[0] {
			t.Fatalf("caller %d: %v, same token %v", i, errs[i], toks[i] == toks[0])
		}
	}
	if n := srv.fetches.Load(); n != 1 {
		t.Fatalf("%d fetches for %d concurrent callers, want 1", n, callers)
	}
}

func TestFetchErrors(t *testing.T) {
	t.Parallel()
	const secret = "eyJzZWNyZXQiOiJ0b2tlbiJ9" // a body that must never reach an error
	cases := []struct {
		name   string
		answer func(w http.ResponseWriter, r *http.Request)
		want   []string
		is     error
	}{
		{"server error", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Metadata-Flavor", "Google")
			w.WriteHeader(http.StatusInternalServerError)
			_, _ = fmt.Fprint(w, secret)
		}, []string{"HTTP status 500 Internal Server Error"}, nil},
		{"not a metadata server", func(w http.ResponseWriter, _ *http.Request) {
			_, _ = fmt.Fprint(w, jwt(map[string]any{"exp": t0.Add(time.Hour).Unix(), "s": secret}))
		}, []string{"not a metadata server"}, ErrNotMetadataServer},
		{"garbage", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Metadata-Flavor", "Google")
			_, _ = fmt.Fprint(w, secret)
		}, []string{"not a JWT"}, nil},
		{"no exp", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Metadata-Flavor", "Google")
			_, _ = fmt.Fprint(w, jwt(map[string]any{"aud": audience, "s": secret}))
		}, []string{"no exp claim"}, nil},
		{"expired", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Metadata-Flavor", "Google")
			_, _ = fmt.Fprint(w, jwt(map[string]any{"exp": t0.Add(-time.Second).Unix(), "s": secret}))
		}, []string{"expired at 2026-11-27T08:59:59Z"}, nil},
		{"too large", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Metadata-Flavor", "Google")
			_, _ = fmt.Fprint(w, strings.Repeat(secret, maxBody/len(secret)+1))
		}, []string{"larger than the limit"}, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			clk := testutil.NewFakeClock(t0)
			srv := newMetadataServer(t, clk, time.Hour)
			srv.answer = tc.answer
			f := newFetcher(t, clk, srv.host())
			for attempt := 1; attempt <= 2; attempt++ { // a failure is not cached
				tok, err := f.Token(t.Context())
				if err == nil {
					t.Fatalf("token %q, want an error", tok)
				}
				for _, want := range append([]string{"metadata server at " + srv.host()}, tc.want...) {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("error %q does not say %q", err, want)
					}
				}
				if strings.Contains(err.Error(), secret) {
					t.Errorf("error %q holds the answer's body", err)
				}
				if tc.is != nil && !errors.Is(err, tc.is) {
					t.Errorf("error %q is not %v", err, tc.is)
				}
				if n := srv.fetches.Load(); n != int32(attempt) {
					t.Fatalf("%d fetches after %d calls", n, attempt)
				}
			}
		})
	}
}

// hangingServer accepts the request and never answers; got closes as the request arrives.
func hangingServer(t *testing.T, clk *testutil.FakeClock) (*metadataServer, <-chan struct{}) {
	t.Helper()
	srv := newMetadataServer(t, clk, time.Hour)
	got := make(chan struct{}, 1)
	srv.answer = func(_ http.ResponseWriter, r *http.Request) {
		got <- struct{}{}
		<-r.Context().Done() // the client closed the connection
	}
	return srv, got
}

func TestCallerContextEnds(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(t0)
	srv, got := hangingServer(t, clk)
	f := newFetcher(t, clk, srv.host())
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		_, err := f.Token(ctx)
		done <- err
	}()
	<-got
	cancel()
	err := <-done
	if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), srv.host()) {
		t.Fatalf("error %v: want context.Canceled naming the host", err)
	}
	// The fetch goes on for other callers until its timeout, which ends the request.
	clk.Advance(DefaultTimeout)
}

func TestFetchTimesOutOnTheClock(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(t0)
	srv, got := hangingServer(t, clk)
	f, err := New(Config{Host: srv.host(), Audience: audience, Clock: clk, Timeout: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := f.Token(t.Context())
		done <- err
	}()
	<-got
	if err := clk.WaitForTimers(t.Context(), 1); err != nil {
		t.Fatal(err)
	}
	clk.Advance(3 * time.Second)
	err = <-done
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "no answer within 3s") ||
		!strings.Contains(err.Error(), srv.host()) {
		t.Fatalf("error %v: want a timeout naming the host", err)
	}
}

func TestNewChecksItsConfig(t *testing.T) {
	t.Parallel()
	if _, err := New(Config{}); err == nil || !strings.Contains(err.Error(), "audience") {
		t.Fatalf("no audience: %v", err)
	}
	for _, host := range []string{"http://169.254.169.254", "metadata/computeMetadata", "h:", ":80"} {
		if _, err := New(Config{Audience: audience, Host: host}); err == nil {
			t.Errorf("host %q accepted", host)
		}
	}
	for host, want := range map[string]string{"": "169.254.169.254:80", "metadata.google.internal": "metadata.google.internal:80",
		"127.0.0.1:8080": "127.0.0.1:8080", "[::1]": "[::1]:80"} {
		f, err := New(Config{Audience: audience, Host: host})
		if err != nil || f.dialAddr != want {
			t.Errorf("host %q: dials %q (%v), want %q", host, f.dialAddr, err, want)
		}
	}
}
