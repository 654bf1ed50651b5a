package localhttp_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/localhttp"
)

// wait bounds, in real time, how long a test waits for something that should come at once.
const wait = 30 * time.Second

func get(t *testing.T, ctx context.Context, url string, maxBody int64) (int, string, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Host = "app.example"
	req.Header.Set("Accept", "text/plain")
	var code int
	var body []byte
	err = localhttp.Do(req, maxBody, func(r *http.Response) error {
		code = r.StatusCode
		var err error
		body, err = io.ReadAll(r.Body)
		return err
	})
	return code, string(body), err
}

func TestDoBoundsTheBody(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Host != "app.example" || r.Header.Get("Accept") != "text/plain" {
			http.Error(w, "host or header not sent", http.StatusBadRequest)
			return
		}
		_, _ = io.WriteString(w, strings.Repeat("x", 100))
	}))
	t.Cleanup(srv.Close)
	for _, tc := range []struct {
		max     int64
		wantErr error
	}{{100, nil}, {1000, nil}, {99, localhttp.ErrBodyTooLarge}, {0, localhttp.ErrBodyTooLarge}} {
		code, body, err := get(t, t.Context(), srv.URL+"/metrics", tc.max)
		if !errors.Is(err, tc.wantErr) {
			t.Errorf("max %d: %v, want %v", tc.max, err, tc.wantErr)
			continue
		}
		if err == nil && (code != http.StatusOK || len(body) != 100) {
			t.Errorf("max %d: %d, %d bytes, want 200 and 100 bytes", tc.max, code, len(body))
		}
	}
}

func TestDoSpeaksTLSWithoutVerifying(t *testing.T) {
	t.Parallel()
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "secure")
	}))
	t.Cleanup(srv.Close)
	if code, body, err := get(t, t.Context(), srv.URL, 1<<10); err != nil || code != http.StatusOK || body != "secure" {
		t.Fatalf("https: %d %q %v, want 200 \"secure\"", code, body, err)
	}
	// Plain HTTP to a TLS port is answered 400 by Go's server: the scheme is what is spoken.
	if code, _, err := get(t, t.Context(), strings.Replace(srv.URL, "https:", "http:", 1), 1<<10); err == nil && code == http.StatusOK {
		t.Fatalf("http to a TLS port answered 200")
	}
}

func TestDoEndsWithTheContext(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { <-release }))
	t.Cleanup(func() { close(release); srv.Close() })
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		_, _, err := get(t, ctx, srv.URL, 1<<10)
		done <- err
	}()
	cancel()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("a request whose context ended succeeded")
		}
	case <-time.After(wait):
		t.Fatal("Do went on after its context ended")
	}
}

func TestDoRefusesOtherSchemes(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.NotFoundHandler())
	t.Cleanup(srv.Close)
	if _, _, err := get(t, t.Context(), strings.Replace(srv.URL, "http:", "ftp:", 1), 1<<10); err == nil || !strings.Contains(err.Error(), "want http or https") {
		t.Fatalf("ftp: %v, want a refusal", err)
	}
}

func getVerified(t *testing.T, url string, roots *x509.CertPool) (string, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	var body []byte
	err = localhttp.DoVerified(req, roots, 1<<10, func(r *http.Response) error {
		var err error
		body, err = io.ReadAll(r.Body)
		return err
	})
	return string(body), err
}

// DoVerified speaks TLS only to a server whose certificate the given roots verify for the URL's
// host: the system roots (which do not hold httptest's), or a host the certificate does not name, is refused before the request.
func TestDoVerifiedVerifiesTheServer(t *testing.T) {
	t.Parallel()
	var asked atomic.Int32
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		asked.Add(1)
		_, _ = io.WriteString(w, "verified")
	}))
	t.Cleanup(srv.Close)
	roots := x509.NewCertPool()
	roots.AddCert(srv.Certificate())
	if body, err := getVerified(t, srv.URL, roots); err != nil || body != "verified" {
		t.Fatalf("with the server's root: %q %v, want \"verified\"", body, err)
	}
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(srv.URL, "https://"))
	for name, tc := range map[string]struct {
		url   string
		roots *x509.CertPool
	}{
		"the system roots":          {srv.URL, nil},
		"a host the cert not names": {"https://localhost:" + port, roots},
	} {
		var verr *tls.CertificateVerificationError
		if _, err := getVerified(t, tc.url, tc.roots); !errors.As(err, &verr) {
			t.Errorf("%s: %v, want a certificate verification error", name, err)
		}
	}
	if n := asked.Load(); n != 1 {
		t.Fatalf("the server answered %d requests, want only the verified one", n)
	}
}
