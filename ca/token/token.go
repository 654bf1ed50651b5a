// Package token mints and verifies Kubernetes-style bound service-account tokens: the JWTs a
// kube-apiserver TokenRequest returns, which workloads present to the CA.
package token

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rsa"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/google/uuid"

	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// Defaults for minted tokens, as kube-apiserver sets them.
const (
	DefaultIssuer   = "https://kubernetes.default.svc.cluster.local"
	DefaultAudience = "istio-ca"
	DefaultTTL      = time.Hour
)

const subjectPrefix = "system:serviceaccount:"

// Claims are a bound service-account token's claims.
type Claims struct {
	jwt.RegisteredClaims
	Kubernetes *KubernetesClaims `json:"kubernetes.io,omitempty"`
}

// UnmarshalJSON decodes the claims, refusing exp, nbf and iat that are not JSON numbers:
// golang-jwt's NumericDate also takes a string holding a number, which Kubernetes never sends.
// One token, one encoding.
func (c *Claims) UnmarshalJSON(data []byte) error {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(data, &fields); err != nil {
		return err
	}
	for name, raw := range fields {
		for _, date := range []string{"exp", "nbf", "iat"} {
			// encoding/json matches keys regardless of case: "EXP" would be decoded as exp.
			if strings.EqualFold(name, date) && !isJSONNumber(raw) {
				return fmt.Errorf("claim %q is not a number of seconds: %s", date, logkey.Untrusted(string(raw)))
			}
		}
	}
	type plain Claims // the same fields, without this method
	return json.Unmarshal(data, (*plain)(c))
}

func isJSONNumber(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) > 0 && (raw[0] == '-' || '0' <= raw[0] && raw[0] <= '9')
}

// KubernetesClaims is the kubernetes.io claim block.
type KubernetesClaims struct {
	Namespace      string `json:"namespace"`
	ServiceAccount Ref    `json:"serviceaccount"`
	Pod            *Ref   `json:"pod,omitempty"`
	Node           *Ref   `json:"node,omitempty"`
}

// Ref names a Kubernetes object in the kubernetes.io block.
type Ref struct {
	Name string `json:"name"`
	UID  string `json:"uid"`
}

// Subject returns the sub claim Kubernetes gives a service account's tokens.
func Subject(namespace, serviceAccount string) string {
	return subjectPrefix + namespace + ":" + serviceAccount
}

// ErrSubject reports a token whose subject is not a well-formed service account.
var ErrSubject = errors.New("token subject is not a service account")

// ServiceAccount returns the namespace and name the token was issued to. The sub claim must be
// system:serviceaccount:NS:SA with valid names, and the kubernetes.io block, when present, must agree.
// The claims are the client's: the errors quote them bounded (logkey.Untrusted), since they are
// logged and sent back.
func (c *Claims) ServiceAccount() (namespace, name string, err error) {
	sub := logkey.Untrusted(c.Subject)
	rest, ok := strings.CutPrefix(c.Subject, subjectPrefix)
	if !ok {
		return "", "", fmt.Errorf("%w: sub %q lacks the %q prefix", ErrSubject, sub, subjectPrefix)
	}
	namespace, name, ok = strings.Cut(rest, ":")
	if !ok {
		return "", "", fmt.Errorf("%w: sub %q is not %sNAMESPACE:NAME", ErrSubject, sub, subjectPrefix)
	}
	// pki's errors quote the whole name: bounded here instead.
	if pki.ValidateNamespace(namespace) != nil {
		return "", "", fmt.Errorf("%w: namespace %q: want an RFC 1123 label (lower-case alphanumerics and '-', at most 63)", ErrSubject, logkey.Untrusted(namespace))
	}
	if pki.ValidateServiceAccount(name) != nil {
		return "", "", fmt.Errorf("%w: service account %q: want an RFC 1123 subdomain (lower-case alphanumerics, '-' and '.')", ErrSubject, logkey.Untrusted(name))
	}
	if k := c.Kubernetes; k != nil && (k.Namespace != namespace || k.ServiceAccount.Name != name) {
		return "", "", fmt.Errorf("%w: sub %q disagrees with kubernetes.io %s/%s", ErrSubject, sub,
			logkey.Untrusted(k.Namespace), logkey.Untrusted(k.ServiceAccount.Name))
	}
	return namespace, name, nil
}

// MintParams describes a token to mint.
type MintParams struct {
	Issuer            string
	Audiences         []string
	Namespace         string
	ServiceAccount    string
	ServiceAccountUID string // random when empty
	TTL               time.Duration
	Now               time.Time
}

// Minter signs bound service-account tokens with one key, read and checked once.
type Minter struct {
	key    crypto.Signer
	method jwt.SigningMethod
	kid    string
}

// NewMinter returns a Minter signing with key: ECDSA P-256/P-384 or RSA.
func NewMinter(key crypto.Signer) (*Minter, error) {
	method, err := signingMethod(key.Public())
	if err != nil {
		return nil, err
	}
	kid, err := pki.KeyID(key.Public())
	if err != nil {
		return nil, err
	}
	return &Minter{key: key, method: method, kid: kid}, nil
}

// LoadMinter reads the signing key at path (see LoadKey) and returns a Minter for it. A missing
// key is an error wrapping fs.ErrNotExist.
func LoadMinter(path string) (*Minter, error) {
	key, err := LoadKey(path)
	if err != nil {
		return nil, err
	}
	return NewMinter(key)
}

// Mint signs a bound service-account token with key; a Minter does the same for many tokens.
func Mint(key crypto.Signer, p MintParams) (string, error) {
	m, err := NewMinter(key)
	if err != nil {
		return "", err
	}
	return m.Mint(p)
}

// Mint signs a bound service-account token. The header carries the key's ID (as kube-apiserver
// derives it) and the algorithm that fits the key: ES256/ES384 or RS256.
func (m *Minter) Mint(p MintParams) (string, error) {
	if err := pki.ValidateNamespace(p.Namespace); err != nil {
		return "", err
	}
	if err := pki.ValidateServiceAccount(p.ServiceAccount); err != nil {
		return "", err
	}
	if p.TTL <= 0 {
		return "", fmt.Errorf("token lifetime %s must be positive", p.TTL)
	}
	if len(p.Audiences) == 0 {
		return "", errors.New("token needs at least one audience")
	}
	uid := p.ServiceAccountUID
	if uid == "" {
		uid = uuid.NewString()
	}
	now := p.Now
	if now.IsZero() {
		now = time.Now()
	}
	now = now.Truncate(time.Second)
	claims := Claims{
		RegisteredClaims: jwt.RegisteredClaims{
			Issuer:    p.Issuer,
			Subject:   Subject(p.Namespace, p.ServiceAccount),
			Audience:  jwt.ClaimStrings(p.Audiences),
			ExpiresAt: jwt.NewNumericDate(now.Add(p.TTL)),
			NotBefore: jwt.NewNumericDate(now),
			IssuedAt:  jwt.NewNumericDate(now),
			ID:        uuid.NewString(),
		},
		Kubernetes: &KubernetesClaims{
			Namespace:      p.Namespace,
			ServiceAccount: Ref{Name: p.ServiceAccount, UID: uid},
		},
	}
	tok := jwt.NewWithClaims(m.method, claims)
	tok.Header["kid"] = m.kid
	signed, err := tok.SignedString(m.key)
	if err != nil {
		return "", fmt.Errorf("sign token: %w", err)
	}
	return signed, nil
}

// signingMethod is the one rule for token keys, however they arrive (PEM keys or certificates,
// JWKS, the signing key of a Minter): ECDSA P-256 or P-384, or RSA of a size pki accepts, with
// the odd modulus and exponent crypto/rsa requires.
func signingMethod(pub crypto.PublicKey) (jwt.SigningMethod, error) {
	switch k := pub.(type) {
	case *ecdsa.PublicKey:
		switch k.Curve {
		case elliptic.P256():
			return jwt.SigningMethodES256, nil
		case elliptic.P384():
			return jwt.SigningMethodES384, nil
		}
	case *rsa.PublicKey:
		bits := k.N.BitLen()
		if err := pki.ValidateRSAKeySize(bits); err != nil {
			size := "large"
			if bits < pki.MinRSAKeySize {
				size = "small"
			}
			return nil, fmt.Errorf("RSA key of %d bits is too %s for tokens: %w", bits, size, err)
		}
		// crypto/rsa refuses such a key at every verification, so each token would fail.
		if k.N.Bit(0) == 0 || k.E&1 == 0 {
			return nil, errors.New("RSA key with an even modulus or exponent cannot verify tokens")
		}
		return jwt.SigningMethodRS256, nil
	}
	return nil, fmt.Errorf("cannot sign tokens with a %s key (want ECDSA P-256/P-384 or RSA)", pki.DescribeKey(pub))
}

// LoadKey reads a token signing key.
func LoadKey(path string) (crypto.Signer, error) {
	data, ok, err := fsutil.ReadOptional(path)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, fmt.Errorf("token signing key %s: %w", path, fs.ErrNotExist)
	}
	return parseKey(path, data)
}

// parseKey parses a token signing key read from path.
func parseKey(path string, data []byte) (crypto.Signer, error) {
	key, err := pki.ParsePrivateKey(data)
	if err != nil {
		return nil, fmt.Errorf("token signing key %s: %w", path, err)
	}
	if _, err := signingMethod(key.Public()); err != nil {
		return nil, fmt.Errorf("token signing key %s: %w", path, err)
	}
	return key, nil
}

// LoadOrCreateKey reads the token signing key at path, or creates an ECDSA P-256 one there (0600).
// It reports whether the key was created. The key is the state dir's, which the CA trusts: one
// that is not ours alone (a link, another user's, open to others) is refused, with
// fsutil.ErrNotOwned.
func LoadOrCreateKey(path string) (crypto.Signer, bool, error) {
	data, created, err := fsutil.LoadOrCreateKeyFile(path, newECDSAKeyPEM)
	if err != nil {
		return nil, false, fmt.Errorf("token signing key: %w", err)
	}
	key, err := parseKey(path, data)
	return key, created, err
}

// newECDSAKeyPEM is a new ECDSA P-256 key (ES256: every JWT library verifies it) in PEM.
func newECDSAKeyPEM() ([]byte, error) {
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		return nil, err
	}
	return pki.EncodePrivateKey(key)
}
