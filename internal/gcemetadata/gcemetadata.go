// Package gcemetadata gets the instance's identity token from the Google Compute Engine metadata
// server, as Google's client libraries and Istio's GoogleComputeEngine credential fetcher do, for
// the agent to present to its CA and discovery server instead of a token file. It speaks through
// internal/localhttp, so that the slim agent links no http.Transport.
package gcemetadata

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/localhttp"
	"github.com/meshid/meshid/internal/tokencache"
)

const (
	// DefaultHost is the metadata server's link-local address, as Google's libraries use it when
	// GCE_METADATA_HOST is not set.
	DefaultHost = "169.254.169.254"
	// DefaultTimeout bounds one fetch, dial to last byte.
	DefaultTimeout = 10 * time.Second
	// RefreshMargin is how long before its expiry a cached token is fetched again.
	RefreshMargin = tokencache.RefreshMargin
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

// Fetcher gets the identity token and keeps it until shortly before it expires. Its Token method
// is an upstream.TokenSource.
type Fetcher struct {
	host, dialAddr, url string
	clk                 clock.Clock
	cache               *tokencache.Cache
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
	f := &Fetcher{host: host, dialAddr: dialAddr, clk: clock.OrReal(cfg.Clock), url: "http://" + host + identityPath + "?" + q.Encode()}
	f.cache = tokencache.New(f.get, timeout, f.clk)
	return f, nil
}

// Token returns the cached token while it is fresh, else the token of a fetch, one at a time:
// callers that arrive during a fetch wait for it (tokencache). A failure is not cached.
func (f *Fetcher) Token(ctx context.Context) (string, error) {
	tok, err := f.cache.Token(ctx)
	if err != nil && ctx.Err() != nil {
		return "", fmt.Errorf("identity token from the metadata server at %s: %w", f.host, err)
	}
	return tok, err
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
	exp, iat, err := tokencache.JWTTimes(tok)
	if err != nil {
		return "", time.Time{}, fmt.Errorf("identity token from the metadata server at %s: %w", f.host, err)
	}
	now := f.clk.Now()
	if !now.Before(exp) {
		return "", time.Time{}, fmt.Errorf("identity token from the metadata server at %s expired at %s, by our clock %s",
			f.host, exp.UTC().Format(time.RFC3339), now.UTC().Format(time.RFC3339))
	}
	return tok, tokencache.RefreshAt(exp, iat, now), nil
}
