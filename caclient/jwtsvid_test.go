package caclient_test

import (
	"errors"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/meshid/meshid/caclient"
)

// The client gets a JWT-SVID of its token's identity from a real CA, and the bundle that
// verifies it, over the connection and credentials Sign uses.
func TestMintJWTSVIDAndBundleFromTheCA(t *testing.T) {
	t.Parallel()
	ca := startCA(t)
	cfg := ca.config()
	cfg.TokenPath = ca.tokenFile(t, "ns1", "sa1")
	c := newClient(t, cfg)
	bundle, err := c.FetchJWTBundle(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if bundle.TrustDomain != "spiffe://"+trustDomain || len(bundle.Keys) != 1 || len(bundle.JWKS) == 0 {
		t.Fatalf("bundle %+v", bundle)
	}
	svid, err := c.MintJWTSVID(t.Context(), []string{"bank"}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	want := spiffeID("ns1", "sa1").String()
	if svid.SPIFFEID != want {
		t.Fatalf("SPIFFE ID %s, want %s", svid.SPIFFEID, want)
	}
	claims := &jwt.RegisteredClaims{}
	if _, err := jwt.ParseWithClaims(svid.Token, claims, func(tok *jwt.Token) (any, error) {
		kid, _ := tok.Header["kid"].(string)
		key, ok := bundle.Keys[kid]
		if !ok {
			return nil, errors.New("kid not in the bundle")
		}
		return key, nil
	}, jwt.WithValidMethods([]string{"ES256"}), jwt.WithAudience("bank"), jwt.WithExpirationRequired()); err != nil {
		t.Fatal(err)
	}
	if claims.Subject != want || claims.ExpiresAt.Sub(claims.IssuedAt.Time) != time.Minute {
		t.Fatalf("sub %s, lifetime %s", claims.Subject, claims.ExpiresAt.Sub(claims.IssuedAt.Time))
	}
	if got := ca.metric(t, `meshid_ca_jwt_svids_issued_total{auth_method="jwt"}`); got != "1" {
		t.Fatalf("the CA counts %q JWT-SVIDs, want 1", got)
	}
}

// A refusal is final, as Sign's are: no retries.
func TestMintJWTSVIDRefusalIsNotRetried(t *testing.T) {
	t.Parallel()
	ca := startCA(t)
	cfg := ca.config()
	cfg.TokenPath = ca.tokenFile(t, "ns1", "sa1")
	c := newClient(t, cfg)
	_, err := c.MintJWTSVID(t.Context(), nil, 0)
	if !errors.Is(err, caclient.ErrRejected) {
		t.Fatalf("no audience: %v, want ErrRejected", err)
	}
	if armed := c.clock.Armed(); armed != 0 {
		t.Fatalf("%d backoffs for a refusal", armed)
	}
}
