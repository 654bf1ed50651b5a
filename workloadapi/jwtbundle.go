package workloadapi

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
)

// jwtBundles holds the CA's JWT bundle: fetched when first asked (the first FetchJWTBundles
// stream, or ValidateJWTSVID), and again when asked once it is older than maxAge. Open streams
// ask every maxAge on the injected clock, so that a new key reaches them; nothing runs without a
// stream. One fetch runs at a time, and a caller waiting for it leaves when its context ends. A
// failed fetch keeps the bundle held, and for jwtBundleRetry (or maxAge, if shorter) callers get
// it, or the failure, without asking the CA again: a CA that is down is not called once per
// validation.
type jwtBundles struct {
	issuer JWTIssuer
	clock  clock.Clock
	maxAge time.Duration

	mu       sync.Mutex
	cur      *JWTBundle
	version  uint64        // 0: none yet; one more at each change
	fetched  time.Time     // of cur
	changed  chan struct{} // closed at the next change
	fetching chan struct{} // closed when the fetch in flight ends; nil: none
	failed   error         // of the last fetch, until retryAt
	retryAt  time.Time
}

// jwtBundleRetry is how long after a failed fetch the next one waits.
const jwtBundleRetry = 30 * time.Second

// bundleView is the bundle at one version, and what is closed when it changes.
type bundleView struct {
	bundle  *JWTBundle
	version uint64
	changed <-chan struct{}
}

func (j *jwtBundles) view() bundleView {
	if j.changed == nil {
		j.changed = make(chan struct{})
	}
	return bundleView{bundle: j.cur, version: j.version, changed: j.changed}
}

// get returns the bundle, fetching it first when there is none or it is older than maxAge. A
// failed fetch returns its error with the bundle held, if any (view.bundle nil: none).
func (j *jwtBundles) get(ctx context.Context) (bundleView, error) {
	for {
		j.mu.Lock()
		now := j.clock.Now()
		switch {
		case j.cur != nil && now.Sub(j.fetched) < j.maxAge:
			defer j.mu.Unlock()
			return j.view(), nil
		case now.Before(j.retryAt):
			defer j.mu.Unlock()
			return j.view(), j.failed
		case j.fetching != nil:
			done := j.fetching
			j.mu.Unlock()
			select {
			case <-done:
				continue
			case <-ctx.Done():
				j.mu.Lock()
				defer j.mu.Unlock()
				return j.view(), ctx.Err()
			}
		}
		done := make(chan struct{})
		j.fetching = done
		j.mu.Unlock()
		b, err := j.issuer.FetchJWTBundle(ctx)
		if err == nil && (len(b.JWKS) == 0 || len(b.Keys) == 0 || b.TrustDomain == "") {
			err = errors.New("the CA's JWT bundle is empty")
		}
		j.mu.Lock()
		defer j.mu.Unlock()
		j.fetching = nil
		close(done)
		return j.fetchedLocked(ctx, b, err)
	}
}

// fetchedLocked records what a fetch returned.
func (j *jwtBundles) fetchedLocked(ctx context.Context, b JWTBundle, err error) (bundleView, error) {
	if err != nil {
		if ctx.Err() == nil { // the CA's failure, not a caller that left
			j.failed, j.retryAt = err, j.clock.Now().Add(min(jwtBundleRetry, j.maxAge))
		}
		return j.view(), err
	}
	j.failed, j.retryAt = nil, time.Time{}
	j.fetched = j.clock.Now()
	if j.cur == nil || j.cur.TrustDomain != b.TrustDomain || !bytes.Equal(j.cur.JWKS, b.JWKS) {
		j.cur = &b
		j.version++
		if j.changed != nil {
			close(j.changed)
		}
		j.changed = make(chan struct{})
	}
	return j.view(), nil
}

// jwtBundle returns the JWT bundle for a call of method: the one held when a refresh fails
// (logged), Unavailable when there is none.
func (s *Server) jwtBundle(ctx context.Context, method string) (bundleView, error) {
	v, err := s.bundles.get(ctx)
	switch {
	case err == nil:
		return v, nil
	case v.bundle == nil:
		return v, s.refuse(ctx, method, reasonBundleFailed, status.Errorf(codes.Unavailable, "no JWT bundle: %s", err.Error()))
	}
	if ok, dropped := s.logs.Allow(reasonBundleFailed); ok {
		attrs := []any{logkey.Error, err.Error()}
		if dropped > 0 {
			attrs = append(attrs, logkey.Dropped, dropped)
		}
		s.log.Warn("JWT bundle not refreshed; the last one is kept", attrs...)
	}
	return v, nil
}

// FetchJWTBundles streams the JWT bundle of the agent's trust domain, as a JWKS keyed by the
// trust domain's SPIFFE ID: at once, and again whenever a refresh finds it changed.
func (s *Server) FetchJWTBundles(_ *workload.JWTBundlesRequest, stream grpc.ServerStreamingServer[workload.JWTBundlesResponse]) error {
	ctx := stream.Context()
	if _, err := s.begin(ctx, methodJWTBundles); err != nil {
		return err
	}
	if s.cfg.JWT == nil {
		return s.refuse(ctx, methodJWTBundles, reasonNoJWTIssuer, errNoJWTIssuer)
	}
	streams := s.metrics.streams.WithLabelValues(methodJWTBundles)
	streams.Inc()
	defer streams.Dec()
	var sent uint64 // the version the client has; 0: none
	for {
		v, err := s.jwtBundle(ctx, methodJWTBundles)
		if err != nil {
			return err
		}
		if v.version != sent {
			b := v.bundle
			if err := stream.Send(&workload.JWTBundlesResponse{Bundles: map[string][]byte{b.TrustDomain: b.JWKS}}); err != nil {
				return err
			}
			sent = v.version
			s.metrics.updates.WithLabelValues(methodJWTBundles).Inc()
		}
		t := s.clock.NewTimer(s.bundles.maxAge)
		select {
		case <-ctx.Done():
			t.Stop()
			return status.FromContextError(ctx.Err()).Err()
		case <-v.changed: // another stream's refresh, or a validation's
			t.Stop()
		case <-t.C():
		}
	}
}

// ValidateJWTSVID checks a JWT-SVID against the trust domain's JWT bundle for the audience given
// and returns its SPIFFE ID and claims. A token that does not pass is InvalidArgument, as the
// standard says.
func (s *Server) ValidateJWTSVID(ctx context.Context, req *workload.ValidateJWTSVIDRequest) (*workload.ValidateJWTSVIDResponse, error) {
	if _, err := s.begin(ctx, methodValidateJWTSVID); err != nil {
		return nil, err
	}
	if s.cfg.JWT == nil {
		return nil, s.refuse(ctx, methodValidateJWTSVID, reasonNoJWTIssuer, errNoJWTIssuer)
	}
	if req.GetAudience() == "" {
		return nil, s.refuse(ctx, methodValidateJWTSVID, reasonNoAudience, status.Error(codes.InvalidArgument, "audience must be specified"))
	}
	if req.GetSvid() == "" {
		return nil, s.refuse(ctx, methodValidateJWTSVID, reasonNoToken, status.Error(codes.InvalidArgument, "svid must be specified"))
	}
	v, err := s.jwtBundle(ctx, methodValidateJWTSVID)
	if err != nil {
		return nil, err
	}
	id, claims, err := verifyJWTSVID(v.bundle, req.GetSvid(), req.GetAudience(), s.clock.Now())
	if err != nil {
		return nil, s.refuse(ctx, methodValidateJWTSVID, reasonInvalidJWTSVID, status.Errorf(codes.InvalidArgument, "invalid JWT-SVID: %s", err.Error()))
	}
	st, err := structpb.NewStruct(claims)
	if err != nil {
		return nil, s.refuse(ctx, methodValidateJWTSVID, reasonInvalidJWTSVID, status.Errorf(codes.InvalidArgument, "invalid JWT-SVID claims: %s", err.Error()))
	}
	return &workload.ValidateJWTSVIDResponse{SpiffeId: id, Claims: st}, nil
}
