package controlplane_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

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
	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/discovery"
	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/testutil"
)

// adsClient opens a connection to the CA's port as an agent's xDS proxy does: TLS verified with
// the CA root (at the time of clk, when not nil), presenting client (when not nil).
func adsClient(t *testing.T, addr, rootFile string, clk *testutil.FakeClock, client *tls.Certificate) discoveryv3.AggregatedDiscoveryServiceClient {
	t.Helper()
	rootPEM, err := os.ReadFile(rootFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(rootPEM)
	cfg := &tls.Config{RootCAs: pool, ServerName: "istiod.istio-system.svc", MinVersion: tls.VersionTLS12}
	if clk != nil {
		cfg.Time = clk.Now
	}
	if client != nil {
		cfg.Certificates = []tls.Certificate{*client}
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return discoveryv3.NewAggregatedDiscoveryServiceClient(conn)
}

// streamLimit bounds, in real time, how long a test waits on a stream for what the server owes.
const streamLimit = 30 * time.Second

// firstClusters opens an ADS stream on client with token tok (none when empty), asks for the
// clusters and returns the stream and the first response. The stream ends after streamLimit.
func firstClusters(t *testing.T, client discoveryv3.AggregatedDiscoveryServiceClient, tok string) (discoveryv3.AggregatedDiscoveryService_StreamAggregatedResourcesClient, *discoveryv3.DiscoveryResponse, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), streamLimit)
	t.Cleanup(cancel)
	if tok != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	}
	stream, err := client.StreamAggregatedResources(ctx)
	if err != nil {
		return nil, nil, err
	}
	if err := stream.Send(&discoveryv3.DiscoveryRequest{Node: &corev3.Node{Id: "sidecar~10.0.0.1~web~web.svc.cluster.local"}, TypeUrl: resource.ClusterType}); err != nil && !errors.Is(err, io.EOF) {
		return nil, nil, err
	}
	resp, err := stream.Recv()
	return stream, resp, err
}

// Attack (issue 24, item 4): discovery served configuration to a namespace that namespace
// targeting refuses certificates. It is now refused as CreateCertificate is, with the same
// text, counted and logged alike; at a stream's open, and at each request, so that a label edit
// ends a stream at its next request.
func TestDiscoveryHonoursNamespaceTargeting(t *testing.T) {
	t.Parallel()
	manifests := t.TempDir()
	testutil.WriteFiles(t, manifests, map[string][]byte{
		"web.yaml":  namespaceManifest("web", `ca.istio.io/env: istio-system`),
		"prod.yaml": namespaceManifest("prod", `ca.istio.io/override: "false"`),
	})
	clk := testutil.NewFakeClock(time.Now().Truncate(time.Second))
	dir := t.TempDir()
	cfg := testConfig(filepath.Join(dir, "state"))
	cfg.Manifests = manifests
	cfg.EnableNamespacesByDefault = false
	cfg.Clock = clk
	cfg.XDSConfig = filepath.Join(dir, "xds.yaml")
	if err := os.WriteFile(cfg.XDSConfig, []byte("clusters: [{name: backend, connect_timeout: 1s}]"), 0o600); err != nil {
		t.Fatal(err)
	}
	cp := start(t, cfg)
	client := adsClient(t, cp.GRPCAddr(), filepath.Join(cfg.StateDir, ca.RootCertFile), clk, nil)
	tok := func(ns string) string {
		return controlplanetest.Token(t, cfg.StateDir, ns, "demo", clk.Now(), time.Hour)
	}

	_, _, err := firstClusters(t, client, tok("prod"))
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a prod token, prod not served: %v, want PermissionDenied", err)
	}
	for _, want := range []string{"namespace prod", `ca.istio.io/override="false"`, "row 12", "no CA instance serves it"} {
		if !strings.Contains(status.Convert(err).Message(), want) {
			t.Errorf("refused with %q, which does not name %q", status.Convert(err).Message(), want)
		}
	}
	_, metrics := get(t, "http://"+cp.MonitoringAddr()+"/metrics")
	if !strings.Contains(metrics, `meshid_ca_requests_refused_total{code="PermissionDenied",reason="namespace_not_targeted"} 1`) {
		t.Errorf("the refusal is not counted:\n%s", metrics)
	}

	stream, resp, err := firstClusters(t, client, tok("web"))
	if err != nil {
		t.Fatalf("web, served: %v", err)
	}
	// web's label is edited: its stream is refused at its next request.
	testutil.WriteFiles(t, manifests, map[string][]byte{"web.yaml": namespaceManifest("web", `ca.istio.io/override: "false"`)})
	store := cp.Namespaces()
	for {
		changed := store.Changed()
		if labels, _, _ := store.NamespaceLabels(t.Context(), "web"); labels["ca.istio.io/override"] == "false" {
			break
		}
		testutil.Drive(t, clk, filewatch.DefaultDebounce, 2, changed) // 2: the root check and secret resync timers
	}
	if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: resource.ClusterType, VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()}); err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); status.Code(err) != codes.PermissionDenied || !strings.Contains(status.Convert(err).Message(), "namespace web") {
		t.Fatalf("web's stream after the edit: %v, want PermissionDenied naming web", err)
	}
}

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
	// io.EOF from Send: the server has already ended the stream (a refused credential), and
	// Recv returns the status it ended it with.
	if err := stream.Send(&discoveryv3.DiscoveryRequest{Node: &corev3.Node{Id: "sidecar~10.0.0.1~web.prod~prod.svc.cluster.local"}, TypeUrl: resource.ClusterType}); err != nil && !errors.Is(err, io.EOF) {
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

// Issue 26: `meshid ca` without --xds-config serves Envoy an empty configuration instead of
// Unimplemented, so that Envoy is up with no listeners rather than retrying for ever. LDS and
// CDS are answered, by state of the world and by delta, with no resource and a version; the
// ACK is not answered again; syncz lists the node; a stream without a credential is still
// refused; the start log says so once.
func TestDiscoveryWithoutXDSConfig(t *testing.T) {
	t.Parallel()
	logs := &testutil.SyncBuffer{}
	cfg := testConfig(filepath.Join(t.TempDir(), "state"))
	cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	cp := start(t, cfg)
	rootFile := filepath.Join(cfg.StateDir, ca.RootCertFile)
	tok := mint(t, cfg.StateDir, "default", "web")
	client := adsClient(t, cp.GRPCAddr(), rootFile, nil, nil)

	stream, cds, err := firstClusters(t, client, tok)
	if err != nil {
		t.Fatalf("an authenticated stream without --xds-config: %v", err)
	}
	version := cds.GetVersionInfo()
	if len(cds.GetResources()) != 0 || version == "" || cds.GetNonce() == "" {
		t.Fatalf("clusters: %d resources, version %q, nonce %q; want none, with a version", len(cds.GetResources()), version, cds.GetNonce())
	}
	// The ACK, then the listeners: the next answer is the listeners', not the clusters' again.
	for _, req := range []*discoveryv3.DiscoveryRequest{
		{TypeUrl: resource.ClusterType, VersionInfo: version, ResponseNonce: cds.GetNonce()},
		{TypeUrl: resource.ListenerType},
	} {
		if err := stream.Send(req); err != nil {
			t.Fatal(err)
		}
	}
	lds, err := stream.Recv()
	if err != nil || lds.GetTypeUrl() != resource.ListenerType || len(lds.GetResources()) != 0 || lds.GetVersionInfo() != version {
		t.Fatalf("after the clusters' ACK: %v, %v; want the empty listeners, version %q", lds, err, version)
	}
	if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: resource.ListenerType, VersionInfo: version, ResponseNonce: lds.GetNonce()}); err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: discovery.DebugSyncz}); err != nil {
		t.Fatal(err)
	}
	syncz, err := stream.Recv()
	if err != nil || syncz.GetTypeUrl() != discovery.DebugSyncz || len(syncz.GetResources()) != 1 ||
		!strings.Contains(string(syncz.GetResources()[0].GetValue()), "sidecar~10.0.0.1~web~web.svc.cluster.local") {
		t.Fatalf("syncz: %v, %v; want the node", syncz, err)
	}

	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+tok)
	delta, err := client.DeltaAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, typeURL := range []string{resource.ListenerType, resource.ClusterType} {
		if err := delta.Send(&discoveryv3.DeltaDiscoveryRequest{Node: &corev3.Node{Id: "sidecar"}, TypeUrl: typeURL}); err != nil {
			t.Fatal(err)
		}
		resp, err := delta.Recv()
		if err != nil || resp.GetTypeUrl() != typeURL || len(resp.GetResources()) != 0 || resp.GetSystemVersionInfo() != version || resp.GetNonce() == "" {
			t.Fatalf("delta %s: %v, %v; want none, version %q", typeURL, resp, err, version)
		}
		if err := delta.Send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: typeURL, ResponseNonce: resp.GetNonce()}); err != nil {
			t.Fatal(err)
		}
	}

	if _, _, err := firstClusters(t, client, ""); status.Code(err) != codes.Unauthenticated {
		t.Errorf("a stream without a credential: %v, want Unauthenticated", err)
	}
	const said = "no --xds-config: Envoy gets an empty configuration (no listeners, no clusters)"
	if n := strings.Count(logs.String(), said); n != 1 {
		t.Errorf("the start log says %q %d times, want once:\n%s", said, n, logs.String())
	}
}
