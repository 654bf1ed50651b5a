package caclient

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/upstream"
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

// DialUpstream returns a connection to cfg.Address; it dials lazily, at the first stream. It shows
// itself and verifies the server as the CA client does (upstream.Credentials), the token read for
// every stream.
func DialUpstream(cfg UpstreamConfig) (*grpc.ClientConn, error) {
	if cfg.Address == "" {
		return nil, errors.New("upstream address is empty")
	}
	if cfg.ServerName == "" {
		cfg.ServerName = DefaultServerName
	}
	reads := fsutil.NewBoundedReads(nil, fsutil.DefaultReadBound, 0)
	creds := &upstream.Credentials{RootCertFile: cfg.RootCertFile, ServerName: cfg.ServerName, Token: tokenSource(cfg.Token, cfg.TokenPath, reads),
		ClientCertificate: cfg.ClientCertificate, ClusterID: cfg.ClusterID, Clock: cfg.Clock, Reads: reads}
	conn, err := grpc.NewClient(cfg.Address, grpc.WithTransportCredentials(credentials.NewTLS(creds.TLSConfig())),
		grpc.WithPerRPCCredentials(creds.PerRPC()))
	if err != nil {
		return nil, fmt.Errorf("upstream address %q: %w", cfg.Address, err)
	}
	return conn, nil
}
