package envoy_test

import (
	"bytes"
	"encoding/json"
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
	"github.com/meshid/meshid/agent/envoy/bootstrapcheck"
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

// build writes cfg's bootstrap, checks it with Envoy's types and validation, and reads it back.
func build(t *testing.T, cfg envoy.BootstrapConfig) *bootstrapv3.Bootstrap {
	t.Helper()
	data, err := envoy.Bootstrap(cfg)
	if err != nil {
		t.Fatalf("Bootstrap: %v", err)
	}
	if err := bootstrapcheck.Check(data); err != nil {
		t.Fatalf("bootstrapcheck.Check: %v\n%s", err, data)
	}
	var b bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(data, &b); err != nil {
		t.Fatal(err)
	}
	return &b
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

// protojsonOf is b as protojson writes it, indented as Bootstrap indents.
func protojsonOf(t *testing.T, b *bootstrapv3.Bootstrap) []byte {
	t.Helper()
	data, err := protojson.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	var compact, out bytes.Buffer
	if err := json.Compact(&compact, data); err != nil {
		t.Fatal(err)
	}
	if err := json.Indent(&out, compact.Bytes(), "", "  "); err != nil {
		t.Fatal(err)
	}
	out.WriteByte('\n')
	return out.Bytes()
}

// Every variant of the bootstrap passes Envoy's validation, and is, byte for byte, what
// protojson writes for the Bootstrap it parses into: no field is lost or misnamed on the way,
// and strings are escaped as protojson escapes them.
func TestBootstrapIsEnvoysBootstrap(t *testing.T) {
	t.Parallel()
	variant := func(mutate func(*envoy.BootstrapConfig)) envoy.BootstrapConfig {
		c := testConfig()
		mutate(&c)
		return c
	}
	for name, cfg := range map[string]envoy.BootstrapConfig{
		"full":                       testConfig(),
		"no xds":                     variant(func(c *envoy.BootstrapConfig) { c.XDSSocket = "" }),
		"no stats":                   variant(func(c *envoy.BootstrapConfig) { c.PrometheusPort = 0 }),
		"no xds, no stats":           variant(func(c *envoy.BootstrapConfig) { c.XDSSocket, c.PrometheusPort = "", 0 }),
		"extreme ports":              variant(func(c *envoy.BootstrapConfig) { c.AdminPort, c.PrometheusPort = 65535, 1 }),
		"admin on the kernel's port": variant(func(c *envoy.BootstrapConfig) { c.AdminPort, c.PrometheusPort = 0, 0 }),
		"no metadata, no identity":   {SDSSocket: "/s", AdminPort: 1},
		"odd metadata": variant(func(c *envoy.BootstrapConfig) {
			c.Node.Metadata = map[string]string{
				"": "empty key", "EMPTY": "", "<html>&": "</script>", "quote\"": "back\\slash",
				"ctl": "\x00\x01\b\f\n\r\t\x1f\x7f", "sep": "\u2028\u2029", "uni": "é日本\U0001F600\ufffd",
				"json": `{"a": [1, 2]}`,
			}
		}),
		"odd node": variant(func(c *envoy.BootstrapConfig) {
			c.Node = envoy.SidecarNode(envoy.Workload{InstanceIP: "fe80::1%eth0", PodName: "p\"o<d>\n", Namespace: "n s", ServiceAccount: "s\\a"})
		}),
		"odd paths": variant(func(c *envoy.BootstrapConfig) {
			c.SDSSocket, c.XDSSocket = "/tmp/a dir/ü \"q\"/socket", "/run/x\\y/\u2028/XDS\t"
		}),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			data, err := envoy.Bootstrap(cfg)
			if err != nil {
				t.Fatalf("Bootstrap: %v", err)
			}
			if err := bootstrapcheck.Check(data); err != nil {
				t.Fatalf("bootstrapcheck.Check: %v\n%s", err, data)
			}
			var b bootstrapv3.Bootstrap
			if err := protojson.Unmarshal(data, &b); err != nil {
				t.Fatal(err)
			}
			if want := protojsonOf(t, &b); !bytes.Equal(data, want) {
				t.Errorf("Bootstrap wrote\n%s\nprotojson writes\n%s", data, want)
			}
			if b.GetNode().GetId() != cfg.Node.ID || b.GetNode().GetCluster() != cfg.Node.Cluster {
				t.Errorf("node %q cluster %q, want %q %q", b.GetNode().GetId(), b.GetNode().GetCluster(), cfg.Node.ID, cfg.Node.Cluster)
			}
			fields := b.GetNode().GetMetadata().GetFields()
			if len(fields) != len(cfg.Node.Metadata) {
				t.Errorf("%d metadata fields, want %d", len(fields), len(cfg.Node.Metadata))
			}
			for k, v := range cfg.Node.Metadata {
				if fields[k].GetStringValue() != v {
					t.Errorf("metadata %q = %v, want %q", k, fields[k], v)
				}
			}
			if got := pipePaths(&b); got[envoy.SDSClusterName] != cfg.SDSSocket || got[envoy.XDSClusterName] != cfg.XDSSocket {
				t.Errorf("pipes %q, want SDS %q and XDS %q", got, cfg.SDSSocket, cfg.XDSSocket)
			}
		})
	}
}

func pipePaths(b *bootstrapv3.Bootstrap) map[string]string {
	out := map[string]string{}
	for _, c := range b.GetStaticResources().GetClusters() {
		if p := endpointAddress(c).GetPipe(); p != nil {
			out[c.GetName()] = p.GetPath()
		}
	}
	return out
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

func TestBootstrapRefusesBadConfig(t *testing.T) {
	t.Parallel()
	for name, mutate := range map[string]func(*envoy.BootstrapConfig){
		"relative SDS socket": func(c *envoy.BootstrapConfig) { c.SDSSocket = "run/socket" },
		"no SDS socket":       func(c *envoy.BootstrapConfig) { c.SDSSocket = "" },
		"relative XDS socket": func(c *envoy.BootstrapConfig) { c.XDSSocket = "XDS" },
		"admin port 0":        func(c *envoy.BootstrapConfig) { c.AdminPort = 0 },
		"admin port too big":  func(c *envoy.BootstrapConfig) { c.AdminPort = 65536 },
		"stats port negative": func(c *envoy.BootstrapConfig) { c.PrometheusPort = -1 },
		"stats port too big":  func(c *envoy.BootstrapConfig) { c.PrometheusPort = 65536 },
		// Envoy refuses a bootstrap whose strings are not UTF-8.
		"node id not UTF-8":        func(c *envoy.BootstrapConfig) { c.Node.ID = "a\xffb" },
		"metadata key not UTF-8":   func(c *envoy.BootstrapConfig) { c.Node.Metadata["\xc3"] = "v" },
		"metadata value not UTF-8": func(c *envoy.BootstrapConfig) { c.Node.Metadata["K"] = "\xc3(" },
		"socket not UTF-8":         func(c *envoy.BootstrapConfig) { c.SDSSocket = "/run/\xfe/socket" },
	} {
		cfg := testConfig()
		mutate(&cfg)
		if data, err := envoy.Bootstrap(cfg); err == nil {
			t.Errorf("%s: accepted:\n%s", name, data)
		} else if errors.Is(err, envoy.ErrOverride) {
			t.Errorf("%s: %v blames the override", name, err)
		}
	}
}

// The same configuration gives the same bytes, whatever the order of a map's iteration.
func TestBootstrapDeterministic(t *testing.T) {
	t.Parallel()
	cfg := testConfig()
	for i := range 20 {
		cfg.Node.Metadata["K"+strings.Repeat("x", i)] = "v"
	}
	first, err := envoy.Bootstrap(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for range 20 {
		again, err := envoy.Bootstrap(cfg)
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
