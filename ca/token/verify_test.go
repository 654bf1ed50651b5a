package token_test

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"math/big"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// verifier checks tokens for istio-ca against ks, ten minutes after testNow unless edit says otherwise.
func verifier(t testing.TB, ks *token.KeySet, edit func(*token.VerifierConfig)) *token.Verifier {
	t.Helper()
	cfg := token.VerifierConfig{Keys: ks, Audience: token.DefaultAudience, Now: at(10 * time.Minute)}
	if edit != nil {
		edit(&cfg)
	}
	v, err := token.NewVerifier(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// at is a clock stopped at testNow+d.
func at(d time.Duration) func() time.Time { return func() time.Time { return testNow().Add(d) } }

func keySet(t testing.TB, pubs ...crypto.PublicKey) *token.KeySet {
	t.Helper()
	ks, err := token.NewKeySet(pubs...)
	if err != nil {
		t.Fatal(err)
	}
	return ks
}

// sign builds a token by hand with golang-jwt: any method, any kid (nil for none), any claims.
func sign(t testing.TB, method jwt.SigningMethod, key, kid any, claims jwt.Claims) string {
	t.Helper()
	tok := jwt.NewWithClaims(method, claims)
	if kid != nil {
		tok.Header["kid"] = kid
	}
	s, err := tok.SignedString(key)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// goodClaims are the claims Mint gives params().
func goodClaims() jwt.MapClaims {
	now := testNow().Unix()
	return jwt.MapClaims{
		"iss": token.DefaultIssuer, "sub": "system:serviceaccount:default:sleep", "aud": []string{"istio-ca"},
		"exp": now + 3600, "iat": now, "nbf": now,
		"kubernetes.io": map[string]any{"namespace": "default", "serviceaccount": map[string]any{"name": "sleep", "uid": "u"}},
	}
}

func b64JSON(t testing.TB, v any) string {
	t.Helper()
	data, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return base64.RawURLEncoding.EncodeToString(data)
}

func TestVerifierAcceptsMintedToken(t *testing.T) {
	t.Parallel()
	key := newKey(t)
	tok := mint(t, key, func(p *token.MintParams) { p.ServiceAccountUID = "uid-1" })
	claims, err := verifier(t, keySet(t, key.Public()), nil).Verify(tok)
	if err != nil {
		t.Fatalf("Verify() error: %v", err)
	}
	ns, sa, err := claims.ServiceAccount()
	if err != nil || ns != "default" || sa != "sleep" {
		t.Fatalf("ServiceAccount() = %q, %q, %v; want default, sleep", ns, sa, err)
	}
	if claims.Issuer != token.DefaultIssuer || !claims.ExpiresAt.Equal(testNow().Add(time.Hour)) {
		t.Fatalf("claims iss %q exp %v, want %q and %v", claims.Issuer, claims.ExpiresAt, token.DefaultIssuer, testNow().Add(time.Hour))
	}
	if claims.Kubernetes == nil || claims.Kubernetes.ServiceAccount.UID != "uid-1" {
		t.Fatalf("kubernetes.io block = %+v, want uid-1", claims.Kubernetes)
	}
}

func TestVerifierRefusals(t *testing.T) {
	t.Parallel()
	key, other := newKey(t), newKey(t)
	kid := keyID(t, key.Public())
	pkix, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		t.Fatal(err)
	}
	good := mint(t, key, nil)
	parts := strings.Split(good, ".")
	noneHeader := b64JSON(t, map[string]string{"alg": "none", "typ": "JWT", "kid": kid})
	es256Sig := func(input string) string { // a genuine ES256 signature by key over input
		sig, err := jwt.SigningMethodES256.Sign(input, key)
		if err != nil {
			t.Fatal(err)
		}
		return base64.RawURLEncoding.EncodeToString(sig)
	}
	withAlg := func(alg string) string { // good's payload under another alg, signed by key with ES256
		input := b64JSON(t, map[string]string{"alg": alg, "typ": "JWT", "kid": kid}) + "." + parts[1]
		return input + "." + es256Sig(input)
	}
	flipped := []byte(parts[2])
	flipped[10] = map[bool]byte{true: 'B', false: 'A'}[flipped[10] == 'A']
	otherPayload := strings.Split(mint(t, key, func(p *token.MintParams) { p.ServiceAccount = "admin" }), ".")[1]
	noExp, noAud := goodClaims(), goodClaims()
	delete(noExp, "exp")
	delete(noAud, "aud")

	tests := []struct {
		name  string
		token string
		cfg   func(*token.VerifierConfig)
		want  error // nil: accepted
	}{
		{name: "valid", token: good},
		{name: "at nbf", token: good, cfg: func(c *token.VerifierConfig) { c.Now = at(0) }},
		{name: "at exp", token: good, cfg: func(c *token.VerifierConfig) { c.Now = at(time.Hour) }},
		{name: "expired within leeway", token: good, cfg: func(c *token.VerifierConfig) { c.Now = at(time.Hour + 59*time.Second) }},
		{name: "expired at the leeway", token: good, cfg: func(c *token.VerifierConfig) { c.Now = at(time.Hour + time.Minute) }, want: jwt.ErrTokenExpired},
		{name: "expired beyond leeway", token: good, cfg: func(c *token.VerifierConfig) { c.Now = at(2 * time.Hour) }, want: jwt.ErrTokenExpired},
		{name: "expired beyond custom leeway", token: good, cfg: func(c *token.VerifierConfig) { c.Now, c.Leeway = at(time.Hour+10*time.Second), 5*time.Second }, want: jwt.ErrTokenExpired},
		{name: "nbf within leeway", token: good, cfg: func(c *token.VerifierConfig) { c.Now = at(-59 * time.Second) }},
		{name: "not yet valid", token: good, cfg: func(c *token.VerifierConfig) { c.Now = at(-5 * time.Minute) }, want: jwt.ErrTokenNotValidYet},
		{name: "wrong audience", token: mint(t, key, func(p *token.MintParams) { p.Audiences = []string{"other"} }), want: jwt.ErrTokenInvalidAudience},
		{name: "one of several audiences", token: mint(t, key, func(p *token.MintParams) { p.Audiences = []string{"a", "istio-ca", "b"} })},
		{name: "verifier wants another audience", token: good, cfg: func(c *token.VerifierConfig) { c.Audience = "spire-server" }, want: jwt.ErrTokenInvalidAudience},
		{name: "no aud claim", token: sign(t, jwt.SigningMethodES256, key, kid, noAud), want: jwt.ErrTokenRequiredClaimMissing},
		{name: "issuer matches", token: good, cfg: func(c *token.VerifierConfig) { c.Issuer = token.DefaultIssuer }},
		{name: "issuer mismatch", token: good, cfg: func(c *token.VerifierConfig) { c.Issuer = "https://other.example" }, want: jwt.ErrTokenInvalidIssuer},
		{name: "any issuer when unset", token: mint(t, key, func(p *token.MintParams) { p.Issuer = "https://anything.example" })},
		{name: "missing issuer when set", token: mint(t, key, func(p *token.MintParams) { p.Issuer = "" }), cfg: func(c *token.VerifierConfig) { c.Issuer = token.DefaultIssuer }, want: jwt.ErrTokenRequiredClaimMissing},
		{name: "missing exp", token: sign(t, jwt.SigningMethodES256, key, kid, noExp), want: jwt.ErrTokenRequiredClaimMissing},
		{name: "kid not in set", token: sign(t, jwt.SigningMethodES256, key, "no-such-key", goodClaims()), want: token.ErrUnknownKey},
		{name: "kid of a key we do not hold", token: mint(t, other, nil), want: token.ErrUnknownKey},
		{name: "no kid, key we do not hold", token: sign(t, jwt.SigningMethodES256, other, nil, goodClaims()), want: jwt.ErrTokenSignatureInvalid},
		{name: "our kid, other key's signature", token: sign(t, jwt.SigningMethodES256, other, kid, goodClaims()), want: jwt.ErrTokenSignatureInvalid},
		{name: "flipped signature byte", token: parts[0] + "." + parts[1] + "." + string(flipped), want: jwt.ErrTokenSignatureInvalid},
		{name: "signature of another payload", token: parts[0] + "." + otherPayload + "." + parts[2], want: jwt.ErrTokenSignatureInvalid},
		{name: "no signature", token: parts[0] + "." + parts[1] + ".", want: jwt.ErrTokenSignatureInvalid},
		{name: "alg none", token: noneHeader + "." + parts[1] + ".", want: jwt.ErrTokenSignatureInvalid},
		{name: "alg none with signature", token: noneHeader + "." + parts[1] + "." + parts[2], want: jwt.ErrTokenSignatureInvalid},
		{name: "alg None", token: b64JSON(t, map[string]string{"alg": "None"}) + "." + parts[1] + ".", want: jwt.ErrTokenUnverifiable},
		{name: "no alg", token: b64JSON(t, map[string]string{"kid": kid}) + "." + parts[1] + "." + parts[2], want: jwt.ErrTokenUnverifiable},
		{name: "HS256 keyed with the public key", token: sign(t, jwt.SigningMethodHS256, pkix, kid, goodClaims()), want: jwt.ErrTokenSignatureInvalid},
		{name: "HS256 keyed with the public key PEM", token: sign(t, jwt.SigningMethodHS256, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pkix}), nil, goodClaims()), want: jwt.ErrTokenSignatureInvalid},
		{name: "RS256 header over an ECDSA key", token: withAlg("RS256"), want: jwt.ErrInvalidKeyType},
		{name: "ES384 header over a P-256 signature", token: withAlg("ES384"), want: jwt.ErrTokenSignatureInvalid},
		{name: "ES256 header re-signed (control)", token: withAlg("ES256")},
		{name: "empty", token: "", want: jwt.ErrTokenMalformed},
		{name: "one segment", token: "abc", want: jwt.ErrTokenMalformed},
		{name: "two segments", token: parts[0] + "." + parts[1], want: jwt.ErrTokenMalformed},
		{name: "four segments", token: good + ".x", want: jwt.ErrTokenMalformed},
		{name: "a.b.c", token: "a.b.c", want: jwt.ErrTokenMalformed},
		{name: "bearer prefix", token: "Bearer " + good, want: jwt.ErrTokenMalformed},
		{name: "padded header", token: parts[0] + "==." + parts[1] + "." + parts[2], want: jwt.ErrTokenMalformed},
		{name: "header not JSON", token: base64.RawURLEncoding.EncodeToString([]byte("alg=ES256")) + "." + parts[1] + "." + parts[2], want: jwt.ErrTokenMalformed},
		{name: "payload not JSON", token: parts[0] + ".bm90IGpzb24." + parts[2], want: jwt.ErrTokenMalformed},
		{name: "exp as string", token: parts[0] + "." + b64JSON(t, map[string]any{"exp": "tomorrow", "aud": "istio-ca"}) + "." + parts[2], want: jwt.ErrTokenMalformed},
	}
	ks := keySet(t, key.Public())
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			claims, err := verifier(t, ks, tc.cfg).Verify(tc.token)
			if tc.want == nil {
				if err != nil {
					t.Fatalf("Verify() error: %v", err)
				}
				if _, _, err := claims.ServiceAccount(); err != nil {
					t.Fatalf("accepted token's ServiceAccount(): %v", err)
				}
				return
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("Verify() error = %v, want %v", err, tc.want)
			}
			if claims != nil {
				t.Fatalf("Verify() returned claims %+v with its error", claims)
			}
		})
	}
}

func TestVerifierKeySelection(t *testing.T) {
	t.Parallel()
	a, b, c := newKey(t), newKey(t), newKey(t)
	one := keySet(t, a.Public())
	jwks := parseKeySet(t, jwksJSON(t, jwkOf(t, a.Public(), "", ""), jwkOf(t, b.Public(), "", "")))
	tests := []struct {
		name  string
		keys  *token.KeySet
		token string
		want  error
	}{
		{name: "single key, no kid", keys: one, token: sign(t, jwt.SigningMethodES256, a, nil, goodClaims())},
		{name: "single key, kid", keys: one, token: mint(t, a, nil)},
		{name: "single key, empty kid", keys: one, token: sign(t, jwt.SigningMethodES256, a, "", goodClaims())},
		{name: "single key, numeric kid", keys: one, token: sign(t, jwt.SigningMethodES256, a, 42, goodClaims())},
		{name: "JWKS, kid of first", keys: jwks, token: mint(t, a, nil)},
		{name: "JWKS, kid of second", keys: jwks, token: mint(t, b, nil)},
		// With several keys a token must say which one signed it (DESIGN.md, Tokens).
		{name: "JWKS, no kid, first key", keys: jwks, token: sign(t, jwt.SigningMethodES256, a, nil, goodClaims()), want: token.ErrNoKeyID},
		{name: "JWKS, no kid, second key", keys: jwks, token: sign(t, jwt.SigningMethodES256, b, nil, goodClaims()), want: token.ErrNoKeyID},
		{name: "JWKS, empty kid", keys: jwks, token: sign(t, jwt.SigningMethodES256, a, "", goodClaims()), want: token.ErrNoKeyID},
		{name: "JWKS, kid names the other key", keys: jwks, token: sign(t, jwt.SigningMethodES256, a, keyID(t, b.Public()), goodClaims()), want: jwt.ErrTokenSignatureInvalid},
		{name: "JWKS, no kid, unknown key", keys: jwks, token: sign(t, jwt.SigningMethodES256, c, nil, goodClaims()), want: token.ErrNoKeyID},
		{name: "single key, no kid, unknown key", keys: one, token: sign(t, jwt.SigningMethodES256, c, nil, goodClaims()), want: jwt.ErrTokenSignatureInvalid},
		{name: "JWKS, kid of unknown key", keys: jwks, token: mint(t, c, nil), want: token.ErrUnknownKey},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := verifier(t, tc.keys, nil).Verify(tc.token)
			if (tc.want == nil && err != nil) || !errors.Is(err, tc.want) {
				t.Fatalf("Verify() error = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestNewVerifierRefusals(t *testing.T) {
	t.Parallel()
	ks := keySet(t, newKey(t).Public())
	tests := []struct {
		name string
		cfg  token.VerifierConfig
	}{
		{name: "no keys", cfg: token.VerifierConfig{Audience: "istio-ca"}},
		{name: "empty key set", cfg: token.VerifierConfig{Keys: keySet(t), Audience: "istio-ca"}},
		{name: "no audience", cfg: token.VerifierConfig{Keys: ks}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if v, err := token.NewVerifier(tc.cfg); err == nil {
				t.Fatalf("NewVerifier() = %v, want error", v)
			}
		})
	}
}

// jwkOf describes pub as a JWK with base64url (unpadded, fixed-width for EC) parameters.
func jwkOf(t testing.TB, pub crypto.PublicKey, kid, use string) map[string]string {
	t.Helper()
	enc := base64.RawURLEncoding.EncodeToString
	var k map[string]string
	switch p := pub.(type) {
	case *rsa.PublicKey:
		k = map[string]string{"kty": "RSA", "n": enc(p.N.Bytes()), "e": enc(big.NewInt(int64(p.E)).Bytes())}
	case *ecdsa.PublicKey:
		point, err := p.Bytes() // 0x04 || X || Y
		if err != nil {
			t.Fatal(err)
		}
		size := (len(point) - 1) / 2
		k = map[string]string{"kty": "EC", "crv": map[int]string{32: "P-256", 48: "P-384"}[size], "x": enc(point[1 : 1+size]), "y": enc(point[1+size:])}
	default:
		t.Fatalf("jwkOf(%T)", pub)
	}
	if kid != "" {
		k["kid"] = kid
	}
	if use != "" {
		k["use"] = use
	}
	return k
}

func jwksJSON(t testing.TB, keys ...map[string]string) []byte {
	t.Helper()
	data, err := json.Marshal(map[string]any{"keys": keys})
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func parseKeySet(t testing.TB, data []byte) *token.KeySet {
	t.Helper()
	ks, err := token.ParseKeySet(data)
	if err != nil {
		t.Fatal(err)
	}
	return ks
}

func TestParseKeySetPEM(t *testing.T) {
	t.Parallel()
	a, b := newKey(t), newKey(t)
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	pubPEM := func(pub crypto.PublicKey) []byte {
		der, err := x509.MarshalPKIXPublicKey(pub)
		if err != nil {
			t.Fatal(err)
		}
		return pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der})
	}
	ks := parseKeySet(t, append(append(pubPEM(a.Public()), pubPEM(b.Public())...), testutil.CertPEM(root.Cert)...))
	if ks.Len() != 3 {
		t.Fatalf("Len() = %d, want 3", ks.Len())
	}
	v := verifier(t, ks, nil)
	for name, key := range map[string]crypto.Signer{"first": a, "second": b, "certificate": root.Key} {
		if _, err := v.Verify(mint(t, key, nil)); err != nil {
			t.Errorf("token of the %s key: %v", name, err)
		}
	}
	if _, err := v.Verify(mint(t, newKey(t), nil)); !errors.Is(err, token.ErrUnknownKey) {
		t.Errorf("token of another key: %v, want ErrUnknownKey", err)
	}
	if dup := parseKeySet(t, append(pubPEM(a.Public()), pubPEM(a.Public())...)); dup.Len() != 1 {
		t.Errorf("the same key twice gives Len() = %d, want 1", dup.Len())
	}
}

func TestParseKeySetJWKS(t *testing.T) {
	t.Parallel()
	ec := newKey(t)
	rsaKey, err := pki.GenerateKey(pki.RSA, 2048)
	if err != nil {
		t.Fatal(err)
	}
	ks := parseKeySet(t, jwksJSON(t, jwkOf(t, ec.Public(), "ec-1", "sig"), jwkOf(t, rsaKey.Public(), "rsa-1", "")))
	if ks.Len() != 2 {
		t.Fatalf("Len() = %d, want 2", ks.Len())
	}
	tests := []struct {
		name  string
		token string
		want  error
	}{
		{name: "EC by JWKS kid", token: sign(t, jwt.SigningMethodES256, ec, "ec-1", goodClaims())},
		{name: "RSA by JWKS kid", token: sign(t, jwt.SigningMethodRS256, rsaKey, "rsa-1", goodClaims())},
		{name: "EC without kid", token: sign(t, jwt.SigningMethodES256, ec, nil, goodClaims()), want: token.ErrNoKeyID},
		{name: "RSA without kid", token: sign(t, jwt.SigningMethodRS256, rsaKey, nil, goodClaims()), want: token.ErrNoKeyID},
		{name: "derived kid is not the JWKS kid", token: mint(t, ec, nil), want: token.ErrUnknownKey},
		{name: "EC signature under the RSA kid", token: sign(t, jwt.SigningMethodES256, ec, "rsa-1", goodClaims()), want: jwt.ErrTokenSignatureInvalid},
		{name: "RSA signature under the EC kid", token: sign(t, jwt.SigningMethodRS256, rsaKey, "ec-1", goodClaims()), want: jwt.ErrTokenSignatureInvalid},
	}
	v := verifier(t, ks, nil)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := v.Verify(tc.token)
			if (tc.want == nil && err != nil) || !errors.Is(err, tc.want) {
				t.Fatalf("Verify() error = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestParseKeySetJWKSDefaultsAndSkips(t *testing.T) {
	t.Parallel()
	sig, enc := newKey(t), newKey(t)
	ks := parseKeySet(t, jwksJSON(t, jwkOf(t, sig.Public(), "", ""), jwkOf(t, enc.Public(), "enc-1", "enc")))
	if ks.Len() != 1 {
		t.Fatalf("Len() = %d, want 1 (the enc key skipped)", ks.Len())
	}
	// A key for another use is skipped before it is parsed: its type need not be one we know.
	if ks := parseKeySet(t, jwksJSON(t, jwkOf(t, sig.Public(), "", ""), map[string]string{"kty": "OKP", "use": "enc", "crv": "X448", "x": "?"})); ks.Len() != 1 {
		t.Fatalf("Len() = %d, want 1 (the unparsable enc key skipped)", ks.Len())
	}
	v := verifier(t, ks, nil)
	if _, err := v.Verify(mint(t, sig, nil)); err != nil {
		t.Fatalf("token with kid = pki.KeyID of a kid-less JWK: %v", err)
	}
	if _, err := v.Verify(sign(t, jwt.SigningMethodES256, enc, "enc-1", goodClaims())); !errors.Is(err, token.ErrUnknownKey) {
		t.Fatalf("token signed by the enc key: %v, want ErrUnknownKey", err)
	}
	if _, err := v.Verify(sign(t, jwt.SigningMethodES256, enc, nil, goodClaims())); !errors.Is(err, jwt.ErrTokenSignatureInvalid) {
		t.Fatalf("kid-less token signed by the enc key: %v, want ErrTokenSignatureInvalid", err)
	}
}

func TestParseKeySetRefusals(t *testing.T) {
	t.Parallel()
	ecKey := newKey(t).(*ecdsa.PrivateKey)
	ec := jwkOf(t, ecKey.Public(), "k", "")
	with := func(edits ...string) map[string]string { // copy of ec with key=value edits
		k := map[string]string{}
		for name, v := range ec {
			k[name] = v
		}
		for _, e := range edits {
			name, v, _ := strings.Cut(e, "=")
			k[name] = v
		}
		return k
	}
	modulus := func(bits int) string { // an odd number of exactly bits bits; its factors don't matter here
		n := new(big.Int).Lsh(big.NewInt(1), uint(bits-1))
		return base64.RawURLEncoding.EncodeToString(n.Or(n, big.NewInt(1)).Bytes())
	}
	n := new(big.Int).Lsh(big.NewInt(1), 2047)
	evenModulus := base64.RawURLEncoding.EncodeToString(n.Or(n, big.NewInt(2)).Bytes())
	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	edPub, _, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	edDER, err := x509.MarshalPKIXPublicKey(edPub)
	if err != nil {
		t.Fatal(err)
	}
	enc := base64.RawURLEncoding.EncodeToString
	ecScalar, err := ecKey.Bytes()
	if err != nil {
		t.Fatal(err)
	}
	ecPrivate := enc(ecScalar)
	rsaPrivate := jwkOf(t, rsaKey.Public(), "r", "")
	rsaPrivate["d"], rsaPrivate["p"], rsaPrivate["q"] = enc(rsaKey.D.Bytes()), enc(rsaKey.Primes[0].Bytes()), enc(rsaKey.Primes[1].Bytes())
	tests := []struct {
		name      string
		data      []byte
		wantNoPEM bool
		wantInErr string
	}{
		{name: "empty JWKS", data: []byte(`{"keys":[]}`), wantInErr: "no signature keys"},
		{name: "no keys member", data: []byte(`{}`), wantInErr: "no signature keys"},
		{name: "only enc keys", data: jwksJSON(t, with("use=enc")), wantInErr: "no signature keys"},
		{name: "truncated JSON", data: []byte(`{"keys":[`), wantInErr: "JWKS"},
		{name: "oct key", data: jwksJSON(t, map[string]string{"kty": "oct", "k": "c2VjcmV0"}), wantInErr: "unsupported key type"},
		{name: "OKP key", data: jwksJSON(t, map[string]string{"kty": "OKP", "crv": "Ed25519", "x": "AAAA"}), wantInErr: "unsupported key type"},
		{name: "P-521", data: jwksJSON(t, with("crv=P-521")), wantInErr: "unsupported curve"},
		{name: "secp256k1", data: jwksJSON(t, with("crv=secp256k1")), wantInErr: "unsupported curve"},
		{name: "P-256 point on P-384", data: jwksJSON(t, with("crv=P-384")), wantInErr: "coordinates"},
		{name: "short x", data: jwksJSON(t, with("x=AAAA")), wantInErr: "coordinates"},
		{name: "padded x", data: jwksJSON(t, with("x="+ec["x"]+"=")), wantInErr: "decode"},
		{name: "point not on curve", data: jwksJSON(t, with("y="+ec["x"])), wantInErr: `kid "k"`},
		{name: "RSA 2047 bits", data: jwksJSON(t, map[string]string{"kty": "RSA", "n": modulus(2047), "e": "AQAB"}), wantInErr: "too small"},
		{name: "RSA 1024 bits", data: jwksJSON(t, map[string]string{"kty": "RSA", "n": modulus(1024), "e": "AQAB"}), wantInErr: "too small"},
		{name: "RSA exponent 1", data: jwksJSON(t, map[string]string{"kty": "RSA", "n": modulus(2048), "e": "AQ"}), wantInErr: "exponent"},
		{name: "RSA huge exponent", data: jwksJSON(t, map[string]string{"kty": "RSA", "n": modulus(2048), "e": "AQAAAAAB"}), wantInErr: "exponent"},
		// 2^64+65537: go-jose keeps the low 64 bits, 65537.
		{name: "RSA exponent past 64 bits", data: jwksJSON(t, map[string]string{"kty": "RSA", "n": modulus(2048), "e": "AQAAAAAAAQAB"}), wantInErr: "exponent"},
		{name: "RSA exponent past 64 bits, padded", data: jwksJSON(t, map[string]string{"kty": "RSA", "n": modulus(2048), "e": "AQAAAAAAAQAB=="}), wantInErr: "decode"},
		// go-jose parses private JWKs; a JWKS of issuers publishes public keys only.
		{name: "EC private key", data: jwksJSON(t, with("d="+ecPrivate)), wantInErr: "private key"},
		{name: "RSA private key", data: jwksJSON(t, rsaPrivate), wantInErr: "private key"},
		// go-jose's decoder: member names are case-sensitive, and a duplicate member is an error.
		{name: "upper-case member names", data: []byte(`{"keys":[{"KTY":"EC","CRV":"P-256","X":"` + ec["x"] + `","Y":"` + ec["y"] + `"}]}`), wantInErr: "unsupported key type"},
		{name: "duplicate member", data: []byte(`{"keys":[{"kty":"EC","kty":"EC","crv":"P-256","x":"` + ec["x"] + `","y":"` + ec["y"] + `"}]}`), wantInErr: "duplicate"},
		// crypto/rsa refuses such keys at every verification: they would fail each token.
		{name: "RSA even exponent", data: jwksJSON(t, map[string]string{"kty": "RSA", "n": modulus(2048), "e": "AQAA"}), wantInErr: "even"},
		{name: "RSA even modulus", data: jwksJSON(t, map[string]string{"kty": "RSA", "n": evenModulus, "e": "AQAB"}), wantInErr: "even"},
		{name: "PEM RSA even exponent", data: pem.EncodeToMemory(&pem.Block{Type: "RSA PUBLIC KEY", Bytes: x509.MarshalPKCS1PublicKey(&rsa.PublicKey{N: rsaKey.N, E: 65536})}), wantInErr: "even"},
		{name: "one bad key spoils the set", data: jwksJSON(t, ec, with("kid=bad", "crv=P-521")), wantInErr: `kid "bad"`},
		{name: "no PEM", data: []byte("hello"), wantNoPEM: true},
		{name: "empty file", data: nil, wantNoPEM: true},
		{name: "Ed25519 public key", data: pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: edDER}), wantInErr: "Ed25519"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ks, err := token.ParseKeySet(tc.data)
			if err == nil {
				t.Fatalf("ParseKeySet() = %d keys, want error", ks.Len())
			}
			if errors.Is(err, pki.ErrNoPEM) != tc.wantNoPEM {
				t.Fatalf("ParseKeySet() error %v: errors.Is(ErrNoPEM) != %v", err, tc.wantNoPEM)
			}
			if !strings.Contains(err.Error(), tc.wantInErr) {
				t.Fatalf("ParseKeySet() error %q does not mention %q", err, tc.wantInErr)
			}
		})
	}
}

func TestParseKeySetRSABoundary(t *testing.T) {
	t.Parallel()
	n := new(big.Int).Lsh(big.NewInt(1), 2047)
	n.Or(n, big.NewInt(1))
	ks, err := token.ParseKeySet(jwksJSON(t, map[string]string{"kty": "RSA", "kid": "r", "n": base64.RawURLEncoding.EncodeToString(n.Bytes()), "e": "AQAB"}))
	if err != nil || ks.Len() != 1 {
		t.Fatalf("ParseKeySet(RSA 2048 bits) = %v; want one key", err)
	}
}

func TestLoadKeySet(t *testing.T) {
	t.Parallel()
	key := newKey(t)
	der, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	testutil.WriteFiles(t, dir, map[string][]byte{
		"keys.pem":  pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}),
		"jwks.json": append([]byte("\n  "), jwksJSON(t, jwkOf(t, key.Public(), "", "sig"))...),
		"bad.json":  []byte(`{"keys":[]}`),
	})
	for _, name := range []string{"keys.pem", "jwks.json"} {
		ks, err := token.LoadKeySet(filepath.Join(dir, name))
		if err != nil {
			t.Fatalf("LoadKeySet(%s): %v", name, err)
		}
		if _, err := verifier(t, ks, nil).Verify(mint(t, key, nil)); err != nil {
			t.Fatalf("LoadKeySet(%s) does not verify the key's token: %v", name, err)
		}
	}
	for _, name := range []string{"bad.json", "missing.pem"} {
		if _, err := token.LoadKeySet(filepath.Join(dir, name)); err == nil {
			t.Fatalf("LoadKeySet(%s) succeeded", name)
		}
	}
}

// Two different keys under one kid are a rotation mistake: refuse the set rather than guess.
func TestParseKeySetRefusesConflictingKid(t *testing.T) {
	t.Parallel()
	a, b := newKey(t), newKey(t)
	_, err := token.ParseKeySet(jwksJSON(t, jwkOf(t, a.Public(), "shared", ""), jwkOf(t, b.Public(), "shared", "")))
	if err == nil || !strings.Contains(err.Error(), `"shared"`) {
		t.Fatalf("error %v, want one naming the shared kid", err)
	}
	if ks := parseKeySet(t, jwksJSON(t, jwkOf(t, a.Public(), "same", ""), jwkOf(t, a.Public(), "same", ""))); ks.Len() != 1 {
		t.Fatalf("the same key twice under one kid gives Len() = %d, want 1", ks.Len())
	}
}

// Attack: an RSA-1024 key in a PEM --jwt-keys file was accepted, while JWKS keys and CSRs needed
// 2048 bits: tokens signed with a factorable key were trusted. One rule (pki.ValidateRSAKeySize)
// now holds for every way a token key arrives, minting keys included.
func TestRSAKeySizeRuleForEveryTokenKey(t *testing.T) {
	t.Parallel()
	weak, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		t.Fatal(err)
	}
	// Too large costs every verification; only its encoding is needed.
	huge := &rsa.PublicKey{N: new(big.Int).Or(new(big.Int).Lsh(big.NewInt(1), 16383), big.NewInt(1)), E: 65537}
	pkix := func(pub crypto.PublicKey) []byte {
		der, err := x509.MarshalPKIXPublicKey(pub)
		if err != nil {
			t.Fatal(err)
		}
		return pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der})
	}
	weakCert := testutil.NewRootCA(t, testutil.CAOptions{Key: weak})
	for _, tc := range []struct {
		name string
		data []byte
		bits string
	}{
		{"PEM public key, RSA 1024", pkix(weak.Public()), "1024"},
		{"PEM PKCS#1 public key, RSA 1024", pem.EncodeToMemory(&pem.Block{Type: "RSA PUBLIC KEY", Bytes: x509.MarshalPKCS1PublicKey(&weak.PublicKey)}), "1024"},
		{"PEM certificate, RSA 1024", testutil.CertPEM(weakCert.Cert), "1024"},
		{"JWKS, RSA 1024", jwksJSON(t, jwkOf(t, weak.Public(), "weak", "")), "1024"},
		{"PEM public key, RSA 16384", pkix(huge), "16384"},
		{"JWKS, RSA 16384", jwksJSON(t, jwkOf(t, huge, "huge", "")), "16384"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ks, err := token.ParseKeySet(tc.data)
			if err == nil {
				t.Fatalf("ParseKeySet accepted %d keys", ks.Len())
			}
			if !strings.Contains(err.Error(), tc.bits) {
				t.Fatalf("ParseKeySet error %q does not name the size %s", err, tc.bits)
			}
		})
	}
	if _, err := token.NewKeySet(weak.Public()); err == nil {
		t.Fatal("NewKeySet accepted an RSA 1024 key")
	}
	if _, err := token.NewMinter(weak); err == nil {
		t.Fatal("NewMinter accepted an RSA 1024 key")
	}
	path := filepath.Join(t.TempDir(), "token-key.pem")
	testutil.WriteFiles(t, filepath.Dir(path), map[string][]byte{filepath.Base(path): testutil.KeyPEM(t, weak)})
	if _, err := token.LoadKey(path); err == nil || !strings.Contains(err.Error(), "1024") {
		t.Fatalf("LoadKey(RSA 1024) = %v, want a refusal naming the size", err)
	}
}

// Attack: a token whose exp was the JSON string "1773500000" was accepted: golang-jwt's
// NumericDate takes a string holding a number. Kubernetes always sends numbers, and a second
// encoding of a claim is a second way to read it (another parser may see no exp at all).
// exp, nbf and iat must be JSON numbers, whatever the case of their key.
func TestVerifierRefusesNumericDatesAsStrings(t *testing.T) {
	t.Parallel()
	key := newKey(t)
	kid := keyID(t, key.Public())
	v := verifier(t, keySet(t, key.Public()), nil)
	exp, iat := goodClaims()["exp"].(int64), goodClaims()["iat"].(int64)
	with := func(edits map[string]any) jwt.MapClaims {
		c := goodClaims()
		for name, value := range edits {
			if value == nil {
				delete(c, name)
			} else {
				c[name] = value
			}
		}
		return c
	}
	for _, tc := range []struct {
		name   string
		claims jwt.MapClaims
		ok     bool
	}{
		{"numbers (control)", goodClaims(), true},
		{"exp as a number with a fraction (control)", with(map[string]any{"exp": float64(exp) + 0.5}), true},
		{"exp as a string", with(map[string]any{"exp": strconv.FormatInt(exp, 10)}), false},
		{"nbf as a string", with(map[string]any{"nbf": strconv.FormatInt(iat, 10)}), false},
		{"iat as a string", with(map[string]any{"iat": strconv.FormatInt(iat, 10)}), false},
		{"EXP as a string instead of exp", with(map[string]any{"exp": nil, "EXP": strconv.FormatInt(exp, 10)}), false},
		{"Nbf as a string besides exp", with(map[string]any{"Nbf": strconv.FormatInt(iat, 10)}), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := v.Verify(sign(t, jwt.SigningMethodES256, key, kid, tc.claims))
			switch {
			case tc.ok && err != nil:
				t.Fatalf("Verify: %v, want accepted", err)
			case !tc.ok && !errors.Is(err, jwt.ErrTokenMalformed):
				t.Fatalf("Verify: %v, want ErrTokenMalformed", err)
			case !tc.ok && !strings.Contains(err.Error(), "not a number"):
				t.Fatalf("Verify: %q does not say the date is not a number", err)
			}
		})
	}
}
