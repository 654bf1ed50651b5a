package controlplane_test

import (
	"crypto"
	"crypto/ecdsa"
	"encoding/json"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/golang-jwt/jwt/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// oidcIssuer is an OIDC issuer's JWKS endpoint over TLS on loopback, whose keys the test rotates
// and which it can take down.
type oidcIssuer struct {
	srv     *httptest.Server
	mu      sync.Mutex
	keys    map[string]*ecdsa.PrivateKey
	down    bool
	fetches int
}

func newOIDCIssuer(t *testing.T) *oidcIssuer {
	t.Helper()
	o := &oidcIssuer{keys: map[string]*ecdsa.PrivateKey{}}
	o.srv = httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		o.mu.Lock()
		defer o.mu.Unlock()
		o.fetches++
		if o.down {
			http.Error(w, "down", http.StatusServiceUnavailable)
			return
		}
		var set jose.JSONWebKeySet
		for kid, k := range o.keys {
			set.Keys = append(set.Keys, jose.JSONWebKey{Key: k.Public(), KeyID: kid, Algorithm: "ES256", Use: "sig"})
		}
		_ = json.NewEncoder(w).Encode(set)
	}))
	t.Cleanup(o.srv.Close)
	return o
}

func (o *oidcIssuer) set(down bool, keys map[string]*ecdsa.PrivateKey) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.down, o.keys = down, keys
}

func (o *oidcIssuer) count() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.fetches
}

// rootFile writes the issuer's TLS certificate, the root the CA must trust for it.
func (o *oidcIssuer) rootFile(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "issuer-root.pem")
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: o.srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func ecdsaKey(t *testing.T) *ecdsa.PrivateKey {
	t.Helper()
	k, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	return k.(*ecdsa.PrivateKey)
}

func signClaims(t *testing.T, key crypto.Signer, kid string, claims jwt.MapClaims) string {
	t.Helper()
	tok := jwt.NewWithClaims(jwt.SigningMethodES256, claims)
	tok.Header["kid"] = kid
	s, err := tok.SignedString(key)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestExternalIssuer runs the CA with two JWT rules against an issuer written here: a VM's token
// of the issuer gets a certificate for the identity the rule maps it to, through the real server.
func TestExternalIssuer(t *testing.T) {
	t.Parallel()
	issuer := newOIDCIssuer(t)
	keyA, keyB := ecdsaKey(t), ecdsaKey(t)
	issuer.set(false, map[string]*ecdsa.PrivateKey{"a": keyA})
	clk := testutil.NewFakeClock(time.Now().Truncate(time.Second)) // TLS checks certificates on the real clock
	cfg := controlplanetest.Config(t)
	cfg.Clock = clk
	cfg.JWTRuleRootCert = issuer.rootFile(t)
	const iss, vmIss = "https://issuer.test", "https://vm-issuer.test"
	cfg.JWTRules = []token.Rule{
		{Issuer: iss, JWKSURI: issuer.srv.URL + "/jwks", Audiences: []string{"meshid-ca"}},
		{Issuer: vmIss, JWKSURI: issuer.srv.URL + "/vm/jwks", Audiences: []string{"meshid-ca"},
			ClaimToNamespace: "tenant", ClaimToServiceAccount: "workload"},
	}
	cp := controlplanetest.Start(t, cfg)
	rootFile := filepath.Join(cfg.StateDir, ca.RootCertFile)
	claims := func(issuer string, edit func(jwt.MapClaims)) jwt.MapClaims {
		now := clk.Now()
		c := jwt.MapClaims{"iss": issuer, "sub": "system:serviceaccount:default:demo", "aud": "meshid-ca",
			"iat": now.Unix(), "exp": now.Add(time.Hour).Unix(), "tenant": "team-a", "workload": "api"}
		if edit != nil {
			edit(c)
		}
		return c
	}
	request := func(tok, id string) error {
		chain, err := createCertificate(t, cp.GRPCAddr(), rootFile, tok, id)
		if err == nil && chain[0].URIs[0].String() != id {
			t.Fatalf("issued for %s, want %s", chain[0].URIs[0], id)
		}
		return err
	}
	const demo = "spiffe://cluster.local/ns/default/sa/demo"
	if err := request(signClaims(t, keyA, "a", claims(iss, nil)), demo); err != nil {
		t.Fatalf("a token of the issuer: %v", err)
	}
	if err := request(signClaims(t, keyA, "a", claims(vmIss, nil)), "spiffe://cluster.local/ns/team-a/sa/api"); err != nil {
		t.Fatalf("a token mapped by its claims: %v", err)
	}
	// A token of no rule's issuer is checked with the CA's own keys, as before.
	if err := request(controlplanetest.Token(t, cfg.StateDir, "default", "demo", clk.Now(), time.Hour), demo); err != nil {
		t.Fatalf("a token of the CA's own key: %v", err)
	}

	refused := func(name, tok, id string, want codes.Code, text string) {
		t.Helper()
		err := request(tok, id)
		if status.Code(err) != want || !strings.Contains(err.Error(), text) {
			t.Errorf("%s: %v, want %s saying %q", name, err, want, text)
		}
	}
	refused("wrong audience", signClaims(t, keyA, "a", claims(iss, func(c jwt.MapClaims) { c["aud"] = "istio-ca" })), demo,
		codes.Unauthenticated, "audience")
	refused("unknown issuer", signClaims(t, keyA, "a", claims("https://else.test", nil)), demo, codes.Unauthenticated, "unknown key")
	refused("expired", signClaims(t, keyA, "a", claims(iss, func(c jwt.MapClaims) { c["exp"] = clk.Now().Add(-time.Hour).Unix() })), demo,
		codes.Unauthenticated, "expired")
	refused("claims missing", signClaims(t, keyA, "a", claims(vmIss, func(c jwt.MapClaims) { delete(c, "tenant") })),
		"spiffe://cluster.local/ns/team-a/sa/api", codes.Unauthenticated, `no claim "tenant"`)
	refused("another identity", signClaims(t, keyA, "a", claims(iss, nil)), "spiffe://cluster.local/ns/default/sa/other",
		codes.PermissionDenied, "")

	// The issuer rotates to key B: a token naming kid b makes the CA fetch the keys again, at
	// most once a minute.
	issuer.set(false, map[string]*ecdsa.PrivateKey{"b": keyB})
	clk.Step(token.MinJWKSFetchInterval)
	if err := request(signClaims(t, keyB, "b", claims(iss, nil)), demo); err != nil {
		t.Fatalf("a token of the rotated key: %v", err)
	}
	fetches := issuer.count()
	refused("unknown kid within the minute", signClaims(t, ecdsaKey(t), "c", claims(iss, nil)), demo, codes.Unauthenticated, "unknown key")
	if n := issuer.count(); n != fetches {
		t.Fatalf("an unknown kid within a minute of the last fetch fetched again (%d, then %d)", fetches, n)
	}

	// The issuer goes down: a fetch fails, and the last keys stay.
	issuer.set(true, nil)
	clk.Step(token.MinJWKSFetchInterval)
	refused("unknown kid, issuer down", signClaims(t, ecdsaKey(t), "d", claims(iss, nil)), demo, codes.Unauthenticated, "unknown key")
	if issuer.count() == fetches {
		t.Fatal("an unknown kid a minute on did not fetch the keys")
	}
	if err := request(signClaims(t, keyB, "b", claims(iss, nil)), demo); err != nil {
		t.Fatalf("the last keys are not kept while the issuer is down: %v", err)
	}
	_, metrics := get(t, "http://"+cp.MonitoringAddr()+"/metrics")
	for _, want := range []string{
		`meshid_ca_jwks_refreshes_total{issuer="https://issuer.test",result="failed"} 1`,
		`meshid_ca_requests_refused_total{code="Unauthenticated",reason="token_audience"} 1`,
		`meshid_ca_requests_refused_total{code="Unauthenticated",reason="token_subject"} 1`,
		`meshid_ca_requests_refused_total{code="Unauthenticated",reason="token_expired"} 1`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}
