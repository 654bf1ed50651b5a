// Package deploy_test checks what can be checked of deploy/ without a container engine: the
// docker-compose demo (Envoy's bootstrap against go-control-plane's types and validation, the
// discovery configuration and the manifests with meshid's own loaders, the compose file's
// structure), the Dockerfile's instructions and build, the Kubernetes manifests (decoded as their
// kinds, applied in kubectl's order on a real API server with -tags external), and make images
// and make manifests with a stand-in for docker.
package deploy_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	httpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"sigs.k8s.io/yaml"

	// The HTTP router filter the listeners name, registered so that their typed_config decodes.
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"

	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/discovery"
)

const (
	demoDir = "compose"

	frontendID = "spiffe://cluster.local/ns/default/sa/frontend"
	backendID  = "spiffe://cluster.local/ns/backend/sa/backend"

	// The agent's default socket paths, which the bootstrap's pipes name.
	sdsSocket = "/var/run/secrets/workload-spiffe-uds/socket"
	xdsSocket = "/etc/istio/proxy/XDS"
)

func readDemo(t *testing.T, name string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(demoDir, name))
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// loadBootstrap decodes the demo's Envoy bootstrap as Envoy would: YAML with Envoy's field names,
// every typed_config resolved against the registered types.
func loadBootstrap(t *testing.T) *bootstrapv3.Bootstrap {
	t.Helper()
	return validateBootstrap(t, "envoy.yaml", readDemo(t, "envoy.yaml"))
}

// validateBootstrap decodes an Envoy bootstrap in YAML and validates it, as loadBootstrap.
func validateBootstrap(t *testing.T, what string, yamlData []byte) *bootstrapv3.Bootstrap {
	t.Helper()
	data, err := yaml.YAMLToJSON(yamlData)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	var b bootstrapv3.Bootstrap
	if err := (protojson.UnmarshalOptions{}).Unmarshal(data, &b); err != nil {
		t.Fatalf("%s does not decode as a Bootstrap: %v", what, err)
	}
	if err := b.ValidateAll(); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return &b
}

func TestEnvoyBootstrap(t *testing.T) {
	t.Parallel()
	b := loadBootstrap(t)

	// One file for both Envoys: the node comes from --service-node and --service-cluster.
	if b.GetNode() != nil {
		t.Errorf("the bootstrap names a node (%v); each Envoy's comes from its command line", b.GetNode())
	}
	if got := b.GetAdmin().GetAddress().GetSocketAddress(); got.GetAddress() != "127.0.0.1" || got.GetPortValue() != 15000 {
		t.Errorf("admin on %v, want 127.0.0.1:15000", got)
	}

	dyn := b.GetDynamicResources()
	ads := dyn.GetAdsConfig()
	if ads.GetApiType() != corev3.ApiConfigSource_GRPC || ads.GetTransportApiVersion() != corev3.ApiVersion_V3 {
		t.Errorf("ads_config %v, want GRPC, V3", ads)
	}
	if gs := ads.GetGrpcServices(); len(gs) != 1 || gs[0].GetEnvoyGrpc().GetClusterName() != "xds-grpc" {
		t.Errorf("ads_config.grpc_services %v, want the cluster xds-grpc", gs)
	}
	for name, src := range map[string]*corev3.ConfigSource{"lds_config": dyn.GetLdsConfig(), "cds_config": dyn.GetCdsConfig()} {
		if src.GetAds() == nil || src.GetResourceApiVersion() != corev3.ApiVersion_V3 {
			t.Errorf("%s %v, want {ads: {}, resource_api_version: V3}", name, src)
		}
	}

	want := map[string]string{"xds-grpc": xdsSocket, "sds-grpc": sdsSocket}
	clusters := b.GetStaticResources().GetClusters()
	if len(clusters) != len(want) {
		t.Errorf("%d static clusters, want %d", len(clusters), len(want))
	}
	for _, c := range clusters {
		path, ok := want[c.GetName()]
		if !ok {
			t.Errorf("unexpected static cluster %q", c.GetName())
			continue
		}
		if got := endpointPipes(c); !slices.Equal(got, []string{path}) {
			t.Errorf("cluster %s reaches %v, want the pipe %s", c.GetName(), got, path)
		}
		// gRPC needs HTTP/2 to the agent.
		anyOpts := c.GetTypedExtensionProtocolOptions()["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
		var opts httpv3.HttpProtocolOptions
		if anyOpts == nil || anyOpts.UnmarshalTo(&opts) != nil || opts.GetExplicitHttpConfig().GetHttp2ProtocolOptions() == nil {
			t.Errorf("cluster %s does not speak HTTP/2 (explicit_http_config.http2_protocol_options)", c.GetName())
		}
	}
}

func endpointPipes(c *clusterv3.Cluster) []string {
	var paths []string
	for _, eps := range c.GetLoadAssignment().GetEndpoints() {
		for _, lb := range eps.GetLbEndpoints() {
			paths = append(paths, lb.GetEndpoint().GetAddress().GetPipe().GetPath())
		}
	}
	return paths
}

func endpointSockets(c *clusterv3.Cluster) []*corev3.SocketAddress {
	var addrs []*corev3.SocketAddress
	for _, eps := range c.GetLoadAssignment().GetEndpoints() {
		for _, lb := range eps.GetLbEndpoints() {
			addrs = append(addrs, lb.GetEndpoint().GetAddress().GetSocketAddress())
		}
	}
	return addrs
}

// set is one configuration set of the discovery config, by type.
type set struct {
	listeners []*listenerv3.Listener
	clusters  map[string]*clusterv3.Cluster
}

func loadSet(t *testing.T, cfg *discovery.Config, namespace string) set {
	t.Helper()
	byType, _ := cfg.For(namespace)
	s := set{clusters: map[string]*clusterv3.Cluster{}}
	for _, r := range byType[resource.ListenerType] {
		s.listeners = append(s.listeners, r.(*listenerv3.Listener))
	}
	for _, r := range byType[resource.ClusterType] {
		c := r.(*clusterv3.Cluster)
		s.clusters[c.GetName()] = c
	}
	if n := len(byType[resource.RouteType]) + len(byType[resource.EndpointType]); n != 0 {
		t.Errorf("namespace %s: %d routes and endpoints; the demo keeps them inline", namespace, n)
	}
	return s
}

func unpack[M proto.Message](t *testing.T, what string, a interface{ UnmarshalTo(proto.Message) error }, msg M) M {
	t.Helper()
	if err := a.UnmarshalTo(msg); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return msg
}

// checkSDS checks that a TLS context takes its key pair from SDS `default` and verifies the peer
// with SDS `ROOTCA` and exactly wantPeer, both from the agent's socket (cluster sds-grpc).
func checkSDS(t *testing.T, what string, common *tlsv3.CommonTlsContext, wantPeer string) {
	t.Helper()
	sdsCluster := func(c *tlsv3.SdsSecretConfig) string {
		api := c.GetSdsConfig().GetApiConfigSource()
		if api.GetApiType() != corev3.ApiConfigSource_GRPC || api.GetTransportApiVersion() != corev3.ApiVersion_V3 ||
			c.GetSdsConfig().GetResourceApiVersion() != corev3.ApiVersion_V3 || len(api.GetGrpcServices()) != 1 {
			return ""
		}
		return api.GetGrpcServices()[0].GetEnvoyGrpc().GetClusterName()
	}
	certs := common.GetTlsCertificateSdsSecretConfigs()
	if len(certs) != 1 || certs[0].GetName() != "default" || sdsCluster(certs[0]) != "sds-grpc" {
		t.Errorf("%s: key pair from %v, want SDS default over sds-grpc (GRPC, V3)", what, certs)
	}
	combined := common.GetCombinedValidationContext()
	if roots := combined.GetValidationContextSdsSecretConfig(); roots.GetName() != "ROOTCA" || sdsCluster(roots) != "sds-grpc" {
		t.Errorf("%s: roots from %v, want SDS ROOTCA over sds-grpc (GRPC, V3)", what, roots)
	}
	sans := combined.GetDefaultValidationContext().GetMatchTypedSubjectAltNames()
	if len(sans) != 1 || sans[0].GetSanType() != tlsv3.SubjectAltNameMatcher_URI || sans[0].GetMatcher().GetExact() != wantPeer ||
		sans[0].GetMatcher().GetIgnoreCase() {
		t.Errorf("%s: peer matched by %v, want exactly the URI SAN %s", what, sans, wantPeer)
	}
}

func onlyHCM(t *testing.T, what string, l *listenerv3.Listener) (*listenerv3.FilterChain, *hcmv3.HttpConnectionManager) {
	t.Helper()
	chains := l.GetFilterChains()
	if len(chains) != 1 || len(chains[0].GetFilters()) != 1 {
		t.Fatalf("%s: want one filter chain with one filter (the HTTP connection manager), got %v", what, chains)
	}
	f := chains[0].GetFilters()[0]
	if f.GetTypedConfig() == nil {
		t.Fatalf("%s: filter %s has no typed_config", what, f.GetName())
	}
	return chains[0], unpack(t, what, f.GetTypedConfig(), &hcmv3.HttpConnectionManager{})
}

// routeClusters lists the clusters an inline route configuration sends to.
func routeClusters(rc *routev3.RouteConfiguration) []string {
	var out []string
	for _, vh := range rc.GetVirtualHosts() {
		for _, r := range vh.GetRoutes() {
			out = append(out, r.GetRoute().GetCluster())
		}
	}
	return out
}

func TestDiscoveryConfig(t *testing.T) {
	t.Parallel()
	cfg, err := discovery.ParseConfig(readDemo(t, "xds.yaml"))
	if err != nil {
		t.Fatalf("meshid ca refuses xds.yaml: %v", err)
	}
	if got := cfg.Namespaces(); !slices.Equal(got, []string{"backend"}) {
		t.Fatalf("namespaces with a set of their own: %v, want [backend]", got)
	}
	// The secrets come over the bootstrap's sds-grpc cluster.
	if !slices.ContainsFunc(loadBootstrap(t).GetStaticResources().GetClusters(), func(c *clusterv3.Cluster) bool { return c.GetName() == "sds-grpc" }) {
		t.Fatal("the bootstrap has no cluster sds-grpc")
	}

	backend := loadSet(t, cfg, "backend")
	if len(backend.listeners) != 1 {
		t.Fatalf("backend: %d listeners, want one (inbound mTLS)", len(backend.listeners))
	}
	inbound := backend.listeners[0]
	chain, hcm := onlyHCM(t, "backend listener", inbound)
	if chain.GetTransportSocket().GetTypedConfig() == nil {
		t.Fatal("backend listener: no TLS transport socket")
	}
	down := unpack(t, "backend listener TLS", chain.GetTransportSocket().GetTypedConfig(), &tlsv3.DownstreamTlsContext{})
	if !down.GetRequireClientCertificate().GetValue() {
		t.Error("backend listener: client certificates are not required")
	}
	checkSDS(t, "backend listener", down.GetCommonTlsContext(), frontendID)
	if hcm.GetForwardClientCertDetails() != hcmv3.HttpConnectionManager_SANITIZE_SET || !hcm.GetSetCurrentClientCertDetails().GetUri() {
		t.Errorf("backend listener: forward_client_cert_details %v, set_current_client_cert_details %v; want SANITIZE_SET with uri",
			hcm.GetForwardClientCertDetails(), hcm.GetSetCurrentClientCertDetails())
	}
	for _, name := range routeClusters(hcm.GetRouteConfig()) {
		c, ok := backend.clusters[name]
		if !ok {
			t.Errorf("backend listener routes to %q, which the backend set lacks", name)
			continue
		}
		appPort := loadCompose(t).Services["backend"].Environment["HTTP_PORT"]
		for _, a := range endpointSockets(c) {
			if a.GetAddress() != "127.0.0.1" || strconv.Itoa(int(a.GetPortValue())) != appPort {
				t.Errorf("backend cluster %s reaches %s:%d, want the application on 127.0.0.1:%s", name, a.GetAddress(), a.GetPortValue(), appPort)
			}
		}
	}
	if len(routeClusters(hcm.GetRouteConfig())) == 0 {
		t.Error("backend listener routes nowhere")
	}

	frontend := loadSet(t, cfg, "default")
	if len(frontend.listeners) != 1 {
		t.Fatalf("default: %d listeners, want one (outbound)", len(frontend.listeners))
	}
	outbound := frontend.listeners[0]
	if a := outbound.GetAddress().GetSocketAddress(); a.GetAddress() != "127.0.0.1" {
		t.Errorf("frontend listener on %s, want loopback (the application's side)", a.GetAddress())
	}
	// The README's curl goes to it.
	a := outbound.GetAddress().GetSocketAddress()
	if url := fmt.Sprintf("curl -s http://%s:%d/", a.GetAddress(), a.GetPortValue()); !strings.Contains(string(readDemo(t, "README.md")), url) {
		t.Errorf("the README does not %s", url)
	}
	chain, hcm = onlyHCM(t, "frontend listener", outbound)
	if chain.GetTransportSocket() != nil {
		t.Error("the frontend's outbound listener takes TLS; the application speaks plain HTTP to it")
	}
	routes := routeClusters(hcm.GetRouteConfig())
	if len(routes) != 1 {
		t.Fatalf("frontend listener routes to %v, want one cluster", routes)
	}
	up, ok := frontend.clusters[routes[0]]
	if !ok {
		t.Fatalf("frontend listener routes to %q, which the default set lacks", routes[0])
	}
	if up.GetTransportSocket().GetTypedConfig() == nil {
		t.Fatalf("cluster %s: no TLS transport socket", up.GetName())
	}
	upTLS := unpack(t, "frontend cluster TLS", up.GetTransportSocket().GetTypedConfig(), &tlsv3.UpstreamTlsContext{})
	checkSDS(t, "frontend cluster", upTLS.GetCommonTlsContext(), backendID)

	// The frontend reaches the backend's listener by the compose service name of the backend's
	// application, whose network namespace the backend's Envoy shares.
	port := inbound.GetAddress().GetSocketAddress().GetPortValue()
	for _, a := range endpointSockets(up) {
		if a.GetAddress() != "backend" || a.GetPortValue() != port {
			t.Errorf("cluster %s reaches %s:%d, want backend:%d", up.GetName(), a.GetAddress(), a.GetPortValue(), port)
		}
	}
	if up.GetType() != clusterv3.Cluster_STRICT_DNS && up.GetType() != clusterv3.Cluster_LOGICAL_DNS {
		t.Errorf("cluster %s is %v; a service name needs DNS", up.GetName(), up.GetType())
	}
}

func TestManifestsServeBothWorkloads(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	m, err := controller.NewManifests(controller.ManifestsConfig{Dir: filepath.Join(demoDir, "manifests")})
	if err != nil {
		t.Fatal(err)
	}
	if p := m.Problems(); p != (controller.ManifestProblems{}) {
		t.Errorf("manifests: %+v skipped", p)
	}
	// As the compose file runs the CA: only labelled namespaces are served.
	enabledByDefault := !slices.Contains(loadCompose(t).Services["ca"].Command, "--enable-namespaces-by-default=false")
	targeting := controller.NewTargeting(controller.TargetingConfig{Store: m, CANamespace: "istio-system", EnabledByDefault: enabledByDefault})
	for _, w := range []struct{ namespace, serviceAccount string }{{"default", "frontend"}, {"backend", "backend"}} {
		served, why, err := targeting.Targets(ctx, w.namespace)
		if err != nil || !served {
			t.Errorf("namespace %s not served: %s %v", w.namespace, why, err)
		}
		sas, err := m.ServiceAccounts(ctx, w.namespace)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.ContainsFunc(sas, func(sa controller.ServiceAccount) bool { return sa.Name == w.serviceAccount }) {
			t.Errorf("no ServiceAccount %s/%s in the manifests (%v)", w.namespace, w.serviceAccount, sas)
		}
	}
}
