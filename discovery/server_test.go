package discovery_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	statusv3 "github.com/envoyproxy/go-control-plane/envoy/service/status/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshid/meshid/discovery"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// headerAuthenticator stands for the CA's authorizer: the namespace is what the caller's
// credential says, here a header (the credential itself, x-credential-id, defaults to it); no
// header is a refusal.
type headerAuthenticator struct{}

func (headerAuthenticator) Authorize(ctx context.Context) (discovery.Caller, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	ns := md.Get("x-credential-namespace")
	if len(ns) != 1 {
		return discovery.Caller{}, status.Error(codes.Unauthenticated, "no credential")
	}
	credential := "header:" + ns[0]
	if id := md.Get("x-credential-id"); len(id) == 1 {
		credential = "header:" + id[0]
	}
	return discovery.Caller{Identity: pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: ns[0], ServiceAccount: "test"}, Credential: credential}, nil
}

// Serves: every namespace a credential names is served here.
func (headerAuthenticator) Serves(context.Context, discovery.Caller) error { return nil }

type discoveryHarness struct {
	t        *testing.T
	path     string
	registry *prometheus.Registry
	logs     *testutil.SyncBuffer // JSON
	addr     string
	reloads  chan error
}

func startDiscovery(t *testing.T, config string) *discoveryHarness {
	t.Helper()
	return startDiscoveryWith(t, config, nil)
}

// startDiscoveryWith starts a server on config, its ServerConfig changed by edit (when not nil).
func startDiscoveryWith(t *testing.T, config string, edit func(*discovery.ServerConfig)) *discoveryHarness {
	t.Helper()
	h := &discoveryHarness{t: t, path: filepath.Join(t.TempDir(), "xds.yaml"), registry: prometheus.NewRegistry(),
		logs: &testutil.SyncBuffer{}, reloads: make(chan error, 16)}
	h.write(config)
	cfg := discovery.ServerConfig{
		ConfigPath: h.path, Authorizer: headerAuthenticator{}, Debounce: time.Millisecond, Registerer: h.registry,
		Logger:   slog.New(slog.NewJSONHandler(h.logs, nil)),
		OnReload: func(err error) { h.reloads <- err },
	}
	if edit != nil {
		edit(&cfg)
	}
	srv, err := discovery.NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	srv.Register(g)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h.addr = lis.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 2)
	go func() { done <- srv.Run(ctx) }()
	go func() { done <- g.Serve(lis) }()
	select {
	case <-srv.Ready():
	case <-time.After(30 * time.Second):
		t.Fatal("the configuration file is never watched")
	}
	t.Cleanup(func() {
		cancel()
		g.Stop()
		for range 2 {
			if err := <-done; err != nil && !errors.Is(err, grpc.ErrServerStopped) {
				t.Errorf("discovery server: %v", err)
			}
		}
	})
	return h
}

// write replaces the file as an editor does: a new file renamed over the old one.
func (h *discoveryHarness) write(config string) {
	h.t.Helper()
	tmp := h.path + ".tmp"
	if err := os.WriteFile(tmp, []byte(config), 0o600); err != nil {
		h.t.Fatal(err)
	}
	if err := os.Rename(tmp, h.path); err != nil {
		h.t.Fatal(err)
	}
}

// reloaded waits for the next reload and returns its outcome.
func (h *discoveryHarness) reloaded() error {
	h.t.Helper()
	select {
	case err := <-h.reloads:
		return err
	case <-time.After(30 * time.Second):
		h.t.Fatal("the edit was never reloaded")
		return nil
	}
}

// ads opens an ADS stream as a client of namespace credential (none: no credential), declaring
// itself in claimed.
func (h *discoveryHarness) ads(credential, claimed string) discoveryv3.AggregatedDiscoveryService_StreamAggregatedResourcesClient {
	h.t.Helper()
	conn, err := grpc.NewClient(h.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { _ = conn.Close() })
	ctx := h.t.Context()
	if credential != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "x-credential-namespace", credential)
	}
	stream, err := discoveryv3.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
	if err != nil {
		h.t.Fatal(err)
	}
	node := &corev3.Node{Id: "sidecar~10.0.0.1~web.default~default.svc.cluster.local", Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
		"NAMESPACE":                    structpb.NewStringValue(claimed),
		discovery.NamespaceMetadataKey: structpb.NewStringValue(claimed),
	}}}
	// EOF: the server has already ended the stream (refused it); Recv has the status.
	if err := stream.Send(&discoveryv3.DiscoveryRequest{Node: node, TypeUrl: resource.ClusterType}); err != nil && !errors.Is(err, io.EOF) {
		h.t.Fatal(err)
	}
	return stream
}

// clusters receives the next response and returns its cluster names.
func clusters(t *testing.T, stream discoveryv3.AggregatedDiscoveryService_StreamAggregatedResourcesClient) ([]string, *discoveryv3.DiscoveryResponse) {
	t.Helper()
	resp, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, r := range resp.GetResources() {
		c := &clusterv3.Cluster{}
		if err := r.UnmarshalTo(c); err != nil {
			t.Fatal(err)
		}
		names = append(names, c.GetName())
	}
	return names, resp
}

const twoNamespaces = `
clusters: [{name: backend, connect_timeout: 1s}]
namespaces:
  prod:
    clusters: [{name: prod-backend, connect_timeout: 1s}]
`

// A client gets the set of the namespace its credential names, whatever its node declares.
func TestDiscoveryServesTheAuthenticatedNamespace(t *testing.T) {
	t.Parallel()
	h := startDiscovery(t, twoNamespaces)
	if got, _ := clusters(t, h.ads("default", "prod")); len(got) != 1 || got[0] != "backend" {
		t.Errorf("a default client claiming prod got %v, want [backend]", got)
	}
	if got, _ := clusters(t, h.ads("prod", "default")); len(got) != 1 || got[0] != "prod-backend" {
		t.Errorf("a prod client got %v, want [prod-backend]", got)
	}
}

// A type the set has none of is answered with an empty list, as Envoy needs to finish its
// initialisation (it waits on LDS and CDS); the config had clusters only.
func TestDiscoveryAnswersATypeItHasNoneOf(t *testing.T) {
	t.Parallel()
	h := startDiscovery(t, twoNamespaces)
	stream := h.ads("prod", "")
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: resource.ListenerType}); err != nil {
		t.Fatal(err)
	}
	resp, err := stream.Recv()
	if err != nil || resp.GetTypeUrl() != resource.ListenerType || len(resp.GetResources()) != 0 || resp.GetVersionInfo() == "" {
		t.Fatalf("listeners of a set without any: %v, %v; want an empty, versioned answer", resp, err)
	}
}

func TestDiscoveryRefusesAClientWithoutCredentials(t *testing.T) {
	t.Parallel()
	h := startDiscovery(t, twoNamespaces)
	_, err := h.ads("", "prod").Recv()
	if status.Code(err) != codes.Unauthenticated {
		t.Fatalf("error %v, want Unauthenticated", err)
	}
}

// An edit is pushed; an invalid edit is reported and the last good set keeps serving; the next
// valid one is pushed.
func TestDiscoveryPushesEdits(t *testing.T) {
	t.Parallel()
	h := startDiscovery(t, twoNamespaces)
	stream := h.ads("default", "")
	_, first := clusters(t, stream)
	if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: resource.ClusterType, VersionInfo: first.GetVersionInfo(), ResponseNonce: first.GetNonce()}); err != nil {
		t.Fatal(err)
	}

	h.write("clusters: [{name: backend, connect_timeout: -1s}]")
	if err := h.reloaded(); err == nil || !strings.Contains(err.Error(), "ConnectTimeout") {
		t.Fatalf("an invalid edit: %v, want it refused with the reason", err)
	}
	h.write("clusters: [{name: backend, connect_timeout: 1s}, {name: cache, connect_timeout: 1s}]")
	if err := h.reloaded(); err != nil {
		t.Fatal(err)
	}
	// The next response is the valid edit's: the invalid one was never sent.
	got, second := clusters(t, stream)
	slices.Sort(got) // the cache answers in no particular order
	if !slices.Equal(got, []string{"backend", "cache"}) || second.GetVersionInfo() == first.GetVersionInfo() {
		t.Fatalf("after the edit: %v (version %s, was %s)", got, second.GetVersionInfo(), first.GetVersionInfo())
	}
	for outcome, want := range map[string]float64{"invalid": 1, "loaded": 1} {
		if got := counter(t, h.registry, "meshid_discovery_config_reloads_total", outcome); got != want {
			t.Errorf("reloads %s: %v, want %v", outcome, got, want)
		}
	}
}

// counter is the value of a counter vector's series of one label value.
func counter(t *testing.T, reg *prometheus.Registry, name, value string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			if f.GetName() == name && len(m.GetLabel()) == 1 && m.GetLabel()[0].GetValue() == value {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

func TestNewServerRefusesAnInvalidFile(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "xds.yaml")
	if err := os.WriteFile(path, []byte("clusters: [{name: a, connect_timeout: -1s}]"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := discovery.NewServer(discovery.ServerConfig{ConfigPath: path, Authorizer: headerAuthenticator{}})
	if err == nil || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "ConnectTimeout") {
		t.Fatalf("error %v, want one naming the file and the field", err)
	}
}

// Without a file the server serves an empty configuration, as it would an empty file: every
// type answered with no resource and a version, the ACK not answered again. Its Ready is
// closed from the start (the harness waits for it): there is nothing to watch.
func TestDiscoveryWithoutAFile(t *testing.T) {
	t.Parallel()
	h := startDiscoveryWith(t, "", func(c *discovery.ServerConfig) { c.ConfigPath = "" })
	emptyFile, err := discovery.ParseConfig(nil)
	if err != nil {
		t.Fatal(err)
	}
	_, want := emptyFile.For("default")
	if _, version := discovery.EmptyConfig().For("default"); version != want {
		t.Fatalf("the empty configuration has version %q, an empty file %q", version, want)
	}

	stream := h.ads("default", "")
	names, resp := clusters(t, stream)
	if len(names) != 0 || resp.GetVersionInfo() != want || resp.GetNonce() == "" {
		t.Fatalf("clusters without a file: %v, version %q nonce %q; want none, version %q", names, resp.GetVersionInfo(), resp.GetNonce(), want)
	}
	// The ACK: the next answer on the stream is the listeners', not the clusters' again.
	if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: resource.ClusterType, VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()}); err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: resource.ListenerType}); err != nil {
		t.Fatal(err)
	}
	if lds, err := stream.Recv(); err != nil || lds.GetTypeUrl() != resource.ListenerType || len(lds.GetResources()) != 0 || lds.GetVersionInfo() != want {
		t.Fatalf("after the clusters' ACK: %v, %v; want the empty listeners", lds, err)
	}

	// config_dump answers too, with no resource of any type.
	if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: discovery.DebugConfigDump}); err != nil {
		t.Fatal(err)
	}
	if dump, err := stream.Recv(); err != nil || dump.GetTypeUrl() != discovery.DebugConfigDump || len(dump.GetResources()) != 1 {
		t.Fatalf("config_dump without a file: %v, %v", dump, err)
	}
}

// Delta xDS: the same sets, resource by resource.
func TestDiscoveryDelta(t *testing.T) {
	t.Parallel()
	h := startDiscovery(t, twoNamespaces)
	conn, err := grpc.NewClient(h.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ctx := metadata.AppendToOutgoingContext(t.Context(), "x-credential-namespace", "prod")
	stream, err := discoveryv3.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&discoveryv3.DeltaDiscoveryRequest{Node: &corev3.Node{Id: "sidecar"}, TypeUrl: resource.ClusterType,
		ResourceNamesSubscribe: []string{"*"}}); err != nil {
		t.Fatal(err)
	}
	resp, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if rs := resp.GetResources(); len(rs) != 1 || rs[0].GetName() != "prod-backend" {
		t.Fatalf("delta resources %v, want prod-backend", rs)
	}
}

// istio.io/debug on the ADS stream: syncz reports what the caller's namespace's nodes ACKed,
// config_dump the namespace's set.
func TestDiscoveryDebug(t *testing.T) {
	t.Parallel()
	h := startDiscovery(t, twoNamespaces)
	stream := h.ads("default", "")
	_, resp := clusters(t, stream)
	if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: resource.ClusterType, VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()}); err != nil {
		t.Fatal(err)
	}
	prod := h.ads("prod", "")
	clusters(t, prod) // a node of another namespace, not ACKed: not in default's syncz

	debug := func(typeURL string) *discoveryv3.DiscoveryResponse {
		t.Helper()
		if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: typeURL}); err != nil {
			t.Fatal(err)
		}
		resp, err := stream.Recv()
		if err != nil || resp.GetTypeUrl() != typeURL {
			t.Fatalf("%s: %v, %v", typeURL, resp, err)
		}
		return resp
	}
	// Each answer is Envoy's type as JSON in a google.protobuf.Value.
	decode := func(a *anypb.Any, into proto.Message) {
		t.Helper()
		v := &structpb.Value{}
		if err := a.UnmarshalTo(v); err != nil {
			t.Fatal(err)
		}
		data, err := protojson.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		if err := protojson.Unmarshal(data, into); err != nil {
			t.Fatalf("%s: %v", data, err)
		}
	}
	// The ACK is processed on the server's own goroutine: syncz catches up with it.
	synced := func() error {
		syncz := debug(discovery.DebugSyncz)
		if len(syncz.GetResources()) != 1 {
			t.Fatalf("syncz lists %d nodes, want the caller's namespace's one", len(syncz.GetResources()))
		}
		cc := &statusv3.ClientConfig{}
		decode(syncz.GetResources()[0], cc)
		if gx := cc.GetGenericXdsConfigs(); len(gx) != 1 || gx[0].GetConfigStatus() != statusv3.ConfigStatus_SYNCED || gx[0].GetVersionInfo() != resp.GetVersionInfo() {
			return fmt.Errorf("syncz of the node: %v", cc)
		}
		return nil
	}
	deadline := time.Now().Add(30 * time.Second)
	for err := synced(); err != nil; err = synced() {
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
	}

	dump := &adminv3.ConfigDump{}
	decode(debug(discovery.DebugConfigDump).GetResources()[0], dump)
	clustersDump := &adminv3.ClustersConfigDump{}
	if err := dump.GetConfigs()[1].UnmarshalTo(clustersDump); err != nil {
		t.Fatal(err)
	}
	c := &clusterv3.Cluster{}
	if dc := clustersDump.GetDynamicActiveClusters(); len(dc) != 1 || dc[0].GetCluster().UnmarshalTo(c) != nil || c.GetName() != "backend" {
		t.Errorf("config_dump clusters: %v", clustersDump)
	}

	if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: "istio.io/debug/secrets"}); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); status.Code(err) != codes.InvalidArgument {
		t.Errorf("an unknown debug type: %v, want InvalidArgument", err)
	}
}
