package xdsproxy_test

import (
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/xdsproxy"
)

const (
	configDump  = xdsproxy.DebugTypePrefix + "config_dump"
	unknownType = "type.googleapis.com/istio.debug.NotLinked"
)

// debugUpstream answers istio.io/debug requests, as istiod does: a config_dump holding a cluster
// and a resource of a type the agent does not link. It first sends, unasked, a response of another
// type, which the proxy must not take for the answer. With silent it answers nothing.
type debugUpstream struct {
	discovery.UnimplementedAggregatedDiscoveryServiceServer
	silent   bool
	opened   chan struct{}
	requests chan *discovery.DiscoveryRequest
}

func (s *debugUpstream) StreamAggregatedResources(stream grpc.BidiStreamingServer[discovery.DiscoveryRequest, discovery.DiscoveryResponse]) error {
	s.opened <- struct{}{}
	for {
		req, err := stream.Recv()
		if err != nil {
			return err
		}
		s.requests <- req
		if s.silent {
			continue
		}
		if err := stream.Send(&discovery.DiscoveryResponse{TypeUrl: xdsproxy.DebugTypePrefix + "syncz"}); err != nil {
			return err
		}
		cluster, err := anypb.New(&clusterv3.Cluster{Name: "dumped-cluster"})
		if err != nil {
			return err
		}
		if err := stream.Send(&discovery.DiscoveryResponse{
			TypeUrl:   req.GetTypeUrl(),
			Resources: []*anypb.Any{cluster, {TypeUrl: unknownType, Value: []byte{1, 2, 3}}},
		}); err != nil {
			return err
		}
	}
}

func startDebugUpstream(t *testing.T, silent bool, opts ...grpc.ServerOption) (*debugUpstream, string) {
	t.Helper()
	u := &debugUpstream{silent: silent, opened: make(chan struct{}, 10), requests: make(chan *discovery.DiscoveryRequest, 10)}
	srv := grpc.NewServer(opts...)
	discovery.RegisterAggregatedDiscoveryServiceServer(srv, u)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return u, lis.Addr().String()
}

func debugGet(t *testing.T, h *proxy, method, target string) *httptest.ResponseRecorder {
	t.Helper()
	rec := httptest.NewRecorder()
	h.DebugHandler().ServeHTTP(rec, httptest.NewRequestWithContext(testContext(t), method, target, nil))
	return rec
}

func shortDebugTimeout(c *xdsproxy.Config) { c.DebugTimeout = 200 * time.Millisecond }

func TestDebugConfigDump(t *testing.T) {
	t.Parallel()
	up, addr := startDebugUpstream(t, false)
	h := startProxy(t, addr, shortDebugTimeout)

	for range 2 {
		rec := debugGet(t, h, http.MethodGet, "/debug/config_dump?resourceName=a&resourceName=b")
		if rec.Code != http.StatusOK || rec.Header().Get("Content-Type") != "application/json" {
			t.Fatalf("GET: %d %s: %s", rec.Code, rec.Header().Get("Content-Type"), rec.Body)
		}
		var got struct {
			TypeURL   string           `json:"typeUrl"`
			Resources []map[string]any `json:"resources"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil {
			t.Fatalf("answer %s: %v", rec.Body, err)
		}
		if got.TypeURL != configDump || len(got.Resources) != 2 {
			t.Fatalf("answer: %s", rec.Body)
		}
		if got.Resources[0]["name"] != "dumped-cluster" {
			t.Errorf("the cluster is shown as %v", got.Resources[0])
		}
		// A type the agent does not link is shown, not an error.
		if got.Resources[1]["@type"] != unknownType || got.Resources[1]["value"] != "AQID" {
			t.Errorf("the unknown resource is shown as %v", got.Resources[1])
		}
		req := <-up.requests
		if req.GetTypeUrl() != configDump || req.GetNode().GetId() != "agent-1" || !slices.Equal(req.GetResourceNames(), []string{"a", "b"}) {
			t.Errorf("the upstream got %v", req)
		}
	}
	// Both went on the proxy's one debug stream; no Envoy stream was involved.
	if len(up.opened) != 1 {
		t.Errorf("debug streams opened: %d, want 1", len(up.opened))
	}
	if got := h.metric(t, "meshid_xds_proxy_streams_total"); got != 0 {
		t.Errorf("Envoy streams counted: %v, want 0", got)
	}
}

func TestDebugTimeout(t *testing.T) {
	t.Parallel()
	up, addr := startDebugUpstream(t, true)
	h := startProxy(t, addr, shortDebugTimeout)

	for i := range 2 {
		rec := debugGet(t, h, http.MethodGet, "/debug/config_dump")
		if rec.Code != http.StatusGatewayTimeout || !strings.Contains(rec.Body.String(), "did not answer "+configDump+" within 200ms") {
			t.Fatalf("GET: %d: %s", rec.Code, rec.Body)
		}
		// The stream that timed out is dropped: a late answer cannot pass for the next one's.
		if len(up.opened) != i+1 {
			t.Errorf("debug streams opened: %d, want %d", len(up.opened), i+1)
		}
	}
}

func TestDebugRefusedByTheUpstream(t *testing.T) {
	t.Parallel()
	refuse := func(any, grpc.ServerStream, *grpc.StreamServerInfo, grpc.StreamHandler) error {
		return status.Error(codes.PermissionDenied, "not this node")
	}
	_, addr := startDebugUpstream(t, false, grpc.StreamInterceptor(refuse))
	h := startProxy(t, addr, shortDebugTimeout)

	rec := debugGet(t, h, http.MethodGet, "/debug/syncz")
	if rec.Code != http.StatusBadGateway || !strings.Contains(rec.Body.String(), "PermissionDenied: not this node") {
		t.Fatalf("GET: %d: %s", rec.Code, rec.Body)
	}
}

func TestDebugBadRequests(t *testing.T) {
	t.Parallel()
	_, addr := startDebugUpstream(t, false)
	h := startProxy(t, addr, shortDebugTimeout)

	for _, tc := range []struct {
		name, method, target string
		code                 int
	}{
		{"post", http.MethodPost, "/debug/config_dump", http.StatusMethodNotAllowed},
		{"no type", http.MethodGet, "/debug/", http.StatusBadRequest},
		{"nested type", http.MethodGet, "/debug/config_dump/x", http.StatusBadRequest},
		{"odd type", http.MethodGet, "/debug/a%20b", http.StatusBadRequest},
		{"other path", http.MethodGet, "/metrics", http.StatusBadRequest},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if rec := debugGet(t, h, tc.method, tc.target); rec.Code != tc.code {
				t.Errorf("%s %s: %d, want %d: %s", tc.method, tc.target, rec.Code, tc.code, rec.Body)
			}
		})
	}
}
