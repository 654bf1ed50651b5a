package server_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/ca/server"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/testutil"
)

func TestBearerToken(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name     string
		md       metadata.MD // nil: no incoming metadata at all
		want     string
		noCreds  bool
		wantFail bool
	}{
		{name: "no metadata", noCreds: true, wantFail: true},
		{name: "no authorization", md: metadata.Pairs("clusterid", "Kubernetes"), noCreds: true, wantFail: true},
		{name: "bearer", md: metadata.Pairs("authorization", "Bearer abc.def.ghi"), want: "abc.def.ghi"},
		{name: "scheme in any case, spaces trimmed", md: metadata.Pairs("authorization", "bEaReR   abc "), want: "abc"},
		{name: "basic", md: metadata.Pairs("authorization", "Basic dXNlcjpwYXNz"), wantFail: true},
		{name: "empty token", md: metadata.Pairs("authorization", "Bearer  "), wantFail: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			if tt.md != nil {
				ctx = metadata.NewIncomingContext(ctx, tt.md)
			}
			got, err := server.BearerToken(ctx)
			if (err != nil) != tt.wantFail || got != tt.want {
				t.Fatalf("BearerToken = %q, %v; want %q, failure %v", got, err, tt.want, tt.wantFail)
			}
			if errors.Is(err, server.ErrNoCredentials) != tt.noCreds {
				t.Fatalf("error %v: wraps ErrNoCredentials = %v, want %v", err, !tt.noCreds, tt.noCreds)
			}
		})
	}
}

// stubAuthenticator fails as an authenticator of another package would.
type stubAuthenticator struct{ err error }

func (s stubAuthenticator) Authenticate(context.Context) (server.Caller, error) {
	return server.Caller{}, s.err
}

// The errors exported for authenticators of other packages (the Kubernetes TokenReview) map to
// codes and reasons here, where every other refusal is mapped; an authenticator that finds no
// credentials of its kind lets the next one decide.
func TestExternalAuthenticatorErrors(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	for _, tt := range []struct {
		name    string
		err     error
		code    codes.Code
		reason  string
		message string // in the status sent back; "" for Internal's fixed text
	}{
		{"rejected", fmt.Errorf("%w: token audiences do not include istio-ca", server.ErrTokenRejected), codes.Unauthenticated, "token_rejected", "audiences"},
		{"unavailable", fmt.Errorf("%w: TokenReview: dial https://10.0.0.1:6443: connection refused", server.ErrAuthenticatorUnavailable), codes.Unavailable, "authenticator_unavailable", "retry"},
		{"misconfigured", fmt.Errorf("%w: may not create tokenreviews", server.ErrAuthenticatorMisconfigured), codes.Internal, "authenticator_misconfigured", ""},
		{"no credentials, then the JWT authenticator", fmt.Errorf("review: %w", server.ErrNoCredentials), codes.OK, "", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			registry := prometheus.NewRegistry()
			metrics, err := server.NewMetrics(registry)
			if err != nil {
				t.Fatal(err)
			}
			logs := &testutil.SyncBuffer{}
			srv := server.New(server.Config{
				Signer:         h.authority,
				Authenticators: []server.Authenticator{stubAuthenticator{tt.err}, jwtAuthenticator(t, h)},
				Targeting:      controller.NewTargeting(controller.TargetingConfig{CANamespace: "istio-system", EnabledByDefault: true}),
				Metrics:        metrics,
				Logger:         slog.New(slog.NewTextHandler(logs, nil)),
			})
			// A token for the JWT authenticator only where the stub finds no credentials: the
			// first success wins.
			ctx := t.Context()
			if tt.code == codes.OK {
				ctx = metadata.NewIncomingContext(ctx, metadata.Pairs("authorization", "Bearer "+h.token(t, mintOptions{})))
			}
			_, err = srv.CreateCertificate(ctx, request(t, p256(t), []string{demoID()}, nil, 0))
			if got := status.Code(err); got != tt.code {
				t.Fatalf("code = %v (%v), want %v", got, err, tt.code)
			}
			if tt.code == codes.OK {
				return
			}
			if !strings.Contains(status.Convert(err).Message(), tt.message) {
				t.Fatalf("message %q, want it to mention %q", status.Convert(err).Message(), tt.message)
			}
			// What the authenticator saw of the CA's own infrastructure stays in the log.
			if msg := status.Convert(err).Message(); strings.Contains(msg, "10.0.0.1") || strings.Contains(msg, "tokenreviews") {
				t.Fatalf("message %q tells the caller the CA's internals", msg)
			}
			labels := map[string]string{"reason": tt.reason, "code": tt.code.String()}
			if got := promtest.ToFloat64(counter(t, registry, "meshid_ca_requests_refused_total", labels)); got != 1 {
				t.Fatalf("refusal counted %v times under %v, want 1", got, labels)
			}
			if got := strings.Count(logs.String(), "certificate request refused"); got != 1 {
				t.Fatalf("refusal logged %d times, want once:\n%s", got, logs.String())
			}
		})
	}
}

// Production's order puts the offline JWT check first: its refusal of a token it cannot verify
// must not hide that the authenticator that could is unavailable, which the caller should retry.
func TestAuthenticatorUnavailableWinsOverARefusal(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	srv := server.New(server.Config{
		Signer: h.authority,
		Authenticators: []server.Authenticator{
			jwtAuthenticator(t, h),
			stubAuthenticator{fmt.Errorf("%w: TokenReview: connection refused", server.ErrAuthenticatorUnavailable)},
		},
		Targeting: controller.NewTargeting(controller.TargetingConfig{CANamespace: "istio-system", EnabledByDefault: true}),
		Logger:    slog.New(slog.DiscardHandler),
	})
	// Signed by a key the offline verifier does not know: an API server's token, say.
	other := p256(t)
	ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs("authorization", "Bearer "+h.token(t, mintOptions{key: other})))
	_, err := srv.CreateCertificate(ctx, request(t, p256(t), []string{demoID()}, nil, 0))
	if got := status.Code(err); got != codes.Unavailable {
		t.Fatalf("code = %v (%v), want Unavailable", got, err)
	}
}

// jwtAuthenticator verifies the harness's tokens offline, as the CA's first authenticator does.
func jwtAuthenticator(t *testing.T, h *harness) server.Authenticator {
	t.Helper()
	keys, err := token.NewKeySet(h.tokenKey.Public())
	if err != nil {
		t.Fatal(err)
	}
	verifier, err := token.NewVerifier(token.VerifierConfig{Keys: keys, Audience: "istio-ca", Now: h.clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	return server.NewJWTAuthenticator(verifier, trustDomain)
}
