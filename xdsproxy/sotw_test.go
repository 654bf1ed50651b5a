package xdsproxy_test

import (
	"slices"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
)

type sotwStream = grpc.BidiStreamingClient[discovery.DiscoveryRequest, discovery.DiscoveryResponse]

func recvSotw(t *testing.T, s sotwStream) *discovery.DiscoveryResponse {
	t.Helper()
	resp, err := s.Recv()
	if err != nil {
		t.Fatalf("Recv: %v", err)
	}
	return resp
}

func sendSotw(t *testing.T, s sotwStream, req *discovery.DiscoveryRequest) {
	t.Helper()
	if err := s.Send(req); err != nil {
		t.Fatalf("Send: %v", err)
	}
}

func TestSotWPassesThrough(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	up := startUpstream(t)
	h := startProxy(t, up.addr)

	stream, err := h.client.StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	node := &corev3.Node{Id: nodeID}
	sendSotw(t, stream, &discovery.DiscoveryRequest{Node: node, TypeUrl: resource.ClusterType})
	cds := recvSotw(t, stream)
	if cds.GetTypeUrl() != resource.ClusterType || cds.GetVersionInfo() != "v1" || !slices.Equal(resourceNames(t, cds.GetResources()), []string{"cluster-1"}) {
		t.Fatalf("CDS response: %v", cds)
	}
	if h.metric(t, "meshid_xds_proxy_streams") != 1 {
		t.Errorf("open streams: %v, want 1", h.metric(t, "meshid_xds_proxy_streams"))
	}

	// The ACK reaches the upstream with the client's nonce, unchanged.
	sendSotw(t, stream, &discovery.DiscoveryRequest{TypeUrl: resource.ClusterType, VersionInfo: "v1", ResponseNonce: cds.GetNonce()})
	ack := up.request(t, ctx, func(r *discovery.DiscoveryRequest) bool { return r.GetResponseNonce() != "" })
	if ack.GetResponseNonce() != cds.GetNonce() || ack.GetVersionInfo() != "v1" || ack.GetErrorDetail() != nil {
		t.Errorf("the upstream saw the ACK as %v", ack)
	}

	sendSotw(t, stream, &discovery.DiscoveryRequest{TypeUrl: resource.ListenerType})
	lds := recvSotw(t, stream)
	if lds.GetTypeUrl() != resource.ListenerType || !slices.Equal(resourceNames(t, lds.GetResources()), []string{"listener-1"}) {
		t.Fatalf("LDS response: %v", lds)
	}
	sendSotw(t, stream, &discovery.DiscoveryRequest{TypeUrl: resource.ListenerType, VersionInfo: "v1", ResponseNonce: lds.GetNonce()})

	// An update is pushed through.
	up.setSnapshot(t, "v2", "cluster-1", "cluster-2")
	push := recvSotw(t, stream)
	if push.GetTypeUrl() != resource.ClusterType || push.GetVersionInfo() != "v2" || !slices.Equal(resourceNames(t, push.GetResources()), []string{"cluster-1", "cluster-2"}) {
		t.Fatalf("pushed CDS response: %v", push)
	}

	// A NACK reaches the upstream with its nonce and reason.
	sendSotw(t, stream, &discovery.DiscoveryRequest{TypeUrl: resource.ClusterType, VersionInfo: "v1", ResponseNonce: push.GetNonce(),
		ErrorDetail: &rpcstatus.Status{Code: 3, Message: "bad cluster"}})
	nack := up.request(t, ctx, func(r *discovery.DiscoveryRequest) bool { return r.GetErrorDetail() != nil })
	if nack.GetResponseNonce() != push.GetNonce() || nack.GetErrorDetail().GetMessage() != "bad cluster" {
		t.Errorf("the upstream saw the NACK as %v", nack)
	}

	// Five requests went up (CDS, ACK, LDS, ACK, NACK); three responses were read, and the
	// upstream may have sent more (v2 of the listeners, the clusters again after the NACK).
	if got := h.metric(t, "meshid_xds_proxy_messages_total", "response"); got < 3 {
		t.Errorf("responses counted: %v, want at least 3", got)
	}
	// The NACK was seen upstream, so counted before.
	if got := h.metric(t, "meshid_xds_proxy_messages_total", "request"); got != 5 {
		t.Errorf("requests counted: %v, want 5", got)
	}
	if got := h.metric(t, "meshid_xds_proxy_streams_total"); got != 1 {
		t.Errorf("streams opened: %v, want 1", got)
	}
}
