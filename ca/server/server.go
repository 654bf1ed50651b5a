// Package server is the gRPC front of the CA: Istio's IstioCertificateService.CreateCertificate,
// with JWT and mTLS authentication, namespace targeting, and errors mapped to status codes.
package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
)

// Signer issues workload certificates, and CA certificates to the callers allowed them.
type Signer interface {
	SignWorkload(ctx context.Context, req ca.WorkloadRequest) (*ca.Issued, error)
	SignCA(ctx context.Context, req ca.CARequest) (*ca.Issued, error)
}

// Targeting decides whether this CA instance serves a namespace.
type Targeting interface {
	// Targets reports whether namespace is served; when it is not, why names the namespace, its
	// labels and the rule that excluded it.
	Targets(ctx context.Context, namespace string) (served bool, why string, err error)
}

// Config configures a Server.
type Config struct {
	Signer         Signer
	Authenticators []Authenticator // tried in order; the first success wins
	Targeting      Targeting
	Metrics        *Metrics
	Logger         *slog.Logger
	Clock          clock.Clock // paces the refusal log, dates JWT-SVIDs; nil means the real clock

	// TrustedNodeAccounts may ask, in Istio's protocol, for the identity of another workload
	// (ImpersonatedIdentityKey), as node agents do for the workloads of their node; empty:
	// nobody may.
	TrustedNodeAccounts []NodeAccount
	// Nodes, when set (on Kubernetes), further requires that identity to have a live pod on
	// the node of the caller's own pod; nil: the trusted account suffices.
	Nodes NodeAuthorizer
}

// Server implements IstioCertificateService.
type Server struct {
	pb.UnimplementedIstioCertificateServiceServer
	signer         Signer
	authenticators []Authenticator
	targeting      Targeting
	metrics        *Metrics
	log            *slog.Logger
	refusals       *admission.LogLimiter
	trustedNodes   map[NodeAccount]struct{}
	nodes          NodeAuthorizer
	clock          clock.Clock
}

// Authorize authenticates a caller and checks that this CA instance serves its namespace:
// CreateCertificate begins with it, and so does every other service on the CA's port (the
// discovery server), so that the two cannot drift. A refusal is logged and counted as
// CreateCertificate's are, and returned as a gRPC status.
func (s *Server) Authorize(ctx context.Context) (Caller, error) {
	caller, err := authenticate(ctx, s.authenticators)
	if err != nil {
		return Caller{}, s.refuse(ctx, caller, err)
	}
	if err := s.Serves(ctx, caller); err != nil {
		return Caller{}, err
	}
	return caller, nil
}

// Serves checks that this CA instance serves the namespace of a caller Authorize let in: the
// discovery server asks again at every request of a stream, as namespace labels change. A
// refusal is logged and counted as Authorize's, and returned as a gRPC status.
func (s *Server) Serves(ctx context.Context, caller Caller) error {
	if err := s.serves(ctx, caller.Identity.Namespace); err != nil {
		return s.refuse(ctx, caller, err)
	}
	return nil
}

// serves checks that this CA instance serves namespace.
func (s *Server) serves(ctx context.Context, namespace string) error {
	served, why, err := s.targeting.Targets(ctx, namespace)
	if err != nil {
		return fmt.Errorf("%w: %w", errTargetingUnavailable, err)
	}
	if !served {
		return fmt.Errorf("%w: %s", errNamespaceNotTargeted, why)
	}
	return nil
}

// New returns a Server.
func New(cfg Config) *Server {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	trusted := make(map[NodeAccount]struct{}, len(cfg.TrustedNodeAccounts))
	for _, a := range cfg.TrustedNodeAccounts {
		trusted[a] = struct{}{}
	}
	return &Server{
		trustedNodes:   trusted,
		nodes:          cfg.Nodes,
		signer:         cfg.Signer,
		authenticators: cfg.Authenticators,
		targeting:      cfg.Targeting,
		metrics:        cfg.Metrics,
		log:            log,
		refusals:       admission.NewLogLimiter(cfg.Clock),
		clock:          clock.OrReal(cfg.Clock),
	}
}

var (
	// errCACertByCertificate: a CA certificate asked with a client certificate. Every CA under
	// this root can mint a client certificate for any identity of the trust domain, one listed
	// for CA certificates included; a token is the listed CA's own credential.
	errCACertByCertificate  = errors.New("a CA certificate is signed only for a caller authenticated by a token, not by a client certificate")
	errNamespaceNotTargeted = errors.New("this CA instance does not serve the namespace")
	errTargetingUnavailable = errors.New("cannot tell whether this CA instance serves the namespace")
)

// Names of the CA's certificate services, as the metrics and logs tell them apart.
const (
	ServiceIstio  = "IstioCertificateService"
	ServiceMeshCA = "MeshCertificateService"
)

// CreateCertificate authenticates the caller, checks that its namespace is served, and signs the
// CSR for the caller's own identity. The response chain is leaf, intermediates, root. A CSR whose
// extension request holds basicConstraints cA TRUE (ca.WantsCA) asks for a CA certificate, which
// only the identities the CA allows get (ca.Authority.SignCA).
//
// A trusted node account may instead name, in the metadata's ImpersonatedIdentityKey, the
// identity of a workload of its node, as Istio's ztunnel does: the certificate is then for that
// identity, whose namespace must be served.
func (s *Server) CreateCertificate(ctx context.Context, req *pb.IstioCertificateRequest) (*pb.IstioCertificateResponse, error) {
	chain, err := s.issue(ctx, ServiceIstio, issueRequest{
		csrPEM:        req.GetCsr(),
		ttl:           secondsToDuration(req.GetValidityDuration()),
		impersonation: impersonationOf(req.GetMetadata()),
	})
	if err != nil {
		return nil, err
	}
	return &pb.IstioCertificateResponse{CertChain: chain}, nil
}

// issueRequest is what both CA protocols ask: a PEM CSR and a lifetime (0: the CA's default).
type issueRequest struct {
	csrPEM string
	ttl    time.Duration
	// ttlErr, when set, is why the protocol's lifetime could not be read: refused as the
	// lifetime the CA refuses.
	ttlErr    error
	requestID string // the Mesh CA's, logged bounded; empty for Istio's protocol
	// impersonation is the identity a node agent asks for instead of its own: Istio's protocol
	// only, the Mesh CA's request having no metadata.
	impersonation impersonation
}

// issue is the one path of every certificate service: authenticate, check that the caller's
// namespace is served, sign the CSR for the caller's identity. It returns the chain in PEM, leaf
// first, or a gRPC status; each request is counted by service and code.
func (s *Server) issue(ctx context.Context, service string, req issueRequest) ([]string, error) {
	chain, err := s.issueChain(ctx, service, req)
	if s.metrics != nil {
		s.metrics.requests.WithLabelValues(service, status.Code(err).String()).Inc()
	}
	return chain, err
}

func (s *Server) issueChain(ctx context.Context, service string, req issueRequest) ([]string, error) {
	caller, err := authenticate(ctx, s.authenticators)
	if err != nil {
		return nil, s.refuse(ctx, caller, err)
	}
	// subject is who the certificate is for: the caller, or the workload a node agent asks for.
	subject, refuse := caller.Identity, s.refuse
	if imp := req.impersonation; imp.ok {
		refuse = func(ctx context.Context, caller Caller, err error) error {
			return s.refuseWith(ctx, caller, err, logkey.Impersonated, logkey.Untrusted(imp.raw))
		}
		if subject, err = s.impersonate(ctx, caller, imp); err != nil {
			return nil, refuse(ctx, caller, err)
		}
	}
	// Targeting is the subject's: a node agent serves namespaces other than its own.
	if err := s.serves(ctx, subject.Namespace); err != nil {
		return nil, refuse(ctx, caller, err)
	}
	if req.ttlErr != nil {
		return nil, refuse(ctx, caller, req.ttlErr)
	}
	csr, err := ca.ParseCSR([]byte(req.csrPEM))
	if err != nil {
		return nil, refuse(ctx, caller, err)
	}
	wantsCA, err := ca.WantsCA(csr)
	if err != nil {
		return nil, refuse(ctx, caller, err)
	}
	switch {
	case wantsCA && req.impersonation.ok:
		return nil, refuse(ctx, caller, errImpersonationCACert)
	case wantsCA && !caller.ByToken:
		return nil, refuse(ctx, caller, errCACertByCertificate)
	}
	start := time.Now()
	var issued *ca.Issued
	if ttl := req.ttl; wantsCA {
		issued, err = s.signer.SignCA(ctx, ca.CARequest{CSR: csr, Identity: subject, TTL: ttl})
	} else {
		issued, err = s.signer.SignWorkload(ctx, ca.WorkloadRequest{CSR: csr, Identity: subject, TTL: ttl})
	}
	if err != nil {
		return nil, refuse(ctx, caller, err)
	}
	if s.metrics != nil {
		s.metrics.signing.Observe(time.Since(start).Seconds())
		s.metrics.issued.WithLabelValues(caller.Method).Inc()
		if req.impersonation.ok {
			s.metrics.impersonated.WithLabelValues(caller.Method).Inc()
		}
	}
	if wantsCA {
		// Rare, and it makes a CA: always in the log.
		s.log.Info("CA certificate issued", logkey.Identity, caller.Identity.String(), logkey.Method, caller.Method,
			logkey.Serial, issued.Leaf.SerialNumber.Text(16), logkey.NotAfter, issued.Leaf.NotAfter)
	}
	// At the default level this line is dropped: build none of its attributes then.
	if s.log.Enabled(ctx, slog.LevelDebug) {
		attrs := []slog.Attr{
			slog.String(logkey.Identity, subject.String()),
			slog.String(logkey.Method, caller.Method),
			slog.String(logkey.GRPCService, service),
			slog.String(logkey.Serial, issued.Leaf.SerialNumber.Text(16)),
			slog.Time(logkey.NotAfter, issued.Leaf.NotAfter),
		}
		if req.requestID != "" {
			attrs = append(attrs, slog.String(logkey.RequestID, logkey.Untrusted(req.requestID)))
		}
		if req.impersonation.ok {
			attrs = append(attrs, slog.String(logkey.Caller, caller.Identity.String()))
		}
		s.log.LogAttrs(ctx, slog.LevelDebug, "certificate issued", attrs...)
	}
	return issued.ChainPEM(), nil
}

// secondsToDuration converts validity_duration, saturating instead of overflowing.
func secondsToDuration(s int64) time.Duration {
	switch {
	case s > math.MaxInt64/int64(time.Second):
		return math.MaxInt64
	case s < math.MinInt64/int64(time.Second):
		return math.MinInt64
	default:
		return time.Duration(s) * time.Second
	}
}

// internalMessage is all a caller learns of an unexpected failure: its error may name files,
// key backends or other internals, so it goes to the log only.
const internalMessage = "internal error in the CA; its log has the details"

// unavailableMessage is what a caller learns when the CA cannot check its credentials now.
const unavailableMessage = "the CA cannot check credentials now; retry"

// refuse counts a refusal, logs it once (paced per reason: a refusal needs no credentials and
// costs the client one request), and returns it as a gRPC
// status. The error texts never contain the token: golang-jwt's errors describe claims, not the
// raw token; the strings of the client they quote are bounded.
func (s *Server) refuse(ctx context.Context, caller Caller, err error) error {
	return s.refuseWith(ctx, caller, err)
}

// refuseWith is refuse, with more attributes for the log line.
func (s *Server) refuseWith(ctx context.Context, caller Caller, err error, extra ...any) error {
	code, reason := classify(err)
	if s.metrics != nil {
		s.metrics.refused.WithLabelValues(reason, code.String()).Inc()
	}
	text := boundErrorText(err.Error())
	if logged, skipped := s.refusals.Allow(reason); logged {
		attrs := []any{logkey.Reason, reason, logkey.Code, code.String(), logkey.Error, text}
		if caller.Method != "" {
			attrs = append(attrs, logkey.Identity, caller.Identity.String(), logkey.Method, caller.Method)
		}
		attrs = append(attrs, extra...)
		if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
			attrs = append(attrs, logkey.Peer, p.Addr.String())
		}
		if skipped > 0 {
			attrs = append(attrs, logkey.Suppressed, skipped)
		}
		level := slog.LevelWarn
		if code == codes.Internal {
			level = slog.LevelError // the CA's fault, not the caller's
		}
		s.log.Log(ctx, level, "certificate request refused", attrs...)
	}
	switch {
	case code == codes.Internal:
		return status.Error(code, internalMessage)
	case reason == "authenticator_unavailable":
		// Its error names the CA's token authority (the API server's address, say).
		return status.Error(code, unavailableMessage)
	}
	return status.Error(code, text)
}

type rule struct {
	target error
	code   codes.Code
	reason string
}

// rules map errors to status codes and metric reasons; the first match wins.
func rules() []rule {
	return []rule{
		{ErrNoCredentials, codes.Unauthenticated, "no_credentials"},
		{errMalformedBearer, codes.Unauthenticated, "token_malformed"},
		{ErrTokenRejected, codes.Unauthenticated, "token_rejected"},
		{ErrAuthenticatorUnavailable, codes.Unavailable, "authenticator_unavailable"},
		{ErrAuthenticatorMisconfigured, codes.Internal, "authenticator_misconfigured"},
		{jwt.ErrTokenExpired, codes.Unauthenticated, "token_expired"},
		{jwt.ErrTokenNotValidYet, codes.Unauthenticated, "token_not_yet_valid"},
		{jwt.ErrTokenUsedBeforeIssued, codes.Unauthenticated, "token_not_yet_valid"},
		{jwt.ErrTokenInvalidAudience, codes.Unauthenticated, "token_audience"},
		{jwt.ErrTokenInvalidIssuer, codes.Unauthenticated, "token_issuer"},
		{token.ErrUnknownKey, codes.Unauthenticated, "token_unknown_key"},
		{token.ErrNoKeyID, codes.Unauthenticated, "token_no_kid"},
		{jwt.ErrTokenMalformed, codes.Unauthenticated, "token_malformed"},
		{jwt.ErrTokenSignatureInvalid, codes.Unauthenticated, "token_signature"},
		{jwt.ErrTokenUnverifiable, codes.Unauthenticated, "token_signature"},
		{jwt.ErrTokenRequiredClaimMissing, codes.Unauthenticated, "token_claims"},
		{token.ErrSubject, codes.Unauthenticated, "token_subject"},
		{token.ErrIdentityClaims, codes.Unauthenticated, "token_subject"},
		{jwt.ErrTokenInvalidClaims, codes.Unauthenticated, "token_claims"},
		{ca.ErrRootRetired, codes.Unauthenticated, "client_root_retired"},
		{errClientCertificate, codes.Unauthenticated, "client_certificate"},
		{errNamespaceNotTargeted, codes.PermissionDenied, "namespace_not_targeted"},
		{errTargetingUnavailable, codes.Unavailable, "targeting_unavailable"},
		{ca.ErrIdentityMismatch, codes.PermissionDenied, "csr_identity"},
		{ca.ErrForbiddenSAN, codes.PermissionDenied, "csr_names"},
		{ca.ErrCACertsNotSigned, codes.PermissionDenied, "ca_cert_not_signed"},
		{ca.ErrCACertIdentity, codes.PermissionDenied, "ca_cert_identity"},
		{errCACertByCertificate, codes.PermissionDenied, "ca_cert_credential"},
		{errImpersonationNotTrusted, codes.PermissionDenied, "impersonation_not_trusted"},
		{errImpersonationByCertificate, codes.PermissionDenied, "impersonation_credential"},
		{errImpersonationMalformed, codes.InvalidArgument, "impersonation_malformed"},
		{errImpersonationTrustDomain, codes.PermissionDenied, "impersonation_trust_domain"},
		{errImpersonationCACert, codes.PermissionDenied, "impersonation_ca_cert"},
		{ErrNoBoundPod, codes.PermissionDenied, "impersonation_no_bound_pod"},
		{ErrCallerPodUnknown, codes.PermissionDenied, "impersonation_caller_pod"},
		{ErrNotOnNode, codes.PermissionDenied, "impersonation_not_on_node"},
		{ErrNodesUnavailable, codes.Unavailable, "impersonation_unavailable"},
		{ca.ErrMalformedCSR, codes.InvalidArgument, "csr_malformed"},
		{ca.ErrCSRSignature, codes.InvalidArgument, "csr_signature"},
		{ca.ErrCSRSignatureAlgorithm, codes.InvalidArgument, "csr_signature_algorithm"},
		{ca.ErrUnsupportedKey, codes.InvalidArgument, "csr_key"},
		{ca.ErrInvalidTTL, codes.InvalidArgument, "validity_duration"},
		{ca.ErrAudience, codes.InvalidArgument, "jwt_svid_audience"},
		{ca.ErrNotReady, codes.Unavailable, "not_ready"},
		{context.Canceled, codes.Canceled, "canceled"},
		{context.DeadlineExceeded, codes.DeadlineExceeded, "deadline"},
	}
}

func classify(err error) (codes.Code, string) {
	// Of several authentication failures, the first authenticator's decides, unless one could
	// not decide at all: the token may be good, and the caller should retry rather than give up.
	if joined, ok := err.(interface{ Unwrap() []error }); ok {
		if errs := joined.Unwrap(); len(errs) > 0 {
			err = errs[0]
			for _, e := range errs {
				if errors.Is(e, ErrAuthenticatorUnavailable) || errors.Is(e, ErrAuthenticatorMisconfigured) {
					err = e
					break
				}
			}
		}
	}
	for _, r := range rules() {
		if errors.Is(err, r.target) {
			return r.code, r.reason
		}
	}
	return codes.Internal, "internal"
}
