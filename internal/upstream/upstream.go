// Package upstream is how the agent shows itself to the control plane and checks it, on every
// connection it makes there (the CA client's, the xDS proxy's): the TLS configuration (the
// server's roots read from their file as each connection is made, its certificate checked on our
// clock with a clock ahead of ours tolerated, a client certificate from a callback) and what goes
// with each call (a bearer token from a source, the cluster id). Where a token comes from (a
// file today) is a TokenSource: the credential providers plug in there.
package upstream

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"

	"google.golang.org/grpc/credentials"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/pki"
)

// ErrNoCredentials reports a call that has neither a token nor a certificate to present.
var ErrNoCredentials = errors.New("no credentials for the CA")

// TokenSource gives the bearer token for one call, or why there is none.
type TokenSource func(ctx context.Context) (string, error)

// FileToken reads the token at path for every call: the kubelet and VM operators rotate it in
// place. A missing, empty or unreadable file is an error naming it. The read goes through reads,
// so that a call gives up on a file system that does not answer (nil: read without a bound).
func FileToken(path string, reads *fsutil.BoundedReads) TokenSource {
	return func(ctx context.Context) (string, error) {
		data, err := readFile(ctx, reads, path)
		if err != nil {
			return "", fmt.Errorf("the token file: %w", err) // the error names the path
		}
		tok := strings.TrimSpace(string(data))
		if tok == "" {
			return "", fmt.Errorf("the token file %s is empty", path)
		}
		return tok, nil
	}
}

// Credentials are how the agent authenticates to the control plane and verifies it.
type Credentials struct {
	// RootCertFile holds the roots that verify the server; it is read as each connection is made,
	// so a rotated root reaches the next one. Empty means the system roots.
	RootCertFile string
	// ServerName is the name verified in the server's certificate (ISTIOD_SAN).
	ServerName string
	// Token gives the bearer token of each call; nil: there is none.
	Token TokenSource
	// ClientCertificate, when set, is asked as each connection is made for a certificate to
	// present; it returns nil when there is none, and the token alone authenticates.
	ClientCertificate func() *tls.Certificate
	// ClusterID goes with each call as the ClusterID header (ISTIO_META_CLUSTER_ID).
	ClusterID string
	Clock     clock.Clock
	// Reads reads the root file, so that a handshake gives up on a file system that does not
	// answer; nil reads it without a bound.
	Reads *fsutil.BoundedReads
}

func readFile(ctx context.Context, reads *fsutil.BoundedReads, path string) ([]byte, error) {
	if reads == nil {
		return os.ReadFile(path)
	}
	return reads.ReadFile(ctx, path)
}

// TLSConfig is the connection's TLS configuration: the server verified against the root file as
// it is at the handshake, instead of a pool fixed when the connection was dialed, on our clock
// (see VerifyServer); the client certificate asked for at the handshake.
func (c *Credentials) TLSConfig() *tls.Config {
	clk := clock.OrReal(c.Clock)
	cfg := &tls.Config{
		MinVersion: tls.VersionTLS12, ServerName: c.ServerName,
		InsecureSkipVerify: true, //nolint:gosec // VerifyConnection verifies the chain and the name
		VerifyConnection: func(cs tls.ConnectionState) error {
			var roots *x509.CertPool // nil: the system roots
			if c.RootCertFile != "" {
				var err error
				// crypto/tls gives VerifyConnection no context: the read's bound is the handshake's.
				if roots, err = readRoots(context.Background(), c.Reads, c.RootCertFile); err != nil {
					return err
				}
			}
			return VerifyServer(cs, roots, c.ServerName, clk)
		},
	}
	if c.ClientCertificate != nil {
		// Presented whatever CAs the server names: it checks the chain itself, per call.
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			if cert := c.ClientCertificate(); cert != nil {
				return cert, nil
			}
			return &tls.Certificate{}, nil // none: the token alone authenticates
		}
	}
	return cfg
}

// readRoots reads the PEM roots of a root file.
func readRoots(ctx context.Context, reads *fsutil.BoundedReads, rootFile string) (*x509.CertPool, error) {
	rootsPEM, err := readFile(ctx, reads, rootFile)
	if err != nil {
		return nil, fmt.Errorf("read the server's root: %w", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(rootsPEM) {
		return nil, fmt.Errorf("the root file %s holds no certificate", rootFile)
	}
	return roots, nil
}

// VerifyServer verifies the server's chain for serverName under roots (nil: the system roots) on
// our clock, as crypto/tls would, except that a NotBefore ahead of our clock by less than
// pki.MaxClockSkew is tolerated: the CA reissues its serving certificate from its own clock, and
// an agent whose clock is behind by minutes must still reach it. An expired chain is refused.
func VerifyServer(cs tls.ConnectionState, roots *x509.CertPool, serverName string, clk clock.Clock) error {
	if len(cs.PeerCertificates) == 0 {
		return errors.New("the server presented no certificate")
	}
	at, err := pki.ValidationTime(clk.Now(), cs.PeerCertificates...)
	if err != nil {
		return fmt.Errorf("the server's certificate: %w", err)
	}
	inter := x509.NewCertPool()
	for _, cert := range cs.PeerCertificates[1:] {
		inter.AddCert(cert)
	}
	_, err = cs.PeerCertificates[0].Verify(x509.VerifyOptions{
		Roots: roots, Intermediates: inter, DNSName: serverName, CurrentTime: at,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	})
	if err != nil {
		return fmt.Errorf("tls: failed to verify certificate: %w", err)
	}
	return nil
}

// Metadata is what goes with a call: the cluster id, and the bearer token. Without a token the
// call goes on when haveCert says a certificate authenticates the connection (tokenErr then says
// why there is none); with neither, the error wraps ErrNoCredentials and nothing should be sent.
// The caller asks ClientCertificate, once: it may read files.
func (c *Credentials) Metadata(ctx context.Context, haveCert bool) (md map[string]string, tokenErr, err error) {
	md = map[string]string{}
	if c.ClusterID != "" {
		md["ClusterID"] = c.ClusterID
	}
	tokenErr = errors.New("no token configured")
	if c.Token != nil {
		var tok string
		if tok, tokenErr = c.Token(ctx); tokenErr == nil {
			md["authorization"] = "Bearer " + tok
			return md, nil, nil
		}
	}
	if !haveCert {
		return nil, tokenErr, fmt.Errorf("%w: %w, and no valid certificate to present", ErrNoCredentials, tokenErr)
	}
	return md, tokenErr, nil
}

// PerRPC puts Metadata on every call (or stream) of a connection.
func (c *Credentials) PerRPC() credentials.PerRPCCredentials { return perRPC{c} }

type perRPC struct{ c *Credentials }

func (p perRPC) GetRequestMetadata(ctx context.Context, _ ...string) (map[string]string, error) {
	haveCert := p.c.ClientCertificate != nil && p.c.ClientCertificate() != nil
	md, _, err := p.c.Metadata(ctx, haveCert)
	return md, err
}

func (perRPC) RequireTransportSecurity() bool { return true }
