package envoy_test

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	upstreamhttpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/meshid/meshid/agent/envoy"
)

func testConfig() envoy.BootstrapConfig {
	return envoy.BootstrapConfig{
		Node: envoy.SidecarNode(envoy.Workload{
			InstanceIP: "10.1.2.3", PodName: "web-7d9f", Namespace: "shop", ServiceAccount: "web",
			ClusterID: "Kubernetes", Meta: map[string]string{"FOO": "bar"},
		}),
		SDSSocket:      "/run/uds/socket",
		XDSSocket:      "/run/proxy/XDS",
		AdminPort:      15000,
		PrometheusPort: 15090,
	}
}

func build(t *testing.T, cfg envoy.BootstrapConfig) *bootstrapv3.Bootstrap {
	t.Helper()
	b, err := envoy.Bootstrap(cfg)
	if err != nil {
		t.Fatalf("Bootstrap: %v", err)
	}
	return b
}

func cluster(b *bootstrapv3.Bootstrap, name string) *clusterv3.Cluster {
	for _, c := range b.GetStaticResources().GetClusters() {
		if c.GetName() == name {
			return c
		}
	}
	return nil
}

func endpointAddress(c *clusterv3.Cluster) *corev3.Address {
	return c.GetLoadAssignment().GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint().GetAddress()
}

// What is written is what Envoy reads: the JSON parses back into the same Bootstrap with Envoy's
// protos, and passes ValidateAll.
func TestBootstrapRoundTrips(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]envoy.BootstrapConfig{
		"full": testConfig(),
		"no xds, no stats": func() envoy.BootstrapConfig {
			c := testConfig()
			c.XDSSocket, c.PrometheusPort = "", 0
			return c
		}(),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := build(t, cfg)
			data, err := envoy.MarshalBootstrap(b)
			if err != nil {
				t.Fatal(err)
			}
			var back bootstrapv3.Bootstrap
			if err := protojson.Unmarshal(data, &back); err != nil {
				t.Fatalf("the bootstrap does not parse as a Bootstrap: %v\n%s", err, data)
			}
			if err := back.ValidateAll(); err != nil {
				t.Fatalf("ValidateAll: %v", err)
			}
			if !proto.Equal(&back, b) {
				t.Errorf("round trip changed the bootstrap:\n%s", data)
			}
		})
	}
}

func TestBootstrapSocketsAndADS(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	b := build(t, cfg)
	for name, path := range map[string]string{envoy.SDSClusterName: cfg.SDSSocket, envoy.XDSClusterName: cfg.XDSSocket} {
		c := cluster(b, name)
		if c == nil {
			t.Fatalf("no cluster %s", name)
		}
		if got := endpointAddress(c).GetPipe().GetPath(); got != path {
			t.Errorf("cluster %s pipe = %q, want %q", name, got, path)
		}
		if c.GetType() != clusterv3.Cluster_STATIC || c.GetConnectTimeout().AsDuration().Seconds() != 1 {
			t.Errorf("cluster %s: type %v, connect timeout %v; want STATIC, 1s", name, c.GetType(), c.GetConnectTimeout())
		}
		var opts upstreamhttpv3.HttpProtocolOptions
		if err := c.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].UnmarshalTo(&opts); err != nil {
			t.Fatalf("cluster %s protocol options: %v", name, err)
		}
		if opts.GetExplicitHttpConfig().GetHttp2ProtocolOptions() == nil {
			t.Errorf("cluster %s does not speak HTTP/2, which gRPC needs", name)
		}
	}
	ads := b.GetDynamicResources().GetAdsConfig()
	if ads.GetApiType() != corev3.ApiConfigSource_GRPC || ads.GetTransportApiVersion() != corev3.ApiVersion_V3 ||
		ads.GetGrpcServices()[0].GetEnvoyGrpc().GetClusterName() != envoy.XDSClusterName || !ads.GetSetNodeOnFirstMessageOnly() {
		t.Errorf("ads_config = %v", ads)
	}
	for name, src := range map[string]*corev3.ConfigSource{"cds": b.GetDynamicResources().GetCdsConfig(), "lds": b.GetDynamicResources().GetLdsConfig()} {
		if src.GetAds() == nil || src.GetResourceApiVersion() != corev3.ApiVersion_V3 {
			t.Errorf("%s_config = %v, want ads, V3", name, src)
		}
	}
	admin := b.GetAdmin().GetAddress().GetSocketAddress()
	if admin.GetAddress() != "127.0.0.1" || admin.GetPortValue() != 15000 {
		t.Errorf("admin on %s:%d, want 127.0.0.1:15000", admin.GetAddress(), admin.GetPortValue())
	}
}

// An agent that proxies no xDS gets a bootstrap without ADS: Envoy would retry a socket no one
// serves.
func TestBootstrapWithoutXDS(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	cfg.XDSSocket = ""
	b := build(t, cfg)
	if b.GetDynamicResources() != nil {
		t.Errorf("dynamic_resources = %v, want none", b.GetDynamicResources())
	}
	if cluster(b, envoy.XDSClusterName) != nil {
		t.Error("an xds-grpc cluster without an XDS socket")
	}
	if cluster(b, envoy.SDSClusterName) == nil {
		t.Error("no sds-grpc cluster")
	}
}

func TestBootstrapStatsListener(t *testing.T) {
	t.Parallel()
	for _, port := range []int{0, 15090, 9999} {
		cfg := testConfig()
		cfg.PrometheusPort, cfg.AdminPort = port, 15111
		b := build(t, cfg)
		listeners := b.GetStaticResources().GetListeners()
		statsCluster := cluster(b, envoy.StatsClusterName)
		if port == 0 {
			if len(listeners) != 0 || statsCluster != nil {
				t.Errorf("port 0: listeners %v, cluster %v; want none", listeners, statsCluster)
			}
			continue
		}
		if len(listeners) != 1 || statsCluster == nil {
			t.Fatalf("port %d: %d listeners, cluster %v; want the stats listener and cluster", port, len(listeners), statsCluster)
		}
		l := listeners[0]
		addr := l.GetAddress().GetSocketAddress()
		if l.GetName() != envoy.StatsListenerName || addr.GetAddress() != "0.0.0.0" || int(addr.GetPortValue()) != port {
			t.Errorf("listener %s on %s:%d, want %s on 0.0.0.0:%d", l.GetName(), addr.GetAddress(), addr.GetPortValue(), envoy.StatsListenerName, port)
		}
		var hcm hcmv3.HttpConnectionManager
		if err := l.GetFilterChains()[0].GetFilters()[0].GetTypedConfig().UnmarshalTo(&hcm); err != nil {
			t.Fatal(err)
		}
		routes := hcm.GetRouteConfig().GetVirtualHosts()[0].GetRoutes()
		want := &routev3.Route{
			Match:  &routev3.RouteMatch{PathSpecifier: &routev3.RouteMatch_Prefix{Prefix: "/stats/prometheus"}},
			Action: &routev3.Route_Route{Route: &routev3.RouteAction{ClusterSpecifier: &routev3.RouteAction_Cluster{Cluster: envoy.StatsClusterName}}},
		}
		if len(routes) != 1 || !proto.Equal(routes[0], want) {
			t.Errorf("routes = %v, want %v", routes, want)
		}
		if filters := hcm.GetHttpFilters(); len(filters) != 1 || filters[0].GetName() != "envoy.filters.http.router" {
			t.Errorf("http_filters = %v, want the router", filters)
		}
		to := endpointAddress(statsCluster).GetSocketAddress()
		if to.GetAddress() != "127.0.0.1" || to.GetPortValue() != 15111 {
			t.Errorf("prometheus_stats leads to %s:%d, want the admin, 127.0.0.1:15111", to.GetAddress(), to.GetPortValue())
		}
	}
}

func TestSidecarNode(t *testing.T) {
	t.Parallel()
	n := envoy.SidecarNode(envoy.Workload{
		InstanceIP: "10.1.2.3", PodName: "web-7d9f", Namespace: "shop", ServiceAccount: "web", ClusterID: "c1",
		// The identity's own keys win over ISTIO_META_*.
		Meta: map[string]string{"FOO": "bar", "NAMESPACE": "other", "CLUSTER_ID": "c0"},
	})
	if want := "sidecar~10.1.2.3~web-7d9f.shop~shop.svc.cluster.local"; n.ID != want {
		t.Errorf("id = %q, want %q", n.ID, want)
	}
	if n.Cluster != "web.shop" {
		t.Errorf("cluster = %q, want web.shop", n.Cluster)
	}
	want := map[string]string{
		"FOO": "bar", "NAMESPACE": "shop", "NAME": "web-7d9f", "POD_NAME": "web-7d9f",
		"INSTANCE_IPS": "10.1.2.3", "SERVICE_ACCOUNT": "web", "CLUSTER_ID": "c1",
	}
	if len(n.Metadata) != len(want) {
		t.Errorf("metadata = %v, want %v", n.Metadata, want)
	}
	for k, v := range want {
		if n.Metadata[k] != v {
			t.Errorf("metadata %s = %q, want %q", k, n.Metadata[k], v)
		}
	}
	if n := envoy.SidecarNode(envoy.Workload{Namespace: "a", Meta: map[string]string{"CLUSTER_ID": "c0"}}); n.Metadata["CLUSTER_ID"] != "c0" {
		t.Errorf("without a cluster id, ISTIO_META_CLUSTER_ID's stays: got %q", n.Metadata["CLUSTER_ID"])
	}

	b := build(t, envoy.BootstrapConfig{Node: n, SDSSocket: "/s", AdminPort: 1})
	if b.GetNode().GetId() != n.ID || b.GetNode().GetCluster() != n.Cluster {
		t.Errorf("node = %v", b.GetNode())
	}
	fields := b.GetNode().GetMetadata().GetFields()
	for k, v := range want {
		if fields[k].GetStringValue() != v {
			t.Errorf("node metadata %s = %v, want %q", k, fields[k], v)
		}
	}
}

// The override is merged as Istio merges ISTIO_BOOTSTRAP_OVERRIDE: a scalar replaces, a repeated
// field is appended to.
func TestBootstrapOverrideMerges(t *testing.T) {
	t.Parallel()
	for name, override := range map[string]string{
		"yaml": `
admin:
  address: {socket_address: {port_value: 16000}}
node:
  metadata: {EXTRA: "yes"}
static_resources:
  clusters:
  - name: zipkin
    type: STRICT_DNS
    connect_timeout: 2s
    load_assignment:
      cluster_name: zipkin
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: zipkin.istio-system, port_value: 9411}}}
`,
		"json": `{"admin": {"address": {"socketAddress": {"portValue": 16000}}},
"node": {"metadata": {"EXTRA": "yes"}},
"staticResources": {"clusters": [{"name": "zipkin", "type": "STRICT_DNS", "connectTimeout": "2s"}]}}`,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			cfg := testConfig()
			base := build(t, cfg)
			cfg.Override, cfg.OverridePath = []byte(override), "/etc/override."+name
			b := build(t, cfg)
			admin := b.GetAdmin().GetAddress().GetSocketAddress()
			if admin.GetPortValue() != 16000 || admin.GetAddress() != "127.0.0.1" {
				t.Errorf("admin on %s:%d, want 127.0.0.1:16000 (the port replaced, the address kept)", admin.GetAddress(), admin.GetPortValue())
			}
			got, was := b.GetStaticResources().GetClusters(), base.GetStaticResources().GetClusters()
			if len(got) != len(was)+1 || got[len(got)-1].GetName() != "zipkin" {
				t.Fatalf("clusters %d, last %q; want the %d built and zipkin appended", len(got), got[len(got)-1].GetName(), len(was))
			}
			for i := range was {
				if !proto.Equal(got[i], was[i]) {
					t.Errorf("built cluster %s changed by the override", was[i].GetName())
				}
			}
			meta := b.GetNode().GetMetadata().GetFields()
			if meta["EXTRA"].GetStringValue() != "yes" || meta["NAMESPACE"].GetStringValue() != "shop" {
				t.Errorf("node metadata %v: want EXTRA added and NAMESPACE kept", meta)
			}
		})
	}
}

func TestBootstrapOverrideRefused(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, override string
		want           []string // in the message, besides the file
	}{
		{"unknown field", "admin: {address: {socket_address: {port_value: 1}}}\nstatic_resources:\n  clusters:\n  - name: x\n    conect_timeout: 1s\n", []string{`unknown field "conect_timeout"`}},
		{"unknown field, JSON", `{"admni": {}}`, []string{`unknown field "admni"`}},
		{"bad enum", "static_resources:\n  clusters:\n  - name: x\n    type: STATICX\n", []string{"field type", "STATICX"}},
		{"wrong type", `{"admin": {"address": {"socket_address": {"port_value": "x"}}}}`, []string{"portValue"}},
		{"bad yaml", "static_resources: [clusters\n", []string{"YAML", "line 1"}},
		{"cluster without a name", "static_resources:\n  clusters:\n  - type: STATIC\n", []string{"Clusters[3]", "Cluster.Name"}},
		{"invalid typed_config", `
static_resources:
  listeners:
  - name: l
    filter_chains:
    - filters:
      - name: hcm
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ""
`, []string{"static_resources.listeners[1].filter_chains[0].filters[0].typed_config", "HttpConnectionManager.StatPrefix"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := testConfig()
			cfg.Override, cfg.OverridePath = []byte(tc.override), "/etc/istio/custom-bootstrap.yaml"
			b, err := envoy.Bootstrap(cfg)
			if err == nil {
				t.Fatalf("Bootstrap accepted the override: %v", b)
			}
			if !errors.Is(err, envoy.ErrOverride) {
				t.Errorf("error %v does not wrap ErrOverride", err)
			}
			for _, want := range append([]string{cfg.OverridePath}, tc.want...) {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not name %q", err, want)
				}
			}
		})
	}
}

func TestBootstrapRefusesBadConfig(t *testing.T) {
	t.Parallel()
	for name, mutate := range map[string]func(*envoy.BootstrapConfig){
		"relative SDS socket": func(c *envoy.BootstrapConfig) { c.SDSSocket = "run/socket" },
		"no SDS socket":       func(c *envoy.BootstrapConfig) { c.SDSSocket = "" },
		"relative XDS socket": func(c *envoy.BootstrapConfig) { c.XDSSocket = "XDS" },
		"admin port 0":        func(c *envoy.BootstrapConfig) { c.AdminPort = 0 },
		"admin port too big":  func(c *envoy.BootstrapConfig) { c.AdminPort = 65536 },
		"stats port negative": func(c *envoy.BootstrapConfig) { c.PrometheusPort = -1 },
	} {
		cfg := testConfig()
		mutate(&cfg)
		if _, err := envoy.Bootstrap(cfg); err == nil {
			t.Errorf("%s: accepted", name)
		} else if errors.Is(err, envoy.ErrOverride) {
			t.Errorf("%s: %v blames the override", name, err)
		}
	}
}

// The same configuration gives the same bytes, whatever the order of a map's iteration.
func TestMarshalBootstrapDeterministic(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	for i := range 20 {
		cfg.Node.Metadata["K"+strings.Repeat("x", i)] = "v"
	}
	first, err := envoy.MarshalBootstrap(build(t, cfg))
	if err != nil {
		t.Fatal(err)
	}
	for range 20 {
		again, err := envoy.MarshalBootstrap(build(t, cfg))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(first, again) {
			t.Fatalf("two marshals differ:\n%s\n---\n%s", first, again)
		}
	}
	if !bytes.HasPrefix(first, []byte("{\n  \"node\": {\n")) || !bytes.HasSuffix(first, []byte("}\n")) {
		t.Errorf("not indented JSON:\n%s", first)
	}
}
