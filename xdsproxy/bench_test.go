package xdsproxy_test

import (
	"context"
	"net"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/xdsproxy"
)

// echoUpstream answers every request at once with one cluster: the upstream's own time is as
// small as it gets, so what the proxy adds stands out.
type echoUpstream struct {
	discovery.UnimplementedAggregatedDiscoveryServiceServer
	resources []*anypb.Any
}

func (u *echoUpstream) StreamAggregatedResources(stream grpc.BidiStreamingServer[discovery.DiscoveryRequest, discovery.DiscoveryResponse]) error {
	for {
		req, err := stream.Recv()
		if err != nil {
			return err
		}
		if err := stream.Send(&discovery.DiscoveryResponse{TypeUrl: req.GetTypeUrl(), VersionInfo: "1", Resources: u.resources}); err != nil {
			return err
		}
	}
}

// benchTargets starts the echo upstream and a proxy in front of it, and returns a client of
// each: direct and through the proxy's Unix socket.
func benchTargets(b *testing.B) (direct, proxied discovery.AggregatedDiscoveryServiceClient) {
	b.Helper()
	cluster, err := anypb.New(&clusterv3.Cluster{Name: "backend"})
	if err != nil {
		b.Fatal(err)
	}
	srv := grpc.NewServer()
	discovery.RegisterAggregatedDiscoveryServiceServer(srv, &echoUpstream{resources: []*anypb.Any{cluster}})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	b.Cleanup(srv.Stop)

	dial := func(target string) *grpc.ClientConn {
		conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = conn.Close() })
		return conn
	}
	socket := filepath.Join(testutil.ShortTempDir(b), "XDS")
	// The stream caps are raised past BenchmarkStreamMemory's 1,000 streams on one connection:
	// what is measured is a stream's cost, not the caps.
	p, err := xdsproxy.New(xdsproxy.Config{Socket: socket, Upstream: dial(lis.Addr().String()), Node: &corev3.Node{Id: "bench"},
		MaxStreams: 2000, MaxStreamsPerConnection: 2000})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	b.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			b.Error(err)
		}
	})
	return discovery.NewAggregatedDiscoveryServiceClient(dial(lis.Addr().String())),
		discovery.NewAggregatedDiscoveryServiceClient(dial("unix://" + socket))
}

// BenchmarkRoundTrip: a request and its response on one open ADS stream, direct and through
// the proxy; the difference is what the proxy adds to each response.
func BenchmarkRoundTrip(b *testing.B) {
	direct, proxied := benchTargets(b)
	for _, target := range []struct {
		name   string
		client discovery.AggregatedDiscoveryServiceClient
	}{{"direct", direct}, {"proxied", proxied}} {
		b.Run(target.name, func(b *testing.B) {
			stream, err := target.client.StreamAggregatedResources(b.Context())
			if err != nil {
				b.Fatal(err)
			}
			req := &discovery.DiscoveryRequest{Node: &corev3.Node{Id: "bench"}, TypeUrl: resource.ClusterType}
			for b.Loop() {
				if err := stream.Send(req); err != nil {
					b.Fatal(err)
				}
				if _, err := stream.Recv(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkStreamMemory: the heap and stacks of 1,000 open streams (each past its first
// response), direct and through the proxy, per stream; client, proxy and upstream all live in
// this process, so the difference is the proxy's cost of a stream.
func BenchmarkStreamMemory(b *testing.B) {
	const streams = 1000
	direct, proxied := benchTargets(b)
	for _, target := range []struct {
		name   string
		client discovery.AggregatedDiscoveryServiceClient
	}{{"direct", direct}, {"proxied", proxied}} {
		b.Run(target.name, func(b *testing.B) {
			for range b.N {
				goroutines := runtime.NumGoroutine()
				before := inUse()
				ctx, cancel := context.WithCancel(b.Context())
				for range streams {
					stream, err := target.client.StreamAggregatedResources(ctx)
					if err != nil {
						b.Fatal(err)
					}
					if err := stream.Send(&discovery.DiscoveryRequest{Node: &corev3.Node{Id: "bench"}, TypeUrl: resource.ClusterType}); err != nil {
						b.Fatal(err)
					}
					if _, err := stream.Recv(); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(inUse()-before)/streams, "B/stream")
				cancel()
				// The next round starts once this one's streams have ended on every side (but for
				// the few goroutines of connections the first round dialed).
				for deadline := time.Now().Add(10 * time.Second); runtime.NumGoroutine() > goroutines+16 && time.Now().Before(deadline); {
					time.Sleep(time.Millisecond)
				}
			}
		})
	}
}

// inUse is the heap and the goroutine stacks in use, after a collection.
func inUse() int64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapInuse + m.StackInuse)
}
