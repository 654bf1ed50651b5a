package xdsproxy_test

import (
	"slices"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/anypb"
)

type deltaStream = grpc.BidiStreamingClient[discovery.DeltaDiscoveryRequest, discovery.DeltaDiscoveryResponse]

func recvDelta(t *testing.T, s deltaStream) *discovery.DeltaDiscoveryResponse {
	t.Helper()
	resp, err := s.Recv()
	if err != nil {
		t.Fatalf("Recv: %v", err)
	}
	return resp
}

func sendDelta(t *testing.T, s deltaStream, req *discovery.DeltaDiscoveryRequest) {
	t.Helper()
	if err := s.Send(req); err != nil {
		t.Fatalf("Send: %v", err)
	}
}

func deltaNames(t *testing.T, resp *discovery.DeltaDiscoveryResponse) []string {
	t.Helper()
	anys := make([]*anypb.Any, 0, len(resp.GetResources()))
	for _, r := range resp.GetResources() {
		anys = append(anys, r.GetResource())
	}
	return resourceNames(t, anys)
}

func TestDeltaPassesThrough(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	up := startUpstream(t)
	h := startProxy(t, up.addr)

	stream, err := h.client.DeltaAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	node := &corev3.Node{Id: nodeID}
	sendDelta(t, stream, &discovery.DeltaDiscoveryRequest{Node: node, TypeUrl: resource.ClusterType})
	cds := recvDelta(t, stream)
	if cds.GetTypeUrl() != resource.ClusterType || !slices.Equal(deltaNames(t, cds), []string{"cluster-1"}) {
		t.Fatalf("CDS response: %v", cds)
	}
	sendDelta(t, stream, &discovery.DeltaDiscoveryRequest{TypeUrl: resource.ClusterType, ResponseNonce: cds.GetNonce()})
	ack := up.delta(t, ctx, func(r *discovery.DeltaDiscoveryRequest) bool { return r.GetResponseNonce() != "" })
	if ack.GetResponseNonce() != cds.GetNonce() {
		t.Errorf("the upstream saw the ACK as %v", ack)
	}

	sendDelta(t, stream, &discovery.DeltaDiscoveryRequest{TypeUrl: resource.ListenerType})
	lds := recvDelta(t, stream)
	if lds.GetTypeUrl() != resource.ListenerType || !slices.Equal(deltaNames(t, lds), []string{"listener-1"}) {
		t.Fatalf("LDS response: %v", lds)
	}
	sendDelta(t, stream, &discovery.DeltaDiscoveryRequest{TypeUrl: resource.ListenerType, ResponseNonce: lds.GetNonce()})

	// An update: the new cluster is pushed, and only it (the listener and cluster-1 unchanged).
	up.setSnapshot(t, "v2", "cluster-1", "cluster-2")
	push := recvDelta(t, stream)
	if push.GetTypeUrl() != resource.ClusterType || !slices.Equal(deltaNames(t, push), []string{"cluster-2"}) {
		t.Fatalf("pushed CDS response: %v", push)
	}
	sendDelta(t, stream, &discovery.DeltaDiscoveryRequest{TypeUrl: resource.ClusterType, ResponseNonce: push.GetNonce()})
	// A removal is pushed through too.
	up.setSnapshot(t, "v3", "cluster-2")
	removal := recvDelta(t, stream)
	if !slices.Equal(removal.GetRemovedResources(), []string{"cluster-1"}) {
		t.Fatalf("pushed removal: %v", removal)
	}

	if got := h.metric(t, "meshid_xds_proxy_messages_total", "response"); got != 4 {
		t.Errorf("responses counted: %v, want 4", got)
	}
	if got := h.metric(t, "meshid_xds_proxy_messages_total", "request"); got < 5 {
		t.Errorf("requests counted: %v, want at least 5", got)
	}
}
