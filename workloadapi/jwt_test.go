package workloadapi_test

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/golang-jwt/jwt/v5"
	"github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/workloadapi"
)

const (
	jwtTTL        = 10 * time.Minute
	bundleRefresh = time.Minute
)

// fakeIssuer signs JWT-SVIDs as the CA does (ES256, kid, sub, aud, iat, exp on the clock), for
// one identity, and publishes its key; the test rotates the key and makes calls fail.
type fakeIssuer struct {
	clock *testutil.FakeClock

	mu        sync.Mutex
	id        string
	key       *ecdsa.PrivateKey
	kid       string
	mints     int
	fetches   int
	mintErr   error
	fetchErr  error
	audiences [][]string
	rotations int
}

func newFakeIssuer(t *testing.T, clk *testutil.FakeClock) *fakeIssuer {
	t.Helper()
	f := &fakeIssuer{clock: clk, id: workloadID}
	f.rotate(t)
	return f
}

func newES256Key(t *testing.T) *ecdsa.PrivateKey {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

// rotate gives the issuer a new key.
func (f *fakeIssuer) rotate(t *testing.T) {
	t.Helper()
	key := newES256Key(t)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rotations++
	f.key, f.kid = key, "kid-"+strconv.Itoa(f.rotations)
}

func (f *fakeIssuer) MintJWTSVID(_ context.Context, audience []string) (workloadapi.JWTSVID, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.mints++
	f.audiences = append(f.audiences, audience)
	if f.mintErr != nil {
		return workloadapi.JWTSVID{}, f.mintErr
	}
	now := f.clock.Now()
	tok, err := signJWT(f.key, f.kid, jwt.MapClaims{"sub": f.id, "aud": audience, "iat": now.Unix(), "exp": now.Add(jwtTTL).Unix()})
	return workloadapi.JWTSVID{Token: tok, SPIFFEID: f.id}, err
}

func (f *fakeIssuer) FetchJWTBundle(context.Context) (workloadapi.JWTBundle, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fetches++
	if f.fetchErr != nil {
		return workloadapi.JWTBundle{}, f.fetchErr
	}
	jwks, err := json.Marshal(jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: &f.key.PublicKey, KeyID: f.kid, Algorithm: "ES256", Use: "jwt-svid"}}})
	if err != nil {
		return workloadapi.JWTBundle{}, err
	}
	return workloadapi.JWTBundle{TrustDomain: "spiffe://cluster.local", JWKS: jwks, Keys: map[string]crypto.PublicKey{f.kid: &f.key.PublicKey}}, nil
}

func (f *fakeIssuer) counts() (mints, fetches int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.mints, f.fetches
}

func (f *fakeIssuer) current() (*ecdsa.PrivateKey, string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.key, f.kid
}

func signJWT(key crypto.Signer, kid string, claims jwt.MapClaims) (string, error) {
	tok := jwt.NewWithClaims(jwt.SigningMethodES256, claims)
	if kid != "" {
		tok.Header["kid"] = kid
	}
	return tok.SignedString(key)
}

// startJWT serves the Workload API with the workload's identity published and iss as its CA.
func startJWT(t *testing.T) (*harness, *fakeIssuer, *testutil.FakeClock) {
	t.Helper()
	clk := testutil.NewFakeClock(time.Now())
	iss := newFakeIssuer(t, clk)
	secrets := newFakeSecrets()
	p := newPKI(t)
	secrets.Publish(p.workload(t, workloadID))
	secrets.Publish(bundle(p.root.Cert))
	h := start(t, secrets, func(c *workloadapi.Config) {
		c.Clock, c.JWT, c.JWTBundleRefresh = clk, iss, bundleRefresh
	})
	return h, iss, clk
}

func fetchJWT(t *testing.T, h *harness, audience ...string) string {
	t.Helper()
	resp, err := h.client.FetchJWTSVID(ctx(t), &workload.JWTSVIDRequest{Audience: audience})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.GetSvids()) != 1 || resp.GetSvids()[0].GetSpiffeId() != workloadID {
		t.Fatalf("response %v: want one JWT-SVID of %s", resp, workloadID)
	}
	return resp.GetSvids()[0].GetSvid()
}

// A JWT-SVID is reused for the same identity and audience set (in any order, duplicates
// aside) until half its life has passed; another audience set gets its own.
func TestFetchJWTSVIDCache(t *testing.T) {
	t.Parallel()
	h, iss, clk := startJWT(t)
	first := fetchJWT(t, h, "b", "a")
	if again := fetchJWT(t, h, "a", "b", "a"); again != first {
		t.Fatal("the same audience set got a new JWT-SVID")
	}
	if other := fetchJWT(t, h, "a"); other == first {
		t.Fatal("another audience set got the same JWT-SVID")
	}
	if mints, _ := iss.counts(); mints != 2 {
		t.Fatalf("%d JWT-SVIDs signed, want 2", mints)
	}
	clk.Advance(jwtTTL/2 - time.Second)
	if again := fetchJWT(t, h, "a", "b"); again != first {
		t.Fatal("a JWT-SVID with more than half its life left was not reused")
	}
	clk.Advance(time.Second)
	if renewed := fetchJWT(t, h, "a", "b"); renewed == first {
		t.Fatal("a JWT-SVID half through its life was reused")
	}
	if mints, _ := iss.counts(); mints != 3 {
		t.Fatalf("%d JWT-SVIDs signed, want 3", mints)
	}
	if got := iss.audiences[0]; strings.Join(got, ",") != "a,b" {
		t.Fatalf("the CA was asked for %v, want the set [a b]", got)
	}
	if got := h.metric(t, "meshid_agent_workload_api_jwt_svids_total", map[string]string{"source": "cache"}); got != 2 {
		t.Fatalf("%v JWT-SVIDs from the cache, want 2", got)
	}
}

// Refusals of FetchJWTSVID: no audience (InvalidArgument, as the standard says), another SPIFFE
// ID than the caller's, and the CA's refusal or absence; nothing signed for the first ones.
func TestFetchJWTSVIDRefusals(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name   string
		req    *workload.JWTSVIDRequest
		setup  func(*fakeIssuer)
		code   codes.Code
		reason string
		mints  int
	}{
		{"no audience", &workload.JWTSVIDRequest{}, nil, codes.InvalidArgument, "missing_audience", 0},
		{"an empty audience", &workload.JWTSVIDRequest{Audience: []string{"a", ""}}, nil, codes.InvalidArgument, "missing_audience", 0},
		{"another SPIFFE ID", &workload.JWTSVIDRequest{Audience: []string{"a"}, SpiffeId: "spiffe://cluster.local/ns/kube-system/sa/admin"}, nil, codes.PermissionDenied, "other_spiffe_id", 0},
		{"the CA signs another identity", &workload.JWTSVIDRequest{Audience: []string{"a"}}, func(f *fakeIssuer) { f.id = "spiffe://cluster.local/ns/other/sa/x" }, codes.PermissionDenied, "other_spiffe_id", 1},
		{"the CA refuses the agent", &workload.JWTSVIDRequest{Audience: []string{"a"}}, func(f *fakeIssuer) {
			// As the CA client wraps it.
			f.mintErr = fmt.Errorf("%w: the CA did not accept the token: %w", errors.New("CA rejected the request"), status.Error(codes.Unauthenticated, "token expired"))
		}, codes.PermissionDenied, "jwt_svid_not_issued", 1},
		{"the CA is down", &workload.JWTSVIDRequest{Audience: []string{"a"}}, func(f *fakeIssuer) { f.mintErr = errors.New("CA unreachable") }, codes.Unavailable, "jwt_svid_not_issued", 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			h, iss, _ := startJWT(t)
			if tt.setup != nil {
				iss.mu.Lock()
				tt.setup(iss)
				iss.mu.Unlock()
			}
			_, err := h.client.FetchJWTSVID(ctx(t), tt.req)
			if got := status.Code(err); got != tt.code {
				t.Fatalf("code %v (%v), want %v", got, err, tt.code)
			}
			if n := h.refusals(t, tt.reason, tt.code.String()); n != 1 {
				t.Fatalf("%v refusals counted under %s, want 1", n, tt.reason)
			}
			if strings.Count(h.logs.String(), "reason="+tt.reason) != 1 {
				t.Fatalf("refusal not logged once:\n%s", h.logs.String())
			}
			if mints, _ := iss.counts(); mints != tt.mints {
				t.Fatalf("%d JWT-SVIDs signed, want %d", mints, tt.mints)
			}
		})
	}
}

// ValidateJWTSVID accepts a JWT-SVID of the trust domain for the audience, and refuses with
// InvalidArgument what does not pass, as the standard says.
func TestValidateJWTSVID(t *testing.T) {
	t.Parallel()
	h, iss, clk := startJWT(t)
	good := fetchJWT(t, h, "bank")
	key, kid := iss.current()
	now := clk.Now()
	claims := func(sub string, exp time.Time) jwt.MapClaims {
		return jwt.MapClaims{"sub": sub, "aud": []string{"bank"}, "iat": now.Unix(), "exp": exp.Unix()}
	}
	mustSign := func(key crypto.Signer, kid string, c jwt.MapClaims) string {
		tok, err := signJWT(key, kid, c)
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	hs256, err := jwt.NewWithClaims(jwt.SigningMethodHS256, claims(workloadID, now.Add(time.Hour))).SignedString([]byte("secret"))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := h.client.ValidateJWTSVID(ctx(t), &workload.ValidateJWTSVIDRequest{Audience: "bank", Svid: good})
	if err != nil {
		t.Fatal(err)
	}
	if resp.GetSpiffeId() != workloadID || resp.GetClaims().GetFields()["sub"].GetStringValue() != workloadID ||
		resp.GetClaims().GetFields()["aud"].GetListValue().GetValues()[0].GetStringValue() != "bank" {
		t.Fatalf("response %v", resp)
	}
	for _, tt := range []struct {
		name, token, audience, reason string
	}{
		{"wrong audience", good, "shop", "invalid_jwt_svid"},
		{"bad signature", mustSign(newES256Key(t), kid, claims(workloadID, now.Add(time.Hour))), "bank", "invalid_jwt_svid"},
		{"unknown kid", mustSign(key, "nobody", claims(workloadID, now.Add(time.Hour))), "bank", "invalid_jwt_svid"},
		{"no kid", mustSign(key, "", claims(workloadID, now.Add(time.Hour))), "bank", "invalid_jwt_svid"},
		{"HS256", hs256, "bank", "invalid_jwt_svid"},
		{"expired", mustSign(key, kid, claims(workloadID, now.Add(-time.Second))), "bank", "invalid_jwt_svid"},
		{"no exp", mustSign(key, kid, jwt.MapClaims{"sub": workloadID, "aud": "bank"}), "bank", "invalid_jwt_svid"},
		{"not yet valid", mustSign(key, kid, jwt.MapClaims{"sub": workloadID, "aud": "bank", "exp": now.Add(time.Hour).Unix(), "nbf": now.Add(time.Minute).Unix()}), "bank", "invalid_jwt_svid"},
		{"sub of another trust domain", mustSign(key, kid, claims("spiffe://example.org/ns/a/sa/b", now.Add(time.Hour))), "bank", "invalid_jwt_svid"},
		{"sub not a SPIFFE ID", mustSign(key, kid, claims("system:serviceaccount:a:b", now.Add(time.Hour))), "bank", "invalid_jwt_svid"},
		{"garbage", "not.a.jwt", "bank", "invalid_jwt_svid"},
		{"no audience", good, "", "missing_audience"},
		{"no token", "", "bank", "missing_jwt_svid"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			before := h.refusals(t, tt.reason, "InvalidArgument")
			_, err := h.client.ValidateJWTSVID(ctx(t), &workload.ValidateJWTSVIDRequest{Audience: tt.audience, Svid: tt.token})
			if got := status.Code(err); got != codes.InvalidArgument {
				t.Fatalf("code %v (%v), want InvalidArgument", got, err)
			}
			if n := h.refusals(t, tt.reason, "InvalidArgument") - before; n != 1 {
				t.Fatalf("%v refusals counted under %s, want 1", n, tt.reason)
			}
		})
	}
	t.Run("expired by the clock", func(t *testing.T) {
		clk.Advance(jwtTTL + time.Second)
		_, err := h.client.ValidateJWTSVID(ctx(t), &workload.ValidateJWTSVIDRequest{Audience: "bank", Svid: good})
		if st := status.Convert(err); st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), "expired") {
			t.Fatalf("%v, want InvalidArgument: expired", err)
		}
	})
	if strings.Contains(h.logs.String(), good) {
		t.Fatal("a token appears in the logs")
	}
}

// The bundle stream sends the JWKS at once, fetched when the first stream opens; refreshes on
// the clock send nothing while it is unchanged, and the new one when the CA's key changes.
func TestJWTBundlesStreamPushesOnChange(t *testing.T) {
	t.Parallel()
	h, iss, clk := startJWT(t)
	if _, fetches := iss.counts(); fetches != 0 {
		t.Fatalf("%d fetches before any stream", fetches)
	}
	stream, err := h.client.FetchJWTBundles(ctx(t), &workload.JWTBundlesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	kidOf := func() string {
		t.Helper()
		resp, err := stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		var set jose.JSONWebKeySet
		if err := json.Unmarshal(resp.GetBundles()["spiffe://cluster.local"], &set); err != nil || len(set.Keys) != 1 {
			t.Fatalf("bundles %v: %v", resp.GetBundles(), err)
		}
		return set.Keys[0].KeyID
	}
	_, kid1 := iss.current()
	if got := kidOf(); got != kid1 {
		t.Fatalf("kid %s, want %s", got, kid1)
	}
	// Unchanged: fetched again, nothing sent (the next Recv below would read it).
	next := clk.Now().Add(bundleRefresh)
	if err := clk.WaitForDeadline(ctx(t), next); err != nil {
		t.Fatal(err)
	}
	clk.Advance(bundleRefresh)
	next = next.Add(bundleRefresh)
	if err := clk.WaitForDeadline(ctx(t), next); err != nil {
		t.Fatal(err)
	}
	if _, fetches := iss.counts(); fetches != 2 {
		t.Fatalf("%d fetches after one refresh, want 2", fetches)
	}
	// A failed refresh keeps the bundle and the stream.
	iss.mu.Lock()
	iss.fetchErr = errors.New("CA unreachable")
	iss.mu.Unlock()
	clk.Advance(bundleRefresh)
	next = next.Add(bundleRefresh)
	if err := clk.WaitForDeadline(ctx(t), next); err != nil {
		t.Fatal(err)
	}
	iss.mu.Lock()
	iss.fetchErr = nil
	iss.mu.Unlock()
	iss.rotate(t)
	_, kid2 := iss.current()
	clk.Advance(bundleRefresh)
	if got := kidOf(); got != kid2 {
		t.Fatalf("after the rotation kid %s, want %s", got, kid2)
	}
	if got := h.metric(t, "meshid_agent_workload_api_responses_sent_total", map[string]string{"method": "FetchJWTBundles"}); got != 2 {
		t.Fatalf("%v bundle responses sent, want 2", got)
	}
}

// With no bundle to be had, the stream ends Unavailable; the CA is not asked again for 30 s,
// and the next stream after that fetches again.
func TestJWTBundlesUnavailable(t *testing.T) {
	t.Parallel()
	h, iss, clk := startJWT(t)
	iss.mu.Lock()
	iss.fetchErr = errors.New("CA unreachable")
	iss.mu.Unlock()
	stream, err := h.client.FetchJWTBundles(ctx(t), &workload.JWTBundlesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if st := recvErr(t, stream.Recv); st.Code() != codes.Unavailable {
		t.Fatalf("%v, want Unavailable", st.Err())
	}
	if n := h.refusals(t, "jwt_bundle_unavailable", "Unavailable"); n != 1 {
		t.Fatalf("%v refusals counted, want 1", n)
	}
	iss.mu.Lock()
	iss.fetchErr = nil
	iss.mu.Unlock()
	stream, err = h.client.FetchJWTBundles(ctx(t), &workload.JWTBundlesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if st := recvErr(t, stream.Recv); st.Code() != codes.Unavailable {
		t.Fatalf("a stream right after a failed fetch: %v, want Unavailable", st.Err())
	}
	if _, fetches := iss.counts(); fetches != 1 {
		t.Fatalf("%d fetches, want 1: the CA is not asked again within 30 s of a failure", fetches)
	}
	clk.Advance(30 * time.Second)
	stream, err = h.client.FetchJWTBundles(ctx(t), &workload.JWTBundlesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
}
