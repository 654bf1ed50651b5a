package ca_test

import (
	"crypto"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/golang-jwt/jwt/v5"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// The JWT-SVID key is created once, private, and reused at every start after: its kid, and so
// every JWT-SVID a validator holds, outlives a restart.
func TestJWTSVIDKeyPersistsAcrossRestarts(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	first, created, err := ca.LoadOrCreateJWTSVIDSigner(dir, "cluster.local", 0)
	if err != nil || !created {
		t.Fatalf("first start: created %v, %v", created, err)
	}
	info, err := os.Stat(ca.JWTSVIDKeyPath(dir))
	if err != nil {
		t.Fatal(err)
	}
	if info.Mode().Perm() != 0o600 {
		t.Fatalf("key mode %v, want 0600", info.Mode().Perm())
	}
	if _, err := os.Stat(ca.TokenKeyPath(dir)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the token key was touched: %v", err)
	}
	again, created, err := ca.LoadOrCreateJWTSVIDSigner(dir, "cluster.local", 0)
	if err != nil || created {
		t.Fatalf("restart: created %v, %v", created, err)
	}
	if first.KeyID(time.Now()) != again.KeyID(time.Now()) || string(first.Bundle(time.Now()).JWKS) != string(again.Bundle(time.Now()).JWKS) {
		t.Fatalf("kid %s after a restart, was %s", again.KeyID(time.Now()), first.KeyID(time.Now()))
	}
	// A token of the first verifies with the second's bundle.
	id, err := pki.NewSPIFFEID("cluster.local", "default", "demo")
	if err != nil {
		t.Fatal(err)
	}
	tok, _, err := first.SignJWTSVID(ca.JWTSVIDRequest{Identity: id, Audience: []string{"a"}, Now: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	pub, err := x509.ParsePKIXPublicKey(again.Bundle(time.Now()).Keys[0].PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := jwt.Parse(tok, func(*jwt.Token) (any, error) { return pub, nil }, jwt.WithValidMethods([]string{"ES256"})); err != nil {
		t.Fatal(err)
	}
}

// A JWT-SVID key another user could have written is refused, as the CA key is.
func TestJWTSVIDKeyNotOursIsRefused(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if _, _, err := ca.LoadOrCreateJWTSVIDSigner(dir, "cluster.local", 0); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(ca.JWTSVIDKeyPath(dir), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := ca.CheckStateDir(dir); !errors.Is(err, fsutil.ErrNotOwned) {
		t.Fatalf("CheckStateDir: %v, want ErrNotOwned", err)
	}
	if _, _, err := ca.LoadOrCreateJWTSVIDSigner(dir, "cluster.local", 0); !errors.Is(err, fsutil.ErrNotOwned) {
		t.Fatalf("load: %v, want ErrNotOwned", err)
	}
}

func TestJWTSVIDSignerPolicy(t *testing.T) {
	t.Parallel()
	for _, ttl := range []time.Duration{-time.Second, ca.MaxJWTSVIDTTL + time.Second} {
		if _, _, err := ca.LoadOrCreateJWTSVIDSigner(t.TempDir(), "cluster.local", ttl); !errors.Is(err, ca.ErrInvalidTTL) {
			t.Errorf("lifetime %s: %v, want ErrInvalidTTL", ttl, err)
		}
	}
	rsaKey, err := pki.GenerateKey(pki.RSA, 2048)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ca.NewJWTSVIDSigner(rsaKey, "cluster.local", time.Minute); !errors.Is(err, ca.ErrJWTSVIDKey) {
		t.Errorf("an RSA key: %v, want ErrJWTSVIDKey", err)
	}
	ecKey, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ca.NewJWTSVIDSigner(ecKey, "cluster.local", ca.MaxJWTSVIDTTL+time.Second); !errors.Is(err, ca.ErrInvalidTTL) {
		t.Errorf("a signer of too long a lifetime: %v, want ErrInvalidTTL", err)
	}
	rsaPEM, err := pki.EncodePrivateKey(rsaKey)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ca.ParseJWTSVIDKey(rsaPEM); !errors.Is(err, ca.ErrJWTSVIDKey) {
		t.Errorf("ParseJWTSVIDKey of an RSA key: %v, want ErrJWTSVIDKey", err)
	}
	genPEM, err := ca.GenerateJWTSVIDKey()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ca.ParseJWTSVIDKey(genPEM); err != nil {
		t.Errorf("ParseJWTSVIDKey of a generated key: %v", err)
	}
}

// A state dir's JWT-SVID key that is not ECDSA P-256 stops the start; it is not replaced.
func TestJWTSVIDKeyFileOfAnotherAlgorithmIsRefused(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	rsaKey, err := pki.GenerateKey(pki.RSA, 2048)
	if err != nil {
		t.Fatal(err)
	}
	rsaPEM, err := pki.EncodePrivateKey(rsaKey)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(ca.JWTSVIDKeyPath(dir), rsaPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := ca.LoadOrCreateJWTSVIDSigner(dir, "cluster.local", 0); !errors.Is(err, ca.ErrJWTSVIDKey) {
		t.Fatalf("load: %v, want ErrJWTSVIDKey", err)
	}
	if got, err := os.ReadFile(ca.JWTSVIDKeyPath(dir)); err != nil || string(got) != string(rsaPEM) {
		t.Fatalf("the refused key file was changed: %v", err)
	}
}

// verifyJWTSVID checks tok at now as a validator holding only bundle's JWKS does: by its kid.
func verifyJWTSVID(bundle ca.JWTBundle, tok string, now time.Time) error {
	var jwks jose.JSONWebKeySet
	if err := json.Unmarshal(bundle.JWKS, &jwks); err != nil {
		return err
	}
	_, err := jwt.Parse(tok, func(t *jwt.Token) (any, error) {
		kid, _ := t.Header["kid"].(string)
		if keys := jwks.Key(kid); len(keys) == 1 {
			return keys[0].Key, nil
		}
		return nil, fmt.Errorf("kid %q is not in the bundle", kid)
	}, jwt.WithValidMethods([]string{"ES256"}), jwt.WithAudience("db"), jwt.WithTimeFunc(func() time.Time { return now }))
	return err
}

func kidsOf(b ca.JWTBundle) []string {
	var kids []string
	for _, k := range b.Keys {
		kids = append(kids, k.ID)
	}
	return kids
}

// A key adopted while the CA runs is published at once, signs only from the time it is given
// (JWTSVIDKeyLead later, once every agent's bundle has it), and the key it replaces stays published
// until the last JWT-SVID it signed has expired.
func TestJWTSVIDSignerAdoptsAKey(t *testing.T) {
	t.Parallel()
	const ttl = 5 * time.Minute
	s, old := newRotatingSigner(t, ttl)
	t0 := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	oldKid := s.KeyID(t0)
	next := testutil.ECDSAKey(t)
	signsFrom := t0.Add(ca.JWTSVIDKeyLead)

	kid, changed, err := s.AdoptKey(next, old, signsFrom, t0)
	if err != nil || !changed || kid == oldKid {
		t.Fatalf("AdoptKey: kid %s (old %s), changed %v, %v", kid, oldKid, changed, err)
	}
	if again, changed, err := s.AdoptKey(next, old, signsFrom, t0.Add(time.Second)); err != nil || changed || again != kid {
		t.Fatalf("the same rotation again: kid %s, changed %v, %v; want no change", again, changed, err)
	}
	// Another replica's schedule for it moves it.
	later := signsFrom.Add(time.Minute)
	if _, changed, err := s.AdoptKey(next, old, later, t0.Add(2*time.Second)); err != nil || !changed {
		t.Fatalf("the rotation at another time: changed %v, %v; want it moved", changed, err)
	}
	if got := s.KeyID(signsFrom); got != oldKid {
		t.Fatalf("signing with %s before the moved time, want the old key", got)
	}
	if _, _, err := s.AdoptKey(next, old, signsFrom, t0.Add(3*time.Second)); err != nil {
		t.Fatal(err)
	}
	if got := kidsOf(s.Bundle(t0)); !slices.Equal(got, []string{oldKid, kid}) {
		t.Fatalf("bundle right after adopting: %v, want the old key and the new", got)
	}
	lastOld := signsFrom.Add(-time.Second)
	if got := s.KeyID(lastOld); got != oldKid {
		t.Fatalf("signing with %s before the lead is over, want the old key", got)
	}
	oldTok := sign(t, s, lastOld)
	if got := s.KeyID(signsFrom); got != kid {
		t.Fatalf("once the lead is over, signing with %s, want %s", got, kid)
	}
	newTok := sign(t, s, signsFrom)

	// An agent that fetched the bundle when the key was adopted verifies the new key's tokens.
	if err := verifyJWTSVID(s.Bundle(t0), newTok, signsFrom); err != nil {
		t.Fatalf("a token of the new key, with the bundle of the adoption: %v", err)
	}
	// The old key's last token verifies until it expires, and the old key goes with it.
	lastValid := lastOld.Add(ttl - time.Second)
	if err := verifyJWTSVID(s.Bundle(lastValid), oldTok, lastValid); err != nil {
		t.Fatalf("the old key's last token, just before it expires: %v", err)
	}
	// Kept JWTSVIDClockSkew longer, for replicas whose clocks are behind.
	if got := kidsOf(s.Bundle(signsFrom.Add(ttl + ca.JWTSVIDClockSkew - time.Second))); !slices.Equal(got, []string{oldKid, kid}) {
		t.Fatalf("bundle within the clock skew after the old key's tokens expired here: %v, want both", got)
	}
	if got := kidsOf(s.Bundle(signsFrom.Add(ttl + ca.JWTSVIDClockSkew))); !slices.Equal(got, []string{kid}) {
		t.Fatalf("bundle once every token of the old key has expired: %v, want only %s", got, kid)
	}

	rsaKey, err := pki.GenerateKey(pki.RSA, 2048)
	if err != nil {
		t.Fatal(err)
	}
	at := signsFrom.Add(time.Hour)
	if _, _, err := s.AdoptKey(rsaKey, next, at.Add(ca.JWTSVIDKeyLead), at); !errors.Is(err, ca.ErrJWTSVIDKey) {
		t.Fatalf("an RSA key: %v, want ErrJWTSVIDKey", err)
	}
	if got := kidsOf(s.Bundle(at)); !slices.Equal(got, []string{kid}) {
		t.Fatalf("bundle after a refused key: %v", got)
	}
}

// The key signing is never dropped, and no key signs before its time: a rotation cancelled (the
// old key put back) drops only the key that never signed, and the next rotation starts from the
// key signing. A key that signed here stays published whatever schedule comes later.
func TestJWTSVIDSignerKeepsTheKeysThatSigned(t *testing.T) {
	t.Parallel()
	const ttl = 5 * time.Minute
	s, a := newRotatingSigner(t, ttl)
	t0 := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	aKid := s.KeyID(t0)
	b := testutil.ECDSAKey(t)
	if _, _, err := s.AdoptKey(b, a, t0.Add(ca.JWTSVIDKeyLead), t0); err != nil {
		t.Fatal(err)
	}
	// The operator puts a back before b signs: b goes, a signs on.
	t1 := t0.Add(time.Minute)
	if _, changed, err := s.AdoptKey(a, a, t1, t1); err != nil || !changed {
		t.Fatalf("cancelling: changed %v, %v", changed, err)
	}
	if got := kidsOf(s.Bundle(t1)); !slices.Equal(got, []string{aKid}) {
		t.Fatalf("bundle after the rotation was cancelled: %v, want only %s", got, aKid)
	}
	// Then c: a signs until c's time.
	c := testutil.ECDSAKey(t)
	t2 := t1.Add(time.Minute)
	cKid, _, err := s.AdoptKey(c, a, t2.Add(ca.JWTSVIDKeyLead), t2)
	if err != nil {
		t.Fatal(err)
	}
	if got := s.KeyID(t2); got != aKid {
		t.Fatalf("signing with %s right after c was adopted, want %s until its lead is over", got, aKid)
	}
	if got := kidsOf(s.Bundle(t2)); !slices.Equal(got, []string{aKid, cKid}) {
		t.Fatalf("bundle %v, want %s and %s", got, aKid, cKid)
	}

	// A replica that started with only d (key.pem before the rotation was written) signs with it,
	// then learns the rotation from a: a signs until its time, and d stays published.
	d := testutil.ECDSAKey(t)
	late, err := ca.NewJWTSVIDSigner(d, "cluster.local", ttl)
	if err != nil {
		t.Fatal(err)
	}
	dKid := late.KeyID(t0)
	dTok := sign(t, late, t0)
	if _, _, err := late.AdoptKey(d, a, t0.Add(ca.JWTSVIDKeyLead), t0.Add(time.Second)); err != nil {
		t.Fatal(err)
	}
	if got := late.KeyID(t0.Add(time.Second)); got != aKid {
		t.Fatalf("signing with %s once the rotation is known, want %s until its time", got, aKid)
	}
	end := t0.Add(ttl - time.Second)
	if err := verifyJWTSVID(late.Bundle(end), dTok, end); err != nil {
		t.Fatalf("a token d signed before the rotation was known: %v", err)
	}
	if got := kidsOf(late.Bundle(t0.Add(time.Second))); !slices.Equal(got, []string{aKid, dKid}) {
		t.Fatalf("bundle %v, want %s and %s", got, aKid, dKid)
	}
	// Another rotation, from a, before d's time: d, scheduled again but having signed, stays.
	if _, _, err := late.AdoptKey(testutil.ECDSAKey(t), a, t0.Add(2*time.Minute+ca.JWTSVIDKeyLead), t0.Add(2*time.Minute)); err != nil {
		t.Fatal(err)
	}
	if err := verifyJWTSVID(late.Bundle(end), dTok, end); err != nil {
		t.Fatalf("a token d signed, after a rotation that does not name d: %v", err)
	}
}

// newRotatingSigner is a signer of a new key, and the key.
func newRotatingSigner(t *testing.T, ttl time.Duration) (*ca.JWTSVIDSigner, crypto.Signer) {
	t.Helper()
	key := testutil.ECDSAKey(t)
	s, err := ca.NewJWTSVIDSigner(key, "cluster.local", ttl)
	if err != nil {
		t.Fatal(err)
	}
	return s, key
}

// sign signs a JWT-SVID for audience db at now.
func sign(t *testing.T, s *ca.JWTSVIDSigner, now time.Time) string {
	t.Helper()
	id, err := pki.NewSPIFFEID("cluster.local", "default", "demo")
	if err != nil {
		t.Fatal(err)
	}
	tok, _, err := s.SignJWTSVID(ca.JWTSVIDRequest{Identity: id, Audience: []string{"db"}, Now: now})
	if err != nil {
		t.Fatal(err)
	}
	return tok
}
