package controlplane_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/workloadapi"
)

func jwtClient(t *testing.T, addr, stateDir, tok string) *caclient.Client {
	t.Helper()
	c, err := caclient.New(caclient.Config{Address: addr, RootCertFile: filepath.Join(stateDir, "root-cert.pem"),
		Token: func(context.Context) (string, error) { return tok, nil }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// The JWT-SVID key is made at the first start, beside the token key and apart from it, and
// kept: after a restart the CA publishes the same kid, and JWT-SVIDs signed before still verify.
func TestRestartKeepsTheJWTSVIDKey(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	runBriefly(t, testConfig(dir))
	keyPEM := readFile(t, ca.JWTSVIDKeyPath(dir))
	if keyPEM == readFile(t, ca.TokenKeyPath(dir)) {
		t.Fatal("the JWT-SVID key is the token key")
	}
	if info, err := os.Stat(ca.JWTSVIDKeyPath(dir)); err != nil || info.Mode().Perm() != 0o600 {
		t.Fatalf("JWT-SVID key: %v, %v; want mode 0600", info, err)
	}

	cp := start(t, testConfig(dir))
	bundle, err := jwtClient(t, cp.GRPCAddr(), dir, mint(t, dir, "default", "demo")).FetchJWTBundle(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if readFile(t, ca.JWTSVIDKeyPath(dir)) != keyPEM {
		t.Fatal("the JWT-SVID key file changed across a restart")
	}
	signer, created, err := ca.LoadOrCreateJWTSVIDSigner(dir, "cluster.local", 0)
	if err != nil || created {
		t.Fatalf("the key: created %v, %v", created, err)
	}
	if _, ok := bundle.Keys[signer.KeyID(time.Now())]; !ok || len(bundle.Keys) != 1 {
		t.Fatalf("the restarted CA publishes %v, not the kept key %s", bundle.Keys, signer.KeyID(time.Now()))
	}
}

// A JWT-SVID, even one for the CA's own audience, authenticates no one at the CA: it is signed
// by a key the CA does not trust for service-account tokens (by default, the state dir's token
// key).
func TestJWTSVIDIsNoTokenAtTheCA(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	cp := start(t, testConfig(dir))
	svid, err := jwtClient(t, cp.GRPCAddr(), dir, mint(t, dir, "default", "demo")).MintJWTSVID(t.Context(), []string{"istio-ca"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := createCertificate(t, cp.GRPCAddr(), filepath.Join(dir, "root-cert.pem"), svid.Token, svid.SPIFFEID); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("CreateCertificate with a JWT-SVID: %v, want Unauthenticated", err)
	}
	if _, err := jwtClient(t, cp.GRPCAddr(), dir, svid.Token).MintJWTSVID(t.Context(), []string{"a"}, 0); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("MintJWTSVID with a JWT-SVID: %v, want Unauthenticated", err)
	}
}

// A JWT-SVID key adopted while the CA runs signs only once every agent has fetched the bundle
// that holds it: the lead is longer than the agents' bundle refresh.
func TestJWTSVIDKeyLeadCoversTheAgentsRefresh(t *testing.T) {
	t.Parallel()
	if ca.JWTSVIDKeyLead < 2*workloadapi.DefaultJWTBundleRefresh {
		t.Fatalf("a new JWT-SVID key signs %s after it is published, but agents refresh their bundle every %s: one fetched just before would lack it",
			ca.JWTSVIDKeyLead, workloadapi.DefaultJWTBundleRefresh)
	}
}
