package xdsproxy_test

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/xdsproxy"
)

// wantProblem fails unless the proxy's configuration problem (for an agent that does not run
// Envoy) contains each of want, or is nil when want is empty.
func wantProblem(t *testing.T, h *proxy, want ...string) {
	t.Helper()
	err := h.ConfigProblem(false)
	if len(want) == 0 {
		if err != nil {
			t.Fatalf("ConfigProblem: %v, want none", err)
		}
		return
	}
	if err == nil {
		t.Fatalf("ConfigProblem: none, want %q", want)
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Fatalf("ConfigProblem: %v, want it to say %q", err, w)
		}
	}
}

// Readiness follows what Envoy acknowledged through the proxy: clusters and listeners, each at
// least once; a refusal is named; what Envoy has it keeps when its stream ends.
func TestConfigProblemFollowsEnvoysAnswers(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	up := startUpstream(t)
	h := startProxy(t, up.addr)

	// No Envoy yet: nothing to say, unless the agent runs one.
	wantProblem(t, h)
	if err := h.ConfigProblem(true); err == nil || !strings.Contains(err.Error(), "no Envoy has connected") {
		t.Fatalf("ConfigProblem(expectEnvoy): %v, want that no Envoy has connected", err)
	}

	stream, err := h.client.StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sendSotw(t, stream, &discovery.DiscoveryRequest{Node: &corev3.Node{Id: nodeID}, TypeUrl: resource.ClusterType})
	up.request(t, ctx, func(r *discovery.DiscoveryRequest) bool { return r.GetTypeUrl() == resource.ClusterType })
	wantProblem(t, h, "clusters (CDS)", "listeners (LDS)")

	cds := recvSotw(t, stream)
	sendSotw(t, stream, &discovery.DiscoveryRequest{TypeUrl: resource.ClusterType, VersionInfo: cds.GetVersionInfo(), ResponseNonce: cds.GetNonce()})
	up.request(t, ctx, func(r *discovery.DiscoveryRequest) bool { return r.GetResponseNonce() == cds.GetNonce() })
	wantProblem(t, h, "listeners (LDS)")
	if err := h.ConfigProblem(false); strings.Contains(err.Error(), "clusters") {
		t.Fatalf("ConfigProblem after the CDS ACK: %v, still names the clusters", err)
	}

	sendSotw(t, stream, &discovery.DiscoveryRequest{TypeUrl: resource.ListenerType})
	lds := recvSotw(t, stream)
	sendSotw(t, stream, &discovery.DiscoveryRequest{TypeUrl: resource.ListenerType, ResponseNonce: lds.GetNonce(),
		ErrorDetail: &rpcstatus.Status{Code: int32(codes.InvalidArgument), Message: "bad listener"}})
	up.request(t, ctx, func(r *discovery.DiscoveryRequest) bool { return r.GetErrorDetail() != nil })
	wantProblem(t, h, "listeners (LDS), which it refused")

	sendSotw(t, stream, &discovery.DiscoveryRequest{TypeUrl: resource.ListenerType, VersionInfo: lds.GetVersionInfo(), ResponseNonce: lds.GetNonce()})
	up.request(t, ctx, func(r *discovery.DiscoveryRequest) bool {
		return r.GetTypeUrl() == resource.ListenerType && r.GetResponseNonce() == lds.GetNonce() && r.GetErrorDetail() == nil
	})
	wantProblem(t, h)
	if err := h.ConfigProblem(true); err != nil {
		t.Fatalf("ConfigProblem(expectEnvoy) once Envoy acknowledged: %v", err)
	}

	// Envoy keeps its configuration across a reconnect; so does readiness.
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	<-up.closed
	wantProblem(t, h)
}

// An upstream that answers Unimplemented serves no ADS: that is said, until it answers.
func TestConfigProblemNamesAnUpstreamWithoutADS(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	var refuse atomic.Bool
	refuse.Store(true)
	up := startUpstream(t, grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if refuse.Load() {
			return status.Error(codes.Unimplemented, "unknown service envoy.service.discovery.v3.AggregatedDiscoveryService")
		}
		return handler(srv, ss)
	}))
	h := startProxy(t, up.addr)

	for _, delta := range []bool{false, true} {
		var err error
		if delta {
			var s grpc.BidiStreamingClient[discovery.DeltaDiscoveryRequest, discovery.DeltaDiscoveryResponse]
			if s, err = h.client.DeltaAggregatedResources(ctx); err == nil {
				_, err = s.Recv()
			}
		} else {
			var s grpc.BidiStreamingClient[discovery.DiscoveryRequest, discovery.DiscoveryResponse]
			if s, err = h.client.StreamAggregatedResources(ctx); err == nil {
				_, err = s.Recv()
			}
		}
		if status.Code(err) != codes.Unimplemented {
			t.Fatalf("delta %v: Recv: %v, want the upstream's Unimplemented", delta, err)
		}
		if err := h.ConfigProblem(false); !errors.Is(err, xdsproxy.ErrUpstreamNoADS) || !strings.Contains(err.Error(), "unknown service") {
			t.Fatalf("delta %v: ConfigProblem: %v, want ErrUpstreamNoADS with the upstream's message", delta, err)
		}
	}

	// The upstream serves ADS after all: the first response clears it.
	refuse.Store(false)
	stream, err := h.client.StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sendSotw(t, stream, &discovery.DiscoveryRequest{Node: &corev3.Node{Id: nodeID}, TypeUrl: resource.ClusterType})
	recvSotw(t, stream)
	if err := h.ConfigProblem(false); errors.Is(err, xdsproxy.ErrUpstreamNoADS) {
		t.Fatalf("ConfigProblem after a response: %v, want the refusal forgotten", err)
	}
}
