package sds_test

import (
	"bytes"
	"context"
	"fmt"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/sds/sdstest"
)

// BenchmarkFanout measures, in one process, a rotation reaching n SotW streams subscribed to
// "default" on 1 + n/1000 connections: from the secret manager's call (Publish) to the last
// stream holding the new certificate. Each op is one rotation; push-µs/stream is the op's time
// divided by n, the server's and the clients' work together (they share the machine's cores).
// cpu-µs/stream is the process's CPU time (server and clients) over the same span, divided by
// n: on a machine shared with other work it is the steadier figure.
// The clients keep responses as bytes and look for the new leaf's PEM in them; they decode only
// the envelope (not the secret) of the one they acknowledge.
// The end-to-end figure, against Istio's pilot-agent, is BenchmarkRotationFanout in
// cmd/meshid-agent.
func BenchmarkFanout(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("streams-%d", n), func(b *testing.B) { fanout(b, n) })
	}
}

func fanout(b *testing.B, n int) {
	pki := newPKI(b)
	secrets := newFakeSecrets()
	secrets.Publish(pki.workload(b))
	socket := filepath.Join(testutil.ShortTempDir(b), "sds", sds.SocketName)
	server, err := sds.New(sds.Config{SocketPath: socket, Secrets: secrets, MaxStreams: 2 * n, MaxStreamsPerConnection: 1000})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- server.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			b.Error(err)
		}
	}()
	conns := make([]*grpc.ClientConn, 1+n/1000)
	for i := range conns {
		if conns[i], err = grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
			b.Fatal(err)
		}
		defer func() { _ = conns[i].Close() }()
	}
	// Each stream's goroutine waits for the next secret's leaf on want, and reports on got.
	want := make([]chan []byte, n)
	got := make(chan error, n)
	streamCtx, endStreams := context.WithCancel(ctx)
	defer endStreams()
	var streams sync.WaitGroup
	defer streams.Wait()
	defer endStreams()
	for i := range n {
		want[i] = make(chan []byte, 1)
		streams.Go(func() { fanoutClient(streamCtx, conns[i%len(conns)], fmt.Sprintf("envoy-%d", i), want[i], got) })
	}
	for range n {
		if err := <-got; err != nil {
			b.Fatal(err)
		}
	}
	var cpu time.Duration
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		next := pki.workload(b)
		leaf := testutil.CertPEM(next.KeyPair.Chain[0])
		for _, c := range want {
			c <- leaf
		}
		b.StartTimer()
		before := cpuTime(b)
		secrets.Publish(next)
		for range n {
			if err := <-got; err != nil {
				b.Fatal(err)
			}
		}
		cpu += cpuTime(b) - before
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/1000/float64(b.N*n), "push-µs/stream")
	b.ReportMetric(float64(cpu.Nanoseconds())/1000/float64(b.N*n), "cpu-µs/stream")
}

// cpuTime is the CPU time the process has used, user and system: on a machine shared with other
// work it moves less than the wall time.
func cpuTime(b *testing.B) time.Duration {
	var u syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &u); err != nil {
		b.Fatal(err)
	}
	return time.Duration(u.Utime.Nano() + u.Stime.Nano())
}

// fanoutClient opens a stream, reports its first response on got, then for each leaf on want
// receives until a response carries it, acknowledges it, and reports.
func fanoutClient(ctx context.Context, conn *grpc.ClientConn, node string, want <-chan []byte, got chan<- error) {
	cs, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: true},
		"/envoy.service.secret.v3.SecretDiscoveryService/StreamSecrets", grpc.ForceCodecV2(sdstest.RawCodec{}))
	if err != nil {
		got <- err
		return
	}
	req := &discovery.DiscoveryRequest{Node: &core.Node{Id: node}, ResourceNames: []string{"default"}, TypeUrl: sds.SecretTypeURL}
	if err := cs.SendMsg(req); err != nil {
		got <- err
		return
	}
	req.Node = nil
	var leaf []byte
	for {
		var raw sdstest.RawMessage
		if err := cs.RecvMsg(&raw); err != nil {
			if ctx.Err() == nil {
				got <- err
			}
			return
		}
		if leaf != nil && !bytes.Contains(raw, leaf) {
			continue
		}
		var resp discovery.DiscoveryResponse
		if err := proto.Unmarshal(raw, &resp); err != nil {
			got <- err
			return
		}
		req.VersionInfo, req.ResponseNonce = resp.GetVersionInfo(), resp.GetNonce()
		if err := cs.SendMsg(req); err != nil {
			got <- err
			return
		}
		got <- nil
		select {
		case leaf = <-want:
		case <-ctx.Done():
			return
		}
	}
}
