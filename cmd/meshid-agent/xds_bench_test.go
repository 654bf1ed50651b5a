package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/token"
)

// BenchmarkIdleXDSStreams measures what an open, idle discovery stream costs `meshid ca
// --xds-config` (issue 24): one CA process, 1,000 ADS streams over 10 TLS connections (each
// connection an agent of its own, with its own token), every stream past its first CDS answer
// and then idle. It reports the CA's resident memory and goroutines before and after, and each
// per stream.
func BenchmarkIdleXDSStreams(b *testing.B) {
	const conns, perConn = 10, 100
	ca := startDiscoveryCA(b)
	cmd, addr, monitor, minter, pool := ca.cmd, ca.addr, ca.monitor, ca.minter, ca.pool

	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		rssBefore := rssOf(b, cmd.Process.Pid) / 1024
		goroutinesBefore := scrape(b, monitor, "go_goroutines")
		ctx, cancel := context.WithCancel(b.Context())
		var clients []*grpc.ClientConn
		var wg sync.WaitGroup
		errs := make(chan error, conns*perConn)
		start := time.Now()
		b.StartTimer()
		for c := range conns {
			conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
				RootCAs: pool, ServerName: "istiod.istio-system.svc", MinVersion: tls.VersionTLS12,
			})))
			if err != nil {
				b.Fatal(err)
			}
			clients = append(clients, conn)
			tok, err := minter.Mint(token.MintParams{Issuer: token.DefaultIssuer, Audiences: []string{token.DefaultAudience},
				Namespace: "default", ServiceAccount: fmt.Sprintf("agent-%d", c), TTL: time.Hour, Now: time.Now()})
			if err != nil {
				b.Fatal(err)
			}
			client := discovery.NewAggregatedDiscoveryServiceClient(conn)
			sctx := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
			for s := range perConn {
				wg.Add(1)
				go func() {
					defer wg.Done()
					stream, err := client.StreamAggregatedResources(sctx)
					if err != nil {
						errs <- err
						return
					}
					node := &corev3.Node{Id: fmt.Sprintf("sidecar~10.0.%d.%d~web-%d.default~default.svc.cluster.local", c, s, s), Cluster: "web"}
					if err := stream.Send(&discovery.DiscoveryRequest{Node: node, TypeUrl: resource.ClusterType}); err != nil {
						errs <- err
						return
					}
					if _, err := stream.Recv(); err != nil {
						errs <- err
					}
				}()
			}
		}
		wg.Wait()
		b.StopTimer()
		took := time.Since(start)
		close(errs)
		for err := range errs {
			b.Fatalf("a stream failed: %v", err)
		}
		n := float64(conns * perConn)
		rssAfter := rssOf(b, cmd.Process.Pid) / 1024
		goroutinesAfter := scrape(b, monitor, "go_goroutines")
		b.ReportMetric(rssBefore, "ca-rss-before-MB")
		b.ReportMetric(rssAfter, "ca-rss-after-MB")
		b.ReportMetric((rssAfter-rssBefore)*1024/n, "ca-rss-kB/stream")
		b.ReportMetric(goroutinesBefore, "goroutines-before")
		b.ReportMetric(goroutinesAfter, "goroutines-after")
		b.ReportMetric((goroutinesAfter-goroutinesBefore)/n, "goroutines/stream")
		b.ReportMetric(scrape(b, monitor, "go_memstats_heap_inuse_bytes")/(1<<20), "ca-heap-after-MB")
		b.ReportMetric(float64(took.Milliseconds()), "open-ms")
		cancel()
		for _, conn := range clients {
			_ = conn.Close()
		}
		b.StartTimer()
	}
}

// discoveryCA is a `meshid ca --xds-config` process, what a client needs to reach it, and the
// key its tokens are minted with.
type discoveryCA struct {
	cmd           *exec.Cmd
	addr, monitor string
	minter        *token.Minter
	pool          *x509.CertPool
}

func startDiscoveryCA(b *testing.B) discoveryCA {
	b.Helper()
	dir := b.TempDir()
	state := filepath.Join(dir, "state")
	xds := filepath.Join(dir, "xds.yaml")
	if err := os.WriteFile(xds, []byte("clusters: [{name: backend, connect_timeout: 1s}]\n"), 0o600); err != nil {
		b.Fatal(err)
	}
	cmd, rec := startLogged(b, agentBinary(b), "CA started", "ca", "--state-dir", state, "--xds-config", xds,
		"--grpc-addr", "127.0.0.1:0", "--monitoring-addr", "127.0.0.1:0")
	dca := discoveryCA{cmd: cmd}
	dca.addr, _ = rec["address"].(string)
	dca.monitor, _ = rec["monitoring_address"].(string)
	var err error
	if dca.minter, err = token.LoadMinter(ca.TokenKeyPath(state)); err != nil {
		b.Fatal(err)
	}
	rootPEM, err := os.ReadFile(filepath.Join(state, "root-cert.pem"))
	if err != nil {
		b.Fatal(err)
	}
	dca.pool = x509.NewCertPool()
	dca.pool.AppendCertsFromPEM(rootPEM)
	return dca
}

// BenchmarkDiscoveryRoundTrip: one request and its answer on an open ADS stream to `meshid ca
// --xds-config`, over TLS with a token, as a sidecar's: what the discovery server's bounds
// (type and node checks, the namespace checked again, the node replaced) cost a request. Each
// request asks for the clusters again without a version, so that each is answered.
func BenchmarkDiscoveryRoundTrip(b *testing.B) {
	ca := startDiscoveryCA(b)
	conn, err := grpc.NewClient(ca.addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
		RootCAs: ca.pool, ServerName: "istiod.istio-system.svc", MinVersion: tls.VersionTLS12,
	})))
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	tok, err := ca.minter.Mint(token.MintParams{Issuer: token.DefaultIssuer, Audiences: []string{token.DefaultAudience},
		Namespace: "default", ServiceAccount: "web", TTL: time.Hour, Now: time.Now()})
	if err != nil {
		b.Fatal(err)
	}
	ctx := metadata.AppendToOutgoingContext(b.Context(), "authorization", "Bearer "+tok)
	stream, err := discovery.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
	if err != nil {
		b.Fatal(err)
	}
	req := &discovery.DiscoveryRequest{Node: &corev3.Node{Id: "sidecar~10.0.0.1~web-1.default~default.svc.cluster.local", Cluster: "web"},
		TypeUrl: resource.ClusterType}
	for b.Loop() {
		if err := stream.Send(req); err != nil {
			b.Fatal(err)
		}
		resp, err := stream.Recv()
		if err != nil {
			b.Fatal(err)
		}
		req = &discovery.DiscoveryRequest{TypeUrl: resource.ClusterType, ResponseNonce: resp.GetNonce()}
	}
}
