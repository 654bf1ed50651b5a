// Package localhttp sends one HTTP request over one connection of its own, for the agent's
// requests to its neighbours in the pod (the application's probes and metrics, Envoy's admin):
// net/http's parser without http.Transport, whose pooling, proxies and HTTP/2 would add 400 kB
// to every sidecar and serve none of these requests. DoVerified is the same for a server
// elsewhere whose certificate must verify (the agent's token exchange).
package localhttp

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
)

// ErrBodyTooLarge is returned by a bounded body's Read past its bound.
var ErrBodyTooLarge = errors.New("response body larger than the limit")

// Do dials req.URL.Host over TCP, within req's context, writes req on the connection and hands
// read the response, whose body yields at most maxBody bytes: reading more returns
// ErrBodyTooLarge. An https URL is spoken over TLS without verifying the server's certificate,
// as the kubelet probes: the server is the pod's own application, at an address no certificate
// names. The connection closes when read returns or the context ends, whichever is first; what
// read returns, Do returns. Nothing is followed: a redirect is the answer.
func Do(req *http.Request, maxBody int64, read func(*http.Response) error) error {
	//nolint:gosec // the kubelet does not verify the application's certificate either
	return do(req, &tls.Config{InsecureSkipVerify: true, ServerName: req.URL.Hostname()}, maxBody, read)
}

// DoVerified is Do for a server elsewhere: an https URL's server must present a certificate
// that roots (nil: the system's roots) verify for the URL's host name. An http URL is spoken
// in clear; whether that is safe is the caller's decision.
func DoVerified(req *http.Request, roots *x509.CertPool, maxBody int64, read func(*http.Response) error) error {
	return do(req, &tls.Config{RootCAs: roots, ServerName: req.URL.Hostname(), MinVersion: tls.VersionTLS12}, maxBody, read)
}

// do sends req over one connection, with tlsConfig for an https URL.
func do(req *http.Request, tlsConfig *tls.Config, maxBody int64, read func(*http.Response) error) error {
	ctx := req.Context()
	var port string
	switch req.URL.Scheme {
	case "http":
		port = "80"
	case "https":
		port = "443"
	default:
		return fmt.Errorf("scheme %q: want http or https", req.URL.Scheme)
	}
	addr := req.URL.Host
	if req.URL.Port() == "" {
		addr = net.JoinHostPort(req.URL.Hostname(), port)
	}
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	// The connection ends with the request, whether the server answers or not.
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer func() {
		stop()
		_ = conn.Close()
	}()
	if req.URL.Scheme == "https" {
		conn = tls.Client(conn, tlsConfig)
	}
	req.Close = true
	if err := req.Write(conn); err != nil {
		return err
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), req)
	if err != nil {
		return err
	}
	defer func() { _ = resp.Body.Close() }()
	resp.Body = &boundedBody{ReadCloser: resp.Body, left: maxBody, limit: maxBody}
	return read(resp)
}

// boundedBody reads at most left more bytes of its body, then ErrBodyTooLarge if more follow.
type boundedBody struct {
	io.ReadCloser
	left, limit int64
}

func (b *boundedBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		var one [1]byte
		n, err := b.ReadCloser.Read(one[:])
		if n > 0 {
			return 0, fmt.Errorf("%w: more than %d bytes", ErrBodyTooLarge, b.limit)
		}
		return 0, err
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.ReadCloser.Read(p)
	b.left -= int64(n)
	return n, err
}
