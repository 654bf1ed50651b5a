package caclient

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/pki"
)

// UpstreamConfig configures a long-lived connection to the control plane's other services on
// the CA's port (the discovery server), authenticated as the CA client authenticates its calls.
type UpstreamConfig struct {
	// Address is HOST:PORT, or unix:///path.
	Address string
	// RootCertFile verifies the server; it is read at every handshake, so a rotated root is
	// picked up by the next connection. Empty means the system roots.
	RootCertFile string
	ServerName   string // the name verified in the server's certificate
	// TokenPath (or Token) gives the bearer token, read for every stream; when there is none,
	// the certificate of ClientCertificate, presented at every handshake, authenticates alone.
	TokenPath         string
	Token             func(ctx context.Context) (string, error)
	ClientCertificate func() *tls.Certificate
	ClusterID         string
	Clock             clock.Clock
}

// DialUpstream returns a connection to cfg.Address; it dials lazily, at the first stream.
func DialUpstream(cfg UpstreamConfig) (*grpc.ClientConn, error) {
	if cfg.Address == "" {
		return nil, errors.New("upstream address is empty")
	}
	if cfg.ServerName == "" {
		cfg.ServerName = DefaultServerName
	}
	clk := clock.OrReal(cfg.Clock)
	tlsCfg := &tls.Config{
		MinVersion: tls.VersionTLS12, ServerName: cfg.ServerName,
		// Verified by VerifyConnection, against the root file as it is now instead of a pool fixed
		// at dial time, and tolerating the server's clock ahead of ours (see verifyServer).
		InsecureSkipVerify: true, //nolint:gosec // VerifyConnection verifies the chain and the name
		VerifyConnection: func(cs tls.ConnectionState) error {
			var roots *x509.CertPool // nil: the system roots
			if cfg.RootCertFile != "" {
				var err error
				if roots, err = readRoots(cfg.RootCertFile); err != nil {
					return err
				}
			}
			return verifyServer(cs, roots, cfg.ServerName, clk)
		},
	}
	if cfg.ClientCertificate != nil {
		tlsCfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			if cert := cfg.ClientCertificate(); cert != nil {
				return cert, nil
			}
			return &tls.Certificate{}, nil // none: the token alone authenticates
		}
	}
	creds := &streamCredentials{client: &Client{cfg: Config{TokenPath: cfg.TokenPath, Token: cfg.Token}}, cert: cfg.ClientCertificate, clusterID: cfg.ClusterID}
	conn, err := grpc.NewClient(cfg.Address, grpc.WithTransportCredentials(credentials.NewTLS(tlsCfg)), grpc.WithPerRPCCredentials(creds))
	if err != nil {
		return nil, fmt.Errorf("upstream address %q: %w", cfg.Address, err)
	}
	return conn, nil
}

func readRoots(rootFile string) (*x509.CertPool, error) {
	rootsPEM, err := os.ReadFile(rootFile)
	if err != nil {
		return nil, fmt.Errorf("read the server's root: %w", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(rootsPEM) {
		return nil, fmt.Errorf("the root file %s holds no certificate", rootFile)
	}
	return roots, nil
}

// verifyServer verifies the server's chain for serverName under roots (nil: the system roots) on
// our clock, as crypto/tls would, except that a NotBefore ahead of our clock by less than
// pki.MaxClockSkew is tolerated: the CA reissues its serving certificate from its own clock, and
// an agent whose clock is behind by minutes must still reach it. An expired chain is refused.
func verifyServer(cs tls.ConnectionState, roots *x509.CertPool, serverName string, clk clock.Clock) error {
	if len(cs.PeerCertificates) == 0 {
		return errors.New("the server presented no certificate")
	}
	at, err := pki.ValidationTime(clk.Now(), cs.PeerCertificates...)
	if err != nil {
		return fmt.Errorf("the server's certificate: %w", err)
	}
	inter := x509.NewCertPool()
	for _, c := range cs.PeerCertificates[1:] {
		inter.AddCert(c)
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

// streamCredentials put the token, read afresh, on every stream, as the CA client does on every
// call; without one, a held certificate authenticates the connection instead.
type streamCredentials struct {
	client    *Client
	cert      func() *tls.Certificate
	clusterID string
}

func (c *streamCredentials) GetRequestMetadata(ctx context.Context, _ ...string) (map[string]string, error) {
	md := map[string]string{}
	if c.clusterID != "" {
		md["ClusterID"] = c.clusterID
	}
	tok, err := c.client.token(ctx)
	switch {
	case err == nil:
		md["authorization"] = "Bearer " + tok
	case c.cert == nil || c.cert() == nil:
		return nil, fmt.Errorf("%w: %w, and no valid certificate to present", ErrNoCredentials, err)
	}
	return md, nil
}

func (c *streamCredentials) RequireTransportSecurity() bool { return true }
