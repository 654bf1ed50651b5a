// Package caclient is the client of Istio's CA protocol (IstioCertificateService) and of the Mesh
// CA's (MeshCertificateService, CA_PROVIDER=GoogleCA): CSR in, chain out, authenticated by a service-account token read afresh for every call and, when the workload
// holds a valid certificate, by mTLS with it. It keeps one connection to the CA and dials again
// only when what it verifies the CA with, or the certificate it presents, changes. Transient
// failures are retried with backoff. It asks meshid ca for JWT-SVIDs and their bundle
// (JWTSVIDService) the same way, over the same connection.
package caclient

import (
	"context"
	"crypto"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/istio"
	"github.com/meshid/meshid/internal/jwtsvidpb"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/meshcapb"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/upstream"
)

// Defaults of the client.
const (
	// DefaultServerName is the name Istio's agents expect in the CA's certificate (ISTIOD_SAN).
	DefaultServerName  = istio.IstiodSAN
	DefaultCallTimeout = 10 * time.Second
	DefaultMaxAttempts = 3
)

// Providers: which CA protocol the client speaks (CA_PROVIDER), as Istio names them.
const (
	// ProviderCitadel is Istio's IstioCertificateService, the default.
	ProviderCitadel = "Citadel"
	// ProviderGoogleCA is the Mesh CA's google.security.meshca.v1.MeshCertificateService.
	ProviderGoogleCA = "GoogleCA"
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
	// Provider is the protocol: ProviderCitadel (or empty), or ProviderGoogleCA. Credentials,
	// retries and errors are the same for both.
	Provider string
	// Location, with ProviderGoogleCA, is the cluster's location (a zone or region), sent as
	// x-goog-request-params: location=locations/<Location>, as Istio's Mesh CA client sent it,
	// for the Mesh CA to route the request; empty sends none.
	Location string
	// RootCertFile holds the roots that verify the CA's certificate; it is read before every call
	// and a change dials the CA again, so a rotated root is picked up. Empty means the system roots.
	RootCertFile string
	// ServerName is the name verified in the CA's certificate (ISTIOD_SAN).
	ServerName string
	// TokenPath is the service-account token, read for every call. A missing, empty or unreadable
	// file fails the call before anything is sent, unless a client certificate authenticates it.
	TokenPath string
	// Token, when set instead, is called for the token at every call (an embedded CA's agent
	// mints its own).
	Token func(ctx context.Context) (string, error)
	// ClientCertificate, when set, is asked before every call for a certificate to present over
	// mTLS; it returns nil when there is none. A different certificate dials the CA again.
	ClientCertificate func() *tls.Certificate
	// ClusterID is sent as the ClusterID header and request metadata (ISTIO_META_CLUSTER_ID).
	ClusterID string
	// CallTimeout bounds one attempt; MaxAttempts bounds the attempts at transient failures.
	CallTimeout time.Duration
	MaxAttempts int

	Clock clock.Clock
	// ReadClock paces the wait for the root file, read at every call (fsutil.DefaultReadBound: a
	// file system that does not answer in time fails the call); nil: the real clock. It is not
	// Clock, which tests drive through backoffs: that must not end a read that is merely slow.
	ReadClock  clock.Clock
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

// Client signs CSRs with a remote CA.
type Client struct {
	cfg     Config
	creds   *upstream.Credentials
	clock   clock.Clock
	log     *slog.Logger
	latency *prometheus.HistogramVec
	// rootReads reads the root file at each call, giving up on a file system that hangs.
	rootReads *fsutil.BoundedReads

	mu       sync.Mutex
	conn     *grpc.ClientConn
	material [sha256.Size]byte // of the roots and client certificate conn was dialed with
	closed   bool
}

// ErrNoCredentials reports a call that has neither a token nor a certificate to present.
var ErrNoCredentials = upstream.ErrNoCredentials

// tokenSource is where the token of cfg comes from: Token, else the file at TokenPath.
func tokenSource(token func(context.Context) (string, error), path string, reads *fsutil.BoundedReads) upstream.TokenSource {
	switch {
	case token != nil:
		return func(ctx context.Context) (string, error) {
			tok, err := token(ctx)
			if err != nil {
				return "", fmt.Errorf("cannot get a token: %w", err)
			}
			return tok, nil
		}
	case path != "":
		return upstream.FileToken(path, reads)
	}
	return nil
}

// New returns a Client. It opens no connection until Connect or the first Sign; call Close when
// done.
func New(cfg Config) (*Client, error) {
	if cfg.Address == "" {
		return nil, errors.New("CA address is empty")
	}
	switch cfg.Provider {
	case "":
		cfg.Provider = ProviderCitadel
	case ProviderCitadel, ProviderGoogleCA:
	default:
		return nil, fmt.Errorf("CA provider %q is unknown: want %s or %s", cfg.Provider, ProviderCitadel, ProviderGoogleCA)
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
	// One BoundedReads for the root file and the token, read at each call and each handshake, so
	// that a hung file system holds one goroutine per file.
	reads := fsutil.NewBoundedReads(cfg.ReadClock, fsutil.DefaultReadBound, 0)
	c := &Client{
		cfg: cfg,
		creds: &upstream.Credentials{RootCertFile: cfg.RootCertFile, ServerName: cfg.ServerName,
			Token: tokenSource(cfg.Token, cfg.TokenPath, reads), ClientCertificate: cfg.ClientCertificate, ClusterID: cfg.ClusterID,
			Clock: cfg.Clock, Reads: reads},
		clock:     clock.OrReal(cfg.Clock),
		rootReads: reads,
		log:       cfg.Logger,
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "ca_request_duration_seconds",
			Help:    "Time of one CreateCertificate attempt (of the CA_PROVIDER's protocol), by outcome (gRPC code).",
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
	return c.sign(ctx, csrDER, ttl, "")
}

// sign is Sign, asking for the identity impersonated instead of the caller's own when it is not
// empty (Istio's protocol only: ForIdentity refuses the Mesh CA's).
func (c *Client) sign(ctx context.Context, csrDER []byte, ttl time.Duration, impersonated string) ([]*x509.Certificate, error) {
	csrPEM := string(pem.EncodeToMemory(&pem.Block{Type: pki.BlockCertificateRequest, Bytes: csrDER}))
	seconds := int64((ttl + time.Second - 1) / time.Second) // never 0, which asks for the CA's default
	var rpc createCertificate
	var err error
	if c.cfg.Provider == ProviderGoogleCA {
		rpc, err = c.meshCARequest(csrPEM, seconds)
	} else {
		rpc, err = c.istioRequest(csrPEM, seconds, impersonated)
	}
	if err != nil {
		return nil, err
	}
	chain, err := retry(c, ctx, rpc, true)
	if err != nil {
		return nil, err
	}
	return parseChain(chain)
}

// createCertificate is one attempt of a protocol's CreateCertificate on conn: the PEM chain, leaf
// first, or the call's error. Its request is built once, so that every attempt sends the same.
type createCertificate = attempt[[]string]

// attempt is one attempt of a call to the CA on conn.
type attempt[T any] func(ctx context.Context, conn *grpc.ClientConn) (T, error)

// retry makes rpc's attempts with the credentials of every call, retrying transient failures
// (unavailable, timed out) with backoff, up to MaxAttempts.
// timed says whether an attempt counts in the CreateCertificate latency histogram.
func retry[T any](c *Client, ctx context.Context, rpc attempt[T], timed bool) (T, error) {
	policy := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(200*time.Millisecond),
		backoff.WithMaxInterval(2*time.Second),
		backoff.WithMaxElapsedTime(0), // bounded by attempts and ctx instead
		backoff.WithClockProvider(c.clock),
	)
	retries := backoff.WithContext(backoff.WithMaxRetries(policy, uint64(c.cfg.MaxAttempts-1)), ctx) //nolint:gosec // MaxAttempts ≥ 1 (New)
	out, err := backoff.RetryNotifyWithTimerAndData(func() (T, error) {
		out, err := call(c, ctx, rpc, timed)
		if err != nil && !transient(err) {
			var zero T
			return zero, backoff.Permanent(err)
		}
		return out, err
	}, retries, func(err error, next time.Duration) {
		c.log.Warn("CA request failed; retrying", logkey.CAAddress, c.cfg.Address, logkey.Error, err.Error(), logkey.RetryIn, next)
	}, clock.BackoffTimer(c.clock))
	if err != nil {
		var zero T
		if ctx.Err() != nil {
			return zero, fmt.Errorf("CA request to %s: %w", c.cfg.Address, ctx.Err())
		}
		return zero, c.explain(err)
	}
	return out, nil
}

func (c *Client) istioRequest(csrPEM string, seconds int64, impersonated string) (createCertificate, error) {
	req := &pb.IstioCertificateRequest{Csr: csrPEM, ValidityDuration: seconds}
	fields := map[string]any{}
	if c.cfg.ClusterID != "" {
		fields["ClusterID"] = c.cfg.ClusterID
	}
	if impersonated != "" {
		fields[ImpersonatedIdentityKey] = impersonated
	}
	if len(fields) > 0 {
		meta, err := structpb.NewStruct(fields)
		if err != nil {
			return nil, err
		}
		req.Metadata = meta
	}
	return func(ctx context.Context, conn *grpc.ClientConn) ([]string, error) {
		resp, err := pb.NewIstioCertificateServiceClient(conn).CreateCertificate(ctx, req)
		return resp.GetCertChain(), err
	}, nil
}

// meshCARequest is the request Istio's Mesh CA client sent: a random UUID as request_id (the
// same for every attempt of one Sign, so that the CA can tell a retry), the validity in whole
// seconds, and the location header when it is known.
func (c *Client) meshCARequest(csrPEM string, seconds int64) (createCertificate, error) {
	id, err := newUUID()
	if err != nil {
		return nil, err
	}
	req := &meshcapb.MeshCertificateRequest{RequestId: id, Csr: csrPEM, Validity: &durationpb.Duration{Seconds: seconds}}
	return func(ctx context.Context, conn *grpc.ClientConn) ([]string, error) {
		if c.cfg.Location != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, "x-goog-request-params", "location=locations/"+c.cfg.Location)
		}
		resp, err := meshcapb.NewMeshCertificateServiceClient(conn).CreateCertificate(ctx, req)
		return resp.GetCertChain(), err
	}, nil
}

// newUUID returns a random (version 4) UUID. Not google/uuid, which the CA uses: its database/sql
// driver interfaces would add 8 kB to every sidecar for these few lines.
func newUUID() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("request id: %w", err)
	}
	b[6] = b[6]&0x0f | 0x40 // version 4
	b[8] = b[8]&0x3f | 0x80 // RFC 9562 variant
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:], nil
}

// Connect starts opening the connection the next Sign will use and returns at once, so that the
// TCP and TLS handshakes with the CA overlap the caller's own work (generating a key, reading
// the token). What goes wrong is left to Sign, which reports and retries it.
func (c *Client) Connect() {
	var cert *tls.Certificate
	if c.cfg.ClientCertificate != nil {
		cert = c.cfg.ClientCertificate()
	}
	if conn, err := c.connection(context.Background(), cert); err == nil {
		conn.Connect()
	}
}

// Close closes the connection to the CA; Sign fails after it.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	if c.conn == nil {
		return nil
	}
	err := c.conn.Close()
	c.conn = nil
	return err
}

func call[T any](c *Client, ctx context.Context, rpc attempt[T], timed bool) (T, error) {
	var zero T
	var cert *tls.Certificate
	if c.cfg.ClientCertificate != nil {
		cert = c.cfg.ClientCertificate()
	}
	// Before anything is sent: a call with neither a token nor a certificate fails here.
	md, tokenErr, err := c.creds.Metadata(ctx, cert != nil)
	if err != nil {
		return zero, err
	}
	if tokenErr != nil {
		c.log.Debug("no token; the certificate held authenticates the request", logkey.Reason, tokenErr.Error())
	}
	conn, err := c.connection(ctx, cert)
	if err != nil {
		return zero, err
	}
	ctx, cancel := context.WithTimeout(ctx, c.cfg.CallTimeout)
	defer cancel()
	for k, v := range md {
		ctx = metadata.AppendToOutgoingContext(ctx, k, v)
	}
	start := time.Now()
	out, err := rpc(ctx, conn)
	if timed {
		c.latency.WithLabelValues(status.Code(err).String()).Observe(time.Since(start).Seconds())
	}
	if status.Code(err) == codes.Unavailable && conn.GetState() != connectivity.Ready {
		// The retries wait on our own backoff (and clock): the next attempt dials afresh rather
		// than fail at once until grpc's own reconnection backoff, up to two minutes, runs out.
		// Not only in TransientFailure: by the time the call has failed, the channel may be
		// connecting again, or idle, and still inside that backoff. A ready connection whose
		// server answered Unavailable (a CA not ready yet) is kept.
		c.drop(conn)
	}
	return out, err
}

// drop closes conn and forgets it, if it is still the one in use.
func (c *Client) drop(conn *grpc.ClientConn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn == conn {
		_ = c.conn.Close()
		c.conn = nil
	}
}

// connection returns the connection to the CA, dialing it again when the roots that verify it or
// the certificate presented changed since it was dialed.
func (c *Client) connection(ctx context.Context, cert *tls.Certificate) (*grpc.ClientConn, error) {
	var rootsPEM []byte
	if c.cfg.RootCertFile != "" {
		// Bounded: on a hung file system the call fails after the bound (or ctx), and one read of
		// the file at most stays behind, however many calls are made meanwhile.
		data, err := c.rootReads.ReadFile(ctx, c.cfg.RootCertFile)
		if err != nil {
			return nil, fmt.Errorf("read the CA root: %w", err)
		}
		rootsPEM = data
	}
	h := sha256.New()
	h.Write(rootsPEM)
	if cert != nil {
		for _, der := range cert.Certificate {
			h.Write(der)
		}
	}
	var material [sha256.Size]byte
	h.Sum(material[:0])

	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, errors.New("the CA client is closed")
	}
	if c.conn != nil && c.material == material {
		return c.conn, nil
	}
	if rootsPEM != nil && !x509.NewCertPool().AppendCertsFromPEM(rootsPEM) {
		return nil, fmt.Errorf("the CA root file %s holds no certificate", c.cfg.RootCertFile)
	}
	// The handshake reads the roots and asks for the certificate again (upstream.Credentials):
	// what it finds is what was hashed here, or newer, which the next call dials again for.
	conn, err := grpc.NewClient(c.cfg.Address, grpc.WithTransportCredentials(credentials.NewTLS(c.creds.TLSConfig())))
	if err != nil {
		return nil, fmt.Errorf("CA address %q: %w", c.cfg.Address, err)
	}
	if c.conn != nil {
		// A call still on the old connection (Sign is not called concurrently by the agent)
		// would fail and be retried on the new one.
		_ = c.conn.Close()
		c.log.Debug("dialing the CA again: its roots or our certificate changed", logkey.CAAddress, c.cfg.Address)
	}
	c.conn, c.material = conn, material
	return conn, nil
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

// JWTSVID is a JWT-SVID the CA signed.
type JWTSVID struct {
	Token    string
	SPIFFEID string // its sub
}

// MintJWTSVID asks the CA for a JWT-SVID of the client's own identity for audience, over the
// connection and credentials Sign uses, with its retries; ttl 0 asks for the CA's lifetime.
func (c *Client) MintJWTSVID(ctx context.Context, audience []string, ttl time.Duration) (JWTSVID, error) {
	return c.mintJWTSVID(ctx, audience, ttl, "")
}

// mintJWTSVID is MintJWTSVID, for the identity impersonated when it is not empty.
func (c *Client) mintJWTSVID(ctx context.Context, audience []string, ttl time.Duration, impersonated string) (JWTSVID, error) {
	req := &jwtsvidpb.MintJWTSVIDRequest{Audience: audience, ImpersonatedIdentity: impersonated}
	if ttl > 0 {
		req.Ttl = durationpb.New(ttl)
	}
	resp, err := retry(c, ctx, func(ctx context.Context, conn *grpc.ClientConn) (*jwtsvidpb.MintJWTSVIDResponse, error) {
		return jwtsvidpb.NewJWTSVIDServiceClient(conn).MintJWTSVID(ctx, req)
	}, false)
	if err != nil {
		return JWTSVID{}, err
	}
	if resp.GetToken() == "" {
		return JWTSVID{}, errors.New("the CA answered an empty JWT-SVID")
	}
	return JWTSVID{Token: resp.GetToken(), SPIFFEID: resp.GetSpiffeId()}, nil
}

// JWTBundle is the keys that verify a trust domain's JWT-SVIDs: the JWKS document, and the same
// keys parsed, by kid.
type JWTBundle struct {
	TrustDomain string // spiffe://TRUST_DOMAIN
	JWKS        []byte
	Keys        map[string]crypto.PublicKey
}

// FetchJWTBundle asks the CA for the keys that verify its JWT-SVIDs, as MintJWTSVID asks.
func (c *Client) FetchJWTBundle(ctx context.Context) (JWTBundle, error) {
	resp, err := retry(c, ctx, func(ctx context.Context, conn *grpc.ClientConn) (*jwtsvidpb.FetchJWTBundleResponse, error) {
		return jwtsvidpb.NewJWTSVIDServiceClient(conn).FetchJWTBundle(ctx, &jwtsvidpb.FetchJWTBundleRequest{})
	}, false)
	if err != nil {
		return JWTBundle{}, err
	}
	b := JWTBundle{TrustDomain: resp.GetTrustDomain(), JWKS: resp.GetJwks(), Keys: make(map[string]crypto.PublicKey, len(resp.GetKeys()))}
	for i, k := range resp.GetKeys() {
		pub, err := x509.ParsePKIXPublicKey(k.GetPublicKey())
		if err != nil {
			return JWTBundle{}, fmt.Errorf("the CA's JWT bundle, key %d: %w", i, err)
		}
		if k.GetId() == "" {
			return JWTBundle{}, fmt.Errorf("the CA's JWT bundle, key %d: no kid", i)
		}
		b.Keys[k.GetId()] = pub
	}
	if len(b.Keys) == 0 || len(b.JWKS) == 0 {
		return JWTBundle{}, errors.New("the CA answered an empty JWT bundle")
	}
	return b, nil
}
