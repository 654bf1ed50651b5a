package caclient_test

import (
	"context"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/internal/istio"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// meshCAConfig is a GoogleCA client configuration for a real meshid ca.
func (c *realCA) meshCAConfig() caclient.Config {
	cfg := c.config()
	cfg.Provider = caclient.ProviderGoogleCA
	return cfg
}

const meshCAOK = `meshid_ca_certificate_requests_total{code="OK",service="MeshCertificateService"}`

func TestMeshCASignReturnsChainForTheTokenIdentity(t *testing.T) {
	t.Parallel()
	ca := startCA(t)
	root := ca.root(t)
	tests := []struct {
		name string
		alg  pki.KeyAlgorithm
		ttl  time.Duration
	}{
		{"P-256 one hour", pki.ECDSA, time.Hour},
		{"RSA 2048 ten minutes", pki.RSA, 10 * time.Minute},
		{"P-256 a fraction of a second rounded up", pki.ECDSA, 90*time.Second + time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			id := spiffeID("ns1", "sa1")
			cfg := ca.meshCAConfig()
			cfg.TokenPath = ca.tokenFile(t, "ns1", "sa1")
			c := newClient(t, cfg)
			csr, key := newCSR(t, tt.alg, id)
			before := time.Now()
			res := c.sign(t, csr, tt.ttl)
			after := time.Now()
			if res.err != nil {
				t.Fatal(res.err)
			}
			checkIssued(t, res.chain, id.String(), key, root)
			// The validity goes in whole seconds, rounded up: never cut.
			ttl := tt.ttl.Round(time.Second)
			if ttl < tt.ttl {
				ttl += time.Second
			}
			lo, hi := before.Add(ttl).Add(-time.Second), after.Add(ttl).Add(time.Second)
			if leaf := res.chain[0]; leaf.NotAfter.Before(lo) || leaf.NotAfter.After(hi) {
				t.Errorf("NotAfter %s, want between %s and %s", leaf.NotAfter, lo, hi)
			}
		})
	}
	t.Cleanup(func() {
		// Every request went to the Mesh CA's service, none to Istio's.
		if got := ca.metric(t, meshCAOK); got != "3" {
			t.Errorf("%s = %q, want 3", meshCAOK, got)
		}
		if got := ca.metric(t, `meshid_ca_certificate_requests_total{code="OK",service="IstioCertificateService"}`); got != "" {
			t.Errorf("IstioCertificateService answered %q requests, want none", got)
		}
	})
}

func TestMeshCARefusalsAreExplainedAndNotRetried(t *testing.T) {
	t.Parallel()
	ca := startCA(t)
	tests := []struct {
		name     string
		token    string
		csrID    pki.SPIFFEID
		wantCode codes.Code
		wantText string
		series   string
	}{
		{"expired token", ca.token(t, "ns1", "sa1", time.Now().Add(-2*time.Hour), time.Hour), spiffeID("ns1", "sa1"),
			codes.Unauthenticated, "did not accept the token", `meshid_ca_requests_refused_total{code="Unauthenticated",reason="token_expired"}`},
		{"CSR for another identity", ca.token(t, "ns1", "sa1", time.Now(), time.Hour), spiffeID("ns1", "someone-else"),
			codes.PermissionDenied, "refused to sign", `meshid_ca_requests_refused_total{code="PermissionDenied",reason="csr_identity"}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := ca.meshCAConfig()
			cfg.TokenPath = filepath.Join(t.TempDir(), "token")
			writeFile(t, cfg.TokenPath, tt.token)
			cfg.MaxAttempts = 5
			c := newClient(t, cfg)
			csr, _ := newCSR(t, pki.ECDSA, tt.csrID)
			res := c.sign(t, csr, time.Hour)
			assertRejectedOnce(t, res, ca, tt.wantCode, tt.wantText, tt.series)
		})
	}
}

// An unreachable Mesh CA is retried with backoff, and the retries reach it once it serves.
func TestMeshCARetryUntilTheCAStarts(t *testing.T) {
	t.Parallel()
	stateDir := t.TempDir()
	first := startCAIn(t, stateDir, "127.0.0.1:0")
	tokenPath := first.tokenFile(t, "ns1", "sa1")
	addr := closedAddr(t)
	c := newClient(t, caclient.Config{
		Address: addr, Provider: caclient.ProviderGoogleCA, RootCertFile: filepath.Join(stateDir, istio.RootCertFile),
		TokenPath: tokenPath, MaxAttempts: 5,
	})
	csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))
	done := make(chan signed, 1)
	go func() {
		chain, err := c.Sign(t.Context(), csr, time.Hour)
		done <- signed{chain: chain, err: err}
	}()
	waitForBackoff(t, c.clock, done) // the first attempt found nothing listening
	second := startCAIn(t, stateDir, addr)
	res := testutil.Drive(t, c.clock, backoffStep, 0, done)
	if res.err != nil {
		t.Fatalf("Sign after the CA started: %v", res.err)
	}
	if got := leafID(t, res.chain[0]); got != spiffeID("ns1", "sa1").String() {
		t.Errorf("leaf names %s", got)
	}
	if got := second.metric(t, meshCAOK); got != "1" {
		t.Errorf("%s = %q, want 1", meshCAOK, got)
	}
}

var uuidV4 = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

// What Istio's Mesh CA client sent: the token as a bearer, the location header when known, a
// UUID request id (one per request, kept by its retries), the validity in seconds.
func TestMeshCARequestOnTheWire(t *testing.T) {
	t.Parallel()
	chain := newTestChain(t)
	tests := []struct {
		name, location string
		wantParams     []string
	}{
		{"location known", "us-central1-c", []string{"location=locations/us-central1-c"}},
		{"no location", "", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			f := startFake(t, func(_ context.Context, call int) (*pb.IstioCertificateResponse, error) {
				if call == 0 {
					return nil, status.Error(codes.Unavailable, "not yet")
				}
				return &pb.IstioCertificateResponse{CertChain: chain.pem}, nil
			}, caclient.DefaultServerName)
			tokenPath := filepath.Join(t.TempDir(), "token")
			writeFile(t, tokenPath, "tok-mesh\n")
			c := newClient(t, caclient.Config{Address: f.addr, RootCertFile: f.rootFile, TokenPath: tokenPath,
				Provider: caclient.ProviderGoogleCA, Location: tt.location})
			csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))
			for range 2 { // two Signs: two request ids
				if res := c.sign(t, csr, 2*time.Hour); res.err != nil {
					t.Fatal(res.err)
				}
			}
			calls := f.recorded()
			if len(calls) != 3 {
				t.Fatalf("%d calls, want 3: a retry, then two answered", len(calls))
			}
			for i, call := range calls {
				req := call.meshReq
				if req == nil {
					t.Fatalf("call %d did not reach the Mesh CA service", i)
				}
				if got := call.md.Get("authorization"); len(got) != 1 || got[0] != "Bearer tok-mesh" {
					t.Errorf("call %d authorization = %q, want the token as a bearer", i, got)
				}
				if got := call.md.Get("x-goog-request-params"); strings.Join(got, ",") != strings.Join(tt.wantParams, ",") {
					t.Errorf("call %d x-goog-request-params = %q, want %q", i, got, tt.wantParams)
				}
				if !uuidV4.MatchString(req.GetRequestId()) {
					t.Errorf("call %d request_id %q is not a random UUID", i, req.GetRequestId())
				}
				if got := req.GetValidity().AsDuration(); got != 2*time.Hour {
					t.Errorf("call %d validity %s, want 2h", i, got)
				}
				if !strings.HasPrefix(req.GetCsr(), "-----BEGIN CERTIFICATE REQUEST-----") {
					t.Errorf("call %d CSR is not PEM", i)
				}
			}
			if calls[0].meshReq.GetRequestId() != calls[1].meshReq.GetRequestId() {
				t.Error("the retry carries another request id than its first attempt")
			}
			if calls[1].meshReq.GetRequestId() == calls[2].meshReq.GetRequestId() {
				t.Error("two requests carry the same request id")
			}
		})
	}
}

func TestNewRefusesAnUnknownProvider(t *testing.T) {
	t.Parallel()
	for _, p := range []string{"googleca", "Vault"} {
		if _, err := caclient.New(caclient.Config{Address: "127.0.0.1:1", Provider: p}); err == nil || !strings.Contains(err.Error(), p) {
			t.Errorf("New with provider %q: error %v, want one naming it", p, err)
		}
	}
}

func TestLocationFromClusterURL(t *testing.T) {
	t.Parallel()
	tests := []struct {
		url, want string
		wantErr   bool
	}{
		{"https://container.googleapis.com/v1/projects/testproj/locations/us-central1-c/clusters/cluster1", "us-central1-c", false},
		{"https://container.googleapis.com/v1/projects/p/locations/europe-west1/clusters/c", "europe-west1", false},
		{"https://gkehub.googleapis.com/projects/hub/locations/global/memberships/m1", "", false},
		{"https://container.googleapis.com/v1/projects/p/clusters/c", "", true},
		{"https://container.googleapis.com/v1/projects/p/locations//clusters/c", "", true},
		{"not a url\x7f", "", true},
	}
	for _, tt := range tests {
		got, err := caclient.LocationFromClusterURL(tt.url)
		if got != tt.want || (err != nil) != tt.wantErr {
			t.Errorf("LocationFromClusterURL(%q) = %q, %v; want %q, error %v", tt.url, got, err, tt.want, tt.wantErr)
		}
	}
}
