// Package tokenexchange trades the agent's token for the one its CA wants, by OAuth 2.0 token
// exchange (RFC 8693): the subject token is posted to a security token service, whose answer is
// presented instead, cached until shortly before it expires. It speaks through
// internal/localhttp, verifying the service's certificate, so that the slim agent links no
// http.Transport.
package tokenexchange

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
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
	// GrantType is RFC 8693's grant type.
	GrantType = "urn:ietf:params:oauth:grant-type:token-exchange"
	// TokenTypeJWT is RFC 8693's token type of a JWT, the default of both the subject token and
	// the requested one: the CA verifies a JWT.
	TokenTypeJWT = "urn:ietf:params:oauth:token-type:jwt" //nolint:gosec // a token type's name, no credential
	// DefaultTimeout bounds one exchange, the subject token's fetch included.
	DefaultTimeout = 10 * time.Second
	// RefreshMargin is how long before its expiry an exchanged token is exchanged again.
	RefreshMargin = tokencache.RefreshMargin
	// maxBody bounds the answer: a token and a few fields.
	maxBody = 64 << 10
	// maxDescription bounds the error_description quoted in an error.
	maxDescription = 256
)

// Config configures an Exchanger.
type Config struct {
	// URL is the token endpoint: https, or http to a loopback address only, since the form
	// carries the subject token.
	URL string
	// Subject gives the token to exchange (the token file's, or the GCE fetcher's).
	Subject func(context.Context) (string, error)
	// SubjectTokenType and RequestedTokenType are RFC 8693 token types; empty: TokenTypeJWT.
	SubjectTokenType   string
	RequestedTokenType string
	// Audience is where the exchanged token will be presented (the CA's JWT audience); Scope
	// is optional. Empty ones are not sent.
	Audience string
	Scope    string
	// RootCAs verify an https endpoint; nil: the system's roots.
	RootCAs *x509.CertPool
	// Timeout bounds one exchange, on Clock; zero: DefaultTimeout.
	Timeout time.Duration
	Clock   clock.Clock
}

// Exchanger exchanges the subject token and keeps the result until shortly before it expires.
// Its Token method is an upstream.TokenSource.
type Exchanger struct {
	cfg   Config
	url   string // as configured, for errors
	clk   clock.Clock
	cache *tokencache.Cache
}

// CheckURL checks a token endpoint: an absolute https URL, or http to a loopback address (an
// IP literal or localhost), without user information or a fragment.
func CheckURL(raw string) error {
	u, err := url.Parse(raw)
	if err != nil {
		return errors.New("is not a URL")
	}
	if u.Host == "" || u.Hostname() == "" {
		return errors.New("want an absolute URL, https://HOST/PATH")
	}
	if u.User != nil || u.Fragment != "" {
		return errors.New("want no user information and no fragment")
	}
	switch u.Scheme {
	case "https":
	case "http":
		if !loopback(u.Hostname()) {
			return errors.New("http to a host other than loopback would send the subject token in clear: want https")
		}
	default:
		return fmt.Errorf("scheme %q: want https (or http to loopback)", u.Scheme)
	}
	return nil
}

func loopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// New returns an Exchanger for cfg; it exchanges nothing until asked.
func New(cfg Config) (*Exchanger, error) {
	if err := CheckURL(cfg.URL); err != nil {
		return nil, fmt.Errorf("token exchange URL %q: %w", cfg.URL, err)
	}
	if cfg.Subject == nil {
		return nil, errors.New("token exchange: no subject token source")
	}
	if cfg.SubjectTokenType == "" {
		cfg.SubjectTokenType = TokenTypeJWT
	}
	if cfg.RequestedTokenType == "" {
		cfg.RequestedTokenType = TokenTypeJWT
	}
	timeout := cfg.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	e := &Exchanger{cfg: cfg, url: cfg.URL, clk: clock.OrReal(cfg.Clock)}
	e.cache = tokencache.New(e.post, timeout, e.clk)
	return e, nil
}

// Token returns the cached token while it is fresh, else the token of an exchange, one at a
// time: callers that arrive during an exchange wait for it (tokencache). A failure is not cached.
func (e *Exchanger) Token(ctx context.Context) (string, error) {
	tok, err := e.cache.Token(ctx)
	if err != nil && ctx.Err() != nil {
		return "", fmt.Errorf("token exchange at %s: %w", e.url, err)
	}
	return tok, err
}

// answer is RFC 8693's response (section 2.2.1), or RFC 6749's error response (section 5.2).
type answer struct {
	AccessToken     string   `json:"access_token"`
	IssuedTokenType string   `json:"issued_token_type"`
	TokenType       string   `json:"token_type"`
	ExpiresIn       *float64 `json:"expires_in"`

	Error            string `json:"error"`
	ErrorDescription string `json:"error_description"`
}

// post exchanges the subject token and reads when to exchange again: expires_in, else the
// exchanged JWT's exp; a zero refresh means neither says, and the token is not cached.
func (e *Exchanger) post(ctx context.Context) (tok string, refresh time.Time, err error) {
	fail := func(err error) (string, time.Time, error) {
		return "", time.Time{}, fmt.Errorf("token exchange at %s: %w", e.url, err)
	}
	subject, err := e.cfg.Subject(ctx)
	if err != nil {
		return fail(fmt.Errorf("the subject token: %w", err))
	}
	form := url.Values{
		"grant_type":           {GrantType},
		"subject_token":        {subject},
		"subject_token_type":   {e.cfg.SubjectTokenType},
		"requested_token_type": {e.cfg.RequestedTokenType},
	}
	if e.cfg.Audience != "" {
		form.Set("audience", e.cfg.Audience)
	}
	if e.cfg.Scope != "" {
		form.Set("scope", e.cfg.Scope)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.cfg.URL, strings.NewReader(form.Encode()))
	if err != nil {
		return fail(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Accept", "application/json")
	var a answer
	start := e.clk.Now()
	err = localhttp.DoVerified(req, e.cfg.RootCAs, maxBody, func(resp *http.Response) error {
		return read(resp, &a)
	})
	if err != nil {
		if cause := context.Cause(ctx); cause != nil {
			err = cause // the connection was closed under the request: say why
		}
		return fail(redact(err, subject))
	}
	if a.IssuedTokenType != "" && a.IssuedTokenType != e.cfg.RequestedTokenType {
		return fail(fmt.Errorf("the issued token is of type %q, not the %q asked for", a.IssuedTokenType, e.cfg.RequestedTokenType))
	}
	var exp time.Time
	if a.ExpiresIn != nil {
		if *a.ExpiresIn <= 0 {
			return fail(fmt.Errorf("the answer's expires_in is %v: the token is already expired", *a.ExpiresIn))
		}
		exp = start.Add(time.Duration(*a.ExpiresIn * float64(time.Second)))
	} else if jwtExp, _, err := tokencache.JWTTimes(a.AccessToken); err == nil {
		exp = jwtExp
	}
	if exp.IsZero() {
		return a.AccessToken, time.Time{}, nil
	}
	now := e.clk.Now()
	if !now.Before(exp) {
		return fail(fmt.Errorf("the exchanged token expired at %s, by our clock %s", exp.UTC().Format(time.RFC3339), now.UTC().Format(time.RFC3339)))
	}
	return a.AccessToken, tokencache.RefreshAt(exp, start, now), nil
}

// read decodes the answer: a token on 200, else the error RFC 6749 describes, else the status.
func read(resp *http.Response, a *answer) error {
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("reading the answer: %w", err)
	}
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	jsonErr := json.Unmarshal(body, a)
	if resp.StatusCode != http.StatusOK {
		if jsonErr == nil && a.Error != "" {
			return fmt.Errorf("%s%s (HTTP %s)", a.Error, description(a.ErrorDescription), resp.Status)
		}
		return fmt.Errorf("HTTP status %s", resp.Status)
	}
	if jsonErr != nil {
		return fmt.Errorf("the answer (Content-Type %q) is not a JSON object", mt)
	}
	if a.Error != "" {
		return fmt.Errorf("%s%s", a.Error, description(a.ErrorDescription))
	}
	if a.AccessToken == "" {
		return errors.New("the answer has no access_token")
	}
	return nil
}

// description quotes an error_description, cut to a bound.
func description(d string) string {
	if d == "" {
		return ""
	}
	if len(d) > maxDescription {
		d = d[:maxDescription] + "..."
	}
	return fmt.Sprintf(": %q", d)
}

// redact keeps the subject token out of an error, should the service echo it in its
// description.
func redact(err error, subject string) error {
	if subject == "" || !strings.Contains(err.Error(), subject) {
		return err
	}
	return errors.New(strings.ReplaceAll(err.Error(), subject, "[subject token]"))
}
