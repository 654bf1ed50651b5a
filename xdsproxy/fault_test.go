package xdsproxy_test

import (
	"context"
	"errors"
	"io"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// openCDS opens a SotW stream through the proxy and reads the clusters.
func openCDS(t *testing.T, ctx context.Context, h *proxy) sotwStream {
	t.Helper()
	stream, err := h.client.StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sendSotw(t, stream, &discovery.DiscoveryRequest{Node: &corev3.Node{Id: nodeID}, TypeUrl: resource.ClusterType})
	if resp := recvSotw(t, stream); resp.GetTypeUrl() != resource.ClusterType {
		t.Fatalf("CDS response: %v", resp)
	}
	return stream
}

func TestUpstreamStopEndsTheStreamAndAReconnectWorks(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	up := startUpstream(t)
	h := startProxy(t, up.addr)

	stream := openCDS(t, ctx, h)
	up.srv.Stop()
	_, err := stream.Recv()
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("after the upstream stopped, Recv: %v, want Unavailable", err)
	}
	if got := h.metric(t, "meshid_xds_proxy_upstream_errors_total", "Unavailable"); got != 1 {
		t.Errorf("upstream errors counted: %v, want 1", got)
	}
	logged := h.logs.Records(t, "xDS proxy stream ended")
	if len(logged) != 1 || logged[0]["level"] != "WARN" || logged[0]["code"] != "Unavailable" || logged[0]["node"] != nodeID {
		t.Errorf("stream end logged as %v", logged)
	}

	up.restart(t)
	h.waitUpstreamReady(t, ctx)
	openCDS(t, ctx, h)
	if got := h.metric(t, "meshid_xds_proxy_streams_total"); got != 2 {
		t.Errorf("streams opened: %v, want 2", got)
	}
}

func TestUpstreamRefusalReachesTheClient(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	refuse := func(any, grpc.ServerStream, *grpc.StreamServerInfo, grpc.StreamHandler) error {
		return status.Error(codes.Unauthenticated, "no token")
	}
	up := startUpstream(t, grpc.StreamInterceptor(refuse))
	h := startProxy(t, up.addr)

	for _, tc := range []struct {
		name string
		recv func() error
	}{
		{"sotw", func() error {
			stream, err := h.client.StreamAggregatedResources(ctx)
			if err != nil {
				return err
			}
			// The refusal may end the stream before the request is sent: Send then says EOF,
			// and Recv gives the status.
			if err := stream.Send(&discovery.DiscoveryRequest{Node: &corev3.Node{Id: nodeID}, TypeUrl: resource.ClusterType}); err != nil && !errors.Is(err, io.EOF) {
				return err
			}
			_, err = stream.Recv()
			return err
		}},
		{"delta", func() error {
			stream, err := h.client.DeltaAggregatedResources(ctx)
			if err != nil {
				return err
			}
			if err := stream.Send(&discovery.DeltaDiscoveryRequest{Node: &corev3.Node{Id: nodeID}, TypeUrl: resource.ClusterType}); err != nil && !errors.Is(err, io.EOF) {
				return err
			}
			_, err = stream.Recv()
			return err
		}},
	} {
		err := tc.recv()
		if st := status.Convert(err); st.Code() != codes.Unauthenticated || st.Message() != "no token" {
			t.Errorf("%s: Recv: %v, want the upstream's Unauthenticated: no token", tc.name, err)
		}
	}
	if got := h.metric(t, "meshid_xds_proxy_upstream_errors_total", "Unauthenticated"); got != 2 {
		t.Errorf("upstream errors counted: %v, want 2", got)
	}
}

func TestClientDisconnectCancelsTheUpstreamStream(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	up := startUpstream(t)
	h := startProxy(t, up.addr)

	for _, tc := range []struct {
		name string
		open func(context.Context)
	}{
		{"sotw", func(ctx context.Context) { openCDS(t, ctx, h) }},
		{"delta", func(ctx context.Context) {
			stream, err := h.client.DeltaAggregatedResources(ctx)
			if err != nil {
				t.Fatal(err)
			}
			sendDelta(t, stream, &discovery.DeltaDiscoveryRequest{Node: &corev3.Node{Id: nodeID}, TypeUrl: resource.ClusterType})
			recvDelta(t, stream)
		}},
	} {
		streamCtx, cancel := context.WithCancel(ctx)
		tc.open(streamCtx)
		cancel()
		select {
		case node := <-up.closed:
			if node.GetId() != nodeID {
				t.Errorf("%s: the upstream closed the stream of %q", tc.name, node.GetId())
			}
		case <-ctx.Done():
			t.Fatalf("%s: the upstream stream was not closed after the client went", tc.name)
		}
	}
}

func TestRunEndsTheStreams(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	up := startUpstream(t)
	h := startProxy(t, up.addr)

	stream := openCDS(t, ctx, h)
	h.stop()
	if _, err := stream.Recv(); err == nil {
		t.Fatal("the stream went on after Run returned")
	}
	select {
	case <-up.closed:
	case <-ctx.Done():
		t.Fatal("the upstream stream was not closed when Run returned")
	}
	if got := h.metric(t, "meshid_xds_proxy_streams"); got != 0 {
		t.Errorf("open streams after Run: %v, want 0", got)
	}
	logged := h.logs.Records(t, "xDS proxy stream ended")
	if len(logged) != 1 || logged[0]["level"] != "INFO" || logged[0]["reason"] != "the proxy is stopping" {
		t.Errorf("stream end logged as %v", logged)
	}
}
