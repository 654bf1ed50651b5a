package discovery_test

import (
	"strings"
	"testing"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/meshid/meshid/discovery"
)

// A configuration as a user writes it: Envoy's own field names, an HTTP listener whose typed
// configs (the connection manager, the router, RBAC) decode, a TLS cluster, and a namespace of
// its own.
const sampleConfig = `
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
                - name: envoy.filters.http.rbac
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC
                - name: envoy.filters.http.router
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
clusters:
  - name: backend
    connect_timeout: 1s
    type: EDS
    eds_cluster_config: {eds_config: {ads: {}, resource_api_version: V3}}
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          tls_certificate_sds_secret_configs: [{name: default}]
routes:
  - name: local
    virtual_hosts: [{name: all, domains: ["*"], routes: [{match: {prefix: /}, route: {cluster: backend}}]}]
endpoints:
  - cluster_name: backend
    endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8080}}}}]}]
namespaces:
  prod:
    clusters:
      - name: prod-backend
        connect_timeout: 2s
`

func TestParseConfig(t *testing.T) {
	t.Parallel()
	cfg, err := discovery.ParseConfig([]byte(sampleConfig))
	if err != nil {
		t.Fatal(err)
	}
	set, version := cfg.For("default")
	if len(set[resource.ListenerType]) != 1 || len(set[resource.ClusterType]) != 1 || len(set[resource.RouteType]) != 1 || len(set[resource.EndpointType]) != 1 {
		t.Fatalf("default set %v", set)
	}
	if l := set[resource.ListenerType][0].(*listenerv3.Listener); l.GetName() != "inbound" {
		t.Errorf("listener %q", l.GetName())
	}
	prod, prodVersion := cfg.For("prod")
	if len(prod[resource.ClusterType]) != 1 || prod[resource.ClusterType][0].(*clusterv3.Cluster).GetName() != "prod-backend" || len(prod[resource.ListenerType]) != 0 {
		t.Errorf("prod's set replaces the default one: %v", prod)
	}
	if version == "" || version == prodVersion {
		t.Errorf("versions %q and %q: want distinct, from the content", version, prodVersion)
	}
	again, err := discovery.ParseConfig([]byte(sampleConfig))
	if err != nil {
		t.Fatal(err)
	}
	if _, v := again.For("default"); v != version {
		t.Errorf("the same file gave version %q, then %q", version, v)
	}
}

func TestParseConfigRefusesWithTheReason(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct{ name, config, want string }{
		{"not yaml", "listeners: [", "not YAML or JSON"},
		{"unknown section", "secrets: []", `secrets: unknown section`},
		{"unknown field", "clusters: [{name: a, connect_timeout: 1s, colour: blue}]", `clusters[0]`},
		{"invalid resource", "clusters: [{name: a, connect_timeout: -1s}]", `clusters[0] "a": invalid Cluster.ConnectTimeout`},
		{"endpoints without a cluster", "endpoints: [{}]", `endpoints[0] ""`},
		{"duplicate", "clusters: [{name: a}, {name: a}]", `clusters[1]: a second resource named "a"`},
		{"bad namespace", "namespaces: {Prod_1: {}}", "namespaces:"},
		{"unknown type", `listeners: [{name: l, filter_chains: [{filters: [{name: x, typed_config: {"@type": type.googleapis.com/not.a.Type}}]}]}]`, "listeners[0]"},
		{"namespace section", "namespaces: {prod: {secrets: []}}", "namespaces.prod.secrets: unknown section"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := discovery.ParseConfig([]byte(tt.config))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one mentioning %q", err, tt.want)
			}
		})
	}
}

// Typed configs that valid Envoy configurations commonly carry beyond the filters: an upstream's
// HTTP protocol options (Envoy's replacement of a cluster's http2_protocol_options, how a gRPC
// upstream is declared), the TLS inspector listener filter, and access logs.
func TestParseConfigDecodesCommonExtensions(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct{ name, config string }{
		{"upstream HTTP/2", `
clusters:
  - name: grpc-upstream
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
`},
		{"TLS inspector", `
listeners:
  - name: inbound
    address: {socket_address: {address: 0.0.0.0, port_value: 15006}}
    listener_filters:
      - name: envoy.filters.listener.tls_inspector
        typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector}
    filter_chains:
      - filters:
          - name: envoy.filters.network.tcp_proxy
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy, stat_prefix: in, cluster: local}
`},
		{"access logs", `
listeners:
  - name: inbound
    address: {socket_address: {address: 0.0.0.0, port_value: 15006}}
    filter_chains:
      - filters:
          - name: envoy.filters.network.tcp_proxy
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
              stat_prefix: in
              cluster: local
              access_log:
                - name: envoy.access_loggers.stdout
                  typed_config: {"@type": type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog}
                - name: envoy.access_loggers.file
                  typed_config: {"@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog, path: /dev/stdout}
`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if _, err := discovery.ParseConfig([]byte(tt.config)); err != nil {
				t.Fatal(err)
			}
		})
	}
}
