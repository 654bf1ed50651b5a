package pki_test

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

func TestGenerateKey(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		alg     pki.KeyAlgorithm
		bits    int
		want    string // pki.DescribeKey of the public key
		wantErr bool
	}{
		{name: "ECDSA", alg: pki.ECDSA, want: "ECDSA P-256"},
		{name: "empty means ECDSA", alg: "", want: "ECDSA P-256"},
		{name: "ECDSA ignores bits", alg: pki.ECDSA, bits: 4096, want: "ECDSA P-256"},
		{name: "RSA default size", alg: pki.RSA, want: "RSA 2048"},
		{name: "RSA 2048", alg: pki.RSA, bits: 2048, want: "RSA 2048"},
		{name: "RSA too small", alg: pki.RSA, bits: 1024, wantErr: true},
		{name: "RSA just too small", alg: pki.RSA, bits: 2047, wantErr: true},
		{name: "RSA too large", alg: pki.RSA, bits: 8193, wantErr: true},
		{name: "RSA negative", alg: pki.RSA, bits: -1, wantErr: true},
		{name: "unknown", alg: "DSA", wantErr: true},
		{name: "lower case is not parsed here", alg: "ecdsa", wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			key, err := pki.GenerateKey(tc.alg, tc.bits)
			if tc.wantErr {
				if err == nil {
					t.Fatalf("GenerateKey(%q, %d) = %s, want error", tc.alg, tc.bits, pki.DescribeKey(key.Public()))
				}
				return
			}
			if err != nil {
				t.Fatalf("GenerateKey(%q, %d) error: %v", tc.alg, tc.bits, err)
			}
			if got := pki.DescribeKey(key.Public()); got != tc.want {
				t.Fatalf("GenerateKey(%q, %d) = %s, want %s", tc.alg, tc.bits, got, tc.want)
			}
		})
	}
}

func TestValidateRSAKeySize(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		bits int
		ok   bool
	}{
		{pki.MinRSAKeySize, true},
		{3072, true},
		{pki.MaxRSAKeySize, true},
		{pki.MinRSAKeySize - 1, false},
		{pki.MaxRSAKeySize + 1, false},
		{1024, false},
		{0, false},
		{-2048, false},
	} {
		err := pki.ValidateRSAKeySize(tc.bits)
		if tc.ok {
			if err != nil {
				t.Errorf("ValidateRSAKeySize(%d) = %v, want nil", tc.bits, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), "[2048, 8192]") || !strings.Contains(err.Error(), strconv.Itoa(tc.bits)) {
			t.Errorf("ValidateRSAKeySize(%d) = %v, want an error naming the size and the range [2048, 8192]", tc.bits, err)
		}
	}
}

func TestGenerateKeyIsFresh(t *testing.T) {
	t.Parallel()
	a, b := newKey(t, pki.ECDSA), newKey(t, pki.ECDSA)
	if pki.PublicKeysEqual(a.Public(), b.Public()) {
		t.Fatal("two GenerateKey calls returned the same key")
	}
	if _, ok := a.(*ecdsa.PrivateKey); !ok {
		t.Fatalf("GenerateKey(ECDSA) = %T, want *ecdsa.PrivateKey", a)
	}
	if k, ok := newKey(t, pki.RSA).(*rsa.PrivateKey); !ok || k.E != 65537 {
		t.Fatalf("GenerateKey(RSA) = %T, want *rsa.PrivateKey with e=65537", k)
	}
}

func TestParseKeyAlgorithm(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in      string
		want    pki.KeyAlgorithm
		wantErr bool
	}{
		{in: "ECDSA", want: pki.ECDSA},
		{in: "ecdsa", want: pki.ECDSA},
		{in: " ec ", want: pki.ECDSA},
		{in: "ECC", want: pki.ECDSA},
		{in: "p256", want: pki.ECDSA},
		{in: "P-256", want: pki.ECDSA},
		{in: "RSA", want: pki.RSA},
		{in: "Rsa", want: pki.RSA},
		{in: "", wantErr: true},
		{in: "ed25519", wantErr: true},
		{in: "RSA2048", wantErr: true},
		{in: "P-384", wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			t.Parallel()
			got, err := pki.ParseKeyAlgorithm(tc.in)
			if (err != nil) != tc.wantErr {
				t.Fatalf("ParseKeyAlgorithm(%q) error = %v, want error %v", tc.in, err, tc.wantErr)
			}
			if got != tc.want {
				t.Fatalf("ParseKeyAlgorithm(%q) = %q, want %q", tc.in, got, tc.want)
			}
		})
	}
}

func TestKeyID(t *testing.T) {
	t.Parallel()
	p384, err := ecdsa.GenerateKey(elliptic.P384(), nil)
	if err != nil {
		t.Fatal(err)
	}
	edPub, _, err := ed25519.GenerateKey(nil)
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]crypto.PublicKey{
		"ECDSA P-256": newKey(t, pki.ECDSA).Public(),
		"ECDSA P-384": p384.Public(),
		"RSA":         newKey(t, pki.RSA).Public(),
		"Ed25519":     edPub,
	}
	unpaddedB64URL := regexp.MustCompile(`^[A-Za-z0-9_-]{43}$`)
	seen := map[string]string{}
	for name, pub := range keys {
		kid, err := pki.KeyID(pub)
		if err != nil {
			t.Fatalf("%s: KeyID() error: %v", name, err)
		}
		der, err := x509.MarshalPKIXPublicKey(pub)
		if err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(der)
		if want := base64.RawURLEncoding.EncodeToString(sum[:]); kid != want {
			t.Errorf("%s: KeyID() = %q, want base64url(sha256(PKIX)) %q", name, kid, want)
		}
		if !unpaddedB64URL.MatchString(kid) {
			t.Errorf("%s: KeyID() = %q, not 43 characters of unpadded base64url", name, kid)
		}
		if again, _ := pki.KeyID(pub); again != kid {
			t.Errorf("%s: KeyID() not deterministic: %q then %q", name, kid, again)
		}
		if other, dup := seen[kid]; dup {
			t.Errorf("%s and %s share KeyID %q", name, other, kid)
		}
		seen[kid] = name
	}
	if _, err := pki.KeyID("not a key"); err == nil {
		t.Error("KeyID(string) succeeded, want error")
	}
}

// A root is self-signed; a certificate it issued, or one whose issuer names itself but whose
// signature is another key's, is not.
func TestIsSelfSigned(t *testing.T) {
	t.Parallel()
	root := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "root"})
	inter := root.NewIntermediate(t, testutil.CAOptions{CommonName: "intermediate"})
	other := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "root"}) // same name, another key
	forged := *other.Cert
	forged.Signature = root.Cert.Signature
	for name, tc := range map[string]struct {
		cert *x509.Certificate
		want bool
	}{
		"root":                                 {root.Cert, true},
		"intermediate":                         {inter.Cert, false},
		"issuer names itself, wrong signature": {&forged, false},
	} {
		if got := pki.IsSelfSigned(tc.cert); got != tc.want {
			t.Errorf("%s: IsSelfSigned = %v, want %v", name, got, tc.want)
		}
	}
}
