package server_test

import (
	"context"
	"fmt"
	"log/slog"
	"testing"

	"github.com/golang-jwt/jwt/v5"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/ca/server"
	"github.com/meshid/meshid/ca/token"
)

// stubIssuer answers for one issuer as a *token.Issuer would.
type stubIssuer struct {
	name    string
	ns, sa  string
	err     error
	checked *int
}

func (s stubIssuer) Name() string { return s.name }

func (s stubIssuer) Verify(context.Context, string) (string, string, error) {
	*s.checked++
	return s.ns, s.sa, s.err
}

// The issuer authenticator routes a token by its iss: a rule's issuer decides, any other token
// is left to the CA's own keys; its errors map to codes and reasons as the JWT authenticator's.
func TestIssuerAuthenticator(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	const iss = "https://issuer.test"
	external := func(issuer string) string {
		tok, err := jwt.NewWithClaims(jwt.SigningMethodES256, jwt.MapClaims{"iss": issuer}).SignedString(p256(t))
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	for _, tt := range []struct {
		name     string
		tok      string
		verifier stubIssuer
		id       string
		code     codes.Code
		reason   string
		checked  int
	}{
		{"mapped", external(iss), stubIssuer{ns: "team-a", sa: "api"}, "spiffe://cluster.local/ns/team-a/sa/api", codes.OK, "", 1},
		{"another identity", external(iss), stubIssuer{ns: "team-a", sa: "api"}, demoID(), codes.PermissionDenied, "csr_identity", 1},
		{"keys not fetched yet", external(iss), stubIssuer{err: fmt.Errorf("%w (issuer)", token.ErrNoIssuerKeys)}, demoID(), codes.Unavailable, "authenticator_unavailable", 1},
		{"claims", external(iss), stubIssuer{err: fmt.Errorf("%w: no claim", token.ErrIdentityClaims)}, demoID(), codes.Unauthenticated, "token_subject", 1},
		{"audience", external(iss), stubIssuer{err: jwt.ErrTokenInvalidAudience}, demoID(), codes.Unauthenticated, "token_audience", 1},
		{"other issuer: the CA's keys", h.token(t, mintOptions{}), stubIssuer{}, demoID(), codes.OK, "", 0},
		{"other issuer, unknown to the CA's keys", external("https://else.test"), stubIssuer{}, demoID(), codes.Unauthenticated, "token_signature", 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			registry := prometheus.NewRegistry()
			metrics, err := server.NewMetrics(registry)
			if err != nil {
				t.Fatal(err)
			}
			checked := 0
			tt.verifier.name, tt.verifier.checked = iss, &checked
			srv := server.New(server.Config{
				Signer: h.authority,
				Authenticators: []server.Authenticator{
					server.NewIssuerAuthenticator([]server.IssuerVerifier{tt.verifier}, trustDomain),
					jwtAuthenticator(t, h),
				},
				Targeting: controller.NewTargeting(controller.TargetingConfig{CANamespace: "istio-system", EnabledByDefault: true}),
				Metrics:   metrics,
				Logger:    slog.New(slog.DiscardHandler),
			})
			ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs("authorization", "Bearer "+tt.tok))
			_, err = srv.CreateCertificate(ctx, request(t, p256(t), []string{tt.id}, nil, 0))
			if got := status.Code(err); got != tt.code {
				t.Fatalf("code = %v (%v), want %v", got, err, tt.code)
			}
			if checked != tt.checked {
				t.Fatalf("the rule's verifier checked %d tokens, want %d", checked, tt.checked)
			}
			if tt.code == codes.OK {
				return
			}
			labels := map[string]string{"reason": tt.reason, "code": tt.code.String()}
			if got := promtest.ToFloat64(counter(t, registry, "meshid_ca_requests_refused_total", labels)); got != 1 {
				t.Fatalf("refusal counted %v times under %v, want 1", got, labels)
			}
		})
	}
}
