package agent_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/controlplane"
)

// Envoy's ADS on the agent's XDS socket reaches the CA's discovery server, authenticated with
// the workload's token, and gets the set of its namespace; /debug/config_dump shows it.
func TestXDSProxiedToTheCA(t *testing.T) {
	t.Parallel()
	xdsConfig := filepath.Join(t.TempDir(), "xds.yaml")
	if err := os.WriteFile(xdsConfig, []byte(`
clusters: [{name: backend, connect_timeout: 1s}]
namespaces:
  prod:
    clusters: [{name: prod-backend, connect_timeout: 1s}]
`), 0o600); err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, func(c *controlplane.Config) { c.XDSConfig = xdsConfig })
	cfg := e.config(t, e.tokenFile(t, "default", "demo"), nil)
	a := newAgent(t, cfg)
	runAgent(t, a)

	conn, err := grpc.NewClient("unix://"+filepath.Join(cfg.RootDir, agent.DefaultXDSSocket), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	stream, err := discoveryv3.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(t.Context(), grpc.WaitForReady(true))
	if err != nil {
		t.Fatal(err)
	}
	// The node claims prod; the token says default.
	if err := stream.Send(&discoveryv3.DiscoveryRequest{Node: &corev3.Node{Id: "sidecar~10.0.0.1~demo.prod~prod.svc.cluster.local"}, TypeUrl: resource.ClusterType}); err != nil {
		t.Fatal(err)
	}
	resp, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	c := &clusterv3.Cluster{}
	if len(resp.GetResources()) != 1 || resp.GetResources()[0].UnmarshalTo(c) != nil || c.GetName() != "backend" {
		t.Fatalf("clusters through the proxy: %v", resp.GetResources())
	}

	code, body := httpGet(t, "http://"+a.DebugAddr()+"/debug/config_dump")
	if code != 200 || !strings.Contains(body, `"backend"`) {
		t.Fatalf("/debug/config_dump: %d %s", code, body)
	}
}
