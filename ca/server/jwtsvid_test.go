package server_test

import (
	"context"
	"crypto"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"strings"
	"testing"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/golang-jwt/jwt/v5"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/spiffe/go-spiffe/v2/bundle/jwtbundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/jwtsvid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/jwtsvidpb"
)

func (h *harness) dialJWTSVID(t testing.TB) jwtsvidpb.JWTSVIDServiceClient {
	t.Helper()
	return jwtsvidpb.NewJWTSVIDServiceClient(h.conn(t, nil))
}

// parseJWTSVID verifies tok with the key the CA's bundle publishes under its kid.
func parseJWTSVID(t *testing.T, bundle *jwtsvidpb.FetchJWTBundleResponse, tok string) (*jwt.Token, *jwt.RegisteredClaims) {
	t.Helper()
	claims := &jwt.RegisteredClaims{}
	parsed, err := jwt.ParseWithClaims(tok, claims, func(tk *jwt.Token) (any, error) {
		for _, k := range bundle.GetKeys() {
			if k.GetId() == tk.Header["kid"] {
				return x509.ParsePKIXPublicKey(k.GetPublicKey())
			}
		}
		t.Fatalf("kid %v is not in the bundle", tk.Header["kid"])
		return nil, nil
	}, jwt.WithValidMethods([]string{"ES256"}), jwt.WithoutClaimsValidation())
	if err != nil {
		t.Fatal(err)
	}
	return parsed, claims
}

// A caller gets a JWT-SVID of its own identity, by token or by client certificate, for the
// audiences it asked, signed by the key of the bundle.
func TestMintJWTSVIDForCallerIdentity(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	ctx := withToken(t.Context(), h.token(t, mintOptions{}))
	bundle, err := h.dialJWTSVID(t).FetchJWTBundle(ctx, &jwtsvidpb.FetchJWTBundleRequest{})
	if err != nil {
		t.Fatal(err)
	}
	leaf, key := h.intermediate.IssueWorkload(t, "spiffe://cluster.local/ns/other/sa/client", time.Hour)
	byCert := jwtsvidpb.NewJWTSVIDServiceClient(h.conn(t, tlsCert([]*x509.Certificate{leaf, h.intermediate.Cert}, key)))
	for _, tt := range []struct {
		name   string
		ctx    context.Context
		client jwtsvidpb.JWTSVIDServiceClient
		want   string
	}{
		{"token", ctx, h.dialJWTSVID(t), demoID()},
		{"client certificate", t.Context(), byCert, "spiffe://cluster.local/ns/other/sa/client"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := tt.client.MintJWTSVID(tt.ctx, &jwtsvidpb.MintJWTSVIDRequest{Audience: []string{"bank", "shop"}})
			if err != nil {
				t.Fatal(err)
			}
			tok, claims := parseJWTSVID(t, bundle, resp.GetToken())
			if tok.Header["kid"] != h.jwtSigner.KeyID(time.Now()) || tok.Header["alg"] != "ES256" {
				t.Fatalf("header %v, want kid %s and ES256", tok.Header, h.jwtSigner.KeyID(time.Now()))
			}
			if claims.Subject != tt.want || resp.GetSpiffeId() != tt.want {
				t.Fatalf("sub %q (response %q), want %q", claims.Subject, resp.GetSpiffeId(), tt.want)
			}
			if strings.Join(claims.Audience, ",") != "bank,shop" {
				t.Fatalf("aud %v", claims.Audience)
			}
			if claims.IssuedAt == nil || claims.ExpiresAt == nil || claims.ExpiresAt.Sub(claims.IssuedAt.Time) != ca.DefaultJWTSVIDTTL {
				t.Fatalf("iat %v exp %v: want a lifetime of %s", claims.IssuedAt, claims.ExpiresAt, ca.DefaultJWTSVIDTTL)
			}
		})
	}
	for method, want := range map[string]float64{"jwt": 1, "mtls": 1} {
		if got := promtest.ToFloat64(counter(t, h.registry, "meshid_ca_jwt_svids_issued_total", map[string]string{"auth_method": method})); got != want {
			t.Errorf("JWT-SVIDs issued by %s = %v, want %v", method, got, want)
		}
	}
	if strings.Contains(h.logs.String(), "eyJ") {
		t.Error("a token appears in the logs")
	}
}

// The lifetime asked is clamped to the CA's; none asks for the CA's.
func TestMintJWTSVIDTTLClamp(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{jwtSVIDTTL: 10 * time.Minute})
	ctx := withToken(t.Context(), h.token(t, mintOptions{}))
	bundle, err := h.dialJWTSVID(t).FetchJWTBundle(ctx, &jwtsvidpb.FetchJWTBundleRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name string
		ttl  *durationpb.Duration
		want time.Duration
	}{
		{"none: the CA's", nil, 10 * time.Minute},
		{"shorter", durationpb.New(time.Minute), time.Minute},
		{"longer: clamped", durationpb.New(time.Hour), 10 * time.Minute},
		{"beyond time.Duration: clamped", &durationpb.Duration{Seconds: 315576000000}, 10 * time.Minute},
	} {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := h.dialJWTSVID(t).MintJWTSVID(ctx, &jwtsvidpb.MintJWTSVIDRequest{Audience: []string{"a"}, Ttl: tt.ttl})
			if err != nil {
				t.Fatal(err)
			}
			_, claims := parseJWTSVID(t, bundle, resp.GetToken())
			if got := claims.ExpiresAt.Sub(claims.IssuedAt.Time); got != tt.want {
				t.Fatalf("lifetime %s, want %s", got, tt.want)
			}
		})
	}
}

// Refusals: the certificate services' authentication and targeting, a missing or oversized
// audience, a bad lifetime; each counted by reason and logged once.
func TestMintJWTSVIDRefusals(t *testing.T) {
	t.Parallel()
	disabled := false
	h := newHarness(t, harnessOptions{})
	hDisabled := newHarness(t, harnessOptions{enabledByDefault: &disabled})
	good := "Bearer " + h.token(t, mintOptions{})
	many := make([]string, ca.MaxJWTSVIDAudiences+1)
	for i := range many {
		many[i] = "aud"
	}
	tests := []struct {
		name   string
		h      *harness
		auth   string
		req    *jwtsvidpb.MintJWTSVIDRequest
		code   codes.Code
		reason string
	}{
		{"no credentials", h, "", &jwtsvidpb.MintJWTSVIDRequest{Audience: []string{"a"}}, codes.Unauthenticated, "no_credentials"},
		{"garbage token", h, "Bearer not.a.jwt", &jwtsvidpb.MintJWTSVIDRequest{Audience: []string{"a"}}, codes.Unauthenticated, "token_malformed"},
		{"namespace not targeted", hDisabled, "Bearer " + hDisabled.token(t, mintOptions{}), &jwtsvidpb.MintJWTSVIDRequest{Audience: []string{"a"}}, codes.PermissionDenied, "namespace_not_targeted"},
		{"no audience", h, good, &jwtsvidpb.MintJWTSVIDRequest{}, codes.InvalidArgument, "jwt_svid_audience"},
		{"only an empty audience", h, good, &jwtsvidpb.MintJWTSVIDRequest{Audience: []string{""}}, codes.InvalidArgument, "jwt_svid_audience"},
		{"too many audiences", h, good, &jwtsvidpb.MintJWTSVIDRequest{Audience: many}, codes.InvalidArgument, "jwt_svid_audience"},
		{"an audience too long", h, good, &jwtsvidpb.MintJWTSVIDRequest{Audience: []string{strings.Repeat("x", ca.MaxJWTSVIDAudienceBytes+1)}}, codes.InvalidArgument, "jwt_svid_audience"},
		{"negative lifetime", h, good, &jwtsvidpb.MintJWTSVIDRequest{Audience: []string{"a"}, Ttl: durationpb.New(-time.Second)}, codes.InvalidArgument, "validity_duration"},
		{"malformed lifetime", h, good, &jwtsvidpb.MintJWTSVIDRequest{Audience: []string{"a"}, Ttl: &durationpb.Duration{Seconds: 1, Nanos: -1}}, codes.InvalidArgument, "validity_duration"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Not parallel: the log count below is this case's.
			ctx := t.Context()
			if tt.auth != "" {
				ctx = metadata.AppendToOutgoingContext(ctx, "authorization", tt.auth)
			}
			before := strings.Count(tt.h.logs.String(), "reason="+tt.reason)
			_, err := tt.h.dialJWTSVID(t).MintJWTSVID(ctx, tt.req)
			if got := status.Code(err); got != tt.code {
				t.Fatalf("code = %v (%v), want %v", got, err, tt.code)
			}
			labels := map[string]string{"reason": tt.reason, "code": tt.code.String()}
			if got := promtest.ToFloat64(counter(t, tt.h.registry, "meshid_ca_requests_refused_total", labels)); got < 1 {
				t.Fatalf("refusal not counted under %v", labels)
			}
			if got := promtest.ToFloat64(counter(t, tt.h.registry, "meshid_ca_jwt_svid_requests_total", map[string]string{"method": "MintJWTSVID", "code": tt.code.String()})); got < 1 {
				t.Fatal("request not counted")
			}
			if got := strings.Count(tt.h.logs.String(), "reason="+tt.reason) - before; got != 1 {
				t.Fatalf("refusal logged %d times, want once:\n%s", got, tt.h.logs.String())
			}
		})
	}
	if got := promtest.ToFloat64(counter(t, h.registry, "meshid_ca_jwt_svids_issued_total", map[string]string{"auth_method": "jwt"})); got != 0 {
		t.Fatalf("%v JWT-SVIDs issued, want none", got)
	}
	t.Run("the bundle needs credentials too", func(t *testing.T) {
		if _, err := h.dialJWTSVID(t).FetchJWTBundle(t.Context(), &jwtsvidpb.FetchJWTBundleRequest{}); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("code = %v, want Unauthenticated", status.Code(err))
		}
	})
}

// The bundle is a JWKS that holds the signing key under its kid (the key's RFC 7638
// thumbprint), which go-spiffe reads and validates the CA's JWT-SVIDs with.
func TestFetchJWTBundleVerifiesJWTSVIDs(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	ctx := withToken(t.Context(), h.token(t, mintOptions{}))
	client := h.dialJWTSVID(t)
	bundle, err := client.FetchJWTBundle(ctx, &jwtsvidpb.FetchJWTBundleRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if bundle.GetTrustDomain() != "spiffe://cluster.local" {
		t.Fatalf("trust domain %q", bundle.GetTrustDomain())
	}
	var jwks jose.JSONWebKeySet
	if err := json.Unmarshal(bundle.GetJwks(), &jwks); err != nil {
		t.Fatal(err)
	}
	if len(jwks.Keys) != 1 || jwks.Keys[0].KeyID != h.jwtSigner.KeyID(time.Now()) || jwks.Keys[0].Use != "jwt-svid" || !jwks.Keys[0].IsPublic() {
		t.Fatalf("JWKS %s: want the one public key, kid %s, use jwt-svid", bundle.GetJwks(), h.jwtSigner.KeyID(time.Now()))
	}
	thumb, err := jwks.Keys[0].Thumbprint(crypto.SHA256)
	if err != nil || jwkB64(thumb) != h.jwtSigner.KeyID(time.Now()) {
		t.Fatalf("kid %s is not the key's thumbprint (%v)", h.jwtSigner.KeyID(time.Now()), err)
	}
	if len(bundle.GetKeys()) != 1 || bundle.GetKeys()[0].GetId() != h.jwtSigner.KeyID(time.Now()) {
		t.Fatalf("keys %v", bundle.GetKeys())
	}
	resp, err := client.MintJWTSVID(ctx, &jwtsvidpb.MintJWTSVIDRequest{Audience: []string{"bank"}})
	if err != nil {
		t.Fatal(err)
	}
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	set, err := jwtbundle.Parse(td, bundle.GetJwks())
	if err != nil {
		t.Fatal(err)
	}
	svid, err := jwtsvid.ParseAndValidate(resp.GetToken(), set, []string{"bank"})
	if err != nil {
		t.Fatal(err)
	}
	if svid.ID.String() != demoID() {
		t.Fatalf("go-spiffe reads %s, want %s", svid.ID, demoID())
	}
}

// A JWT-SVID is signed by a key the CA never trusts for service-account tokens: presented as a
// token, it authenticates no one.
func TestJWTSVIDIsNotAServiceAccountToken(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	resp, err := h.dialJWTSVID(t).MintJWTSVID(withToken(t.Context(), h.token(t, mintOptions{})),
		&jwtsvidpb.MintJWTSVIDRequest{Audience: []string{"istio-ca"}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := withToken(t.Context(), resp.GetToken())
	if _, err := h.dial(t, nil).CreateCertificate(ctx, request(t, p256(t), []string{demoID()}, nil, 0)); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("CreateCertificate with a JWT-SVID: code %v, want Unauthenticated", status.Code(err))
	}
	if _, err := h.dialJWTSVID(t).MintJWTSVID(ctx, &jwtsvidpb.MintJWTSVIDRequest{Audience: []string{"a"}}); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("MintJWTSVID with a JWT-SVID: code %v, want Unauthenticated", status.Code(err))
	}
}

func jwkB64(b []byte) string { return base64.RawURLEncoding.EncodeToString(b) }
