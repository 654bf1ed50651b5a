package server

import (
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// Caller is an authenticated client of the CA.
type Caller struct {
	Identity pki.SPIFFEID
	// Method names how the caller proved its identity ("jwt", "mtls", "tokenreview"); it is the
	// auth_method label of the issued-certificates metric.
	Method string
	// Credential is a fingerprint of the credential itself, never the credential: "jwt:" and the
	// first 16 hex digits of the token's SHA-256 (TokenCredential), or "mtls:" and those of the
	// client certificate's DER (CertificateCredential). Servers on the CA's port cap the streams
	// of one credential with it.
	Credential string
	// Pod is the pod the caller's token is bound to, when the authenticator knows it: a node
	// agent's node is its pod's (NodeAuthorizer).
	Pod BoundPod
	// ByToken is set by the authenticators of bearer tokens, and only by them: what a token
	// proves (a CA certificate, another workload's identity) is refused to every other caller,
	// whatever a new authenticator names its method.
	ByToken bool
}

// TokenCredential is the Caller.Credential of a caller authenticated by bearer token raw.
func TokenCredential(raw string) string { return "jwt:" + fingerprint([]byte(raw)) }

// CertificateCredential is the Caller.Credential of a caller authenticated by the client
// certificate whose DER is leaf.
func CertificateCredential(leaf []byte) string { return "mtls:" + fingerprint(leaf) }

// fingerprint is the first 16 hex digits of data's SHA-256: enough that two credentials in use
// at once do not share one, and no use to whoever reads it in a log.
func fingerprint(data []byte) string {
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:8])
}

// Authenticator establishes a caller's identity from a request's credentials. It returns an
// error wrapping ErrNoCredentials when the request carries none of the kind it checks, so that
// the next authenticator is tried.
type Authenticator interface {
	Authenticate(ctx context.Context) (Caller, error)
}

// Errors of authenticators, mapped to status codes by the server. Authenticators outside this
// package wrap them; test with errors.Is.
var (
	// ErrNoCredentials: the request carries no credentials of the kind an authenticator checks.
	ErrNoCredentials = errors.New("no credentials")
	// ErrTokenRejected: the token's issuer (the API server's TokenReview, say) did not authenticate
	// the token. Unauthenticated.
	ErrTokenRejected = errors.New("token not authenticated by its issuer")
	// ErrAuthenticatorUnavailable: the authenticator could not reach whoever vouches for the
	// credentials; the caller may retry. Unavailable.
	ErrAuthenticatorUnavailable = errors.New("cannot check the credentials now")
	// ErrAuthenticatorMisconfigured: the CA itself is not allowed to check credentials (missing
	// RBAC, say); the operator must act. Internal, logged as an error.
	ErrAuthenticatorMisconfigured = errors.New("the CA is not set up to check credentials")

	errMalformedBearer   = errors.New("authorization header is not a bearer token")
	errClientCertificate = errors.New("client certificate not accepted")
)

// BearerToken returns the token of the request's "authorization: Bearer <token>" metadata. With
// no authorization metadata the error wraps ErrNoCredentials.
func BearerToken(ctx context.Context) (string, error) {
	// Only this key: FromIncomingContext would copy every key of the request's metadata.
	values := metadata.ValueFromIncomingContext(ctx, "authorization")
	if len(values) == 0 {
		return "", fmt.Errorf("bearer token: %w", ErrNoCredentials)
	}
	scheme, raw, ok := strings.Cut(values[0], " ")
	if !ok || !strings.EqualFold(scheme, "bearer") || strings.TrimSpace(raw) == "" {
		return "", errMalformedBearer
	}
	return strings.TrimSpace(raw), nil
}

// JWTAuthenticator accepts Kubernetes service-account tokens sent as "authorization: Bearer <JWT>".
type JWTAuthenticator struct {
	verifier    *token.Verifier
	trustDomain string
}

// NewJWTAuthenticator returns a JWTAuthenticator mapping tokens to identities in trustDomain.
func NewJWTAuthenticator(v *token.Verifier, trustDomain string) *JWTAuthenticator {
	return &JWTAuthenticator{verifier: v, trustDomain: trustDomain}
}

// Authenticate implements Authenticator.
func (a *JWTAuthenticator) Authenticate(ctx context.Context) (Caller, error) {
	raw, err := BearerToken(ctx)
	if err != nil {
		return Caller{}, err
	}
	claims, err := a.verifier.Verify(raw)
	if err != nil {
		return Caller{}, fmt.Errorf("bearer token: %w", err)
	}
	ns, sa, err := claims.ServiceAccount()
	if err != nil {
		return Caller{}, fmt.Errorf("bearer token: %w", err)
	}
	caller := Caller{Identity: pki.SPIFFEID{TrustDomain: a.trustDomain, Namespace: ns, ServiceAccount: sa}, Method: "jwt",
		Credential: TokenCredential(raw), ByToken: true}
	if k := claims.Kubernetes; k != nil && k.Pod != nil {
		caller.Pod = BoundPod{Name: k.Pod.Name, UID: k.Pod.UID}
	}
	return caller, nil
}

// TrustSource yields the CA's current key material, whose roots client certificates must chain to.
type TrustSource interface {
	Bundle() *ca.Bundle
}

// MTLSAuthenticator accepts a client certificate that chains to the CA's trust bundle and names a
// workload of this trust domain by its only URI SAN: a workload renewing with its current certificate.
type MTLSAuthenticator struct {
	trust       TrustSource
	trustDomain string
	clock       clock.Clock
}

// NewMTLSAuthenticator returns an MTLSAuthenticator. A nil clock means the real one.
func NewMTLSAuthenticator(trust TrustSource, trustDomain string, clk clock.Clock) *MTLSAuthenticator {
	return &MTLSAuthenticator{trust: trust, trustDomain: trustDomain, clock: clock.OrReal(clk)}
}

// Authenticate implements Authenticator. The chain is verified per call, against the bundle in
// service now, so that a trust change applies to connections opened before it.
func (a *MTLSAuthenticator) Authenticate(ctx context.Context) (Caller, error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return Caller{}, fmt.Errorf("client certificate: %w", ErrNoCredentials)
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(info.State.PeerCertificates) == 0 {
		return Caller{}, fmt.Errorf("client certificate: %w", ErrNoCredentials)
	}
	b := a.trust.Bundle()
	if b == nil {
		return Caller{}, ca.ErrNotReady
	}
	certs := info.State.PeerCertificates
	leaf := certs[0]
	intermediates := x509.NewCertPool()
	for _, c := range certs[1:] {
		intermediates.AddCert(c)
	}
	now := a.clock.Now()
	chains, err := leaf.Verify(x509.VerifyOptions{
		Roots:         b.RootPool(),
		Intermediates: intermediates,
		CurrentTime:   now,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	if err != nil {
		return Caller{}, fmt.Errorf("%w: %w", errClientCertificate, err)
	}
	if err := anyTrustedRoot(b, chains, now); err != nil {
		return Caller{}, fmt.Errorf("%w: %w", errClientCertificate, err)
	}
	if leaf.IsCA {
		return Caller{}, fmt.Errorf("%w: it is a CA certificate", errClientCertificate)
	}
	if len(leaf.URIs) != 1 {
		return Caller{}, fmt.Errorf("%w: it has %d URI SANs, want exactly one SPIFFE ID", errClientCertificate, len(leaf.URIs))
	}
	id, err := pki.SPIFFEIDFromURL(leaf.URIs[0])
	if err != nil {
		// pki's error quotes the whole URI, which a plugged-in root may have certified for
		// anyone: bounded here instead.
		return Caller{}, fmt.Errorf("%w: URI SAN %q is not a workload SPIFFE ID (spiffe://TRUST_DOMAIN/ns/NAMESPACE/sa/SERVICE_ACCOUNT)",
			errClientCertificate, logkey.Untrusted(leaf.URIs[0].String()))
	}
	if id.TrustDomain != a.trustDomain {
		return Caller{}, fmt.Errorf("%w: trust domain %q, want %q", errClientCertificate, logkey.Untrusted(id.TrustDomain), a.trustDomain)
	}
	return Caller{Identity: id, Method: "mtls", Credential: CertificateCredential(leaf.Raw)}, nil
}

// anyTrustedRoot accepts chains if one of them ends at a root still trusted now: the pool keeps a
// replaced root until the key manager's next check, which may come well after its overlap ends.
func anyTrustedRoot(b *ca.Bundle, chains [][]*x509.Certificate, now time.Time) error {
	var err error
	for _, chain := range chains {
		if err = b.CheckRoot(chain[len(chain)-1], now); err == nil {
			return nil
		}
	}
	return err
}

// authenticate tries each authenticator in order; the first success wins. When every one fails,
// the error of the first that found credentials is returned, or ErrNoCredentials if none did.
func authenticate(ctx context.Context, authenticators []Authenticator) (Caller, error) {
	var errs []error
	for _, a := range authenticators {
		caller, err := a.Authenticate(ctx)
		if err == nil {
			return caller, nil
		}
		if !errors.Is(err, ErrNoCredentials) {
			errs = append(errs, err)
		}
	}
	if len(errs) == 0 {
		return Caller{}, fmt.Errorf("%w: send a bearer token or a client certificate issued by this CA", ErrNoCredentials)
	}
	return Caller{}, errors.Join(errs...)
}
