package xdsproxy_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/xdsproxy"
)

// Attack: 10,000 streams over 10 connections took the agent to 324 MB and the CA to 330 MB, each
// stream opening an authenticated stream upstream. Past MaxStreams open at once over any number
// of connections, a stream is refused with ResourceExhausted before any upstream stream is
// opened, counted and logged with the peer; one that ends frees its place.
func TestStreamLimit(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	up := startUpstream(t)
	h := startProxy(t, up.addr, func(c *xdsproxy.Config) { c.MaxStreams = 2 })
	first := openCDS(t, ctx, h)
	openCDS(t, ctx, h)

	over, err := h.client.StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := over.Recv(); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a third stream: %v, want ResourceExhausted", err)
	}
	delta, err := h.client.DeltaAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := delta.Recv(); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a delta stream over the limit: %v, want ResourceExhausted", err)
	}
	if got := h.metric(t, "meshid_xds_proxy_refusals_total", "ResourceExhausted", "too_many_streams"); got != 2 {
		t.Fatalf("refusals counted: %v, want 2", got)
	}
	if got := h.metric(t, "meshid_xds_proxy_streams_total"); got != 2 {
		t.Fatalf("streams proxied: %v, want only the 2 admitted", got)
	}
	logged := h.logs.Records(t, "xDS proxy request refused")
	if len(logged) != 2 || logged[0]["reason"] != "too_many_streams" || !strings.Contains(logged[0]["peer"].(string), "pid=") {
		t.Fatalf("refusals logged as %v", logged)
	}

	// An ended stream frees its place.
	if err := first.CloseSend(); err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := first.Recv(); err != nil {
			break
		}
	}
	limit := time.Now().Add(waitLimit)
	for {
		s, err := h.client.StreamAggregatedResources(ctx)
		if err != nil {
			t.Fatal(err)
		}
		sendSotw(t, s, &discovery.DiscoveryRequest{Node: &corev3.Node{Id: nodeID}, TypeUrl: resource.ClusterType})
		_, err = s.Recv()
		if err == nil {
			break
		}
		// The proxy releases the place a moment after the client sees the end.
		if status.Code(err) != codes.ResourceExhausted || time.Now().After(limit) {
			t.Fatalf("after a stream ended: %v", err)
		}
	}
}

// Connections are bounded by MaxStreams too (one that carries no stream serves nothing): past it
// a new connection is closed at once, counted and logged.
func TestConnectionLimit(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	up := startUpstream(t)
	h := startProxy(t, up.addr, func(c *xdsproxy.Config) { c.MaxStreams = 1 })
	openCDS(t, ctx, h)

	conn, err := grpc.NewClient("unix://"+h.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	s, err := discovery.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
	if err == nil {
		_, err = s.Recv()
	}
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("a second connection: %v, want Unavailable (closed)", err)
	}
	if got := h.metric(t, "meshid_xds_proxy_refusals_total", "closed", "too_many_connections"); got < 1 {
		t.Fatalf("connection refusals counted: %v", got)
	}
	if logged := h.logs.Records(t, "xDS proxy connection refused"); len(logged) == 0 || !strings.Contains(logged[0]["peer"].(string), "pid=") {
		t.Fatalf("the refused connection logged as %v", logged)
	}
}

// A connection is bounded by HTTP/2: the proxy advertises MaxStreamsPerConnection, so that Envoy
// holds further streams back, and a client that floods it with pings is sent away.
func TestConnectionSettings(t *testing.T) {
	t.Parallel()
	up := startUpstream(t)
	h := startProxy(t, up.addr, func(c *xdsproxy.Config) { c.MaxStreamsPerConnection = 3 })
	conn := testutil.H2Dial(t, h.socket)
	if got, ok := conn.Settings(t)[testutil.H2SettingMaxConcurrentStreams]; !ok || got != 3 {
		t.Fatalf("SETTINGS_MAX_CONCURRENT_STREAMS = %d (sent: %v), want 3", got, ok)
	}
	for range 10 {
		conn.Write(t, testutil.H2FramePing, 0, make([]byte, 8))
	}
	if code, ok := conn.GoAway(t); !ok || code != testutil.H2ErrEnhanceYourCalm {
		t.Fatalf("a ping flood: GOAWAY %v with code %#x, want ENHANCE_YOUR_CALM", ok, code)
	}
}

// Attack: 3.9 MB nodes were passed on. A request over 1 MiB ends its stream with
// ResourceExhausted, and nothing of it reaches the upstream.
func TestOversizedRequest(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	up := startUpstream(t)
	h := startProxy(t, up.addr)
	s, err := h.client.StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	node := &corev3.Node{Id: nodeID, Cluster: strings.Repeat("c", 2<<20)}
	sendSotw(t, s, &discovery.DiscoveryRequest{Node: node, TypeUrl: resource.ClusterType})
	if _, err := s.Recv(); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a 2 MiB request: %v, want ResourceExhausted", err)
	}
	openCDS(t, ctx, h) // served: the upstream's next request is this one
	if req := up.request(t, ctx, func(*discovery.DiscoveryRequest) bool { return true }); len(req.GetNode().GetCluster()) != 0 {
		t.Fatal("the oversized request reached the upstream")
	}
}

// Attack: one unthrottled log line per stream end. A client that opens and ends streams as fast
// as it likes gets a burst of lines per reason, then one a second (the clock stands still here).
func TestStreamEndLogsArePaced(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	up := startUpstream(t)
	h := startProxy(t, up.addr, func(c *xdsproxy.Config) { c.Clock = testutil.NewFakeClock(time.Now()) })
	const streams = 30
	for range streams {
		sctx, cancel := context.WithCancel(ctx)
		s, err := h.client.StreamAggregatedResources(sctx)
		if err != nil {
			t.Fatal(err)
		}
		sendSotw(t, s, &discovery.DiscoveryRequest{Node: &corev3.Node{Id: nodeID}, TypeUrl: resource.ClusterType})
		if _, err := s.Recv(); err != nil {
			t.Fatal(err)
		}
		cancel()
	}
	h.stop() // every stream has ended once Run has returned
	perReason := map[string]int{}
	logged := h.logs.Records(t, "xDS proxy stream ended")
	for _, rec := range logged {
		perReason[rec["reason"].(string)]++
	}
	for reason, n := range perReason {
		if n > 10 {
			t.Fatalf("%d streams ended logged %d lines of reason %q, want the burst of 10 at most", streams, n, reason)
		}
	}
	if len(logged) >= streams {
		t.Fatalf("%d streams ended logged %d lines: not paced", streams, len(logged))
	}
}

// Attack: /debug/<type> asked the upstream for any type. A type the discovery servers do not
// answer is refused before any upstream stream, counted and logged.
func TestDebugUnknownTypeIsRefusedBeforeTheUpstream(t *testing.T) {
	t.Parallel()
	up, addr := startDebugUpstream(t, false)
	h := startProxy(t, addr, shortDebugTimeout)
	for _, typ := range []string{"adsz", "connections", "config_dumpx"} {
		rec := debugGet(t, h, http.MethodGet, "/debug/"+typ)
		if rec.Code != http.StatusNotFound || !strings.Contains(rec.Body.String(), "/debug/syncz") {
			t.Fatalf("/debug/%s: %d %s, want 404 naming the known types", typ, rec.Code, rec.Body)
		}
	}
	if len(up.opened) != 0 {
		t.Fatalf("%d upstream streams opened for unknown types", len(up.opened))
	}
	if got := h.metric(t, "meshid_xds_proxy_refusals_total", strconv.Itoa(http.StatusNotFound), "unknown_debug_type"); got != 3 {
		t.Fatalf("unknown types counted: %v, want 3", got)
	}
	if logged := h.logs.Records(t, "xDS proxy request refused"); len(logged) != 3 || logged[0]["protocol"] != "debug" {
		t.Fatalf("refusals logged as %v", logged)
	}
}

// A server that takes the proxy's socket path after it started gets Envoy's new connections:
// noticed at the next look, logged once naming the process, counted; once it is gone, the path
// is taken back.
func TestSocketTakenAndTakenBack(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	up := startUpstream(t)
	clk := testutil.NewFakeClock(time.Now())
	changes := make(chan error, 10)
	h := startProxy(t, up.addr, func(c *xdsproxy.Config) {
		c.SocketClock = clk
		c.OnSocket = func(err error) { changes <- err }
	})
	openCDS(t, ctx, h)

	other, err := net.Listen("unix", h.socket+".new")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(h.socket+".new", h.socket); err != nil {
		t.Fatal(err)
	}
	err = testutil.Drive(t, clk, xdsproxy.SocketCheckInterval, 0, changes)
	if !errors.Is(err, fsutil.ErrSocketTaken) || !strings.Contains(err.Error(), "served by pid="+strconv.Itoa(os.Getpid())) {
		t.Fatalf("the takeover reported as %v", err)
	}
	if !errors.Is(h.SocketProblem(), fsutil.ErrSocketTaken) {
		t.Fatalf("SocketProblem() = %v while the path is taken", h.SocketProblem())
	}
	if got := h.metric(t, "meshid_xds_proxy_socket_taken_total"); got != 1 {
		t.Fatalf("takeovers counted: %v, want 1", got)
	}
	if logged := h.logs.Records(t, "the socket path was taken: Envoy's new connections reach whatever is there now"); len(logged) != 1 {
		t.Fatalf("the takeover logged %d times, want once", len(logged))
	}

	_ = other.Close()
	if err := os.Remove(h.socket); err != nil {
		t.Fatal(err)
	}
	if err := testutil.Drive(t, clk, xdsproxy.SocketCheckInterval, 0, changes); !errors.Is(err, fsutil.ErrSocketTaken) {
		t.Fatalf("the other server's end reported as %v", err)
	}
	if err := <-changes; err != nil {
		t.Fatalf("the path taken back reported as %v", err)
	}
	if err := h.SocketProblem(); err != nil {
		t.Fatalf("SocketProblem() = %v once the path is taken back", err)
	}
	openCDS(t, ctx, h) // a new connection reaches the proxy again
}
