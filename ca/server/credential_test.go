package server_test

import (
	"context"
	"regexp"
	"strings"
	"testing"

	"google.golang.org/grpc/metadata"

	"github.com/meshid/meshid/ca/server"
	"github.com/meshid/meshid/ca/token"
)

// A caller's Credential names its credential without revealing it: the servers on the CA's port
// cap streams by it, and may log it.
func TestCallerCredentialIsAFingerprint(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	keys, err := token.NewKeySet(h.tokenKey.Public())
	if err != nil {
		t.Fatal(err)
	}
	verifier, err := token.NewVerifier(token.VerifierConfig{Keys: keys, Audience: "istio-ca", Now: h.clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	jwtAuth := server.NewJWTAuthenticator(verifier, trustDomain)
	credentialOf := func(tok string) string {
		t.Helper()
		ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs("authorization", "Bearer "+tok))
		caller, err := jwtAuth.Authenticate(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return caller.Credential
	}
	first, second := h.token(t, mintOptions{}), h.token(t, mintOptions{sa: "other"})
	pattern := regexp.MustCompile(`^jwt:[0-9a-f]{16}$`)
	for _, tc := range []struct {
		name, got, want string
	}{
		{"a token", credentialOf(first), server.TokenCredential(first)},
		{"the same token again", credentialOf(first), server.TokenCredential(first)},
		{"another token", credentialOf(second), server.TokenCredential(second)},
	} {
		if tc.got != tc.want || !pattern.MatchString(tc.got) {
			t.Errorf("%s: credential %q, want %q of the form jwt:<16 hex digits>", tc.name, tc.got, tc.want)
		}
		for _, part := range strings.Split(first, ".") {
			if strings.Contains(tc.got, part) {
				t.Errorf("%s: credential %q holds part of the token", tc.name, tc.got)
			}
		}
	}
	if server.TokenCredential(first) == server.TokenCredential(second) {
		t.Error("two tokens have one credential")
	}
	if got := server.CertificateCredential(h.intermediate.Cert.Raw); !regexp.MustCompile(`^mtls:[0-9a-f]{16}$`).MatchString(got) {
		t.Errorf("certificate credential %q, want mtls:<16 hex digits>", got)
	}
}
