package kube

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/singleflight"
	authenticationv1 "k8s.io/api/authentication/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilcache "k8s.io/apimachinery/pkg/util/cache"
	authenticationv1client "k8s.io/client-go/kubernetes/typed/authentication/v1"

	caserver "github.com/meshid/meshid/ca/server"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// Limits of the TokenReview cache.
const (
	// MaxTokenReviewCacheTTL is the longest a review is trusted: a token revoked (its pod or
	// service account deleted) is refused within this long.
	MaxTokenReviewCacheTTL = time.Minute
	// DefaultTokenReviewMaxEntries bounds each of the two caches (accepted and refused tokens).
	DefaultTokenReviewMaxEntries = 10000

	// refusalCacheTTL is how long a refused token stays refused without asking again: long
	// enough that a flood of one bad token is not a flood of TokenReviews, short enough that a
	// refusal from a passing hiccup of the API server does not last.
	refusalCacheTTL = 10 * time.Second
	// expiryMargin stops serving an accepted token from the cache a little before its exp, so
	// that the API server, not the cache, has the last word on a token about to expire.
	expiryMargin = 5 * time.Second
	// reviewTimeout bounds one TokenReview. It is network time, so it is real time: a review
	// shared by several callers runs detached from any one caller's context.
	reviewTimeout = 10 * time.Second
)

// MethodTokenReview is the Caller.Method of callers authenticated by TokenReview.
const MethodTokenReview = "tokenreview"

const serviceAccountPrefix = "system:serviceaccount:"

// TokenReviewConfig configures a TokenReviewAuthenticator.
type TokenReviewConfig struct {
	Reviews     authenticationv1client.TokenReviewInterface // Clients.Authentication.TokenReviews()
	Audience    string                                      // the audience tokens must be for; empty means istio-ca
	TrustDomain string                                      // required
	// CacheTTL is how long an accepted token is served from the cache, never past its exp; zero
	// means, and more than that is refused, MaxTokenReviewCacheTTL.
	CacheTTL   time.Duration
	MaxEntries int // zero means DefaultTokenReviewMaxEntries

	Clock      clock.Clock // expires cache entries; nil means the real clock
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

// TokenReviewAuthenticator accepts service-account tokens sent as "authorization: Bearer <JWT>"
// that the API server authenticates through the TokenReview API for the configured audience, as
// Istio's CA does: the API server checks the signature, the expiry and that the service account
// (and the pod the token is bound to) still exists. Reviews are cached by the token's SHA-256.
type TokenReviewAuthenticator struct {
	reviews     authenticationv1client.TokenReviewInterface
	audience    string
	trustDomain string
	ttl         time.Duration
	clock       clock.Clock
	log         *slog.Logger

	// flight makes concurrent reviews of one token a single API call.
	flight singleflight.Group

	// Keyed by the token's SHA-256. Refusals have their own cache, so that a flood of distinct
	// bad tokens cannot evict the accepted ones.
	accepted, refused *utilcache.LRUExpireCache

	reviewsSent *prometheus.CounterVec // by outcome
	cacheHits   *prometheus.CounterVec // by outcome
}

// NewTokenReviewAuthenticator returns a TokenReviewAuthenticator.
func NewTokenReviewAuthenticator(cfg TokenReviewConfig) (*TokenReviewAuthenticator, error) {
	if cfg.Reviews == nil {
		return nil, errors.New("token review authenticator: no TokenReview client")
	}
	if err := pki.ValidateTrustDomain(cfg.TrustDomain); err != nil {
		return nil, fmt.Errorf("token review authenticator: %w", err)
	}
	if cfg.Audience == "" {
		cfg.Audience = token.DefaultAudience
	}
	switch {
	case cfg.CacheTTL == 0:
		cfg.CacheTTL = MaxTokenReviewCacheTTL
	case cfg.CacheTTL < 0 || cfg.CacheTTL > MaxTokenReviewCacheTTL:
		return nil, fmt.Errorf("token review authenticator: cache TTL %s: want at most %s", cfg.CacheTTL, MaxTokenReviewCacheTTL)
	}
	switch {
	case cfg.MaxEntries == 0:
		cfg.MaxEntries = DefaultTokenReviewMaxEntries
	case cfg.MaxEntries < 0:
		return nil, fmt.Errorf("token review authenticator: max entries %d is negative", cfg.MaxEntries)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	clk := clock.OrReal(cfg.Clock)
	a := &TokenReviewAuthenticator{
		reviews: cfg.Reviews, audience: cfg.Audience, trustDomain: cfg.TrustDomain, ttl: cfg.CacheTTL,
		clock: clk, log: log,
		accepted: utilcache.NewLRUExpireCacheWithClock(cfg.MaxEntries, clk),
		refused:  utilcache.NewLRUExpireCacheWithClock(cfg.MaxEntries, clk),
		reviewsSent: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshid_ca_token_reviews_total",
			Help: "TokenReviews sent to the API server, by outcome: authenticated, refused, or error (the API call failed).",
		}, []string{"outcome"}),
		cacheHits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshid_ca_token_review_cache_hits_total",
			Help: "Bearer tokens answered from the TokenReview cache, by outcome: authenticated or refused.",
		}, []string{"outcome"}),
	}
	if cfg.Registerer != nil {
		for _, c := range []prometheus.Collector{a.reviewsSent, a.cacheHits} {
			if err := cfg.Registerer.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return a, nil
}

// reviewResult is the outcome of one review: a caller, or the refusal.
type reviewResult struct {
	caller caserver.Caller
	err    error
}

// Authenticate implements caserver.Authenticator. Refusals wrap caserver.ErrTokenRejected (or
// token.ErrSubject for a user that is not a service account); a failed API call wraps
// caserver.ErrAuthenticatorUnavailable, or caserver.ErrAuthenticatorMisconfigured when the CA
// may not create TokenReviews. The token itself is never part of an error.
func (a *TokenReviewAuthenticator) Authenticate(ctx context.Context) (caserver.Caller, error) {
	raw, err := caserver.BearerToken(ctx)
	if err != nil {
		return caserver.Caller{}, err
	}
	key := sha256.Sum256([]byte(raw))
	if r, ok := a.cached(key); ok {
		return r.caller, r.err
	}
	// DoChan, so that a caller whose context ends stops waiting while the shared review goes
	// on for the others; the review runs detached from this caller's cancellation.
	ch := a.flight.DoChan(string(key[:]), func() (any, error) {
		// Checked again: a review that ended between the lookup above and this flight has
		// filled the cache.
		if r, ok := a.cached(key); ok {
			return r, nil
		}
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), reviewTimeout)
		defer cancel()
		return a.review(rctx, raw, key), nil
	})
	select {
	case res := <-ch:
		r := res.Val.(reviewResult)
		return r.caller, r.err
	case <-ctx.Done():
		return caserver.Caller{}, fmt.Errorf("token review: %w", ctx.Err())
	}
}

// cached returns the cached result for a token's key, counting the hit.
func (a *TokenReviewAuthenticator) cached(key [sha256.Size]byte) (reviewResult, bool) {
	v, ok := a.accepted.Get(string(key[:]))
	outcome := "authenticated"
	if !ok {
		v, ok = a.refused.Get(string(key[:]))
		outcome = "refused"
	}
	if !ok {
		return reviewResult{}, false
	}
	a.cacheHits.WithLabelValues(outcome).Inc()
	return v.(reviewResult), true
}

// review asks the API server about raw and caches the answer. A failed API call is not cached.
func (a *TokenReviewAuthenticator) review(ctx context.Context, raw string, key [sha256.Size]byte) reviewResult {
	tr, err := a.reviews.Create(ctx, &authenticationv1.TokenReview{
		Spec: authenticationv1.TokenReviewSpec{Token: raw, Audiences: []string{a.audience}},
	}, metav1.CreateOptions{})
	if err != nil {
		if rejected := a.badInput(err); rejected != nil {
			a.reviewsSent.WithLabelValues("refused").Inc()
			return a.remember(reviewResult{err: rejected}, raw, key)
		}
		a.reviewsSent.WithLabelValues("error").Inc()
		return reviewResult{err: apiError(err)}
	}
	caller, err := a.check(tr.Status)
	if err != nil {
		a.reviewsSent.WithLabelValues("refused").Inc()
		return a.remember(reviewResult{err: err}, raw, key)
	}
	caller.Credential = caserver.TokenCredential(raw)
	a.reviewsSent.WithLabelValues("authenticated").Inc()
	a.log.Debug("token reviewed", logkey.Identity, caller.Identity.String())
	return a.remember(reviewResult{caller: caller}, raw, key)
}

// badInput returns a refusal for an API error that says the token itself cannot be reviewed
// (too large, say), or nil. The API server's message is not quoted: it might echo the token.
func (a *TokenReviewAuthenticator) badInput(err error) error {
	if apierrors.IsBadRequest(err) || apierrors.IsInvalid(err) || apierrors.IsRequestEntityTooLargeError(err) {
		return fmt.Errorf("%w: the API server would not review it (%s)", caserver.ErrTokenRejected, apierrors.ReasonForError(err))
	}
	return nil
}

// apiError classifies a failed TokenReview call: the CA's own fault (RBAC, its credentials) or
// the API server's unavailability. Neither is the caller's fault.
func apiError(err error) error {
	switch {
	case apierrors.IsForbidden(err):
		return fmt.Errorf("%w: the CA may not create TokenReviews (grant its service account create on tokenreviews.authentication.k8s.io): %w",
			caserver.ErrAuthenticatorMisconfigured, err)
	case apierrors.IsUnauthorized(err):
		return fmt.Errorf("%w: the API server does not accept the CA's own credentials for TokenReviews: %w",
			caserver.ErrAuthenticatorMisconfigured, err)
	default:
		return fmt.Errorf("%w: TokenReview: %w", caserver.ErrAuthenticatorUnavailable, err)
	}
}

// check accepts an authenticated review for the audience whose user is a service account.
func (a *TokenReviewAuthenticator) check(st authenticationv1.TokenReviewStatus) (caserver.Caller, error) {
	if !st.Authenticated {
		why := st.Error
		if why == "" {
			why = "not authenticated"
		}
		// The API server's error may quote the token's audiences, which the client chose.
		return caserver.Caller{}, fmt.Errorf("%w: %s", caserver.ErrTokenRejected, logkey.Untrusted(why))
	}
	// An authenticator that ignored spec.audiences returns none: the token may be meant for
	// another audience, so it is refused (as the TokenReview API documentation asks).
	if !slices.Contains(st.Audiences, a.audience) {
		return caserver.Caller{}, fmt.Errorf("%w: authenticated for audiences %q, not for %q",
			caserver.ErrTokenRejected, logkey.UntrustedList(st.Audiences), a.audience)
	}
	user := st.User.Username
	rest, ok := strings.CutPrefix(user, serviceAccountPrefix)
	if !ok {
		return caserver.Caller{}, fmt.Errorf("%w: the API server authenticated user %q, not a service account (%sNAMESPACE:NAME)",
			token.ErrSubject, logkey.Untrusted(user), serviceAccountPrefix)
	}
	ns, sa, ok := strings.Cut(rest, ":")
	if !ok || pki.ValidateNamespace(ns) != nil || pki.ValidateServiceAccount(sa) != nil {
		return caserver.Caller{}, fmt.Errorf("%w: user %q does not name a valid namespace and service account",
			token.ErrSubject, logkey.Untrusted(user))
	}
	return caserver.Caller{
		Identity: pki.SPIFFEID{TrustDomain: a.trustDomain, Namespace: ns, ServiceAccount: sa},
		Method:   MethodTokenReview,
		Pod:      boundPod(st.User.Extra),
		ByToken:  true,
	}, nil
}

// The user extras in which the API server names the pod a token is bound to.
const (
	extraPodName = "authentication.kubernetes.io/pod-name"
	extraPodUID  = "authentication.kubernetes.io/pod-uid"
)

// boundPod reads the pod a reviewed token is bound to; zero when it is bound to none, or the
// extras are not one name and one UID.
func boundPod(extra map[string]authenticationv1.ExtraValue) caserver.BoundPod {
	name, uid := extra[extraPodName], extra[extraPodUID]
	if len(name) != 1 || len(uid) != 1 || name[0] == "" || uid[0] == "" {
		return caserver.BoundPod{}
	}
	return caserver.BoundPod{Name: name[0], UID: uid[0]}
}

// remember caches r and returns it. An accepted token is cached for the TTL but never past its
// exp (less a margin). A refusal is cached for refusalCacheTTL, whatever its exp says: expiry
// never makes a refused token good, and a refused token's exp is unverified, so honouring it would
// let a flood of tokens with a past exp bypass the cache.
func (a *TokenReviewAuthenticator) remember(r reviewResult, raw string, key [sha256.Size]byte) reviewResult {
	now := a.clock.Now()
	if r.err != nil {
		a.refused.Add(string(key[:]), r, refusalCacheTTL)
		return r
	}
	until := now.Add(a.ttl)
	// The API server verified the token, so its exp is the signed one.
	if exp, ok := tokenExpiry(raw); ok && exp.Add(-expiryMargin).Before(until) {
		until = exp.Add(-expiryMargin)
	}
	if !until.After(now) {
		return r
	}
	a.accepted.Add(string(key[:]), r, until.Sub(now))
	return r
}

// tokenExpiry reads the exp claim of a JWT without verifying it.
func tokenExpiry(raw string) (time.Time, bool) {
	parts := strings.Split(raw, ".")
	if len(parts) != 3 {
		return time.Time{}, false
	}
	payload, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(parts[1], "="))
	if err != nil {
		return time.Time{}, false
	}
	var claims struct {
		Exp json.Number `json:"exp"`
	}
	if err := json.Unmarshal(payload, &claims); err != nil || claims.Exp == "" {
		return time.Time{}, false
	}
	f, err := claims.Exp.Float64()
	if err != nil || math.IsNaN(f) || f < 0 || f > 1e12 { // far beyond any real token
		return time.Time{}, false
	}
	return time.Unix(int64(f), 0), true
}
