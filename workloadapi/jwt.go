package workloadapi

import (
	"context"
	"crypto"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/logkey"
)

// JWTIssuer is what the Workload API needs of the CA for JWT-SVIDs (the agent's CA client):
// JWT-SVIDs of the agent's own identity, and the keys that verify them.
type JWTIssuer interface {
	MintJWTSVID(ctx context.Context, audience []string) (JWTSVID, error)
	FetchJWTBundle(ctx context.Context) (JWTBundle, error)
}

// JWTSVID is a JWT-SVID the CA signed: the token and the SPIFFE ID it names.
type JWTSVID struct {
	Token, SPIFFEID string
}

// JWTBundle is the keys that verify a trust domain's JWT-SVIDs: the JWKS document handed to
// workloads, and the same keys by kid, which ValidateJWTSVID verifies with.
type JWTBundle struct {
	TrustDomain string // spiffe://TRUST_DOMAIN
	JWKS        []byte
	Keys        map[string]crypto.PublicKey
}

// Defaults of the JWT methods.
const (
	// DefaultJWTBundleRefresh is how often an open FetchJWTBundles stream has the bundle fetched
	// again, and how old a bundle ValidateJWTSVID verifies with may be.
	DefaultJWTBundleRefresh = 5 * time.Minute
	// maxCachedJWTSVIDs bounds the cache: a workload chooses its audiences.
	maxCachedJWTSVIDs = 1024
)

// Why JWT calls are refused.
const (
	reasonNoJWTIssuer    = "no_jwt_issuer"
	reasonNoAudience     = "missing_audience"
	reasonOtherID        = "other_spiffe_id"
	reasonMintFailed     = "jwt_svid_not_issued"
	reasonBundleFailed   = "jwt_bundle_unavailable"
	reasonInvalidJWTSVID = "invalid_jwt_svid"
	reasonNoToken        = "missing_jwt_svid" //nolint:gosec // a metric label, not a credential
)

// errNoJWTIssuer answers the JWT methods of an agent without a CA: its certificates come from
// files, and nothing could sign a JWT-SVID. FailedPrecondition, not Unavailable: it lasts as long
// as the agent's configuration, and a client retrying would only hammer the socket.
var errNoJWTIssuer = status.Error(codes.FailedPrecondition, "no CA signs JWT-SVIDs for this agent: its certificates come from mounted files (use FetchX509SVID)")

// jwtCache keeps each identity's JWT-SVIDs, by audience set, until half their lifetime.
type jwtCache struct {
	mu      sync.Mutex
	entries map[string]cachedJWTSVID
}

type cachedJWTSVID struct {
	token     string
	refreshAt time.Time
}

func (c *jwtCache) get(key string, now time.Time) (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.entries[key]
	if !ok || !now.Before(e.refreshAt) {
		return "", false
	}
	return e.token, true
}

func (c *jwtCache) put(key, token string, refreshAt, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.entries == nil {
		c.entries = map[string]cachedJWTSVID{}
	}
	if len(c.entries) >= maxCachedJWTSVIDs {
		for k, e := range c.entries {
			if !now.Before(e.refreshAt) {
				delete(c.entries, k)
			}
		}
	}
	for k := range c.entries {
		if len(c.entries) < maxCachedJWTSVIDs {
			break
		}
		delete(c.entries, k) // still full of live ones: any will do, it is minted again if asked
	}
	c.entries[key] = cachedJWTSVID{token: token, refreshAt: refreshAt}
}

// cacheKey names an identity and an audience set (sorted, without duplicates).
func cacheKey(id string, audience []string) string {
	var b strings.Builder
	b.WriteString(strconv.Quote(id))
	for _, a := range audience {
		b.WriteString(strconv.Quote(a))
	}
	return b.String()
}

// FetchJWTSVID returns a JWT-SVID of the caller's identity for the audiences asked: from the
// cache while it has more than half its life left, else signed by the CA. The standard requires
// an audience; a caller that asks for a SPIFFE ID other than its own is refused.
func (s *Server) FetchJWTSVID(ctx context.Context, req *workload.JWTSVIDRequest) (*workload.JWTSVIDResponse, error) {
	names, err := s.begin(ctx, methodJWTSVID)
	if err != nil {
		return nil, err
	}
	if s.cfg.JWT == nil {
		return nil, s.refuse(ctx, methodJWTSVID, reasonNoJWTIssuer, errNoJWTIssuer)
	}
	audience := slices.Compact(slices.Sorted(slices.Values(req.GetAudience())))
	if len(audience) == 0 || slices.Contains(audience, "") {
		return nil, s.refuse(ctx, methodJWTSVID, reasonNoAudience, status.Error(codes.InvalidArgument, "audience must be specified"))
	}
	id, err := s.identityOf(ctx, methodJWTSVID, names)
	if err != nil {
		return nil, err
	}
	if asked := req.GetSpiffeId(); asked != "" && asked != id {
		return nil, s.refuse(ctx, methodJWTSVID, reasonOtherID, status.Errorf(codes.PermissionDenied, "no identity issued: the caller is %s, not %s", id, asked))
	}
	key := cacheKey(id, audience)
	now := s.clock.Now()
	token, ok := s.jwtCache.get(key, now)
	if ok {
		s.metrics.jwtSVIDs.WithLabelValues("cache").Inc()
	} else {
		minted, err := s.cfg.JWT.MintJWTSVID(ctx, audience)
		if err != nil {
			return nil, s.refuse(ctx, methodJWTSVID, reasonMintFailed, status.Errorf(mintCode(err), "no JWT-SVID issued: %s", err.Error()))
		}
		// The CA signs for the agent's credentials: never hand a caller another's identity.
		if minted.SPIFFEID != id {
			return nil, s.refuse(ctx, methodJWTSVID, reasonOtherID, status.Errorf(codes.PermissionDenied, "no JWT-SVID issued: the CA signs for %s, the caller is %s", minted.SPIFFEID, id))
		}
		token = minted.Token
		if refreshAt, ok := halfLife(token); ok {
			s.jwtCache.put(key, token, refreshAt, now)
		}
		s.metrics.jwtSVIDs.WithLabelValues("ca").Inc()
	}
	return &workload.JWTSVIDResponse{Svids: []*workload.JWTSVID{{SpiffeId: id, Svid: token}}}, nil
}

// mintCode is the status a workload gets when the CA did not sign: its refusal of the agent's
// credentials is the workload's refusal; anything else may pass, and the client may retry.
func mintCode(err error) codes.Code {
	switch status.Code(err) {
	case codes.Unauthenticated, codes.PermissionDenied:
		return codes.PermissionDenied
	case codes.InvalidArgument:
		return codes.InvalidArgument
	}
	return codes.Unavailable
}

// halfLife is when a JWT-SVID the CA signed is half through its life: from then on the cache
// mints another. A token without iat and exp is not cached.
func halfLife(token string) (time.Time, bool) {
	var claims jwt.RegisteredClaims
	// The CA's own token, just received over its verified connection: read, not verified.
	if _, _, err := jwt.NewParser().ParseUnverified(token, &claims); err != nil || claims.IssuedAt == nil || claims.ExpiresAt == nil {
		return time.Time{}, false
	}
	iat, exp := claims.IssuedAt.Time, claims.ExpiresAt.Time
	if !exp.After(iat) {
		return time.Time{}, false
	}
	return iat.Add(exp.Sub(iat) / 2), true
}

// identityOf returns the SPIFFE ID of the caller's key pair, waiting for it if the secret manager
// has not said anything of it yet.
func (s *Server) identityOf(ctx context.Context, method string, names Names) (string, error) {
	f, err := s.follow(names.KeyPair)
	if err != nil {
		return "", s.refuse(ctx, method, reasonNoIdentity, status.Errorf(codes.PermissionDenied, "no identity issued: %s", err.Error()))
	}
	defer f.close()
	for {
		secrets, known, why := f.current()
		switch {
		case !known:
			select {
			case <-ctx.Done():
				return "", status.FromContextError(ctx.Err()).Err()
			case <-f.wake:
			}
			continue
		case why != nil:
			return "", s.refuse(ctx, method, reasonUnavailable, status.Errorf(codes.Unavailable, "no identity issued: %s", why.Error()))
		case secrets[0].KeyPair == nil:
			return "", s.refuse(ctx, method, reasonNotAnSVID, status.Errorf(codes.PermissionDenied, "no identity issued: %q is not a key pair", names.KeyPair))
		}
		id, err := spiffeID(secrets[0].KeyPair.Leaf())
		if err != nil {
			return "", s.refuse(ctx, method, reasonNotAnSVID, status.Errorf(codes.PermissionDenied, "no identity issued: %s", err.Error()))
		}
		return id.String(), nil
	}
}

// Why a JWT-SVID does not verify.
var (
	errUnknownKey    = errors.New("the token's kid is not in the trust domain's JWT bundle")
	errAlgorithm     = errors.New("the token's algorithm is not one of a JWT-SVID")
	errNoKeyID       = errors.New("the token has no kid")
	errExpired       = errors.New("the token has expired")
	errNoExpiry      = errors.New("the token has no exp")
	errNotYetValid   = errors.New("the token is not valid yet")
	errWrongAudience = errors.New("the token is not for the audience")
)

// jwtSVIDAlgorithms are the algorithms the standard allows a JWT-SVID: never none, never HMAC.
func jwtSVIDAlgorithms() []string {
	return []string{"ES256", "ES384", "ES512", "RS256", "RS384", "RS512", "PS256", "PS384", "PS512"}
}

// verifyJWTSVID checks a JWT-SVID as the standard says: signed by a key of the bundle named by
// its kid, with an allowed algorithm, unexpired (exp required, nbf honoured), for audience, and
// its sub a SPIFFE ID of the bundle's trust domain. It returns the SPIFFE ID and the claims.
//
// golang-jwt decodes the token and checks the signature, but its Parser's claim validation is
// not used: it calls Validate() on an interface, which makes the linker keep every Validate
// method of Envoy's messages in meshid-agent (1.5 MB). The claims are checked here instead.
func verifyJWTSVID(b *JWTBundle, token, audience string, now time.Time) (string, jwt.MapClaims, error) {
	claims := jwt.MapClaims{}
	tok, parts, err := jwt.NewParser().ParseUnverified(token, claims)
	if err != nil {
		return "", nil, err
	}
	if !slices.Contains(jwtSVIDAlgorithms(), tok.Method.Alg()) {
		return "", nil, fmt.Errorf("%w: %s", errAlgorithm, logkey.Untrusted(tok.Method.Alg()))
	}
	kid, _ := tok.Header["kid"].(string)
	if kid == "" {
		return "", nil, errNoKeyID
	}
	key, ok := b.Keys[kid]
	if !ok {
		return "", nil, fmt.Errorf("%w: %q", errUnknownKey, logkey.Untrusted(kid))
	}
	if err := tok.Method.Verify(parts[0]+"."+parts[1], tok.Signature, key); err != nil {
		return "", nil, fmt.Errorf("signature: %w", err)
	}
	exp, err := claims.GetExpirationTime()
	switch {
	case err != nil:
		return "", nil, err
	case exp == nil:
		return "", nil, errNoExpiry
	case !now.Before(exp.Time):
		return "", nil, errExpired
	}
	if nbf, err := claims.GetNotBefore(); err != nil {
		return "", nil, err
	} else if nbf != nil && now.Before(nbf.Time) {
		return "", nil, errNotYetValid
	}
	aud, err := claims.GetAudience()
	if err != nil {
		return "", nil, err
	}
	if !slices.Contains(aud, audience) {
		return "", nil, fmt.Errorf("%w %q", errWrongAudience, logkey.Untrusted(audience))
	}
	sub, err := claims.GetSubject()
	if err != nil {
		return "", nil, err
	}
	id, err := parseSPIFFEID(sub)
	if err != nil {
		return "", nil, err
	}
	if "spiffe://"+id.Host != b.TrustDomain {
		return "", nil, fmt.Errorf("sub %q is not of the trust domain %s", logkey.Untrusted(sub), b.TrustDomain)
	}
	return sub, claims, nil
}
