package token_test

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/golang-jwt/jwt/v5"

	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

const testIssuer = "https://issuer.example"

// fakeJWKS serves the JWKS of the keys it holds now, or fails when down, and counts fetches.
type fakeJWKS struct {
	mu      sync.Mutex
	keys    map[string]crypto.Signer
	down    bool
	fetches int
	fetched chan struct{}
}

func newFakeJWKS() *fakeJWKS {
	return &fakeJWKS{keys: map[string]crypto.Signer{}, fetched: make(chan struct{}, 100)}
}

func (f *fakeJWKS) set(down bool, keys map[string]crypto.Signer) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.down, f.keys = down, keys
}

func (f *fakeJWKS) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fetches
}

func (f *fakeJWKS) fetch(context.Context) ([]byte, error) {
	f.mu.Lock()
	defer func() {
		f.mu.Unlock()
		f.fetched <- struct{}{}
	}()
	f.fetches++
	if f.down {
		return nil, errors.New("issuer down")
	}
	var set jose.JSONWebKeySet
	for kid, k := range f.keys {
		set.Keys = append(set.Keys, jose.JSONWebKey{Key: k.Public(), KeyID: kid, Algorithm: "ES256", Use: "sig"})
	}
	return json.Marshal(set)
}

func ecKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	k, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	return k.(*ecdsa.PrivateKey)
}

// issuerClaims are a good token's claims for rule at now: Kubernetes' sub, the audience meshid-ca.
func issuerClaims(now time.Time) jwt.MapClaims {
	return jwt.MapClaims{
		"iss": testIssuer, "sub": "system:serviceaccount:default:demo", "aud": []string{"other", "meshid-ca"},
		"iat": now.Unix(), "nbf": now.Unix(), "exp": now.Add(time.Hour).Unix(),
		"tenant": "team-a", "workload": "api",
	}
}

func newTestIssuer(t *testing.T, rule token.Rule, src *fakeJWKS, clk *testutil.FakeClock, refreshes *[]bool) *token.Issuer {
	t.Helper()
	var mu sync.Mutex
	iss, err := token.NewIssuer(token.IssuerConfig{Rule: rule, Fetch: src.fetch, Clock: clk, OnRefresh: func(ok bool) {
		mu.Lock()
		defer mu.Unlock()
		if refreshes != nil {
			*refreshes = append(*refreshes, ok)
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	return iss
}

func baseRule() token.Rule {
	return token.Rule{Issuer: testIssuer, JWKSURI: "https://issuer.example/jwks", Audiences: []string{"meshid-ca"}}
}

func TestIssuerVerifiesAndMaps(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(testNow())
	key := ecKey(t)
	src := newFakeJWKS()
	src.set(false, map[string]crypto.Signer{"a": key})
	claimRule := baseRule()
	claimRule.ClaimToNamespace, claimRule.ClaimToServiceAccount = "tenant", "workload"
	k8s := newTestIssuer(t, baseRule(), src, clk, nil)
	byClaims := newTestIssuer(t, claimRule, src, clk, nil)
	if err := k8s.Refresh(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := byClaims.Refresh(t.Context()); err != nil {
		t.Fatal(err)
	}
	now := clk.Now()
	good := sign(t, jwt.SigningMethodES256, key, "a", issuerClaims(now))
	if ns, sa, err := k8s.Verify(t.Context(), good); err != nil || ns != "default" || sa != "demo" {
		t.Fatalf("Kubernetes mapping: %s/%s, %v", ns, sa, err)
	}
	if ns, sa, err := byClaims.Verify(t.Context(), good); err != nil || ns != "team-a" || sa != "api" {
		t.Fatalf("claim mapping: %s/%s, %v", ns, sa, err)
	}

	edit := func(f func(jwt.MapClaims)) string {
		c := issuerClaims(now)
		f(c)
		return sign(t, jwt.SigningMethodES256, key, "a", c)
	}
	for name, tc := range map[string]struct {
		issuer *token.Issuer
		tok    string
		want   error
	}{
		"wrong audience":   {k8s, edit(func(c jwt.MapClaims) { c["aud"] = "istio-ca" }), jwt.ErrTokenInvalidAudience},
		"other issuer":     {k8s, edit(func(c jwt.MapClaims) { c["iss"] = "https://else" }), jwt.ErrTokenInvalidIssuer},
		"expired":          {k8s, edit(func(c jwt.MapClaims) { c["exp"] = now.Add(-time.Hour).Unix() }), jwt.ErrTokenExpired},
		"not yet valid":    {k8s, edit(func(c jwt.MapClaims) { c["nbf"] = now.Add(time.Hour).Unix() }), jwt.ErrTokenNotValidYet},
		"no exp":           {k8s, edit(func(c jwt.MapClaims) { delete(c, "exp") }), jwt.ErrTokenRequiredClaimMissing},
		"sub not an SA":    {k8s, edit(func(c jwt.MapClaims) { c["sub"] = "vm-1234" }), token.ErrSubject},
		"claim missing":    {byClaims, edit(func(c jwt.MapClaims) { delete(c, "tenant") }), token.ErrIdentityClaims},
		"claim not string": {byClaims, edit(func(c jwt.MapClaims) { c["workload"] = 7 }), token.ErrIdentityClaims},
		"claim bad name":   {byClaims, edit(func(c jwt.MapClaims) { c["tenant"] = "Team_A" }), token.ErrIdentityClaims},
		"other key":        {k8s, sign(t, jwt.SigningMethodES256, ecKey(t), "a", issuerClaims(now)), jwt.ErrTokenSignatureInvalid},
	} {
		if _, _, err := tc.issuer.Verify(t.Context(), tc.tok); !errors.Is(err, tc.want) {
			t.Errorf("%s: got %v, want %v", name, err, tc.want)
		}
	}
}

func TestIssuerPicksUpRotatedKeyRateLimited(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(testNow())
	oldKey, newKey := ecKey(t), ecKey(t)
	src := newFakeJWKS()
	src.set(false, map[string]crypto.Signer{"old": oldKey})
	var refreshes []bool
	iss := newTestIssuer(t, baseRule(), src, clk, &refreshes)
	// Before any fetch, a token makes the issuer fetch its keys.
	if _, _, err := iss.Verify(t.Context(), sign(t, jwt.SigningMethodES256, oldKey, "old", issuerClaims(clk.Now()))); err != nil {
		t.Fatalf("first token: %v", err)
	}
	src.set(false, map[string]crypto.Signer{"old": oldKey, "new": newKey})
	clk.Step(30 * time.Second)
	rotated := sign(t, jwt.SigningMethodES256, newKey, "new", issuerClaims(clk.Now()))
	if _, _, err := iss.Verify(t.Context(), rotated); !errors.Is(err, token.ErrUnknownKey) {
		t.Fatalf("within a minute of the last fetch: %v, want ErrUnknownKey", err)
	}
	if n := src.count(); n != 1 {
		t.Fatalf("%d fetches within the minute, want 1", n)
	}
	clk.Step(30 * time.Second)
	if _, _, err := iss.Verify(t.Context(), rotated); err != nil {
		t.Fatalf("a minute on, the unknown kid is fetched: %v", err)
	}
	if _, _, err := iss.Verify(t.Context(), rotated); err != nil || src.count() != 2 {
		t.Fatalf("again: %v after %d fetches, want 2", err, src.count())
	}
	if len(refreshes) != 2 || !refreshes[0] || !refreshes[1] {
		t.Fatalf("refreshes reported %v", refreshes)
	}
}

func TestIssuerKeepsLastKeysWhenDown(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(testNow())
	key := ecKey(t)
	src := newFakeJWKS()
	src.set(false, map[string]crypto.Signer{"a": key})
	var refreshes []bool
	iss := newTestIssuer(t, baseRule(), src, clk, &refreshes)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- iss.Run(ctx) }()
	<-src.fetched
	if err := clk.WaitForTimers(t.Context(), 1); err != nil {
		t.Fatal(err)
	}
	src.set(true, nil)
	clk.Advance(token.DefaultJWKSRefreshInterval)
	<-src.fetched
	if err := clk.WaitForTimers(t.Context(), 1); err != nil { // the refresh has ended: the next is armed
		t.Fatal(err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if len(refreshes) != 2 || !refreshes[0] || refreshes[1] {
		t.Fatalf("refreshes reported %v, want [true false]", refreshes)
	}
	if _, _, err := iss.Verify(t.Context(), sign(t, jwt.SigningMethodES256, key, "a", issuerClaims(clk.Now()))); err != nil {
		t.Fatalf("the last good keys are not kept: %v", err)
	}
}

func TestIssuerWithoutKeysIsUnavailable(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(testNow())
	src := newFakeJWKS()
	src.set(true, nil)
	iss := newTestIssuer(t, baseRule(), src, clk, nil)
	tok := sign(t, jwt.SigningMethodES256, ecKey(t), "a", issuerClaims(clk.Now()))
	if _, _, err := iss.Verify(t.Context(), tok); !errors.Is(err, token.ErrNoIssuerKeys) {
		t.Fatalf("got %v, want ErrNoIssuerKeys", err)
	}
}

func TestParseAndValidateRules(t *testing.T) {
	t.Parallel()
	rules, err := token.ParseRules(`{"issuer": "https://a", "jwksUri": "https://a/keys", "audiences": ["x"]}`)
	if err != nil || len(rules) != 1 || rules[0].JWKSURI != "https://a/keys" || token.ValidateRules(rules) != nil {
		t.Fatalf("one rule as istiod reads it: %+v, %v", rules, err)
	}
	rules, err = token.ParseRules(`[{"issuer": "https://a", "jwksUri": "https://a/keys", "audiences": ["x"]},
		{"issuer": "https://b", "jwksUri": "https://b/keys", "audiences": ["y"], "claimToNamespace": "ns", "claimToServiceAccount": "sa"}]`)
	if err != nil || len(rules) != 2 || rules[1].ClaimToServiceAccount != "sa" || token.ValidateRules(rules) != nil {
		t.Fatalf("a list: %+v, %v", rules, err)
	}
	for text, want := range map[string]string{
		`[{"issuer": "a", "jwks": "{}"}]`: `unknown field "jwks"`,
		`[{"issuer": 1}]`:                 "issuer",
		`{"issuer": "a"} x`:               "after the JSON value",
	} {
		if _, err := token.ParseRules(text); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseRules(%s) = %v, want an error naming %q", text, err, want)
		}
	}
	for text, want := range map[string][]string{
		`[{"jwksUri": "https://a/keys", "audiences": ["x"]}]`:                                                                            {`rule 1 (issuer "")`, "issuer: required"},
		`[{"issuer": "i", "jwksUri": "http://a/keys", "audiences": ["x"]}]`:                                                              {`rule 1 (issuer "i")`, "jwksUri", "https"},
		`[{"issuer": "i", "audiences": ["x"]}]`:                                                                                          {"jwksUri: required"},
		`[{"issuer": "i", "jwksUri": "https://a/k"}]`:                                                                                    {"audiences"},
		`[{"issuer": "i", "jwksUri": "https://a/k", "audiences": ["x"], "claimToNamespace": "n"}]`:                                       {"claimToServiceAccount"},
		`[{"issuer": "i", "jwksUri": "https://a/k", "audiences": ["x"]}, {"issuer": "i", "jwksUri": "https://a/k", "audiences": ["x"]}]`: {`rule 2 (issuer "i")`, "rule 1"},
	} {
		rules, err := token.ParseRules(text)
		if err != nil {
			t.Fatal(err)
		}
		err = token.ValidateRules(rules)
		for _, w := range want {
			if err == nil || !strings.Contains(err.Error(), w) {
				t.Errorf("ValidateRules(%s) = %v, want %q", text, err, w)
			}
		}
	}
}
