package agent_test

import (
	"context"
	"strings"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/jwtsvid"
	spiffeapi "github.com/spiffe/go-spiffe/v2/workloadapi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/testutil"
)

// go-spiffe's own Workload API client, unmodified, gets JWT-SVIDs of the agent's identity from a
// running agent with its embedded CA: FetchJWTSVID (cached: the same token twice), the JWT bundle
// (FetchJWTBundles), which go-spiffe's jwtsvid.ParseAndValidate verifies the token with, and
// ValidateJWTSVID on the agent, which refuses another audience.
func TestGoSPIFFEJWTSVIDAgainstTheAgent(t *testing.T) {
	t.Parallel()
	clk := newFakeClock() // shared by the agent and its embedded CA
	a := newAgent(t, testConfig(t, clk, newLogSink(t), nil))
	runAgent(t, a)
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	addr := spiffeapi.WithAddr("unix://" + a.SocketPath())

	svid, err := spiffeapi.FetchJWTSVID(ctx, jwtsvid.Params{Audience: "bank", ExtraAudiences: []string{"shop"}}, addr)
	if err != nil {
		t.Fatalf("FetchJWTSVID: %v", err)
	}
	if svid.ID.String() != embeddedID || strings.Join(svid.Audience, ",") != "bank,shop" {
		t.Fatalf("JWT-SVID of %s for %v, want %s for [bank shop]", svid.ID, svid.Audience, embeddedID)
	}
	again, err := spiffeapi.FetchJWTSVID(ctx, jwtsvid.Params{Audience: "shop", ExtraAudiences: []string{"bank"}}, addr)
	if err != nil {
		t.Fatal(err)
	}
	if again.Marshal() != svid.Marshal() {
		t.Fatal("the same audience set got a new JWT-SVID: the agent's cache missed")
	}

	bundles, err := spiffeapi.FetchJWTBundles(ctx, addr)
	if err != nil {
		t.Fatalf("FetchJWTBundles: %v", err)
	}
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	if _, err := bundles.GetJWTBundleForTrustDomain(td); err != nil {
		t.Fatal(err)
	}
	parsed, err := jwtsvid.ParseAndValidate(svid.Marshal(), bundles, []string{"bank"})
	if err != nil {
		t.Fatalf("go-spiffe's ParseAndValidate with the fetched bundle: %v", err)
	}
	if parsed.ID.String() != embeddedID {
		t.Fatalf("go-spiffe reads %s, want %s", parsed.ID, embeddedID)
	}

	validated, err := spiffeapi.ValidateJWTSVID(ctx, svid.Marshal(), "shop", addr)
	if err != nil {
		t.Fatalf("ValidateJWTSVID: %v", err)
	}
	if validated.ID.String() != embeddedID || validated.Claims["sub"] != embeddedID {
		t.Fatalf("validated %s with claims %v", validated.ID, validated.Claims)
	}
	if _, err := spiffeapi.ValidateJWTSVID(ctx, svid.Marshal(), "elsewhere", addr); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("ValidateJWTSVID for another audience: %v, want InvalidArgument", err)
	}
	if _, err := spiffeapi.FetchJWTSVID(ctx, jwtsvid.Params{}, addr); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("FetchJWTSVID without an audience: %v, want InvalidArgument", err)
	}

	if got := metric(t, a, `meshid_agent_workload_api_jwt_svids_total{source="ca"}`); got != "1" {
		t.Errorf("%s JWT-SVIDs signed by the CA, want 1", got)
	}
	if got := metric(t, a, `meshid_agent_workload_api_jwt_svids_total{source="cache"}`); got != "1" {
		t.Errorf("%s JWT-SVIDs from the cache, want 1", got)
	}
}

// With mounted credentials no CA signs JWT-SVIDs: the JWT methods say so with
// FailedPrecondition, while the X.509-SVID is served.
func TestJWTSVIDWithoutACA(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t, newFakeClock(), nil, nil)
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	cfg.SDS.CredentialsDir = credentialsDir(t, newCredentials(t, root, embeddedID))
	a := newAgent(t, cfg)
	runAgent(t, a)
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	addr := spiffeapi.WithAddr("unix://" + a.SocketPath())
	if _, err := spiffeapi.FetchX509Context(ctx, addr); err != nil {
		t.Fatalf("FetchX509Context: %v", err)
	}
	_, err := spiffeapi.FetchJWTSVID(ctx, jwtsvid.Params{Audience: "bank"}, addr)
	if st := status.Convert(err); st.Code() != codes.FailedPrecondition || !strings.Contains(st.Message(), "no CA signs JWT-SVIDs") {
		t.Fatalf("FetchJWTSVID: %v, want FailedPrecondition: no CA", err)
	}
	if _, err := spiffeapi.FetchJWTBundles(ctx, addr); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("FetchJWTBundles: %v, want FailedPrecondition", err)
	}
}
