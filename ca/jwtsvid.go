package ca

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/golang-jwt/jwt/v5"

	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/pki"
)

// JWTSVIDKeyFile is the state dir's JWT-SVID signing key. It is not the token key
// (TokenKeyFile): the CA trusts that one for service-account tokens, and a JWT-SVID must never
// pass for one.
const JWTSVIDKeyFile = "jwt-svid-key.pem"

// JWTSVIDKeyPath is where the CA whose state dir is stateDir keeps its JWT-SVID signing key.
func JWTSVIDKeyPath(stateDir string) string { return filepath.Join(stateDir, JWTSVIDKeyFile) }

// JWT-SVID lifetimes.
const (
	// DefaultJWTSVIDTTL is short: a JWT-SVID is a bearer token, and cannot be revoked.
	DefaultJWTSVIDTTL = 5 * time.Minute
	// MaxJWTSVIDTTL bounds the configured lifetime.
	MaxJWTSVIDTTL = 24 * time.Hour
)

// jwtSVIDUse is the JWK use of a JWT-SVID key in a SPIFFE bundle.
const jwtSVIDUse = "jwt-svid"

// ErrAudience refuses a JWT-SVID asked for no audience (the standard requires one), or for
// more or longer audiences than the CA signs.
var ErrAudience = errors.New("invalid JWT-SVID audience")

// Bounds of a JWT-SVID's audiences, which the caller chooses.
const (
	MaxJWTSVIDAudiences     = 16
	MaxJWTSVIDAudienceBytes = 256
)

// JWTSVIDSigner signs JWT-SVIDs with one ES256 key at a time, for the identities the server
// authenticated, and publishes the keys that verify them. A key adopted later (AdoptKey) is
// published at once and signs from the time it is given (JWTSVIDKeyLead later, once every agent's
// bundle holds it); the key it replaces stays published until the last JWT-SVID it signed
// expires. It holds no transport and no policy beyond the lifetime.
type JWTSVIDSigner struct {
	trustDomain string // spiffe://TRUST_DOMAIN
	ttl         time.Duration

	mu sync.Mutex
	// keys are in the order they sign; each signs from its signsFrom until the next one's.
	keys []jwtSVIDKey
}

// jwtSVIDKey is one key of a signer.
type jwtSVIDKey struct {
	signer    crypto.Signer
	kid       string    // the RFC 7638 thumbprint
	jwk       []byte    // the public JWK, as JSON
	der       []byte    // PKIX
	signsFrom time.Time // zero: from the start
	// lastSigned is when this signer last signed with the key: zero, it can be dropped while
	// scheduled, not otherwise.
	lastSigned time.Time
}

// JWTSVIDKeyLead is how long an adopted JWT-SVID key is published before it signs, so that no
// validator is handed a JWT-SVID whose key its bundle lacks: twice the agents' bundle refresh
// (workloadapi.DefaultJWTBundleRefresh, 5 min), the second for a refresh that failed and is
// retried.
const JWTSVIDKeyLead = 10 * time.Minute

// JWTSVIDClockSkew is how far apart the clocks of the replicas following one schedule may be: a
// replaced key is kept that much longer than its last JWT-SVID may live.
const JWTSVIDClockSkew = time.Minute

// JWTBundle is what verifies a trust domain's JWT-SVIDs: the JWKS document the Workload API
// hands out, and the same keys as PKIX DER, which the agent reads without a JWK parser.
type JWTBundle struct {
	TrustDomain string // spiffe://TRUST_DOMAIN
	JWKS        []byte
	Keys        []JWTKey
}

// JWTKey is one verification key of a JWTBundle.
type JWTKey struct {
	ID        string
	PublicKey []byte // PKIX DER
}

// LoadOrCreateJWTSVIDSigner reads the JWT-SVID key of stateDir, or creates an ECDSA P-256 one
// there (0600, written atomically), and reports whether it was created. ttl is the lifetime of
// every JWT-SVID and the most a request gets; 0 means DefaultJWTSVIDTTL.
func LoadOrCreateJWTSVIDSigner(stateDir, trustDomain string, ttl time.Duration) (*JWTSVIDSigner, bool, error) {
	// Checked before the state dir is touched.
	if _, err := jwtSVIDTTL(ttl); err != nil {
		return nil, false, err
	}
	path := JWTSVIDKeyPath(stateDir)
	data, created, err := fsutil.LoadOrCreateKeyFile(path, GenerateJWTSVIDKey)
	if err != nil {
		return nil, false, fmt.Errorf("JWT-SVID signing key %s: %w", path, err)
	}
	key, err := ParseJWTSVIDKey(data)
	if err != nil {
		return nil, false, fmt.Errorf("JWT-SVID signing key %s: %w", path, err)
	}
	s, err := NewJWTSVIDSigner(key, trustDomain, ttl)
	return s, created, err
}

// GenerateJWTSVIDKey returns a new JWT-SVID signing key, ECDSA P-256, as PEM.
func GenerateJWTSVIDKey() ([]byte, error) {
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		return nil, err
	}
	return pki.EncodePrivateKey(key)
}

// ParseJWTSVIDKey parses a JWT-SVID signing key from PEM, and refuses any key but ECDSA P-256.
func ParseJWTSVIDKey(keyPEM []byte) (crypto.Signer, error) {
	key, err := pki.ParsePrivateKey(keyPEM)
	if err != nil {
		return nil, err
	}
	if _, err := checkJWTSVIDKey(key); err != nil {
		return nil, err
	}
	return key, nil
}

// ErrJWTSVIDKey refuses a JWT-SVID signing key that is not ECDSA P-256.
var ErrJWTSVIDKey = errors.New("a JWT-SVID key must be ECDSA P-256 (ES256)")

// checkJWTSVIDKey returns key's public key when it is ECDSA P-256.
func checkJWTSVIDKey(key crypto.Signer) (*ecdsa.PublicKey, error) {
	pub, ok := key.Public().(*ecdsa.PublicKey)
	if !ok || pub.Curve != elliptic.P256() {
		return nil, fmt.Errorf("%w, not %s", ErrJWTSVIDKey, pki.DescribeKey(key.Public()))
	}
	return pub, nil
}

// jwtSVIDTTL returns the lifetime of the JWT-SVIDs: ttl, or DefaultJWTSVIDTTL for 0.
func jwtSVIDTTL(ttl time.Duration) (time.Duration, error) {
	if ttl == 0 {
		return DefaultJWTSVIDTTL, nil
	}
	if ttl < 0 || ttl > MaxJWTSVIDTTL {
		return 0, fmt.Errorf("%w: JWT-SVID lifetime %s is not in (0, %s]", ErrInvalidTTL, ttl, MaxJWTSVIDTTL)
	}
	return ttl, nil
}

// NewJWTSVIDSigner returns a signer with key, an ECDSA P-256 key (ES256, the algorithm every
// JWT-SVID validator supports). ttl is as for LoadOrCreateJWTSVIDSigner.
func NewJWTSVIDSigner(key crypto.Signer, trustDomain string, ttl time.Duration) (*JWTSVIDSigner, error) {
	ttl, err := jwtSVIDTTL(ttl)
	if err != nil {
		return nil, err
	}
	if err := pki.ValidateTrustDomain(trustDomain); err != nil {
		return nil, err
	}
	k, err := newJWTSVIDKey(key)
	if err != nil {
		return nil, err
	}
	return &JWTSVIDSigner{trustDomain: "spiffe://" + trustDomain, ttl: ttl, keys: []jwtSVIDKey{k}}, nil
}

// JWTSVIDKeyID is the kid of the JWT-SVIDs key signs: its RFC 7638 thumbprint. A key that is not
// ECDSA P-256 is refused.
func JWTSVIDKeyID(key crypto.Signer) (string, error) {
	k, err := newJWTSVIDKey(key)
	return k.kid, err
}

func newJWTSVIDKey(key crypto.Signer) (jwtSVIDKey, error) {
	pub, err := checkJWTSVIDKey(key)
	if err != nil {
		return jwtSVIDKey{}, err
	}
	jwk := jose.JSONWebKey{Key: pub, Algorithm: string(jose.ES256), Use: jwtSVIDUse}
	thumb, err := jwk.Thumbprint(crypto.SHA256)
	if err != nil {
		return jwtSVIDKey{}, fmt.Errorf("JWT-SVID key thumbprint: %w", err)
	}
	// The RFC 7638 thumbprint: any holder of the JWKS can check that the kid is the key's.
	jwk.KeyID = base64.RawURLEncoding.EncodeToString(thumb)
	jwkJSON, err := json.Marshal(jwk)
	if err != nil {
		return jwtSVIDKey{}, fmt.Errorf("JWT-SVID JWK: %w", err)
	}
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return jwtSVIDKey{}, fmt.Errorf("JWT-SVID public key: %w", err)
	}
	return jwtSVIDKey{signer: key, kid: jwk.KeyID, jwk: jwkJSON, der: der}, nil
}

// AdoptKey schedules a rotation: previous signs until signsFrom (not before now), then key; both
// are published from now, and a key that is to sign should be published JWTSVIDKeyLead before.
// previous equal to key cancels a rotation: key signs from now. A key adopted before that has not
// signed and is neither is dropped; every key that signed stays published until the last JWT-SVID
// it signed has expired. It returns key's kid and whether anything changed. A key that is not
// ECDSA P-256 is refused.
func (s *JWTSVIDSigner) AdoptKey(key, previous crypto.Signer, signsFrom, now time.Time) (string, bool, error) {
	k, err := newJWTSVIDKey(key)
	if err != nil {
		return "", false, err
	}
	p, err := newJWTSVIDKey(previous)
	if err != nil {
		return "", false, err
	}
	if signsFrom.Before(now) {
		signsFrom = now
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pruneLocked(now)
	before := s.scheduleLocked()
	signing := s.keys[s.signingLocked(now)]
	kept := make([]jwtSVIDKey, 0, len(s.keys)+2)
	for _, old := range s.keys {
		switch {
		case old.kid == k.kid:
			k.lastSigned = old.lastSigned
		case old.kid == p.kid:
			p.lastSigned = old.lastSigned
		case old.signsFrom.After(now) && old.lastSigned.IsZero():
			// Scheduled, never signed: nothing needs it.
		default:
			kept = append(kept, old)
		}
	}
	switch {
	case p.kid == k.kid && signing.kid == k.kid:
		k.signsFrom = signing.signsFrom
		kept = append(kept, k)
	case p.kid == k.kid:
		k.signsFrom = now
		kept = append(kept, k)
	default:
		p.signsFrom = now
		if signing.kid == p.kid {
			p.signsFrom = signing.signsFrom
		}
		k.signsFrom = signsFrom
		kept = append(kept, p, k)
	}
	s.keys = kept
	return k.kid, !slices.Equal(before, s.scheduleLocked()), nil
}

// scheduleLocked is which key signs from when, to tell a change.
func (s *JWTSVIDSigner) scheduleLocked() []string {
	out := make([]string, len(s.keys))
	for i, k := range s.keys {
		out[i] = k.kid + "@" + strconv.FormatInt(k.signsFrom.UnixNano(), 10)
	}
	return out
}

// pruneLocked drops the keys no valid JWT-SVID can need: each stopped signing, here or on the
// same schedule at another replica, when the key after it took over (never before it last signed
// here: a key takes over at its adoption or later), more than a lifetime and JWTSVIDClockSkew
// ago. The newest is kept.
func (s *JWTSVIDSigner) pruneLocked(now time.Time) {
	kept := s.keys[:0]
	for i, k := range s.keys {
		if i == len(s.keys)-1 || now.Before(s.keys[i+1].signsFrom.Add(s.ttl+JWTSVIDClockSkew)) {
			kept = append(kept, k)
		}
	}
	s.keys = kept
}

// signingLocked is the index of the key that signs at now: the newest whose time has come.
func (s *JWTSVIDSigner) signingLocked(now time.Time) int {
	for i := len(s.keys) - 1; i > 0; i-- {
		if !now.Before(s.keys[i].signsFrom) {
			return i
		}
	}
	return 0
}

// KeyID is the kid of the JWT-SVIDs signed at now.
func (s *JWTSVIDSigner) KeyID(now time.Time) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.keys[s.signingLocked(now)].kid
}

// TTL is the lifetime of the JWT-SVIDs signed, and the most a request gets.
func (s *JWTSVIDSigner) TTL() time.Duration { return s.ttl }

// Bundle returns the keys that verify the signer's JWT-SVIDs at now: the one signing, one
// adopted to sign next, and those whose JWT-SVIDs may still be valid (pruneLocked), in the order
// they sign.
func (s *JWTSVIDSigner) Bundle(now time.Time) JWTBundle {
	s.mu.Lock()
	s.pruneLocked(now)
	keys := slices.Clone(s.keys)
	s.mu.Unlock()
	b := JWTBundle{TrustDomain: s.trustDomain, JWKS: []byte(`{"keys":[`)}
	for i, k := range keys {
		if i > 0 {
			b.JWKS = append(b.JWKS, ',')
		}
		b.JWKS = append(b.JWKS, k.jwk...) // each marshaled once, when adopted
		b.Keys = append(b.Keys, JWTKey{ID: k.kid, PublicKey: k.der})
	}
	b.JWKS = append(b.JWKS, "]}"...)
	return b
}

// JWTSVIDRequest is one JWT-SVID to sign.
type JWTSVIDRequest struct {
	Identity pki.SPIFFEID // the authenticated caller's
	Audience []string
	TTL      time.Duration // 0: the signer's; more: clamped to it; negative: refused
	Now      time.Time
}

// SignJWTSVID signs a JWT-SVID: sub the identity, aud the audiences, iat now, exp now+ttl, and
// kid the signing key's thumbprint. It returns the token and its expiry.
func (s *JWTSVIDSigner) SignJWTSVID(req JWTSVIDRequest) (string, time.Time, error) {
	aud := slices.DeleteFunc(slices.Clone(req.Audience), func(a string) bool { return a == "" })
	switch {
	case len(aud) == 0:
		return "", time.Time{}, fmt.Errorf("%w: none given, and the standard requires one", ErrAudience)
	case len(aud) > MaxJWTSVIDAudiences:
		return "", time.Time{}, fmt.Errorf("%w: %d audiences, more than %d", ErrAudience, len(aud), MaxJWTSVIDAudiences)
	}
	for _, a := range aud {
		if len(a) > MaxJWTSVIDAudienceBytes {
			return "", time.Time{}, fmt.Errorf("%w: an audience of %d bytes, more than %d", ErrAudience, len(a), MaxJWTSVIDAudienceBytes)
		}
	}
	ttl := req.TTL
	switch {
	case ttl < 0:
		return "", time.Time{}, fmt.Errorf("%w: %s", ErrInvalidTTL, ttl)
	case ttl == 0 || ttl > s.ttl:
		ttl = s.ttl
	}
	now := req.Now.Truncate(time.Second)
	exp := now.Add(ttl)
	tok := jwt.NewWithClaims(jwt.SigningMethodES256, jwt.RegisteredClaims{
		Subject:   req.Identity.String(),
		Audience:  jwt.ClaimStrings(aud),
		IssuedAt:  jwt.NewNumericDate(now),
		ExpiresAt: jwt.NewNumericDate(exp),
	})
	s.mu.Lock()
	i := s.signingLocked(req.Now)
	s.keys[i].lastSigned = req.Now
	k := s.keys[i]
	s.mu.Unlock()
	tok.Header["kid"] = k.kid
	signed, err := tok.SignedString(k.signer)
	if err != nil {
		return "", time.Time{}, fmt.Errorf("sign JWT-SVID: %w", err)
	}
	return signed, exp, nil
}
