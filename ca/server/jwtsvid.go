package server

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/jwtsvidpb"
	"github.com/meshid/meshid/internal/logkey"
)

// JWTSVIDSigner signs JWT-SVIDs and publishes the keys that verify them (ca.JWTSVIDSigner).
type JWTSVIDSigner interface {
	SignJWTSVID(req ca.JWTSVIDRequest) (token string, expires time.Time, err error)
	Bundle(now time.Time) ca.JWTBundle
}

// JWTSVIDServer serves JWTSVIDService on the pipeline of the Server it was made from: the same
// authentication, targeting, refusals and metrics as the certificate services, so that a caller
// gets a JWT-SVID exactly when it would get an X.509-SVID, and for the same identity.
type JWTSVIDServer struct {
	jwtsvidpb.UnimplementedJWTSVIDServiceServer
	s      *Server
	signer JWTSVIDSigner
}

// JWTSVID returns the JWT-SVID front of s, signing with signer.
func (s *Server) JWTSVID(signer JWTSVIDSigner) *JWTSVIDServer {
	return &JWTSVIDServer{s: s, signer: signer}
}

// The methods of JWTSVIDService, as counted.
const (
	methodMintJWTSVID    = "MintJWTSVID"
	methodFetchJWTBundle = "FetchJWTBundle"
)

// MintJWTSVID signs a JWT-SVID of the caller's own identity for the audiences asked, for the
// lifetime asked clamped to the CA's (none: the CA's); or, for a trusted node account, of the
// workload named in impersonated_identity, as CreateCertificate signs one (impersonate).
func (j *JWTSVIDServer) MintJWTSVID(ctx context.Context, req *jwtsvidpb.MintJWTSVIDRequest) (*jwtsvidpb.MintJWTSVIDResponse, error) {
	resp, err := j.mint(ctx, req)
	j.count(methodMintJWTSVID, err)
	return resp, err
}

func (j *JWTSVIDServer) mint(ctx context.Context, req *jwtsvidpb.MintJWTSVIDRequest) (*jwtsvidpb.MintJWTSVIDResponse, error) {
	caller, err := j.s.Authorize(ctx)
	if err != nil {
		return nil, err
	}
	var ttl time.Duration
	if d := req.GetTtl(); d != nil {
		if err := d.CheckValid(); err != nil {
			return nil, j.s.refuse(ctx, caller, fmt.Errorf("%w: ttl: %w", ca.ErrInvalidTTL, err))
		}
		ttl = d.AsDuration()
	}
	subject, refuse := caller.Identity, j.s.refuse
	if raw := req.GetImpersonatedIdentity(); raw != "" {
		refuse = func(ctx context.Context, caller Caller, err error) error {
			return j.s.refuseWith(ctx, caller, err, logkey.Impersonated, logkey.Untrusted(raw))
		}
		if subject, err = j.s.impersonate(ctx, caller, impersonation{raw: raw, ok: true}); err != nil {
			return nil, refuse(ctx, caller, err)
		}
		// Authorize checked the caller's namespace; the workload's is checked here.
		if err := j.s.serves(ctx, subject.Namespace); err != nil {
			return nil, refuse(ctx, caller, err)
		}
	}
	tok, expires, err := j.signer.SignJWTSVID(ca.JWTSVIDRequest{
		Identity: subject, Audience: req.GetAudience(), TTL: ttl, Now: j.s.clock.Now(),
	})
	if err != nil {
		return nil, refuse(ctx, caller, err)
	}
	if m := j.s.metrics; m != nil {
		m.jwtSVIDs.WithLabelValues(caller.Method).Inc()
	}
	// The token is never logged; who got one for how long is, at debug level.
	if j.s.log.Enabled(ctx, slog.LevelDebug) {
		j.s.log.LogAttrs(ctx, slog.LevelDebug, "JWT-SVID issued",
			slog.String(logkey.Identity, subject.String()),
			slog.String(logkey.Method, caller.Method),
			slog.Int(logkey.Audience, len(req.GetAudience())),
			slog.Time(logkey.Expires, expires))
	}
	return &jwtsvidpb.MintJWTSVIDResponse{Token: tok, SpiffeId: subject.String()}, nil
}

// FetchJWTBundle returns the keys that verify this CA's JWT-SVIDs. They are public, but asked
// with the same credentials as the rest: the agents that ask have them, and the CA's port then
// answers nothing to a caller it cannot name.
func (j *JWTSVIDServer) FetchJWTBundle(ctx context.Context, _ *jwtsvidpb.FetchJWTBundleRequest) (*jwtsvidpb.FetchJWTBundleResponse, error) {
	_, err := j.s.Authorize(ctx)
	j.count(methodFetchJWTBundle, err)
	if err != nil {
		return nil, err
	}
	b := j.signer.Bundle(j.s.clock.Now())
	resp := &jwtsvidpb.FetchJWTBundleResponse{TrustDomain: b.TrustDomain, Jwks: b.JWKS}
	for _, k := range b.Keys {
		resp.Keys = append(resp.Keys, &jwtsvidpb.JWTKey{Id: k.ID, PublicKey: k.PublicKey})
	}
	return resp, nil
}

func (j *JWTSVIDServer) count(method string, err error) {
	if m := j.s.metrics; m != nil {
		m.jwtRequests.WithLabelValues(method, status.Code(err).String()).Inc()
	}
}
