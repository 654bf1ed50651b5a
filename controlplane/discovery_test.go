package controlplane_test

import (
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/ca"
)

// clustersFor opens an ADS stream to the CA's port as an agent's xDS proxy does (TLS verified
// with the CA root, a bearer token) and returns the clusters of the first response.
func clustersFor(t *testing.T, addr, rootFile, tok string) ([]string, error) {
	t.Helper()
	rootPEM, err := os.ReadFile(rootFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(rootPEM)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
		RootCAs: pool, ServerName: "istiod.istio-system.svc", MinVersion: tls.VersionTLS12,
	})))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+tok)
	stream, err := discoveryv3.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
	if err != nil {
		return nil, err
	}
	if err := stream.Send(&discoveryv3.DiscoveryRequest{Node: &corev3.Node{Id: "sidecar~10.0.0.1~web.prod~prod.svc.cluster.local"}, TypeUrl: resource.ClusterType}); err != nil {
		return nil, err
	}
	resp, err := stream.Recv()
	if err != nil {
		return nil, err
	}
	var names []string
	for _, r := range resp.GetResources() {
		c := &clusterv3.Cluster{}
		if err := r.UnmarshalTo(c); err != nil {
			t.Fatal(err)
		}
		names = append(names, c.GetName())
	}
	return names, nil
}

// meshid ca --xds-config serves discovery on the CA's port, authenticated as the CA is: the
// namespace of the token picks the set.
func TestDiscoveryOnTheCAPort(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	cfg := testConfig(filepath.Join(dir, "state"))
	cfg.XDSConfig = filepath.Join(dir, "xds.yaml")
	if err := os.WriteFile(cfg.XDSConfig, []byte(`
clusters: [{name: backend, connect_timeout: 1s}]
namespaces:
  prod:
    clusters: [{name: prod-backend, connect_timeout: 1s}]
`), 0o600); err != nil {
		t.Fatal(err)
	}
	cp := start(t, cfg)
	rootFile := filepath.Join(cfg.StateDir, ca.RootCertFile)
	for ns, want := range map[string]string{"prod": "prod-backend", "default": "backend"} {
		got, err := clustersFor(t, cp.GRPCAddr(), rootFile, mint(t, cfg.StateDir, ns, "web"))
		if err != nil || len(got) != 1 || got[0] != want {
			t.Errorf("a %s token got %v (%v), want [%s]", ns, got, err, want)
		}
	}
	if _, err := clustersFor(t, cp.GRPCAddr(), rootFile, "not-a-token"); status.Code(err) != codes.Unauthenticated {
		t.Errorf("a bad token: %v, want Unauthenticated", err)
	}
}
