// Package gcemetadata gets the instance's identity token from the Google Compute Engine metadata
// server, as Google's client libraries and Istio's GoogleComputeEngine credential fetcher do, for
// the agent to present to its CA and discovery server instead of a token file. It speaks through
// internal/localhttp, so that the slim agent links no http.Transport.
package gcemetadata

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/localhttp"
)

const (
	// DefaultHost is the metadata server's link-local address, as Google's libraries use it when
	// GCE_METADATA_HOST is not set.
	DefaultHost = "169.254.169.254"
	// DefaultTimeout bounds one fetch, dial to last byte.
	DefaultTimeout = 10 * time.Second
	// RefreshMargin is how long before its expiry a cached token is fetched again: Istio's GCE
	// fetcher refreshes five minutes ahead, which covers a CA whose clock is ahead of ours and a
	// call that waits in a retry. A token whose whole life is shorter than four margins is
	// refreshed with a quarter of its life left instead, so that it is still reused.
	RefreshMargin = 5 * time.Minute
	// identityPath is the default service account's identity token, as Google documents it.
	identityPath = "/computeMetadata/v1/instance/service-accounts/default/identity"
	flavorHeader = "Metadata-Flavor"
	flavorGoogle = "Google"
	// maxBody bounds the answer: an identity token is a couple of kilobytes.
	maxBody = 64 << 10
)

// ErrNotMetadataServer reports an answer without Metadata-Flavor: Google, which is not from a
// metadata server (a proxy, or something else listening at the address).
var ErrNotMetadataServer = errors.New("not a metadata server: the answer has no Metadata-Flavor: Google header")

// Config configures a Fetcher.
type Config struct {
	// Host is the metadata server, host or host:port (GCE_METADATA_HOST); empty: DefaultHost.
	Host string
	// Audience is the token's audience (CREDENTIAL_IDENTITY_PROVIDER); it is required.
	Audience string
	// Timeout bounds one fetch, on Clock; zero: DefaultTimeout.
	Timeout time.Duration
	Clock   clock.Clock
}

// joinHook, when set (by tests), is called as a caller joins a fetch under way.
type joinHook func()

// Fetcher gets the identity token and keeps it until shortly before it expires. Its Token method
// is an upstream.TokenSource.
type Fetcher struct {
	host, dialAddr, url string
	timeout             time.Duration
	clk                 clock.Clock

	mu       sync.Mutex
	token    string
	refresh  time.Time // when the cached token is fetched again
	inflight *fetch    // the fetch under way, shared by every caller meanwhile
	joined   joinHook
}

// fetch is one request to the metadata server; done closes when token or err is set.
type fetch struct {
	done  chan struct{}
	token string
	err   error
}

// CheckHost checks a metadata host as GCE_METADATA_HOST gives it: a host or host:port, without
// a scheme or a path.
func CheckHost(host string) error {
	if host == "" {
		return errors.New("is empty")
	}
	if strings.ContainsAny(host, "/?#@ ") {
		return errors.New("want a host or host:port, without a scheme or a path")
	}
	if h, port, err := net.SplitHostPort(host); err == nil {
		if h == "" || port == "" {
			return errors.New("want a host or host:port")
		}
	}
	return nil
}

// New returns a Fetcher for cfg; it fetches nothing until asked.
func New(cfg Config) (*Fetcher, error) {
	if cfg.Audience == "" {
		return nil, errors.New("the identity token's audience is empty")
	}
	host := cfg.Host
	if host == "" {
		host = DefaultHost
	}
	if err := CheckHost(host); err != nil {
		return nil, fmt.Errorf("metadata host %q: %w", host, err)
	}
	// Google's libraries put the host in the URL as given; a dial needs a port.
	dialAddr := host
	if _, _, err := net.SplitHostPort(host); err != nil {
		dialAddr = net.JoinHostPort(strings.Trim(host, "[]"), "80")
	}
	timeout := cfg.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	q := url.Values{"audience": {cfg.Audience}, "format": {"full"}}
	return &Fetcher{
		host: host, dialAddr: dialAddr, timeout: timeout, clk: clock.OrReal(cfg.Clock),
		url: "http://" + host + identityPath + "?" + q.Encode(),
	}, nil
}

// Token returns the cached token while it is fresh, else the token of a fetch, one at a time:
// callers that arrive during a fetch wait for it. A caller whose ctx ends stops waiting; the
// fetch goes on, bounded by the timeout, for the others. A failure is not cached.
func (f *Fetcher) Token(ctx context.Context) (string, error) {
	f.mu.Lock()
	if f.token != "" && f.clk.Now().Before(f.refresh) {
		tok := f.token
		f.mu.Unlock()
		return tok, nil
	}
	call, joined := f.inflight, f.inflight != nil
	if !joined {
		call = &fetch{done: make(chan struct{})}
		f.inflight = call
		// Detached from this caller's ctx, which may end before the others': the timeout bounds it.
		go f.run(context.WithoutCancel(ctx), call)
	}
	f.mu.Unlock()
	if joined && f.joined != nil {
		f.joined()
	}
	select {
	case <-call.done:
		return call.token, call.err
	case <-ctx.Done():
		return "", fmt.Errorf("identity token from the metadata server at %s: %w", f.host, ctx.Err())
	}
}

// run does call's request and publishes its result, cached on success.
func (f *Fetcher) run(ctx context.Context, call *fetch) {
	ctx, cancel := context.WithCancelCause(ctx)
	timer := f.clk.NewTimer(f.timeout)
	stopTimer := make(chan struct{})
	go func() {
		select {
		case <-timer.C():
			cancel(fmt.Errorf("%w: no answer within %s", context.DeadlineExceeded, f.timeout))
		case <-stopTimer:
		}
	}()
	tok, refresh, err := f.get(ctx)
	close(stopTimer)
	timer.Stop()
	cancel(nil)

	f.mu.Lock()
	if err == nil {
		f.token, f.refresh = tok, refresh
	}
	f.inflight = nil
	f.mu.Unlock()
	call.token, call.err = tok, err
	close(call.done)
}

// get asks the metadata server for a token and reads when to fetch it again from its exp.
func (f *Fetcher) get(ctx context.Context) (tok string, refresh time.Time, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, f.url, nil)
	if err != nil {
		return "", time.Time{}, fmt.Errorf("identity token request to the metadata server at %s: %w", f.host, err)
	}
	req.Header.Set(flavorHeader, flavorGoogle)
	req.URL.Host = f.dialAddr // the Host header stays as configured
	req.Host = f.host
	var body []byte
	err = localhttp.Do(req, maxBody, func(resp *http.Response) error {
		if resp.Header.Get(flavorHeader) != flavorGoogle {
			return ErrNotMetadataServer
		}
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("HTTP status %s", resp.Status)
		}
		var rerr error
		body, rerr = io.ReadAll(resp.Body)
		return rerr
	})
	if err != nil {
		if cause := context.Cause(ctx); cause != nil {
			err = cause // the connection was closed under the request: say why
		}
		return "", time.Time{}, fmt.Errorf("identity token from the metadata server at %s: %w", f.host, err)
	}
	tok = strings.TrimSpace(string(body))
	exp, iat, err := claims(tok)
	if err != nil {
		return "", time.Time{}, fmt.Errorf("identity token from the metadata server at %s: %w", f.host, err)
	}
	now := f.clk.Now()
	if !now.Before(exp) {
		return "", time.Time{}, fmt.Errorf("identity token from the metadata server at %s expired at %s, by our clock %s",
			f.host, exp.UTC().Format(time.RFC3339), now.UTC().Format(time.RFC3339))
	}
	return tok, exp.Add(-margin(exp, iat, now)), nil
}

// margin is how long before exp the token is fetched again: RefreshMargin, or a quarter of its
// life (from iat, else from now) when that is shorter.
func margin(exp, iat, now time.Time) time.Duration {
	start := now
	if !iat.IsZero() && iat.Before(exp) {
		start = iat
	}
	return min(RefreshMargin, exp.Sub(start)/4)
}

// claims reads the exp (required) and iat claims of a JWT without verifying it: the CA verifies
// it, and the agent needs only to know when to fetch another.
func claims(tok string) (exp, iat time.Time, err error) {
	parts := strings.Split(tok, ".")
	if len(parts) != 3 {
		return time.Time{}, time.Time{}, errors.New("the answer is not a JWT")
	}
	payload, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(parts[1], "="))
	if err != nil {
		return time.Time{}, time.Time{}, errors.New("the answer is not a JWT: its payload is not base64url")
	}
	var c struct {
		Exp *float64 `json:"exp"`
		Iat *float64 `json:"iat"`
	}
	if err := json.Unmarshal(payload, &c); err != nil {
		return time.Time{}, time.Time{}, errors.New("the answer is not a JWT: its payload is not a JSON object")
	}
	if c.Exp == nil || *c.Exp <= 0 {
		return time.Time{}, time.Time{}, errors.New("the token has no exp claim")
	}
	exp = time.Unix(int64(*c.Exp), 0)
	if c.Iat != nil && *c.Iat > 0 {
		iat = time.Unix(int64(*c.Iat), 0)
	}
	return exp, iat, nil
}
