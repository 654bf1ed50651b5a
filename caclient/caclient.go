// Package caclient is the client of Istio's CA protocol (IstioCertificateService): CSR in, chain
// out, authenticated by a service-account token re-read on every call and, when the workload
// already holds a valid certificate, by mTLS with it. Transient failures are retried with backoff.
package caclient

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/meshid/meshid/internal/logkey"

	"github.com/cenkalti/backoff/v4"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/pki"
)

// Defaults of the client.
const (
	// DefaultServerName is the name Istio's agents expect in the CA's certificate (ISTIOD_SAN).
	DefaultServerName  = "istiod.istio-system.svc"
	DefaultCallTimeout = 10 * time.Second
	DefaultMaxAttempts = 3
)

// Errors that tell what kind of failure a Sign error is; test with errors.Is.
var (
	// ErrRejected: the CA refused the credentials or the request; retrying the same will not help.
	ErrRejected = errors.New("CA rejected the request")
	// ErrUnreachable: the CA could not be reached or did not answer in time.
	ErrUnreachable = errors.New("CA unreachable")
)

// Config configures a Client.
type Config struct {
	// Address of the CA: HOST:PORT, or unix:///path for a local socket.
	Address string
	// RootCertFile holds the roots that verify the CA's certificate; it is read at every
	// connection, so a rotated root is picked up. Empty means the system roots.
	RootCertFile string
	// ServerName is the name verified in the CA's certificate (ISTIOD_SAN).
	ServerName string
	// TokenPath is the service-account token, read at every call; a missing file sends none.
	TokenPath string
	// Token, when set instead, is called for the token at every call (an embedded CA's agent
	// mints its own).
	Token func(ctx context.Context) (string, error)
	// ClientCertificate, when set, is asked at every TLS handshake for a certificate to present;
	// it returns nil when there is none.
	ClientCertificate func() (*tls.Certificate, error)
	// ClusterID is sent as the ClusterID header and request metadata (ISTIO_META_CLUSTER_ID).
	ClusterID string
	// CallTimeout bounds one attempt; MaxAttempts bounds the attempts at transient failures.
	CallTimeout time.Duration
	MaxAttempts int

	Clock      clock.Clock
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

// Client signs CSRs with a remote CA.
type Client struct {
	cfg     Config
	clock   clock.Clock
	log     *slog.Logger
	latency *prometheus.HistogramVec
}

// New returns a Client. It opens no connection: each Sign connects afresh, with the root file and
// client certificate as they are at that moment.
func New(cfg Config) (*Client, error) {
	if cfg.Address == "" {
		return nil, errors.New("CA address is empty")
	}
	if cfg.ServerName == "" {
		cfg.ServerName = DefaultServerName
	}
	if cfg.CallTimeout <= 0 {
		cfg.CallTimeout = DefaultCallTimeout
	}
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = DefaultMaxAttempts
	}
	c := &Client{
		cfg:   cfg,
		clock: clock.OrReal(cfg.Clock),
		log:   cfg.Logger,
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "ca_request_duration_seconds",
			Help:    "Time of one CreateCertificate attempt, by outcome (gRPC code).",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 14), // 1 ms to ~16 s
		}, []string{"code"}),
	}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(c.latency); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// Sign sends a DER CSR to the CA and returns the chain it issued: leaf first, root last.
// Transient failures (unavailable, timed out) are retried with backoff, up to MaxAttempts.
func (c *Client) Sign(ctx context.Context, csrDER []byte, ttl time.Duration) ([]*x509.Certificate, error) {
	req := &pb.IstioCertificateRequest{
		Csr:              string(pem.EncodeToMemory(&pem.Block{Type: pki.BlockCertificateRequest, Bytes: csrDER})),
		ValidityDuration: int64((ttl + time.Second - 1) / time.Second), // never 0, which asks for the CA's default
	}
	if c.cfg.ClusterID != "" {
		meta, err := structpb.NewStruct(map[string]any{"ClusterID": c.cfg.ClusterID})
		if err != nil {
			return nil, err
		}
		req.Metadata = meta
	}
	policy := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(200*time.Millisecond),
		backoff.WithMaxInterval(2*time.Second),
		backoff.WithMaxElapsedTime(0), // bounded by attempts and ctx instead
		backoff.WithClockProvider(c.clock),
	)
	retries := backoff.WithContext(backoff.WithMaxRetries(policy, uint64(c.cfg.MaxAttempts-1)), ctx) //nolint:gosec // MaxAttempts ≥ 1 (New)
	resp, err := backoff.RetryNotifyWithTimerAndData(func() (*pb.IstioCertificateResponse, error) {
		resp, err := c.call(ctx, req)
		if err != nil && !transient(err) {
			return nil, backoff.Permanent(err)
		}
		return resp, err
	}, retries, func(err error, next time.Duration) {
		c.log.Warn("CA request failed; retrying", logkey.CAAddress, c.cfg.Address, logkey.Error, err.Error(), logkey.RetryIn, next)
	}, clock.BackoffTimer(c.clock))
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("CA request to %s: %w", c.cfg.Address, ctx.Err())
		}
		return nil, c.explain(err)
	}
	return parseChain(resp.GetCertChain())
}

func (c *Client) call(ctx context.Context, req *pb.IstioCertificateRequest) (*pb.IstioCertificateResponse, error) {
	tlsConfig, err := c.tlsConfig()
	if err != nil {
		return nil, err
	}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(tlsConfig))}
	switch {
	case c.cfg.Token != nil:
		opts = append(opts, grpc.WithPerRPCCredentials(tokenFunc(c.cfg.Token)))
	case c.cfg.TokenPath != "":
		opts = append(opts, grpc.WithPerRPCCredentials(tokenFile(c.cfg.TokenPath)))
	}
	conn, err := grpc.NewClient(c.cfg.Address, opts...)
	if err != nil {
		return nil, fmt.Errorf("CA address %q: %w", c.cfg.Address, err)
	}
	defer func() { _ = conn.Close() }()

	ctx, cancel := context.WithTimeout(ctx, c.cfg.CallTimeout)
	defer cancel()
	if c.cfg.ClusterID != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "ClusterID", c.cfg.ClusterID)
	}
	start := time.Now()
	resp, err := pb.NewIstioCertificateServiceClient(conn).CreateCertificate(ctx, req)
	c.latency.WithLabelValues(status.Code(err).String()).Observe(time.Since(start).Seconds())
	return resp, err
}

func (c *Client) tlsConfig() (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: c.cfg.ServerName}
	if c.cfg.RootCertFile != "" {
		data, err := os.ReadFile(c.cfg.RootCertFile)
		if err != nil {
			return nil, fmt.Errorf("read the CA root: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(data) {
			return nil, fmt.Errorf("the CA root file %s holds no certificate", c.cfg.RootCertFile)
		}
		cfg.RootCAs = pool
	}
	if get := c.cfg.ClientCertificate; get != nil {
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			cert, err := get()
			if err != nil || cert == nil {
				if err != nil {
					c.log.Debug("no usable client certificate; relying on the token", logkey.Reason, err.Error())
				}
				return &tls.Certificate{}, nil //nolint:nilerr // present none: the token may authenticate
			}
			return cert, nil
		}
	}
	return cfg, nil
}

func transient(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded, codes.ResourceExhausted, codes.Aborted:
		return true
	default:
		return false
	}
}

// explain turns a gRPC failure into an error that says what failed, keeping the status.
func (c *Client) explain(err error) error {
	st, ok := status.FromError(err)
	if !ok {
		return err // a local problem (the root file, the address), described where it arose
	}
	switch st.Code() {
	case codes.Unauthenticated:
		return fmt.Errorf("%w: the CA at %s did not accept the token or client certificate: %w", ErrRejected, c.cfg.Address, err)
	case codes.PermissionDenied:
		return fmt.Errorf("%w: the CA at %s refused to sign: %w", ErrRejected, c.cfg.Address, err)
	case codes.InvalidArgument:
		return fmt.Errorf("%w: the CA at %s found the request invalid: %w", ErrRejected, c.cfg.Address, err)
	case codes.Unavailable, codes.DeadlineExceeded:
		return fmt.Errorf("%w at %s: %w", ErrUnreachable, c.cfg.Address, err)
	case codes.FailedPrecondition:
		return fmt.Errorf("CA request to %s not sent: %w", c.cfg.Address, err)
	default:
		return fmt.Errorf("CA request to %s failed: %w", c.cfg.Address, err)
	}
}

func parseChain(elements []string) ([]*x509.Certificate, error) {
	var chain []*x509.Certificate
	for i, e := range elements {
		certs, err := pki.ParseCertificates([]byte(e))
		if err != nil {
			return nil, fmt.Errorf("CA response element %d: %w", i, err)
		}
		chain = append(chain, certs...)
	}
	if len(chain) == 0 {
		return nil, errors.New("CA returned an empty certificate chain")
	}
	return chain, nil
}

// tokenFile is per-RPC credentials that read the token file at every call (istio#26225: a token
// cached at start-up expired and broke rotation).
type tokenFile string

func (t tokenFile) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	data, err := os.ReadFile(string(t))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil // no token: a client certificate may still authenticate
	}
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "cannot read the token file %s: %s", string(t), err.Error())
	}
	tok := strings.TrimSpace(string(data))
	if tok == "" {
		return nil, nil
	}
	return map[string]string{"authorization": "Bearer " + tok}, nil
}

func (tokenFile) RequireTransportSecurity() bool { return true }

// tokenFunc is per-RPC credentials that ask a function for the token at every call.
type tokenFunc func(ctx context.Context) (string, error)

func (t tokenFunc) GetRequestMetadata(ctx context.Context, _ ...string) (map[string]string, error) {
	tok, err := t(ctx)
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "cannot get a token: %s", err.Error())
	}
	return map[string]string{"authorization": "Bearer " + tok}, nil
}

func (tokenFunc) RequireTransportSecurity() bool { return true }
