package caclient

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"time"

	"github.com/meshid/meshid/internal/pki"
)

// ImpersonatedIdentityKey is the key of IstioCertificateRequest.metadata under which a node agent
// names the workload it asks a certificate for (Istio's security.ImpersonatedIdentity, as ztunnel
// sends it): a SPIFFE ID.
const ImpersonatedIdentityKey = "ImpersonatedIdentity"

// ErrNoImpersonation: the client's protocol cannot ask for another identity. The Mesh CA's
// request (CA_PROVIDER=GoogleCA) has no metadata to name one in.
var ErrNoImpersonation = errors.New("the Mesh CA protocol (CA_PROVIDER=" + ProviderGoogleCA + ") cannot ask for another identity: its request has no metadata")

// IdentitySigner signs CSRs for one identity other than the client's own, as a node agent asks
// for its workloads': the client authenticates as itself, and the CA signs only when it trusts
// the client's account as a node account (meshid ca --trusted-node-accounts).
type IdentitySigner struct {
	c  *Client
	id pki.SPIFFEID
}

// ForIdentity returns a signer of certificates for id, over c's connection and credentials. The
// CA accepts impersonation only from a caller authenticated by a token: a client that has none
// and presents a certificate is refused.
func (c *Client) ForIdentity(id pki.SPIFFEID) (*IdentitySigner, error) {
	if c.cfg.Provider == ProviderGoogleCA {
		return nil, ErrNoImpersonation
	}
	return &IdentitySigner{c: c, id: id}, nil
}

// Identity returns the identity s asks for.
func (s *IdentitySigner) Identity() pki.SPIFFEID { return s.id }

// MintJWTSVID asks the CA for a JWT-SVID of s's identity, as Client.MintJWTSVID asks for the
// client's own; meshid ca signs it for a trusted node account as it signs certificates.
func (s *IdentitySigner) MintJWTSVID(ctx context.Context, audience []string, ttl time.Duration) (JWTSVID, error) {
	svid, err := s.c.mintJWTSVID(ctx, audience, ttl, s.id.String())
	if err != nil {
		return JWTSVID{}, fmt.Errorf("JWT-SVID for %s: %w", s.id, err)
	}
	return svid, nil
}

// Sign sends a DER CSR to the CA with the ImpersonatedIdentity metadata and returns the chain it
// issued, leaf first; retries and errors are Client.Sign's.
func (s *IdentitySigner) Sign(ctx context.Context, csrDER []byte, ttl time.Duration) ([]*x509.Certificate, error) {
	chain, err := s.c.sign(ctx, csrDER, ttl, s.id.String())
	if err != nil {
		return nil, fmt.Errorf("certificate for %s: %w", s.id, err)
	}
	return chain, nil
}
