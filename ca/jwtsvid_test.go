package ca_test

import (
	"crypto/x509"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/pki"
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
	if first.KeyID() != again.KeyID() || string(first.Bundle().JWKS) != string(again.Bundle().JWKS) {
		t.Fatalf("kid %s after a restart, was %s", again.KeyID(), first.KeyID())
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
	pub, err := x509.ParsePKIXPublicKey(again.Bundle().Keys[0].PublicKey)
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
