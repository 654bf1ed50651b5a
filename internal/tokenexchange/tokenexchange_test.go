package tokenexchange

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/testutil"
)

const (
	subjectToken = "subject-token-never-in-errors"
	issuedToken  = "issued-token-never-in-errors"
)

var t0 = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

// sts is a token endpoint written for the tests: it checks the request as RFC 8693 section 2.1
// says and answers with answer (default: issuedToken, expiring in an hour). forms holds each
// request's form; exchanges counts them.
type sts struct {
	srv       *httptest.Server
	exchanges atomic.Int32
	mu        sync.Mutex
	forms     []url.Values
	answer    func(w http.ResponseWriter)
}

func newSTS(t *testing.T, tlsServer bool) *sts {
	t.Helper()
	s := &sts{answer: func(w http.ResponseWriter) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = fmt.Fprintf(w, `{"access_token":%q,"issued_token_type":%q,"token_type":"N_A","expires_in":3600}`, issuedToken, TokenTypeJWT)
	}}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Path != "/v1/token" || r.Header.Get("Content-Type") != "application/x-www-form-urlencoded" {
			http.Error(w, "not a token exchange request", http.StatusBadRequest)
			return
		}
		if err := r.ParseForm(); err != nil {
			http.Error(w, "bad form", http.StatusBadRequest)
			return
		}
		s.exchanges.Add(1)
		s.mu.Lock()
		s.forms = append(s.forms, r.PostForm)
		s.mu.Unlock()
		s.answer(w)
	})
	if tlsServer {
		s.srv = httptest.NewTLSServer(h)
	} else {
		s.srv = httptest.NewServer(h)
	}
	t.Cleanup(s.srv.Close)
	return s
}

func (s *sts) url() string { return s.srv.URL + "/v1/token" }

func (s *sts) roots() *x509.CertPool {
	roots := x509.NewCertPool()
	roots.AddCert(s.srv.Certificate())
	return roots
}

func subject(context.Context) (string, error) { return subjectToken, nil }

func newExchanger(t *testing.T, cfg Config) *Exchanger {
	t.Helper()
	if cfg.Subject == nil {
		cfg.Subject = subject
	}
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// jwt is an unsigned JWT with claims: the exchanger reads its exp and never verifies it.
func jwt(claims map[string]any) string {
	enc := base64.RawURLEncoding
	payload, _ := json.Marshal(claims)
	return enc.EncodeToString([]byte(`{"alg":"none"}`)) + "." + enc.EncodeToString(payload) + "." + enc.EncodeToString([]byte("sig"))
}

func TestExchangeSendsTheRFC8693Form(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		cfg  Config
		want url.Values
	}{
		{"defaults", Config{Audience: "istio-ca"}, url.Values{
			"grant_type": {GrantType}, "subject_token": {subjectToken}, "subject_token_type": {TokenTypeJWT},
			"requested_token_type": {TokenTypeJWT}, "audience": {"istio-ca"},
		}},
		{"types and scope", Config{Audience: "ca", Scope: "openid mesh", SubjectTokenType: "urn:ietf:params:oauth:token-type:id_token",
			RequestedTokenType: TokenTypeJWT}, url.Values{
			"grant_type": {GrantType}, "subject_token": {subjectToken}, "subject_token_type": {"urn:ietf:params:oauth:token-type:id_token"},
			"requested_token_type": {TokenTypeJWT}, "audience": {"ca"}, "scope": {"openid mesh"},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := newSTS(t, true)
			tc.cfg.URL, tc.cfg.RootCAs = s.url(), s.roots()
			tok, err := newExchanger(t, tc.cfg).Token(t.Context())
			if err != nil || tok != issuedToken {
				t.Fatalf("Token: %q, %v; want the issued token", tok, err)
			}
			if len(s.forms) != 1 || fmt.Sprint(s.forms[0]) != fmt.Sprint(tc.want) {
				t.Fatalf("forms %v, want one: %v", s.forms, tc.want)
			}
		})
	}
}

// An https endpoint whose certificate the roots do not verify gets no request, and so never the
// subject token.
func TestExchangeVerifiesTheEndpoint(t *testing.T) {
	t.Parallel()
	s := newSTS(t, true)
	_, err := newExchanger(t, Config{URL: s.url()}).Token(t.Context()) // the system roots
	var verr *tls.CertificateVerificationError
	if !errors.As(err, &verr) {
		t.Fatalf("Token: %v, want a certificate verification error", err)
	}
	if n := s.exchanges.Load(); n != 0 {
		t.Fatalf("%d exchanges with an unverified endpoint", n)
	}
}

func TestExchangeCachesUntilNearExpiry(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		answer  func() string
		refresh time.Duration // from t0; 0: not cached
	}{
		{"expires_in", func() string { return fmt.Sprintf(`{"access_token":%q,"expires_in":3600}`, issuedToken) }, 55 * time.Minute},
		{"the JWT's exp", func() string {
			return fmt.Sprintf(`{"access_token":%q,"token_type":"Bearer"}`, jwt(map[string]any{"exp": t0.Add(20 * time.Minute).Unix()}))
		}, 15 * time.Minute},
		{"no expiry", func() string { return fmt.Sprintf(`{"access_token":%q}`, issuedToken) }, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			clk := testutil.NewFakeClock(t0)
			s := newSTS(t, false)
			s.answer = func(w http.ResponseWriter) { _, _ = io.WriteString(w, tc.answer()) }
			e := newExchanger(t, Config{URL: s.url(), Clock: clk})
			token := func() {
				t.Helper()
				if _, err := e.Token(t.Context()); err != nil {
					t.Fatal(err)
				}
			}
			token()
			token()
			if tc.refresh == 0 {
				if n := s.exchanges.Load(); n != 2 {
					t.Fatalf("%d exchanges for 2 calls with no expiry known, want 2", n)
				}
				return
			}
			clk.Step(tc.refresh - time.Second)
			token()
			if n := s.exchanges.Load(); n != 1 {
				t.Fatalf("%d exchanges before the refresh point, want 1", n)
			}
			clk.Step(time.Second)
			token()
			token()
			if n := s.exchanges.Load(); n != 2 {
				t.Fatalf("%d exchanges at the refresh point, want 2", n)
			}
		})
	}
}

func TestConcurrentCallersShareOneExchange(t *testing.T) {
	t.Parallel()
	s := newSTS(t, false)
	release := make(chan struct{})
	answer := s.answer
	s.answer = func(w http.ResponseWriter) { <-release; answer(w) }
	e := newExchanger(t, Config{URL: s.url()})
	const callers = 8
	joined := make(chan struct{}, callers)
	e.cache.Joined = func() { joined <- struct{}{} }
	var wg sync.WaitGroup
	toks := make([]string, callers)
	errs := make([]error, callers)
	for i := range callers {
		wg.Go(func() { toks[i], errs[i] = e.Token(t.Context()) })
	}
	for range callers {
		<-joined
	}
	close(release)
	wg.Wait()
	for i := range callers {
		if errs[i] != nil || toks[i] != issuedToken {
			t.Fatalf("caller %d: %v, issued token %v", i, errs[i], toks[i] == issuedToken)
		}
	}
	if n := s.exchanges.Load(); n != 1 {
		t.Fatalf("%d exchanges for %d concurrent callers, want 1", n, callers)
	}
}

func TestExchangeErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		status int
		body   string
		want   string
	}{
		{"invalid_grant", http.StatusBadRequest, `{"error":"invalid_grant","error_description":"the subject token expired"}`,
			`invalid_grant: "the subject token expired" (HTTP 400 Bad Request)`},
		{"description echoing the subject token", http.StatusBadRequest,
			`{"error":"invalid_request","error_description":"bad token ` + subjectToken + `"}`, `invalid_request: "bad token [subject token]"`},
		{"500", http.StatusInternalServerError, "oops " + issuedToken, "HTTP status 500 Internal Server Error"},
		{"non-JSON", http.StatusOK, "access_token=" + issuedToken, "is not a JSON object"},
		{"no access_token", http.StatusOK, `{"token_type":"Bearer","expires_in":3600}`, "the answer has no access_token"},
		{"error on 200", http.StatusOK, `{"error":"unauthorized_client"}`, "unauthorized_client"},
		{"another token type", http.StatusOK,
			`{"access_token":"` + issuedToken + `","issued_token_type":"urn:ietf:params:oauth:token-type:access_token"}`, "not the"},
		{"expired", http.StatusOK, `{"access_token":"` + issuedToken + `","expires_in":0}`, "already expired"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := newSTS(t, false)
			s.answer = func(w http.ResponseWriter) {
				w.WriteHeader(tc.status)
				_, _ = io.WriteString(w, tc.body)
			}
			e := newExchanger(t, Config{URL: s.url()})
			for range 2 { // a failure is not cached
				tok, err := e.Token(t.Context())
				if err == nil || tok != "" || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("Token: %q, %v; want no token and %q", tok, err, tc.want)
				}
				if strings.Contains(err.Error(), subjectToken) || strings.Contains(err.Error(), issuedToken) {
					t.Fatalf("the error shows a token: %v", err)
				}
			}
			if n := s.exchanges.Load(); n != 2 {
				t.Fatalf("%d exchanges for 2 failing calls, want 2", n)
			}
		})
	}
}

func TestSubjectTokenError(t *testing.T) {
	t.Parallel()
	s := newSTS(t, false)
	errNoFile := errors.New("the token file is missing")
	_, err := newExchanger(t, Config{URL: s.url(), Subject: func(context.Context) (string, error) { return "", errNoFile }}).Token(t.Context())
	if !errors.Is(err, errNoFile) {
		t.Fatalf("Token: %v, want the subject's error", err)
	}
	if n := s.exchanges.Load(); n != 0 {
		t.Fatalf("%d exchanges without a subject token", n)
	}
}

// An endpoint that does not answer fails the exchange at the timeout, on the injected clock.
func TestExchangeTimesOut(t *testing.T) {
	t.Parallel()
	s := newSTS(t, false)
	release := make(chan struct{})
	s.answer = func(http.ResponseWriter) { <-release }
	t.Cleanup(func() { close(release) })
	clk := testutil.NewFakeClock(t0)
	e := newExchanger(t, Config{URL: s.url(), Clock: clk, Timeout: time.Minute})
	done := make(chan error, 1)
	go func() {
		_, err := e.Token(t.Context())
		done <- err
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if err := clk.WaitForTimers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Minute)
	select {
	case err := <-done:
		if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "no answer within 1m0s") {
			t.Fatalf("Token: %v, want no answer within the timeout", err)
		}
	case <-ctx.Done():
		t.Fatal("the exchange went on past its timeout")
	}
}

func TestNewChecksTheURL(t *testing.T) {
	t.Parallel()
	for raw, want := range map[string]string{
		"http://sts.example.com/v1/token": "in clear",
		"http://10.0.0.1/v1/token":        "in clear",
		"ftp://127.0.0.1/v1/token":        "want https",
		"/v1/token":                       "absolute URL",
		"https://user:pw@sts.example/":    "no user information",
		"https://sts.example/#frag":       "no fragment",
		"https://sts.example/v1/token":    "",
		"http://127.0.0.1:8080/token":     "",
		"http://[::1]/token":              "",
		"http://localhost/token":          "",
	} {
		_, err := New(Config{URL: raw, Subject: subject})
		if want == "" && err != nil || want != "" && (err == nil || !strings.Contains(err.Error(), want)) {
			t.Errorf("New(%q): %v, want %q", raw, err, want)
		}
	}
	if _, err := New(Config{URL: "https://sts.example/"}); err == nil {
		t.Error("New without a subject token source succeeded")
	}
}
