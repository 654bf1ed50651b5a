//go:build external

package interop_test

import (
	"context"
	"crypto/x509"
	"maps"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/sds/sdsclient"
)

// xdsConfig has a default set and two namespaces' sets that replace it: prod with listeners and
// clusters of its own, batch with clusters only.
const xdsConfig = `
listeners:
  - {name: inbound, address: {socket_address: {address: 0.0.0.0, port_value: 15006}}}
clusters:
  - {name: backend, connect_timeout: 1s}
namespaces:
  prod:
    listeners:
      - {name: prod-inbound, address: {socket_address: {address: 0.0.0.0, port_value: 15006}}}
      - {name: prod-outbound, address: {socket_address: {address: 0.0.0.0, port_value: 15001}}}
    clusters:
      - {name: prod-backend, connect_timeout: 1s}
  batch:
    clusters:
      - {name: batch-backend, connect_timeout: 1s}
`

// envoyNode is the node an Envoy sends, claiming namespace default whatever its token says.
func envoyNode() *corev3.Node {
	return &corev3.Node{
		Id:      "sidecar~127.0.0.1~" + podName + ".default~default.svc.cluster.local",
		Cluster: "demo.default",
		Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
			"NAMESPACE": structpb.NewStringValue("default"),
		}},
	}
}

// pilot-agent fetches its workload certificate from meshid's CA over Istio's CA protocol, with
// its service-account token, and serves it to Envoy over SDS: `default` is a chain issued by
// meshid's CA for the token's identity, and ROOTCA is meshid's root.
func TestPilotAgentServesACertificateFromMeshidCA(t *testing.T) {
	t.Parallel()
	if !isolated(t) {
		return
	}
	m := startMesh(t, "prod", xdsConfig)
	stream, err := sdsclient.New(m.dial(t, sdsSocketPath), sdsclient.WithNode(envoyNode())).StreamSecrets(m.Ctx)
	if err != nil {
		m.fatal(t, "open an SDS stream on pilot-agent's socket", err)
	}
	secrets := map[string]*tlsv3.Secret{}
	for _, name := range []string{"default", "ROOTCA"} {
		if err := stream.Subscribe(name); err != nil {
			m.fatal(t, "ask for "+name, err)
		}
		resp, err := stream.Recv()
		if err != nil {
			m.fatal(t, "receive "+name, err)
		}
		if len(resp.Secrets) != 1 {
			t.Fatalf("asked for %s, got %d resources", name, len(resp.Secrets))
		}
		maps.Copy(secrets, resp.Secrets)
		if err := stream.Ack(resp, name); err != nil {
			m.fatal(t, "ACK "+name, err)
		}
	}

	rootPEM, err := os.ReadFile(m.RootFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(rootPEM) {
		t.Fatalf("%s holds no certificate", m.RootFile)
	}
	chain, err := pki.ParseCertificates(secrets["default"].GetTlsCertificate().GetCertificateChain().GetInlineBytes())
	if err != nil || len(chain) == 0 {
		t.Fatalf("default's certificate chain: %v (%d certificates)", err, len(chain))
	}
	if len(secrets["default"].GetTlsCertificate().GetPrivateKey().GetInlineBytes()) == 0 {
		t.Error("default has no private key")
	}
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	if _, err := chain[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Errorf("default's leaf does not verify against meshid's root: %v", err)
	}
	if len(chain[0].URIs) != 1 || chain[0].URIs[0].String() != "spiffe://cluster.local/ns/prod/sa/demo" {
		t.Errorf("default's leaf names %v, want [spiffe://cluster.local/ns/prod/sa/demo]", chain[0].URIs)
	}

	trusted, err := pki.ParseCertificates(secrets["ROOTCA"].GetValidationContext().GetTrustedCa().GetInlineBytes())
	if err != nil || len(trusted) == 0 {
		t.Fatalf("ROOTCA's trusted CAs: %v (%d certificates)", err, len(trusted))
	}
	want, err := pki.ParseCertificates(rootPEM)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(trusted, want[0].Equal) {
		t.Errorf("ROOTCA does not hold meshid's root %s", want[0].Subject)
	}
}

// pilot-agent proxies Envoy's ADS stream to meshid's discovery server with its token, and Envoy
// gets the listeners and clusters of the token's namespace, not of the one its node claims; an
// edit of the configuration file reaches the open stream.
func TestPilotAgentProxiesMeshidDiscovery(t *testing.T) {
	t.Parallel()
	if !isolated(t) {
		return
	}
	m := startMesh(t, "prod", xdsConfig)
	stream, err := discoveryv3.NewAggregatedDiscoveryServiceClient(m.dial(t, xdsSocketPath)).StreamAggregatedResources(m.Ctx)
	if err != nil {
		m.fatal(t, "open an ADS stream on pilot-agent's socket", err)
	}
	// Envoy's order: clusters, then listeners.
	if got := m.names(t, stream, resource.ClusterType); !slices.Equal(got, []string{"prod-backend"}) {
		t.Errorf("clusters %v, want prod's [prod-backend]", got)
	}
	if got := m.names(t, stream, resource.ListenerType); !slices.Equal(got, []string{"prod-inbound", "prod-outbound"}) {
		t.Errorf("listeners %v, want prod's [prod-inbound prod-outbound]", got)
	}

	// Every type's version follows the file, so the listeners may come again before the clusters.
	writeFile(t, m.XDSConfig, strings.Replace(xdsConfig, "{name: prod-backend, connect_timeout: 1s}", "{name: prod-backend, connect_timeout: 2s}", 1))
	for {
		resp, err := stream.Recv()
		if err != nil {
			m.fatal(t, "wait for the edit to be pushed", err)
		}
		if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: resp.GetTypeUrl(), VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()}); err != nil {
			m.fatal(t, "ACK", err)
		}
		if resp.GetTypeUrl() != resource.ClusterType {
			continue
		}
		c := &clusterv3.Cluster{}
		if len(resp.GetResources()) != 1 || resp.GetResources()[0].UnmarshalTo(c) != nil || c.GetConnectTimeout().AsDuration() != 2*time.Second {
			t.Fatalf("clusters after the edit: %v", resp)
		}
		return
	}
}

// The same over delta xDS, which Istio's Envoy speaks by default (ISTIO_DELTA_XDS).
func TestPilotAgentProxiesMeshidDeltaDiscovery(t *testing.T) {
	t.Parallel()
	if !isolated(t) {
		return
	}
	m := startMesh(t, "prod", xdsConfig)
	stream, err := discoveryv3.NewAggregatedDiscoveryServiceClient(m.dial(t, xdsSocketPath)).DeltaAggregatedResources(m.Ctx)
	if err != nil {
		m.fatal(t, "open a delta ADS stream on pilot-agent's socket", err)
	}
	if got := m.deltaNames(t, stream, resource.ClusterType); !slices.Equal(got, []string{"prod-backend"}) {
		t.Errorf("clusters %v, want prod's [prod-backend]", got)
	}
	if got := m.deltaNames(t, stream, resource.ListenerType); !slices.Equal(got, []string{"prod-inbound", "prod-outbound"}) {
		t.Errorf("listeners %v, want prod's [prod-inbound prod-outbound]", got)
	}

	// Delta sends only what changed: the edited cluster.
	writeFile(t, m.XDSConfig, strings.Replace(xdsConfig, "{name: prod-backend, connect_timeout: 1s}", "{name: prod-backend, connect_timeout: 2s}", 1))
	for {
		resp, err := stream.Recv()
		if err != nil {
			m.fatal(t, "wait for the edit to be pushed", err)
		}
		if err := stream.Send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: resp.GetTypeUrl(), ResponseNonce: resp.GetNonce()}); err != nil {
			m.fatal(t, "ACK", err)
		}
		if resp.GetTypeUrl() != resource.ClusterType {
			continue
		}
		c := &clusterv3.Cluster{}
		if len(resp.GetResources()) != 1 || resp.GetResources()[0].GetResource().UnmarshalTo(c) != nil || c.GetConnectTimeout().AsDuration() != 2*time.Second {
			t.Fatalf("clusters after the edit: %v", resp)
		}
		return
	}
}

// A namespace whose set has no listeners gets an empty answer to LDS through pilot-agent, rather
// than none, by state of the world and by delta: Envoy waits for LDS before it serves.
func TestPilotAgentGetsNoListeners(t *testing.T) {
	t.Parallel()
	if !isolated(t) {
		return
	}
	m := startMesh(t, "batch", xdsConfig)
	client := discoveryv3.NewAggregatedDiscoveryServiceClient(m.dial(t, xdsSocketPath))
	// One after the other: pilot-agent proxies one Envoy stream at a time.
	t.Run("state of the world", func(t *testing.T) {
		ctx, cancel := context.WithCancel(m.Ctx)
		defer cancel()
		stream, err := client.StreamAggregatedResources(ctx)
		if err != nil {
			m.fatal(t, "open an ADS stream on pilot-agent's socket", err)
		}
		if got := m.names(t, stream, resource.ClusterType); !slices.Equal(got, []string{"batch-backend"}) {
			t.Errorf("clusters %v, want batch's [batch-backend]", got)
		}
		if got := m.names(t, stream, resource.ListenerType); len(got) != 0 {
			t.Errorf("listeners %v, want none", got)
		}
	})
	t.Run("delta", func(t *testing.T) {
		ctx, cancel := context.WithCancel(m.Ctx)
		defer cancel()
		stream, err := client.DeltaAggregatedResources(ctx)
		if err != nil {
			m.fatal(t, "open a delta ADS stream on pilot-agent's socket", err)
		}
		if got := m.deltaNames(t, stream, resource.ClusterType); !slices.Equal(got, []string{"batch-backend"}) {
			t.Errorf("clusters %v, want batch's [batch-backend]", got)
		}
		if got := m.deltaNames(t, stream, resource.ListenerType); len(got) != 0 {
			t.Errorf("listeners %v, want none", got)
		}
	})
}

// names asks for one type on a state-of-the-world stream as Envoy does, ACKs the answer, and
// returns the names of its resources, sorted.
func (m *mesh) names(t *testing.T, stream discoveryv3.AggregatedDiscoveryService_StreamAggregatedResourcesClient, typeURL string) []string {
	t.Helper()
	if err := stream.Send(&discoveryv3.DiscoveryRequest{Node: envoyNode(), TypeUrl: typeURL}); err != nil {
		m.fatal(t, "ask for "+typeURL, err)
	}
	resp, err := stream.Recv()
	if err != nil {
		m.fatal(t, "receive "+typeURL, err)
	}
	if resp.GetTypeUrl() != typeURL {
		t.Fatalf("asked for %s, got %s", typeURL, resp.GetTypeUrl())
	}
	if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: typeURL, VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()}); err != nil {
		m.fatal(t, "ACK "+typeURL, err)
	}
	var out []string
	for _, r := range resp.GetResources() {
		msg, err := r.UnmarshalNew()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, cache.GetResourceName(msg))
	}
	slices.Sort(out)
	return out
}

// deltaNames subscribes to every resource of one type on a delta stream as Envoy does, ACKs the
// answer, and returns the names of its resources, sorted.
func (m *mesh) deltaNames(t *testing.T, stream discoveryv3.AggregatedDiscoveryService_DeltaAggregatedResourcesClient, typeURL string) []string {
	t.Helper()
	if err := stream.Send(&discoveryv3.DeltaDiscoveryRequest{Node: envoyNode(), TypeUrl: typeURL, ResourceNamesSubscribe: []string{"*"}}); err != nil {
		m.fatal(t, "subscribe to "+typeURL, err)
	}
	resp, err := stream.Recv()
	if err != nil {
		m.fatal(t, "receive "+typeURL, err)
	}
	if resp.GetTypeUrl() != typeURL {
		t.Fatalf("subscribed to %s, got %s", typeURL, resp.GetTypeUrl())
	}
	if err := stream.Send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: typeURL, ResponseNonce: resp.GetNonce()}); err != nil {
		m.fatal(t, "ACK "+typeURL, err)
	}
	var out []string
	for _, r := range resp.GetResources() {
		out = append(out, r.GetName())
	}
	slices.Sort(out)
	return out
}

// fatal fails the test on err from a call to pilot-agent, saying why the scenario's context
// ended if it did: pilot-agent exited, or the time is up.
func (m *mesh) fatal(t *testing.T, what string, err error) {
	t.Helper()
	if cause := context.Cause(m.Ctx); cause != nil {
		t.Fatalf("%s: %v (%v)", what, err, cause)
	}
	t.Fatalf("%s: %v", what, err)
}
