package server

import (
	"context"
	"errors"
	"fmt"

	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// IssuerVerifier verifies the tokens of one external issuer (a *token.Issuer).
type IssuerVerifier interface {
	Name() string
	Verify(ctx context.Context, raw string) (namespace, serviceAccount string, err error)
}

// IssuerAuthenticator accepts bearer tokens of external OIDC issuers (JWT_RULE), each verified by
// its issuer's verifier. A token whose iss is none of them is left to the next authenticator
// (ErrNoCredentials), which checks it against the CA's own token keys.
type IssuerAuthenticator struct {
	issuers     map[string]IssuerVerifier
	trustDomain string
}

// NewIssuerAuthenticator returns an IssuerAuthenticator mapping tokens to identities in trustDomain.
func NewIssuerAuthenticator(issuers []IssuerVerifier, trustDomain string) *IssuerAuthenticator {
	byName := make(map[string]IssuerVerifier, len(issuers))
	for _, i := range issuers {
		byName[i.Name()] = i
	}
	return &IssuerAuthenticator{issuers: byName, trustDomain: trustDomain}
}

// Authenticate implements Authenticator.
func (a *IssuerAuthenticator) Authenticate(ctx context.Context) (Caller, error) {
	raw, err := BearerToken(ctx)
	if err != nil {
		return Caller{}, err
	}
	iss, _ := token.UnverifiedIssuer(raw)
	issuer, ok := a.issuers[iss]
	if !ok {
		return Caller{}, fmt.Errorf("bearer token of issuer %q, no JWT rule's: %w", logkey.Untrusted(iss), ErrNoCredentials)
	}
	ns, sa, err := issuer.Verify(ctx, raw)
	if errors.Is(err, token.ErrNoIssuerKeys) {
		return Caller{}, fmt.Errorf("bearer token: %w: %w", ErrAuthenticatorUnavailable, err)
	}
	if err != nil {
		return Caller{}, fmt.Errorf("bearer token of issuer %q: %w", iss, err)
	}
	return Caller{Identity: pki.SPIFFEID{TrustDomain: a.trustDomain, Namespace: ns, ServiceAccount: sa}, Method: "jwt",
		Credential: TokenCredential(raw), ByToken: true}, nil
}
