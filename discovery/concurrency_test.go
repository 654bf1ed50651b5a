package discovery_test

import (
	"errors"
	"io"
	"sync"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshid/meshid/discovery"
)

// Attack (issue 24): go-control-plane puts the node a SotW stream sent first into every later
// request that has none, and the server stamped the namespace into that node while syncz cloned
// the one its tracker kept: a map written under one lock and read under another, which crashed
// the CA ("concurrent map iteration and map write"). Run under -race, over real gRPC: streams
// sending node-less requests with a stale nonce as fast as they can, streams of the same
// namespace asking syncz in a loop, and delta streams, each a bounded number of times.
func TestDiscoveryNodesAreNeverShared(t *testing.T) {
	t.Parallel()
	h := startDiscovery(t, twoNamespaces)
	conn, err := grpc.NewClient(h.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	client := discoveryv3.NewAggregatedDiscoveryServiceClient(conn)
	ctx := metadata.AppendToOutgoingContext(t.Context(), "x-credential-namespace", "prod")
	node := func(i int) *corev3.Node {
		return &corev3.Node{Id: "sidecar~10.0.0." + string(rune('1'+i)) + "~web.prod~prod.svc.cluster.local", Cluster: "web",
			Locality: &corev3.Locality{Region: "eu", Zone: "a"},
			Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{"NAMESPACE": structpb.NewStringValue("prod")}}}
	}
	const (
		staleStreams, staleRequests = 3, 5000
		synczStreams, synczRequests = 4, 500
		deltaStreams, deltaRequests = 2, 2000
	)
	var wg sync.WaitGroup
	errs := make(chan error, staleStreams+synczStreams+deltaStreams)
	run := func(f func() error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f(); err != nil {
				errs <- err
			}
		}()
	}
	for i := range staleStreams {
		run(func() error {
			stream, err := client.StreamAggregatedResources(ctx)
			if err != nil {
				return err
			}
			if err := stream.Send(&discoveryv3.DiscoveryRequest{Node: node(i), TypeUrl: resource.ClusterType}); err != nil {
				return err
			}
			if _, err := stream.Recv(); err != nil {
				return err
			}
			for range staleRequests {
				if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: resource.ClusterType, ResponseNonce: "stale"}); err != nil {
					return err
				}
			}
			return stream.CloseSend()
		})
	}
	for i := range synczStreams {
		run(func() error {
			stream, err := client.StreamAggregatedResources(ctx)
			if err != nil {
				return err
			}
			req := &discoveryv3.DiscoveryRequest{Node: node(staleStreams + i), TypeUrl: discovery.DebugSyncz}
			for range synczRequests {
				if err := stream.Send(req); err != nil {
					return err
				}
				if _, err := stream.Recv(); err != nil {
					return err
				}
				req = &discoveryv3.DiscoveryRequest{TypeUrl: discovery.DebugSyncz}
			}
			return stream.CloseSend()
		})
	}
	for i := range deltaStreams {
		run(func() error {
			stream, err := client.DeltaAggregatedResources(ctx)
			if err != nil {
				return err
			}
			if err := stream.Send(&discoveryv3.DeltaDiscoveryRequest{Node: node(staleStreams + synczStreams + i), TypeUrl: resource.ClusterType,
				ResourceNamesSubscribe: []string{"*"}}); err != nil {
				return err
			}
			if _, err := stream.Recv(); err != nil {
				return err
			}
			for range deltaRequests {
				if err := stream.Send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: resource.ClusterType, ResponseNonce: "stale"}); err != nil {
					return err
				}
			}
			return stream.CloseSend()
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if !errors.Is(err, io.EOF) {
			t.Error(err)
		}
	}
}
