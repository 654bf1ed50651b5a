package token_test

import (
	"crypto/ecdsa"
	"crypto/sha256"
	"encoding/base64"
	"math/big"
	"strings"
	"testing"
)

// FuzzVerify feeds arbitrary strings to one Verifier holding a key generated for this run. Verify
// must never panic, and it may accept only tokens that carry a genuine signature by that key, which
// here means tokens minted below for default/sleep.
func FuzzVerify(f *testing.F) {
	key := newKey(f).(*ecdsa.PrivateKey)
	v := verifier(f, keySet(f, key.Public()), nil)

	good := mint(f, key, nil)
	parts := strings.Split(good, ".")
	sig := []byte(parts[2])
	sig[5] = map[bool]byte{true: 'B', false: 'A'}[sig[5] == 'A']
	// The oracle must tell the seeds apart, or the property below proves nothing.
	if _, err := v.Verify(good); err != nil || !signedBy(&key.PublicKey, good) {
		f.Fatalf("minted seed: Verify() = %v, signedBy = %v", err, signedBy(&key.PublicKey, good))
	}
	if signedBy(&key.PublicKey, parts[0]+"."+parts[1]+"."+string(sig)) {
		f.Fatal("signedBy accepts a flipped signature")
	}
	f.Add(good)
	f.Add(parts[0] + "." + parts[1] + "." + string(sig))
	f.Add(b64JSON(f, map[string]string{"alg": "none", "typ": "JWT"}) + "." + parts[1] + ".")
	f.Add("")
	f.Add("a.b.c")

	f.Fuzz(func(t *testing.T, raw string) {
		claims, err := v.Verify(raw)
		if err != nil {
			if claims != nil {
				t.Fatalf("Verify() returned claims with error %v", err)
			}
			return
		}
		if ns, sa, err := claims.ServiceAccount(); err != nil || ns != "default" || sa != "sleep" {
			t.Fatalf("accepted token has service account %q/%q (%v), want default/sleep", ns, sa, err)
		}
		if !signedBy(&key.PublicKey, raw) {
			t.Fatalf("Verify accepted %q, which the test key did not sign", raw)
		}
	})
}

// signedBy checks, without golang-jwt, that raw's third segment is an ES256 signature by pub over
// its first two segments.
func signedBy(pub *ecdsa.PublicKey, raw string) bool {
	parts := strings.Split(raw, ".")
	if len(parts) != 3 {
		return false
	}
	sig, err := base64.RawURLEncoding.DecodeString(parts[2])
	if err != nil || len(sig) != 64 {
		return false
	}
	digest := sha256.Sum256([]byte(parts[0] + "." + parts[1]))
	return ecdsa.Verify(pub, digest[:], new(big.Int).SetBytes(sig[:32]), new(big.Int).SetBytes(sig[32:]))
}
