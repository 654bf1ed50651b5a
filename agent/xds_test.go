package agent_test

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/testutil"
)

const xdsE2EConfig = `
listeners:
  - name: inbound
    address: {socket_address: {address: 0.0.0.0, port_value: 15006}}
    filter_chains:
      - filters:
          - name: envoy.filters.network.http_connection_manager
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
              stat_prefix: inbound
              rds: {route_config_name: local, config_source: {ads: {}, resource_api_version: V3}}
              http_filters:
                - name: envoy.filters.http.router
                  typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
clusters:
  - {name: backend, connect_timeout: 1s, type: EDS, eds_cluster_config: {eds_config: {ads: {}, resource_api_version: V3}}}
routes:
  - {name: local, virtual_hosts: [{name: all, domains: ["*"], routes: [{match: {prefix: /}, route: {cluster: backend}}]}]}
endpoints:
  - {cluster_name: backend, endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8080}}}}]}]}
namespaces:
  prod:
    clusters: [{name: prod-backend, connect_timeout: 1s}]
`

// xdsClient is an ADS client on an agent's XDS socket, as Envoy is.
func xdsClient(t *testing.T, cfg agent.Config) discoveryv3.AggregatedDiscoveryServiceClient {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+filepath.Join(cfg.RootDir, agent.DefaultXDSSocket), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return discoveryv3.NewAggregatedDiscoveryServiceClient(conn)
}

// names asks for one type on a state-of-the-world stream, ACKs the answer, and returns the
// names of the resources.
func names(t *testing.T, stream discoveryv3.AggregatedDiscoveryService_StreamAggregatedResourcesClient, typeURL string) []string {
	t.Helper()
	if err := stream.Send(&discoveryv3.DiscoveryRequest{Node: &corev3.Node{Id: "sidecar~10.0.0.1~demo.prod~prod.svc.cluster.local"}, TypeUrl: typeURL}); err != nil {
		t.Fatal(err)
	}
	resp, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: typeURL, VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()}); err != nil {
		t.Fatal(err)
	}
	return resourceNames(t, resp.GetResources())
}

func resourceNames(t *testing.T, resources []*anypb.Any) []string {
	t.Helper()
	var out []string
	for _, r := range resources {
		m, err := r.UnmarshalNew()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, cache.GetResourceName(m))
	}
	return out
}

// Envoy's ADS on the agent's XDS socket reaches the CA's discovery server, authenticated with
// the workload's token, and gets the set of its namespace whatever its node claims: listeners,
// clusters, routes and endpoints, by state of the world and by delta; an edit of the file is
// pushed through; /debug/config_dump shows the set.
func TestXDSProxiedToTheCA(t *testing.T) {
	t.Parallel()
	xdsConfig := filepath.Join(t.TempDir(), "xds.yaml")
	write := func(config string) {
		t.Helper()
		if err := os.WriteFile(xdsConfig+".tmp", []byte(config), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(xdsConfig+".tmp", xdsConfig); err != nil {
			t.Fatal(err)
		}
	}
	write(xdsE2EConfig)
	e := newEnv(t, func(c *controlplane.Config) { c.XDSConfig = xdsConfig })
	cfg := e.config(t, e.tokenFile(t, "default", "demo"), nil)
	a := newAgent(t, cfg)
	runAgent(t, a)
	client := xdsClient(t, cfg)

	stream, err := client.StreamAggregatedResources(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for typeURL, want := range map[string]string{
		resource.ClusterType: "backend", resource.ListenerType: "inbound", resource.RouteType: "local", resource.EndpointType: "backend",
	} {
		if got := names(t, stream, typeURL); len(got) != 1 || got[0] != want {
			t.Errorf("%s through the proxy: %v, want [%s]", typeURL, got, want)
		}
	}

	delta, err := client.DeltaAggregatedResources(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := delta.Send(&discoveryv3.DeltaDiscoveryRequest{Node: &corev3.Node{Id: "sidecar"}, TypeUrl: resource.ClusterType, ResourceNamesSubscribe: []string{"*"}}); err != nil {
		t.Fatal(err)
	}
	dresp, err := delta.Recv()
	if err != nil || len(dresp.GetResources()) != 1 || dresp.GetResources()[0].GetName() != "backend" {
		t.Fatalf("delta clusters through the proxy: %v, %v", dresp, err)
	}

	// The edit reaches the open state-of-the-world stream through the proxy.
	// Every type's version follows the file, so the other types may come first.
	clusters := make(chan *discoveryv3.DiscoveryResponse, 1)
	go func() {
		defer close(clusters)
		for {
			resp, err := stream.Recv()
			if err != nil || resp.GetTypeUrl() == resource.ClusterType {
				clusters <- resp
				return
			}
		}
	}()
	baseline := e.clock.PendingTimers()
	write(strings.Replace(xdsE2EConfig, "connect_timeout: 1s, type: EDS", "connect_timeout: 2s, type: EDS", 1))
	resp := testutil.Drive(t, e.clock, filewatch.DefaultDebounce, baseline, clusters)
	c := &clusterv3.Cluster{}
	if len(resp.GetResources()) != 1 || resp.GetResources()[0].UnmarshalTo(c) != nil || c.GetConnectTimeout().AsDuration() != 2*time.Second {
		t.Fatalf("after the edit: %v", resp)
	}

	code, body := unixGet(t, a.XDSDebugSocket(), "/debug/config_dump")
	if code != 200 || !strings.Contains(body, `"backend"`) || !strings.Contains(body, `"inbound"`) {
		t.Fatalf("/debug/config_dump: %d %s", code, body)
	}
}

// An agent of another namespace gets that namespace's set.
func TestXDSOfAnotherNamespace(t *testing.T) {
	t.Parallel()
	e := newXDSEnv(t)
	cfg := e.config(t, e.tokenFile(t, "prod", "demo"), nil)
	cfg.Identity.Namespace = "prod"
	runAgent(t, newAgent(t, cfg))
	stream, err := xdsClient(t, cfg).StreamAggregatedResources(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if got := names(t, stream, resource.ClusterType); len(got) != 1 || got[0] != "prod-backend" {
		t.Errorf("a prod agent got clusters %v, want [prod-backend]", got)
	}
}

// A VM whose provisioned token is gone keeps its configuration: the proxy's upstream stream
// presents the workload certificate the agent holds.
func TestXDSAfterTheTokenIsGone(t *testing.T) {
	t.Parallel()
	e := newXDSEnv(t)
	tokenPath := e.tokenFile(t, "prod", "demo")
	cfg := e.config(t, tokenPath, nil)
	cfg.Identity.Namespace = "prod"
	a := newAgent(t, cfg)
	certs := issued(t, a)
	runAgent(t, a)
	receive(t, certs, "first certificate")
	if err := os.Remove(tokenPath); err != nil {
		t.Fatal(err)
	}
	stream, err := xdsClient(t, cfg).StreamAggregatedResources(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if got := names(t, stream, resource.ClusterType); len(got) != 1 || got[0] != "prod-backend" {
		t.Errorf("without a token the agent got clusters %v, want [prod-backend]", got)
	}
}

// emptyConfiguration asks, as Envoy does, for the listeners and the clusters through the agent's
// XDS socket, by state of the world then by delta, and checks that each is answered with no
// resource and a version (issue 26: not Unimplemented), and that an ACK is not answered again.
func emptyConfiguration(t *testing.T, client discoveryv3.AggregatedDiscoveryServiceClient) {
	t.Helper()
	stream, err := client.StreamAggregatedResources(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	node := &corev3.Node{Id: "sidecar~10.0.0.1~demo.default~default.svc.cluster.local"}
	for _, typeURL := range []string{resource.ListenerType, resource.ClusterType} {
		if err := stream.Send(&discoveryv3.DiscoveryRequest{Node: node, TypeUrl: typeURL}); err != nil {
			t.Fatal(err)
		}
		// After the listeners' ACK the next answer is the clusters', not the listeners' again.
		resp, err := stream.Recv()
		if err != nil || resp.GetTypeUrl() != typeURL || len(resp.GetResources()) != 0 || resp.GetVersionInfo() == "" {
			t.Fatalf("%s through the proxy: %v, %v; want no resource, with a version", typeURL, resp, err)
		}
		if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: typeURL, VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()}); err != nil {
			t.Fatal(err)
		}
	}
	delta, err := client.DeltaAggregatedResources(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for _, typeURL := range []string{resource.ListenerType, resource.ClusterType} {
		if err := delta.Send(&discoveryv3.DeltaDiscoveryRequest{Node: node, TypeUrl: typeURL}); err != nil {
			t.Fatal(err)
		}
		resp, err := delta.Recv()
		if err != nil || resp.GetTypeUrl() != typeURL || len(resp.GetResources()) != 0 || resp.GetSystemVersionInfo() == "" {
			t.Fatalf("delta %s through the proxy: %v, %v; want no resource, with a version", typeURL, resp, err)
		}
		if err := delta.Send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: typeURL, ResponseNonce: resp.GetNonce()}); err != nil {
			t.Fatal(err)
		}
	}
}

// Issue 26: an agent whose CA runs without --xds-config gives Envoy an empty configuration, so
// that Envoy is up with no listeners instead of retrying Unimplemented, and /debug/config_dump
// answers (it answered 502).
func TestXDSProxiedToACAWithoutConfig(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := e.config(t, e.tokenFile(t, "default", "demo"), nil)
	a := newAgent(t, cfg)
	runAgent(t, a)
	emptyConfiguration(t, xdsClient(t, cfg))
	if code, body := unixGet(t, a.XDSDebugSocket(), "/debug/config_dump"); code != http.StatusOK || !strings.Contains(body, "configs") {
		t.Fatalf("/debug/config_dump: %d %s", code, body)
	}
}

// The same with the embedded control plane and no xds.yaml in its state dir; its start log
// says where the file goes, once.
func TestXDSEmbeddedWithoutConfig(t *testing.T) {
	t.Parallel()
	logs := newLogSink(t)
	cfg := testConfig(t, newFakeClock(), logs, nil)
	a := newAgent(t, cfg)
	runAgent(t, a)
	emptyConfiguration(t, xdsClient(t, cfg))
	if code, body := unixGet(t, a.XDSDebugSocket(), "/debug/config_dump"); code != http.StatusOK {
		t.Fatalf("/debug/config_dump: %d %s", code, body)
	}
	said := logs.records(t, "no xds.yaml in the state dir: Envoy gets an empty configuration (no listeners, no clusters)")
	want := filepath.Join(cfg.RootDir, agent.DefaultEmbeddedDir, controlplane.EmbeddedXDSConfig)
	if len(said) != 1 || said[0]["path"] != want {
		t.Fatalf("the start log said %v, want once with path %s", said, want)
	}
}
