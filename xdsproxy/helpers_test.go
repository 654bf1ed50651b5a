package xdsproxy_test

import (
	"context"
	"log/slog"
	"net"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/xdsproxy"
)

const (
	nodeID = "envoy-1"
	// waitLimit bounds every wait of a test: it only turns a hang into a failure.
	waitLimit = 20 * time.Second
)

func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	t.Cleanup(cancel)
	return ctx
}

// upstream is a go-control-plane discovery server on 127.0.0.1 with a snapshot cache, which
// reports the requests it receives and the streams it sees close.
type upstream struct {
	addr     string
	cache    cachev3.SnapshotCache
	xds      serverv3.Server
	opts     []grpc.ServerOption
	srv      *grpc.Server
	requests chan *discovery.DiscoveryRequest
	deltas   chan *discovery.DeltaDiscoveryRequest
	closed   chan *corev3.Node
}

func startUpstream(t *testing.T, opts ...grpc.ServerOption) *upstream {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	u := &upstream{
		cache:    cachev3.NewSnapshotCache(false, cachev3.IDHash{}, nil),
		opts:     opts,
		requests: make(chan *discovery.DiscoveryRequest, 100),
		deltas:   make(chan *discovery.DeltaDiscoveryRequest, 100),
		closed:   make(chan *corev3.Node, 100),
	}
	closed := func(_ int64, node *corev3.Node) { u.closed <- node }
	u.xds = serverv3.NewServer(ctx, u.cache, serverv3.CallbackFuncs{
		StreamRequestFunc: func(_ int64, req *discovery.DiscoveryRequest) error {
			u.requests <- req
			return nil
		},
		StreamDeltaRequestFunc: func(_ int64, req *discovery.DeltaDiscoveryRequest) error {
			u.deltas <- req
			return nil
		},
		StreamClosedFunc:      closed,
		DeltaStreamClosedFunc: closed,
	})
	u.setSnapshot(t, "v1", "cluster-1")
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u.addr = lis.Addr().String()
	u.serve(lis)
	t.Cleanup(func() { u.srv.Stop() })
	return u
}

func (u *upstream) serve(lis net.Listener) {
	u.srv = grpc.NewServer(u.opts...)
	discovery.RegisterAggregatedDiscoveryServiceServer(u.srv, u.xds)
	srv := u.srv
	go func() { _ = srv.Serve(lis) }()
}

// restart serves again on the same address after a Stop.
func (u *upstream) restart(t *testing.T) {
	t.Helper()
	lis, err := net.Listen("tcp", u.addr)
	if err != nil {
		t.Fatalf("listen again on %s: %v", u.addr, err)
	}
	u.serve(lis)
}

// setSnapshot sets the node's snapshot: a listener and the named clusters.
func (u *upstream) setSnapshot(t *testing.T, version string, clusters ...string) {
	t.Helper()
	var cs []types.Resource
	for _, name := range clusters {
		cs = append(cs, &clusterv3.Cluster{Name: name})
	}
	snap, err := cachev3.NewSnapshot(version, map[resource.Type][]types.Resource{
		resource.ClusterType:  cs,
		resource.ListenerType: {&listenerv3.Listener{Name: "listener-1"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := snap.Consistent(); err != nil {
		t.Fatal(err)
	}
	if err := u.cache.SetSnapshot(context.Background(), nodeID, snap); err != nil {
		t.Fatal(err)
	}
}

// request waits for the next SotW request the upstream receives that matches.
func (u *upstream) request(t *testing.T, ctx context.Context, match func(*discovery.DiscoveryRequest) bool) *discovery.DiscoveryRequest {
	t.Helper()
	for {
		select {
		case req := <-u.requests:
			if match(req) {
				return req
			}
		case <-ctx.Done():
			t.Fatal("the upstream did not receive the request")
		}
	}
}

// delta waits for the next delta request the upstream receives that matches.
func (u *upstream) delta(t *testing.T, ctx context.Context, match func(*discovery.DeltaDiscoveryRequest) bool) *discovery.DeltaDiscoveryRequest {
	t.Helper()
	for {
		select {
		case req := <-u.deltas:
			if match(req) {
				return req
			}
		case <-ctx.Done():
			t.Fatal("the upstream did not receive the delta request")
		}
	}
}

// proxy is a running Proxy on a socket in a short temp dir, its upstream connection, and an ADS
// client on its socket.
type proxy struct {
	*xdsproxy.Proxy
	socket   string
	upstream *grpc.ClientConn
	reg      *prometheus.Registry
	logs     *testutil.SyncBuffer
	client   discovery.AggregatedDiscoveryServiceClient
	// stop ends Run and waits for it to return.
	stop func()
}

func startProxy(t *testing.T, addr string, adjust ...func(*xdsproxy.Config)) *proxy {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		// Quick reconnects, for the tests that restart the upstream.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 10 * time.Millisecond, Multiplier: 1.6, MaxDelay: 100 * time.Millisecond},
			MinConnectTimeout: time.Second,
		}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	h := &proxy{
		socket:   filepath.Join(testutil.ShortTempDir(t), "proxy", "XDS"),
		upstream: conn,
		reg:      prometheus.NewRegistry(),
		logs:     &testutil.SyncBuffer{},
	}
	cfg := xdsproxy.Config{
		Socket:     h.socket,
		Upstream:   conn,
		Node:       &corev3.Node{Id: "agent-1"},
		Logger:     slog.New(slog.NewJSONHandler(h.logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		Registerer: h.reg,
	}
	for _, fn := range adjust {
		fn(&cfg)
	}
	h.socket = cfg.Socket
	if h.Proxy, err = xdsproxy.New(cfg); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.Run(ctx) }()
	h.stop = sync.OnceFunc(func() {
		cancel()
		limit := time.NewTimer(waitLimit)
		defer limit.Stop()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-limit.C:
			t.Error("Run did not return")
		}
	})
	t.Cleanup(h.stop)
	// Run listens before it serves: the client's connection waits for the socket (WaitForReady
	// on every call below), so no start-up race.
	client, err := grpc.NewClient("unix://"+h.socket, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Close() })
	h.client = discovery.NewAggregatedDiscoveryServiceClient(client)
	return h
}

// waitUpstreamReady waits until the proxy's upstream connection is ready, asking it to connect.
func (h *proxy) waitUpstreamReady(t *testing.T, ctx context.Context) {
	t.Helper()
	for {
		s := h.upstream.GetState()
		if s == connectivity.Ready {
			return
		}
		h.upstream.Connect()
		if !h.upstream.WaitForStateChange(ctx, s) {
			t.Fatal("the upstream connection did not become ready")
		}
	}
}

// metric reads a counter or gauge of the proxy's registry for the given label values (in the
// order of the metric's labels); absent means 0.
func (h *proxy) metric(t *testing.T, name string, labels ...string) float64 {
	t.Helper()
	families, err := h.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	next:
		for _, m := range f.GetMetric() {
			if len(m.GetLabel()) != len(labels) {
				continue
			}
			for i, l := range m.GetLabel() {
				if l.GetValue() != labels[i] {
					continue next
				}
			}
			if m.GetCounter() != nil {
				return m.GetCounter().GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return 0
}

// resourceNames decodes clusters and listeners and returns their names, sorted.
func resourceNames(t *testing.T, anys []*anypb.Any) []string {
	t.Helper()
	out := make([]string, 0, len(anys))
	for _, a := range anys {
		m, err := a.UnmarshalNew()
		if err != nil {
			t.Fatal(err)
		}
		switch r := m.(type) {
		case *clusterv3.Cluster:
			out = append(out, r.GetName())
		case *listenerv3.Listener:
			out = append(out, r.GetName())
		default:
			t.Fatalf("unexpected resource %s", a.GetTypeUrl())
		}
	}
	slices.Sort(out) // a response's order is the server's
	return out
}
