// Package workloadapi serves the SPIFFE Workload API (SpiffeWorkloadAPI) to local workloads: the
// caller's X.509-SVID and its trust bundle, from the same secrets SDS serves and pushed on the
// same notifications, the moment the secret manager rotates them. It registers on a server it is
// given (the SDS socket's), whose bounds and peer naming it shares; it knows nothing of SDS.
//
// JWT-SVIDs are signed by the CA for the caller's identity and the audiences it asks, cached until
// half their life, and validated against the CA's JWT bundle, which streams follow. An agent
// without a CA (file-mounted certificates) answers the JWT methods FailedPrecondition.
// WIT-SVIDs are not issued: their methods answer Unimplemented, which the standard's clients take
// as final.
package workloadapi

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/secretmanager"
)

// Secrets is what the server needs of the secret manager: the named secret's state now and at
// every change after (the secret, or nil and why there is none), as SDS has it.
type Secrets interface {
	Subscribe(name string, fn func(*secretmanager.Secret, error)) (cancel func(), err error)
}

// Names are the secrets that make one caller's identity: its key pair and its trust bundle.
type Names struct {
	KeyPair, Bundle string
}

// AgentIdentity is every caller's identity in single-workload mode: the agent's own.
func AgentIdentity() Names {
	return Names{KeyPair: secretmanager.WorkloadCertName, Bundle: secretmanager.RootCertName}
}

// Config configures a Server.
type Config struct {
	Secrets Secrets
	// Identify says which secrets are a caller's identity, from its call's context (its peer);
	// nil: every caller is the agent's workload (AgentIdentity). An error refuses the caller
	// with PermissionDenied, as the standard says for a caller with no identity.
	Identify func(ctx context.Context) (Names, error)
	// JWT signs JWT-SVIDs and gives the keys that verify them: the CA, through the agent's
	// client. nil: no CA serves this agent, and the JWT methods answer FailedPrecondition.
	JWT JWTIssuer
	// JWTBundleRefresh is how often open FetchJWTBundles streams have the bundle fetched again;
	// 0: DefaultJWTBundleRefresh.
	JWTBundleRefresh time.Duration
	// Clock paces the refusals' log lines, the cache of JWT-SVIDs and the JWT bundle's
	// refreshes; nil: the real clock.
	Clock      clock.Clock
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

// Server serves SpiffeWorkloadAPI. It starts no goroutine: each stream runs on its handler's,
// until the client goes or the server it is registered on stops.
type Server struct {
	workload.UnimplementedSpiffeWorkloadAPIServer

	cfg     Config
	log     *slog.Logger
	metrics *metrics
	logs    *admission.LogLimiter
	clock   clock.Clock

	jwtCache jwtCache
	bundles  *jwtBundles
}

// New returns a Server; Register serves it.
func New(cfg Config) (*Server, error) {
	if cfg.Secrets == nil {
		return nil, errors.New("the Workload API needs secrets to serve")
	}
	if cfg.Identify == nil {
		cfg.Identify = func(context.Context) (Names, error) { return AgentIdentity(), nil }
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.JWTBundleRefresh <= 0 {
		cfg.JWTBundleRefresh = DefaultJWTBundleRefresh
	}
	clk := clock.OrReal(cfg.Clock)
	s := &Server{cfg: cfg, log: log, metrics: newMetrics(), logs: admission.NewLogLimiter(cfg.Clock), clock: clk,
		bundles: &jwtBundles{issuer: cfg.JWT, clock: clk, maxAge: cfg.JWTBundleRefresh}}
	if cfg.Registerer != nil {
		if err := s.metrics.register(cfg.Registerer); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// Register registers the Workload API on r (the SDS server, before it runs).
func (s *Server) Register(r grpc.ServiceRegistrar) {
	workload.RegisterSpiffeWorkloadAPIServer(r, s)
}

// The methods, as counted and logged.
const (
	methodX509SVID        = "FetchX509SVID"
	methodX509Bundles     = "FetchX509Bundles"
	methodJWTSVID         = "FetchJWTSVID"
	methodJWTBundles      = "FetchJWTBundles"
	methodValidateJWTSVID = "ValidateJWTSVID"
	methodWITSVID         = "FetchWITSVID"
	methodWITBundles      = "FetchWITBundles"
)

// Why calls are refused, as counted in meshid_agent_workload_api_refusals_total.
const (
	reasonMissingHeader = "missing_security_header"
	reasonNoIdentity    = "no_identity"
	reasonUnavailable   = "identity_unavailable"
	reasonNotAnSVID     = "not_an_svid"
	reasonUnimplemented = "unimplemented"
)

// securityHeader is the metadata every call must carry with the value "true" (SPIFFE Workload
// Endpoint, section 3): a request forged through a server-side request forgery carries none.
const securityHeader = "workload.spiffe.io"

// FetchX509SVID streams the caller's X.509-SVID and its trust domain's bundle: at once, and again
// whenever either changes.
func (s *Server) FetchX509SVID(_ *workload.X509SVIDRequest, stream grpc.ServerStreamingServer[workload.X509SVIDResponse]) error {
	ctx := stream.Context()
	names, err := s.begin(ctx, methodX509SVID)
	if err != nil {
		return err
	}
	return serve(s, ctx, methodX509SVID, names, x509SVIDResponse, stream.Send)
}

// FetchX509Bundles streams the trust bundle of the caller's trust domain: at once, and again
// whenever it changes.
func (s *Server) FetchX509Bundles(_ *workload.X509BundlesRequest, stream grpc.ServerStreamingServer[workload.X509BundlesResponse]) error {
	ctx := stream.Context()
	names, err := s.begin(ctx, methodX509Bundles)
	if err != nil {
		return err
	}
	return serve(s, ctx, methodX509Bundles, names, x509BundlesResponse, stream.Send)
}

// errNoWIT answers the WIT-SVID profile.
var errNoWIT = status.Error(codes.Unimplemented, "WIT-SVIDs are not issued here: the CA signs X.509-SVIDs only (use FetchX509SVID)")

// FetchWITSVID answers Unimplemented: no WIT-SVID is issued.
func (s *Server) FetchWITSVID(_ *workload.WITSVIDRequest, stream grpc.ServerStreamingServer[workload.WITSVIDResponse]) error {
	return s.unimplemented(stream.Context(), methodWITSVID, errNoWIT)
}

// FetchWITBundles answers Unimplemented: there is no WIT bundle.
func (s *Server) FetchWITBundles(_ *workload.WITBundlesRequest, stream grpc.ServerStreamingServer[workload.WITBundlesResponse]) error {
	return s.unimplemented(stream.Context(), methodWITBundles, errNoWIT)
}

func (s *Server) unimplemented(ctx context.Context, method string, err error) error {
	if _, err := s.begin(ctx, method); err != nil {
		return err
	}
	return s.refuse(ctx, method, reasonUnimplemented, err)
}

// begin counts a call, checks its security header and says whose identity it asks for.
func (s *Server) begin(ctx context.Context, method string) (Names, error) {
	s.metrics.calls.WithLabelValues(method).Inc()
	if v := metadata.ValueFromIncomingContext(ctx, securityHeader); len(v) != 1 || v[0] != "true" {
		return Names{}, s.refuse(ctx, method, reasonMissingHeader, status.Error(codes.InvalidArgument, "security header missing from request"))
	}
	names, err := s.cfg.Identify(ctx)
	if err != nil {
		refused := status.Errorf(codes.PermissionDenied, "no identity issued: %s", err.Error())
		if errors.Is(err, admission.ErrLogged) { // by the attestor, with the caller's process
			return Names{}, s.count(reasonNoIdentity, refused)
		}
		return Names{}, s.refuse(ctx, method, reasonNoIdentity, refused)
	}
	return names, nil
}

// count counts a refusal logged where it was decided, and returns err, the call's status.
func (s *Server) count(reason string, err error) error {
	s.metrics.refusals.WithLabelValues(reason, status.Code(err).String()).Inc()
	return err
}

// refuse counts a refusal and logs it with who asked and why, unless too many of its reason came
// too fast (the next line says how many were left out); it returns err, the call's status.
func (s *Server) refuse(ctx context.Context, method, reason string, err error) error {
	code := status.Code(err).String()
	s.metrics.refusals.WithLabelValues(reason, code).Inc()
	ok, dropped := s.logs.Allow(reason)
	if !ok {
		return err
	}
	attrs := []any{logkey.Peer, admission.Peer(ctx), logkey.Protocol, method, logkey.Reason, reason, logkey.Code, code,
		logkey.Error, status.Convert(err).Message()}
	if dropped > 0 {
		attrs = append(attrs, logkey.Dropped, dropped)
	}
	s.log.Warn("Workload API call refused", attrs...)
	return err
}
