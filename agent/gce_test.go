package agent_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/controlplane/controlplanetest"
)

// gceMetadata is a metadata server on loopback as Google documents it: it answers the default
// service account's identity token for audience istio-ca, format=full, to a request with
// Metadata-Flavor: Google, with the header; the token is the CA's own kind, minted with its
// token key for default/demo. fetches counts the tokens it gave.
func gceMetadata(t *testing.T, e *env) (host string, fetches *atomic.Int32) {
	t.Helper()
	fetches = new(atomic.Int32)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		if r.Header.Get("Metadata-Flavor") != "Google" || r.URL.Path != "/computeMetadata/v1/instance/service-accounts/default/identity" ||
			q.Get("audience") != "istio-ca" || q.Get("format") != "full" {
			http.Error(w, "refused", http.StatusForbidden)
			return
		}
		fetches.Add(1)
		w.Header().Set("Metadata-Flavor", "Google")
		_, _ = fmt.Fprint(w, controlplanetest.Token(t, e.stateDir, "default", "demo", e.clock.Now(), time.Hour))
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://"), fetches
}

// With CREDENTIAL_FETCHER_TYPE=GoogleComputeEngine and no token file, the agent gets its
// certificate with the metadata server's token, and Envoy's ADS through the agent gets its
// configuration; the CA client and the xDS proxy share one fetcher, so one token serves both.
func TestGCECredentialFetcher(t *testing.T) {
	t.Parallel()
	e := newXDSEnv(t)
	host, fetches := gceMetadata(t, e)
	cfg := e.config(t, filepath.Join(e.dir, "no-such-token"), nil)
	cfg.CA.CredentialFetcherType = agent.CredentialFetcherGCE
	cfg.CA.CredentialIdentityProvider = "istio-ca"
	cfg.CA.MetadataHost = host
	certificateAndClusters(t, cfg)
	if n := fetches.Load(); n != 1 {
		t.Fatalf("%d tokens fetched, want 1 shared by the CA client and the xDS proxy", n)
	}
	// Past the token's refresh point, and the certificate's expiry, on the wall clock only (no
	// renewal fires): a new ADS stream's upstream stream asks the fetcher for a fresh token, and
	// that token alone authenticates it.
	e.clock.Step(55 * time.Minute)
	stream2, err := xdsClient(t, cfg).StreamAggregatedResources(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if got := names(t, stream2, resource.ListenerType); len(got) != 1 || got[0] != "inbound" {
		t.Fatalf("listeners through the proxy: %v, want [inbound]", got)
	}
	if n := fetches.Load(); n != 2 {
		t.Fatalf("%d tokens fetched, want a second one for the xDS proxy's new stream", n)
	}
}

func TestGCECredentialFetcherConfigRefused(t *testing.T) {
	t.Parallel()
	cases := []refusal{
		{"unknown type", func(c *agent.Config) { withCA(c); c.CA.CredentialFetcherType = "AWS" }, "CA.CredentialFetcherType", "is unknown"},
		{"no audience", func(c *agent.Config) { withCA(c); c.CA.CredentialFetcherType = agent.CredentialFetcherGCE },
			"CA.CredentialIdentityProvider", "is required with CA.CredentialFetcherType GoogleComputeEngine"},
		{"embedded", func(c *agent.Config) {
			c.CA.CredentialFetcherType, c.CA.CredentialIdentityProvider = agent.CredentialFetcherGCE, "istio-ca"
		}, "CA.CredentialFetcherType", "needs CA.Address"},
		{"audience without GCE", func(c *agent.Config) { withCA(c); c.CA.CredentialIdentityProvider = "istio-ca" },
			"CA.CredentialIdentityProvider", "has no effect"},
		{"host without GCE", func(c *agent.Config) { withCA(c); c.CA.MetadataHost = "metadata" }, "CA.MetadataHost", "has no effect"},
		{"bad host", func(c *agent.Config) {
			withCA(c)
			c.CA.CredentialFetcherType, c.CA.CredentialIdentityProvider, c.CA.MetadataHost = agent.CredentialFetcherGCE, "istio-ca", "http://metadata/"
		}, "CA.MetadataHost", "without a scheme"},
	}
	wantRefused(t, cases)
}
