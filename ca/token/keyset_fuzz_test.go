package token

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"maps"
	"math/big"
	"slices"
	"strings"
	"testing"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// FuzzParseKeySet feeds arbitrary bytes to ParseKeySet, as the --jwt-keys file (PEM public keys
// or certificates, or a JWKS document). A refusal is an error with a message and no set. An
// accepted set holds at least one key, every one of a type and size tokens may be signed with
// (ECDSA P-256/P-384, RSA 2048-8192), each under one key ID; keys read from PEM are named as
// kube-apiserver names them; every key survives PKIX encoding, so the same set written as PEM
// loads again. A verifier over the set looks up exactly its IDs: a token naming one of them is
// refused for its signature, never as signed by an unknown key, and one naming another ID is
// refused as unknown.
func FuzzParseKeySet(f *testing.F) {
	p256, p384 := newECKey(f, elliptic.P256()), newECKey(f, elliptic.P384())
	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		f.Fatal(err)
	}
	_, edKey, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		f.Fatal(err)
	}
	p224 := newECKey(f, elliptic.P224())
	root := testutil.NewRootCA(f, testutil.CAOptions{CommonName: "fuzz issuer"})
	pkix := func(pub crypto.PublicKey) []byte {
		der, err := x509.MarshalPKIXPublicKey(pub)
		if err != nil {
			f.Fatal(err)
		}
		return pem.EncodeToMemory(&pem.Block{Type: pki.BlockPublicKey, Bytes: der})
	}
	pkcs1 := pem.EncodeToMemory(&pem.Block{Type: pki.BlockRSAPublicKey, Bytes: x509.MarshalPKCS1PublicKey(&rsaKey.PublicKey)})
	for _, seed := range [][]byte{
		pkix(p256.Public()),
		append(append(pkix(p256.Public()), pkix(p384.Public())...), pkcs1...),
		append(pkix(p256.Public()), pkix(p256.Public())...),
		testutil.CertPEM(root.Cert),
		pkix(edKey.Public()),
		pkix(p224.Public()),
		[]byte("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"),
		jwks(f, jwkOf(f, p256.Public(), "a"), jwkOf(f, p384.Public(), ""), jwkOf(f, &rsaKey.PublicKey, "r")),
		jwks(f, jwkOf(f, p256.Public(), "a"), jwkOf(f, p384.Public(), "a")),
		jwks(f, jwkOf(f, p256.Public(), "a"), jwkOf(f, p256.Public(), "a")),
		jwks(f, map[string]string{"kty": "EC", "crv": "P-256", "x": "AA", "y": "AA"}),
		jwks(f, map[string]string{"kty": "RSA", "n": "AQAB", "e": "AQAB"}),
		jwks(f, map[string]string{"kty": "RSA", "n": jwkOf(f, &rsaKey.PublicKey, "")["n"], "e": "AQAA"}),
		jwks(f, map[string]string{"kty": "oct", "k": "c2VjcmV0"}),
		jwks(f, map[string]string{"kty": "EC", "use": "enc", "crv": "P-521"}),
		[]byte(`{"keys": []}`),
		[]byte(`{`),
	} {
		f.Add(seed)
	}

	f.Fuzz(func(t *testing.T, data []byte) {
		ks, err := ParseKeySet(data)
		if err != nil {
			if ks != nil || err.Error() == "" {
				t.Fatalf("refused with %q, and a set %v", err, ks)
			}
			return
		}
		if ks.Len() == 0 || len(ks.ids) != len(ks.keys) {
			t.Fatalf("accepted a set of %d IDs and %d keys", len(ks.ids), len(ks.keys))
		}
		isJWKS := strings.HasPrefix(strings.TrimSpace(string(data)), "{")
		var asPEM []byte
		for _, kid := range ks.ids {
			key, ok := ks.keys[kid]
			if !ok || kid == "" {
				t.Fatalf("ID %q names no key", kid)
			}
			checkTokenKey(t, kid, key)
			if !isJWKS {
				if want, err := pki.KeyID(key); err != nil || kid != want {
					t.Errorf("a PEM key named %q, want %q (%v)", kid, want, err)
				}
			}
			der, err := x509.MarshalPKIXPublicKey(key)
			if err != nil {
				t.Fatalf("accepted key %q cannot be written as PKIX: %v", kid, err)
			}
			asPEM = append(asPEM, pem.EncodeToMemory(&pem.Block{Type: pki.BlockPublicKey, Bytes: der})...)
		}
		again, err := ParseKeySet(asPEM)
		if err != nil {
			t.Fatalf("the accepted set, written as PEM, is refused: %v", err)
		}
		for _, key := range ks.keys {
			if !slices.ContainsFunc(slices.Collect(maps.Values(again.keys)), func(k crypto.PublicKey) bool { return pki.PublicKeysEqual(k, key) }) {
				t.Fatalf("a key of the set is not in the set written as PEM")
			}
		}
		checkKeyLookup(t, ks)
	})
}

// checkTokenKey fails unless key is one signingMethod accepts, and of its rule.
func checkTokenKey(t *testing.T, kid string, key crypto.PublicKey) {
	t.Helper()
	if _, err := signingMethod(key); err != nil {
		t.Fatalf("key %q: accepted, yet %v", kid, err)
	}
	switch k := key.(type) {
	case *ecdsa.PublicKey:
		if k.Curve != elliptic.P256() && k.Curve != elliptic.P384() {
			t.Fatalf("key %q: ECDSA %s", kid, k.Curve.Params().Name)
		}
	case *rsa.PublicKey:
		if bits := k.N.BitLen(); bits < pki.MinRSAKeySize || bits > pki.MaxRSAKeySize {
			t.Fatalf("key %q: RSA %d", kid, bits)
		}
		if k.N.Bit(0) == 0 || k.E < 3 || k.E&1 == 0 {
			t.Fatalf("key %q: RSA with exponent %d and an odd modulus: %v, which crypto/rsa refuses", kid, k.E, k.N.Bit(0) == 1)
		}
	default:
		t.Fatalf("key %q: a %T", kid, key)
	}
}

// checkKeyLookup verifies, through a Verifier, tokens that name each ID of ks with a signature
// that cannot be right, and one that names an ID ks does not hold.
func checkKeyLookup(t *testing.T, ks *KeySet) {
	t.Helper()
	v, err := NewVerifier(VerifierConfig{Keys: ks, Audience: DefaultAudience})
	if err != nil {
		t.Fatal(err)
	}
	forged := func(alg string, kid any) string {
		header := map[string]any{"alg": alg, "typ": "JWT"}
		if kid != nil {
			header["kid"] = kid
		}
		h, err := json.Marshal(header)
		if err != nil {
			t.Fatal(err)
		}
		enc := base64.RawURLEncoding.EncodeToString
		return enc(h) + "." + enc([]byte(`{"aud":"`+DefaultAudience+`","exp":4102444800}`)) + "." + enc(make([]byte, 64))
	}
	for _, kid := range ks.ids {
		method, err := signingMethod(ks.keys[kid])
		if err != nil {
			t.Fatal(err)
		}
		if _, err := v.Verify(forged(method.Alg(), kid)); err == nil || errors.Is(err, ErrUnknownKey) || errors.Is(err, ErrNoKeyID) {
			t.Fatalf("a token naming key %q: %v, want a refused signature", kid, err)
		}
	}
	unknown := "not-a-kid"
	for _, ok := ks.keys[unknown]; ok; _, ok = ks.keys[unknown] {
		unknown += "x"
	}
	if _, err := v.Verify(forged("ES256", unknown)); !errors.Is(err, ErrUnknownKey) {
		t.Fatalf("a token naming no key of the set: %v, want ErrUnknownKey", err)
	}
	_, err = v.Verify(forged("ES256", nil))
	if noKid := errors.Is(err, ErrNoKeyID); noKid != (ks.Len() > 1) || err == nil {
		t.Fatalf("a token without kid, %d keys: %v", ks.Len(), err)
	}
}

func newECKey(t testing.TB, curve elliptic.Curve) *ecdsa.PrivateKey {
	t.Helper()
	key, err := ecdsa.GenerateKey(curve, rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

// jwkOf is pub as a JWK, named kid (none when empty).
func jwkOf(t testing.TB, pub crypto.PublicKey, kid string) map[string]string {
	t.Helper()
	enc := base64.RawURLEncoding.EncodeToString
	k := map[string]string{}
	switch pub := pub.(type) {
	case *ecdsa.PublicKey:
		raw, err := pub.Bytes()
		if err != nil {
			t.Fatal(err)
		}
		size := (len(raw) - 1) / 2
		k["kty"], k["crv"], k["x"], k["y"] = "EC", pub.Curve.Params().Name, enc(raw[1:1+size]), enc(raw[1+size:])
	case *rsa.PublicKey:
		k["kty"], k["n"], k["e"] = "RSA", enc(pub.N.Bytes()), enc(big.NewInt(int64(pub.E)).Bytes())
	default:
		t.Fatalf("no JWK for %T", pub)
	}
	if kid != "" {
		k["kid"] = kid
	}
	return k
}

func jwks(t testing.TB, keys ...map[string]string) []byte {
	t.Helper()
	data, err := json.Marshal(map[string]any{"keys": keys})
	if err != nil {
		t.Fatal(err)
	}
	return data
}
