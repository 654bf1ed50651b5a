package token_test

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// testNow is the fixed "now" of these tests; tokens are minted and verified around it.
func testNow() time.Time { return time.Date(2030, 3, 1, 12, 0, 0, 0, time.UTC) }

func newKey(t testing.TB) crypto.Signer {
	t.Helper()
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

func keyID(t testing.TB, pub crypto.PublicKey) string {
	t.Helper()
	kid, err := pki.KeyID(pub)
	if err != nil {
		t.Fatal(err)
	}
	return kid
}

// params are the MintParams of a typical token: default/sleep for istio-ca, an hour from testNow.
func params() token.MintParams {
	return token.MintParams{
		Issuer:         token.DefaultIssuer,
		Audiences:      []string{token.DefaultAudience},
		Namespace:      "default",
		ServiceAccount: "sleep",
		TTL:            time.Hour,
		Now:            testNow(),
	}
}

func mint(t testing.TB, key crypto.Signer, edit func(*token.MintParams)) string {
	t.Helper()
	p := params()
	if edit != nil {
		edit(&p)
	}
	tok, err := token.Mint(key, p)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// segment decodes part i (0 header, 1 payload) of a compact JWT as JSON, keeping numbers exact.
func segment(t *testing.T, tok string, i int) map[string]any {
	t.Helper()
	parts := strings.Split(tok, ".")
	if len(parts) != 3 {
		t.Fatalf("token has %d segments, want 3", len(parts))
	}
	raw, err := base64.RawURLEncoding.DecodeString(parts[i])
	if err != nil {
		t.Fatalf("segment %d is not unpadded base64url: %v", i, err)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var m map[string]any
	if err := dec.Decode(&m); err != nil {
		t.Fatalf("segment %d is not a JSON object: %v", i, err)
	}
	return m
}

func TestMintWireFormat(t *testing.T) {
	t.Parallel()
	p384, err := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	rsaKey, err := pki.GenerateKey(pki.RSA, 2048)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		key     crypto.Signer
		wantAlg string
	}{
		{name: "P-256", key: newKey(t), wantAlg: "ES256"},
		{name: "P-384", key: p384, wantAlg: "ES384"},
		{name: "RSA", key: rsaKey, wantAlg: "RS256"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			now := testNow().Add(700 * time.Millisecond) // fractions of a second are dropped
			tok := mint(t, tc.key, func(p *token.MintParams) {
				p.Now = now
				p.Audiences = []string{"istio-ca", "other"}
				p.ServiceAccountUID = "8c4f6f4e-1d2b-4b3e-9d7a-0f3c2b1a0e9d"
				p.TTL = 90 * time.Minute
			})
			header := segment(t, tok, 0)
			wantHeader := map[string]any{"alg": tc.wantAlg, "kid": keyID(t, tc.key.Public()), "typ": "JWT"}
			if !reflect.DeepEqual(header, wantHeader) {
				t.Errorf("header = %v, want %v", header, wantHeader)
			}
			claims := segment(t, tok, 1)
			iat := testNow().Unix()
			jti, _ := claims["jti"].(string)
			if !regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`).MatchString(jti) {
				t.Errorf("jti = %v, want a random (version 4) UUID", claims["jti"])
			}
			delete(claims, "jti")
			want := map[string]any{
				"iss": token.DefaultIssuer,
				"sub": "system:serviceaccount:default:sleep",
				"aud": []any{"istio-ca", "other"},
				"exp": json.Number(strconv.FormatInt(iat+90*60, 10)),
				"iat": json.Number(strconv.FormatInt(iat, 10)),
				"nbf": json.Number(strconv.FormatInt(iat, 10)),
				"kubernetes.io": map[string]any{
					"namespace":      "default",
					"serviceaccount": map[string]any{"name": "sleep", "uid": "8c4f6f4e-1d2b-4b3e-9d7a-0f3c2b1a0e9d"},
				},
			}
			if !reflect.DeepEqual(claims, want) {
				t.Errorf("claims =\n%v\nwant\n%v", claims, want)
			}
			// And the token is one our verifier accepts with that key.
			ks, err := token.NewKeySet(tc.key.Public())
			if err != nil {
				t.Fatal(err)
			}
			if _, err := verifier(t, ks, nil).Verify(tok); err != nil {
				t.Fatalf("Verify(minted %s token): %v", tc.wantAlg, err)
			}
		})
	}
}

func TestMintSingleAudienceIsArray(t *testing.T) {
	t.Parallel()
	aud := segment(t, mint(t, newKey(t), nil), 1)["aud"]
	if !reflect.DeepEqual(aud, []any{"istio-ca"}) {
		t.Fatalf("aud = %#v, want [\"istio-ca\"] as kube-apiserver writes it", aud)
	}
}

func TestMintRandomIDs(t *testing.T) {
	t.Parallel()
	key := newKey(t)
	a, b := segment(t, mint(t, key, nil), 1), segment(t, mint(t, key, nil), 1)
	if a["jti"] == b["jti"] {
		t.Errorf("two tokens share jti %v", a["jti"])
	}
	uid := func(c map[string]any) any {
		return c["kubernetes.io"].(map[string]any)["serviceaccount"].(map[string]any)["uid"]
	}
	if u, _ := uid(a).(string); len(u) != 36 || u == uid(b) {
		t.Errorf("service account uids %v and %v: want distinct random UUIDs when none is given", uid(a), uid(b))
	}
}

func TestMintRefusals(t *testing.T) {
	t.Parallel()
	_, edKey, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	p521, err := ecdsa.GenerateKey(elliptic.P521(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		key  crypto.Signer
		edit func(*token.MintParams)
	}{
		{name: "empty namespace", edit: func(p *token.MintParams) { p.Namespace = "" }},
		{name: "upper-case namespace", edit: func(p *token.MintParams) { p.Namespace = "Default" }},
		{name: "namespace with colon", edit: func(p *token.MintParams) { p.Namespace = "a:b" }},
		{name: "empty service account", edit: func(p *token.MintParams) { p.ServiceAccount = "" }},
		{name: "service account with colon", edit: func(p *token.MintParams) { p.ServiceAccount = "sleep:admin" }},
		{name: "zero TTL", edit: func(p *token.MintParams) { p.TTL = 0 }},
		{name: "negative TTL", edit: func(p *token.MintParams) { p.TTL = -time.Second }},
		{name: "nil audiences", edit: func(p *token.MintParams) { p.Audiences = nil }},
		{name: "empty audiences", edit: func(p *token.MintParams) { p.Audiences = []string{} }},
		{name: "Ed25519 key", key: edKey},
		{name: "P-521 key", key: p521},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			key := tc.key
			if key == nil {
				key = newKey(t)
			}
			p := params()
			if tc.edit != nil {
				tc.edit(&p)
			}
			if tok, err := token.Mint(key, p); err == nil || tok != "" {
				t.Fatalf("Mint() = %q, %v; want no token and an error", tok, err)
			}
		})
	}
}

func TestLoadOrCreateKey(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "token-key.pem")
	key, created, err := token.LoadOrCreateKey(path)
	if err != nil {
		t.Fatal(err)
	}
	if !created {
		t.Fatal("first LoadOrCreateKey() reported created=false")
	}
	if got := pki.DescribeKey(key.Public()); got != "ECDSA P-256" {
		t.Fatalf("created key is %s, want ECDSA P-256", got)
	}
	info, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if mode := info.Mode().Perm(); mode != 0o600 {
		t.Fatalf("key file mode = %o, want 600", mode)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if onDisk, err := pki.ParsePrivateKey(data); err != nil || !pki.PublicKeysEqual(onDisk.Public(), key.Public()) {
		t.Fatalf("file does not hold the returned key (%v)", err)
	}

	again, created, err := token.LoadOrCreateKey(path)
	if err != nil {
		t.Fatal(err)
	}
	if created {
		t.Fatal("second LoadOrCreateKey() reported created=true")
	}
	if !pki.PublicKeysEqual(again.Public(), key.Public()) {
		t.Fatal("second LoadOrCreateKey() returned a different key")
	}
	if after, _ := os.ReadFile(path); !bytes.Equal(after, data) {
		t.Fatal("second LoadOrCreateKey() rewrote the key file")
	}
}

func TestLoadOrCreateKeyRefusesUnusableFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	testutil.WriteFiles(t, dir, map[string][]byte{"garbage.pem": []byte("not a key")})
	if _, created, err := token.LoadOrCreateKey(filepath.Join(dir, "garbage.pem")); err == nil || created {
		t.Fatalf("LoadOrCreateKey(garbage) = created %v, %v; want an error and no new key", created, err)
	}
	if data, _ := os.ReadFile(filepath.Join(dir, "garbage.pem")); string(data) != "not a key" {
		t.Fatal("LoadOrCreateKey overwrote an existing file it could not read")
	}
	if _, _, err := token.LoadOrCreateKey(filepath.Join(dir, "missing-dir", "key.pem")); err == nil {
		t.Fatal("LoadOrCreateKey() in a missing directory succeeded")
	}
}

// A Minter reads its key once: tokens keep coming, all under the key's ID, after the file is gone.
func TestLoadMinter(t *testing.T) {
	t.Parallel()
	key := newKey(t)
	path := filepath.Join(t.TempDir(), "token-key.pem")
	testutil.WriteFiles(t, filepath.Dir(path), map[string][]byte{filepath.Base(path): testutil.KeyPEM(t, key)})
	m, err := token.LoadMinter(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	v, err := token.NewVerifier(token.VerifierConfig{Keys: keySet(t, key.Public()), Audience: token.DefaultAudience, Now: testNow})
	if err != nil {
		t.Fatal(err)
	}
	for _, sa := range []string{"a", "b"} {
		p := params()
		p.ServiceAccount = sa
		tok, err := m.Mint(p)
		if err != nil {
			t.Fatal(err)
		}
		if got := segment(t, tok, 0)["kid"]; got != keyID(t, key.Public()) {
			t.Fatalf("kid %v, want the key's ID", got)
		}
		claims, err := v.Verify(tok)
		if err != nil {
			t.Fatal(err)
		}
		if _, name, err := claims.ServiceAccount(); err != nil || name != sa {
			t.Fatalf("token for %q (%v), want %q", name, err, sa)
		}
	}

	if _, err := token.LoadMinter(path); !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), path) {
		t.Fatalf("LoadMinter of a missing key: %v, want ErrNotExist naming %s", err, path)
	}
	_, edKey, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := token.NewMinter(edKey); err == nil {
		t.Fatal("NewMinter accepted an Ed25519 key")
	}
}

func TestLoadKey(t *testing.T) {
	t.Parallel()
	ec := newKey(t)
	sec1, err := x509.MarshalECPrivateKey(ec.(*ecdsa.PrivateKey))
	if err != nil {
		t.Fatal(err)
	}
	_, edKey, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	dir := t.TempDir()
	testutil.WriteFiles(t, dir, map[string][]byte{
		"pkcs8.pem":   testutil.KeyPEM(t, ec),
		"sec1.pem":    pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: sec1}),
		"ed25519.pem": testutil.KeyPEM(t, edKey),
		"cert.pem":    testutil.CertPEM(root.Cert),
	})
	tests := []struct {
		file    string
		wantErr bool
	}{
		{file: "pkcs8.pem"},
		{file: "sec1.pem"},
		{file: "missing.pem", wantErr: true},
		{file: "ed25519.pem", wantErr: true},
		{file: "cert.pem", wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.file, func(t *testing.T) {
			t.Parallel()
			key, err := token.LoadKey(filepath.Join(dir, tc.file))
			if tc.wantErr {
				if err == nil {
					t.Fatalf("LoadKey(%s) = %s key, want error", tc.file, pki.DescribeKey(key.Public()))
				}
				if !strings.Contains(err.Error(), tc.file) {
					t.Errorf("LoadKey(%s) error %q does not name the file", tc.file, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !pki.PublicKeysEqual(key.Public(), ec.Public()) {
				t.Fatalf("LoadKey(%s) returned another key", tc.file)
			}
		})
	}
}

func TestSubject(t *testing.T) {
	t.Parallel()
	if got := token.Subject("istio-system", "ingress.gw"); got != "system:serviceaccount:istio-system:ingress.gw" {
		t.Fatalf("Subject() = %q", got)
	}
}

func TestClaimsServiceAccount(t *testing.T) {
	t.Parallel()
	k8s := func(ns, sa string) *token.KubernetesClaims {
		return &token.KubernetesClaims{Namespace: ns, ServiceAccount: token.Ref{Name: sa, UID: "u"}}
	}
	tests := []struct {
		name     string
		sub      string
		k8s      *token.KubernetesClaims
		wantNS   string
		wantSA   string
		wantFail bool
	}{
		{name: "sub only", sub: "system:serviceaccount:default:sleep", wantNS: "default", wantSA: "sleep"},
		{name: "agreeing block", sub: "system:serviceaccount:default:sleep", k8s: k8s("default", "sleep"), wantNS: "default", wantSA: "sleep"},
		{name: "dotted SA", sub: "system:serviceaccount:istio-system:gw.v1", wantNS: "istio-system", wantSA: "gw.v1"},
		{name: "empty sub", sub: "", wantFail: true},
		{name: "missing prefix", sub: "default:sleep", wantFail: true},
		{name: "user subject", sub: "system:user:default:sleep", wantFail: true},
		{name: "prefix in other case", sub: "System:ServiceAccount:default:sleep", wantFail: true},
		{name: "missing colon", sub: "system:serviceaccount:default", wantFail: true},
		{name: "extra colon", sub: "system:serviceaccount:default:sleep:x", wantFail: true},
		{name: "empty namespace", sub: "system:serviceaccount::sleep", wantFail: true},
		{name: "empty name", sub: "system:serviceaccount:default:", wantFail: true},
		{name: "invalid namespace", sub: "system:serviceaccount:Default:sleep", wantFail: true},
		{name: "dotted namespace", sub: "system:serviceaccount:a.b:sleep", wantFail: true},
		{name: "invalid name", sub: "system:serviceaccount:default:Sleep_1", wantFail: true},
		{name: "block with other namespace", sub: "system:serviceaccount:default:sleep", k8s: k8s("prod", "sleep"), wantFail: true},
		{name: "block with other name", sub: "system:serviceaccount:default:sleep", k8s: k8s("default", "admin"), wantFail: true},
		{name: "empty block", sub: "system:serviceaccount:default:sleep", k8s: &token.KubernetesClaims{}, wantFail: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := &token.Claims{Kubernetes: tc.k8s}
			c.Subject = tc.sub
			ns, sa, err := c.ServiceAccount()
			if tc.wantFail {
				if !errors.Is(err, token.ErrSubject) {
					t.Fatalf("ServiceAccount() = %q, %q, %v; want ErrSubject", ns, sa, err)
				}
				if ns != "" || sa != "" {
					t.Fatalf("ServiceAccount() returned %q, %q with its error", ns, sa)
				}
				return
			}
			if err != nil || ns != tc.wantNS || sa != tc.wantSA {
				t.Fatalf("ServiceAccount() = %q, %q, %v; want %q, %q", ns, sa, err, tc.wantNS, tc.wantSA)
			}
		})
	}
}
