package token

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/rsa"
	"encoding/base64"
	"errors"
	"fmt"
	"math/big"
	"os"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	josejson "github.com/go-jose/go-jose/v4/json"
	"github.com/golang-jwt/jwt/v5"

	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// allowedAlgorithms are the only signature algorithms the verifier accepts: never "none", never
// an HMAC whose secret could be a public key.
func allowedAlgorithms() []string { return []string{"RS256", "RS384", "ES256", "ES384"} }

// DefaultLeeway tolerates clock skew between the token issuer and the CA.
const DefaultLeeway = time.Minute

// ErrUnknownKey reports a token signed with a key the verifier does not hold.
var ErrUnknownKey = errors.New("token signed by an unknown key")

// ErrNoKeyID reports a token without a kid header checked by a verifier that holds several keys,
// which cannot tell which of them is meant to have signed it.
var ErrNoKeyID = errors.New("token has no kid header but several issuer keys are trusted")

// KeySet holds the public keys of trusted token issuers, by key ID.
type KeySet struct {
	keys map[string]crypto.PublicKey
	ids  []string // in file order
}

// NewKeySet builds a key set; keys get the IDs pki.KeyID derives.
func NewKeySet(keys ...crypto.PublicKey) (*KeySet, error) {
	ks := &KeySet{keys: map[string]crypto.PublicKey{}}
	for _, k := range keys {
		kid, err := pki.KeyID(k)
		if err != nil {
			return nil, err
		}
		if err := ks.add(kid, k); err != nil {
			return nil, err
		}
	}
	return ks, nil
}

func (ks *KeySet) add(kid string, key crypto.PublicKey) error {
	if _, err := signingMethod(key); err != nil {
		return err
	}
	if existing, dup := ks.keys[kid]; dup {
		if pki.PublicKeysEqual(existing, key) {
			return nil
		}
		return fmt.Errorf("two different keys share the key ID %q", kid)
	}
	ks.keys[kid] = key
	ks.ids = append(ks.ids, kid)
	return nil
}

// Len returns the number of keys.
func (ks *KeySet) Len() int { return len(ks.ids) }

// LoadKeySet reads issuer keys from a file of PEM public keys (or certificates), or a JWKS document.
func LoadKeySet(path string) (*KeySet, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read token keys: %w", err)
	}
	ks, err := ParseKeySet(data)
	if err != nil {
		return nil, fmt.Errorf("token keys %s: %w", path, err)
	}
	return ks, nil
}

// ParseKeySet parses PEM public keys or a JWKS document.
func ParseKeySet(data []byte) (*KeySet, error) {
	if trimmed := bytes.TrimSpace(data); len(trimmed) > 0 && trimmed[0] == '{' {
		return parseJWKS(trimmed)
	}
	keys, err := pki.ParsePublicKeys(data)
	if err != nil {
		return nil, err
	}
	return NewKeySet(keys...)
}

// jwkNames are the members of a JWK that meshid's key policy reads before go-jose parses the key:
// which keys are for signatures, which types and curves are allowed, and the exponent go-jose
// would truncate.
type jwkNames struct {
	Kty string `json:"kty"`
	Kid string `json:"kid"`
	Use string `json:"use"`
	Crv string `json:"crv"`
	E   string `json:"e"`
}

// parseJWKS reads a JWKS document with go-jose, under meshid's key policy: keys whose use is
// neither empty nor "sig" are skipped unparsed; the others must be EC P-256/P-384 or RSA public
// keys that signingMethod accepts, with an exponent in [3, 2^31-1]; a JWK without kid is named
// by pki.KeyID; one key twice under a kid counts once, two keys under one kid spoil the set.
//
// The keys are decoded one by one rather than as a jose.JSONWebKeySet, so that a key skipped by
// its use is never parsed, and an error names the key. Both steps read JSON with go-jose's own
// decoder, so the policy and the parser see the same members (names are case-sensitive, and a
// duplicate member is an error).
func parseJWKS(data []byte) (*KeySet, error) {
	var doc struct {
		Keys []josejson.RawMessage `json:"keys"`
	}
	if err := josejson.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("parse JWKS: %w", err)
	}
	ks := &KeySet{keys: map[string]crypto.PublicKey{}}
	for i, raw := range doc.Keys {
		var names jwkNames
		if err := josejson.Unmarshal(raw, &names); err != nil {
			return nil, fmt.Errorf("parse JWKS key %d: %w", i, err)
		}
		if names.Use != "" && names.Use != "sig" {
			continue
		}
		pub, err := jwkPublicKey(raw, names)
		if err != nil {
			return nil, fmt.Errorf("JWKS key %d (kid %q): %w", i, names.Kid, err)
		}
		kid := names.Kid
		if kid == "" {
			if kid, err = pki.KeyID(pub); err != nil {
				return nil, err
			}
		}
		if err := ks.add(kid, pub); err != nil {
			return nil, fmt.Errorf("JWKS key %d (kid %q): %w", i, names.Kid, err)
		}
	}
	if ks.Len() == 0 {
		return nil, errors.New("JWKS holds no signature keys")
	}
	return ks, nil
}

// jwkPublicKey parses one JWK with go-jose and applies the policy go-jose does not: key types and
// curves (go-jose also takes oct, OKP and P-521), public keys only (go-jose also returns private
// ones), and the RSA exponent's range (go-jose keeps the low 64 bits of e). The key's size and
// the rest of the rule for token keys are signingMethod's, checked in KeySet.add.
func jwkPublicKey(raw []byte, names jwkNames) (crypto.PublicKey, error) {
	switch names.Kty {
	case "EC":
		if names.Crv != "P-256" && names.Crv != "P-384" {
			return nil, fmt.Errorf("unsupported curve %q", names.Crv)
		}
	case "RSA":
	default:
		return nil, fmt.Errorf("unsupported key type %q", names.Kty)
	}
	var k jose.JSONWebKey
	if err := k.UnmarshalJSON(raw); err != nil {
		what := map[string]string{"EC": "EC coordinates", "RSA": "RSA modulus and exponent"}[names.Kty]
		return nil, fmt.Errorf("decode %s: %w", what, err)
	}
	switch pub := k.Key.(type) {
	case *ecdsa.PublicKey:
		return pub, nil
	case *rsa.PublicKey:
		// go-jose has decoded e (strict base64url), and kept only its low 64 bits.
		e, err := base64.RawURLEncoding.DecodeString(names.E)
		if err != nil {
			return nil, fmt.Errorf("decode RSA exponent: %w", err)
		}
		if exp := new(big.Int).SetBytes(e); !exp.IsInt64() || exp.Int64() < 3 || exp.Int64() > 1<<31-1 {
			return nil, errors.New("RSA exponent out of range")
		}
		return pub, nil
	case *ecdsa.PrivateKey, *rsa.PrivateKey:
		return nil, errors.New("a private key: a JWKS of token issuers holds public keys only")
	}
	return nil, fmt.Errorf("unsupported key %T", k.Key)
}

// VerifierConfig configures a Verifier.
type VerifierConfig struct {
	Keys     *KeySet
	Audience string // required
	Issuer   string // checked when set
	Leeway   time.Duration
	Now      func() time.Time // nil means time.Now
}

// Verifier checks bound service-account tokens.
type Verifier struct {
	keys   *KeySet
	parser *jwt.Parser
}

// NewVerifier returns a Verifier.
func NewVerifier(cfg VerifierConfig) (*Verifier, error) {
	if cfg.Keys == nil || cfg.Keys.Len() == 0 {
		return nil, errors.New("token verifier needs at least one key")
	}
	if cfg.Audience == "" {
		return nil, errors.New("token verifier needs an audience")
	}
	if cfg.Leeway == 0 {
		cfg.Leeway = DefaultLeeway
	}
	opts := []jwt.ParserOption{
		jwt.WithValidMethods(allowedAlgorithms()),
		jwt.WithAudience(cfg.Audience),
		jwt.WithExpirationRequired(),
		jwt.WithLeeway(cfg.Leeway),
		jwt.WithStrictDecoding(), // one token, one encoding
	}
	if cfg.Issuer != "" {
		opts = append(opts, jwt.WithIssuer(cfg.Issuer))
	}
	if cfg.Now != nil {
		opts = append(opts, jwt.WithTimeFunc(cfg.Now))
	}
	return &Verifier{keys: cfg.Keys, parser: jwt.NewParser(opts...)}, nil
}

// Verify checks raw's signature, algorithm, audience, issuer and validity window, and returns its claims.
// Errors wrap golang-jwt's (jwt.ErrTokenExpired, jwt.ErrTokenInvalidAudience, ...), ErrUnknownKey or
// ErrNoKeyID.
func (v *Verifier) Verify(raw string) (*Claims, error) {
	claims := &Claims{}
	if _, err := v.parser.ParseWithClaims(raw, claims, v.keyFor); err != nil {
		return nil, err
	}
	return claims, nil
}

// keyFor picks the key named by the header's kid. A token without kid is checked against the
// only key when there is one; with several it is refused rather than tried against each, so
// that which key vouches for a token never depends on trial and error (DESIGN.md, Tokens).
func (v *Verifier) keyFor(t *jwt.Token) (any, error) {
	kid, hasKid := t.Header["kid"].(string)
	if hasKid && kid != "" {
		key, ok := v.keys.keys[kid]
		if !ok {
			return nil, fmt.Errorf("%w: kid %q", ErrUnknownKey, logkey.Untrusted(kid))
		}
		return key, nil
	}
	if n := len(v.keys.ids); n != 1 {
		return nil, fmt.Errorf("%w (%d keys)", ErrNoKeyID, n)
	}
	return v.keys.keys[v.keys.ids[0]], nil
}
