package agent_test

import (
	"testing"
	"time"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds/sdstest"
)

// With CA_PROVIDER=GoogleCA the agent gets its certificate, and its renewal, over the Mesh CA
// protocol, from meshid ca and from the embedded control plane alike, and serves it over SDS.
func TestGoogleCAProvider(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		setup func(t *testing.T, logs *logSink) (agent.Config, *testutil.FakeClock, string)
	}{
		{"meshid ca", func(t *testing.T, logs *logSink) (agent.Config, *testutil.FakeClock, string) {
			e := newEnv(t, func(c *controlplane.Config) { c.Logger = logs.logger() })
			cfg := e.config(t, e.tokenFile(t, "default", "demo"), nil)
			cfg.Logger = logs.logger()
			return cfg, e.clock, demoID
		}},
		{"embedded control plane", func(t *testing.T, logs *logSink) (agent.Config, *testutil.FakeClock, string) {
			clk := newFakeClock()
			cfg := testConfig(t, clk, logs, nil)
			cfg.Certificate.TTL = 30 * time.Minute
			return cfg, clk, embeddedID
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			logs := newLogSink(t)
			cfg, clk, id := tt.setup(t, logs)
			cfg.CA.Provider = agent.CAProviderGoogleCA
			if err := cfg.Validate(); err != nil {
				t.Fatal(err)
			}
			a := newAgent(t, cfg)
			runAgent(t, a)
			envoy := sdstest.Dial(t, a.SocketPath())
			sotw := envoy.StreamSecrets()
			sotw.Subscribe(secretNames...)
			last, initial := sotw.RecvAll(secretNames...)
			sotw.Ack(last, secretNames...)
			roots := sdstest.Roots(t, initial["ROOTCA"])
			chain := workloadChain(t, initial["default"])
			checkVerifies(t, chain, roots, id, clk.Now())

			rotate(t, clk, a)
			renewed := workloadChain(t, sotw.Recv().Secrets["default"])
			checkVerifies(t, renewed, roots, id, clk.Now())
			if serialOf(renewed) == serialOf(chain) {
				t.Fatal("the renewal pushed the same serial")
			}

			if src := logs.records(t, "CA source"); len(src) != 1 || src[0]["ca_provider"] != agent.CAProviderGoogleCA {
				t.Errorf("CA source logged as %v, want ca_provider GoogleCA", src)
			}
			// The CA's own account: both certificates came through its Mesh CA service.
			got := logs.records(t, "certificate issued")
			if len(got) != 2 {
				t.Fatalf("the CA issued %d certificates, want 2", len(got))
			}
			for _, rec := range got {
				if rec["grpc_service"] != "MeshCertificateService" || rec["identity"] != id {
					t.Errorf("issued through %v for %v, want MeshCertificateService for %s", rec["grpc_service"], rec["identity"], id)
				}
			}
		})
	}
}

// With credential files the CA is not asked: CA_PROVIDER is said to go unused, not refused.
func TestGoogleCAProviderUnusedWithFiles(t *testing.T) {
	t.Parallel()
	logs := newLogSink(t)
	cfg := testConfig(t, newFakeClock(), logs, nil)
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	cfg.SDS.CredentialsDir = credentialsDir(t, newCredentials(t, root, embeddedID))
	cfg.CA.Provider = agent.CAProviderGoogleCA
	a := newAgent(t, cfg)
	runAgent(t, a)
	if got := logs.records(t, "CA provider unused: no CA is asked for certificates"); len(got) != 1 || got[0]["source"] != string(agent.SourceFiles) {
		t.Fatalf("logged %v, want one line naming the files source", got)
	}
}

func TestCAProviderConfigRefused(t *testing.T) {
	t.Parallel()
	const clusterURL = "https://container.googleapis.com/v1/projects/p/locations/us-central1-c/clusters/c"
	cases := []refusal{
		{"unknown provider", func(c *agent.Config) { withCA(c); c.CA.Provider = "googleca" }, "CA.Provider", "is unknown"},
		{"cluster URL with Citadel", func(c *agent.Config) { withCA(c); c.CA.GKEClusterURL = clusterURL }, "CA.GKEClusterURL", "has no effect without CA.Provider GoogleCA"},
		{"cluster URL naming no location", func(c *agent.Config) {
			withCA(c)
			c.CA.Provider, c.CA.GKEClusterURL = agent.CAProviderGoogleCA, "https://container.googleapis.com/v1/projects/p"
		}, "CA.GKEClusterURL", "names no location"},
	}
	wantRefused(t, cases)
}
