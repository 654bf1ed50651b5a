package admission_test

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/testutil"
)

func TestGateCapsStreamsOverallAndPerKey(t *testing.T) {
	t.Parallel()
	g, err := admission.NewGate(admission.Limits{Streams: 3, StreamsPerKey: 2})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := g.Admit("alice"); err != nil {
			t.Fatalf("alice's stream refused under the caps: %v", err)
		}
	}
	if err := g.Admit("alice"); !errors.Is(err, admission.ErrTooManyForKey) {
		t.Fatalf("alice's third stream: %v, want ErrTooManyForKey", err)
	}
	if err := g.Admit("bob"); err != nil {
		t.Fatalf("bob's stream refused for alice's: %v", err)
	}
	if err := g.Admit("carol"); !errors.Is(err, admission.ErrTooManyStreams) {
		t.Fatalf("a fourth stream overall: %v, want ErrTooManyStreams", err)
	}
	g.Release("alice")
	if err := g.Admit("alice"); err != nil {
		t.Fatalf("a stream released, alice refused again: %v", err)
	}
	if got := g.Streams(); got != 3 {
		t.Fatalf("%d streams counted, want 3", got)
	}
	for _, key := range []string{"alice", "alice", "bob"} {
		g.Release(key)
	}
	if got := g.Streams(); got != 0 {
		t.Fatalf("%d streams counted after every release, want 0", got)
	}
}

func TestGateUncappedAndNegative(t *testing.T) {
	t.Parallel()
	g, err := admission.NewGate(admission.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	for range 1000 {
		if err := g.Admit("k"); err != nil {
			t.Fatalf("no cap set, refused: %v", err)
		}
	}
	if _, err := admission.NewGate(admission.Limits{Streams: -1}); err == nil {
		t.Fatal("a negative limit was accepted")
	}
}

func TestLogLimiterPacesEachKindAndCountsWhatItDropped(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(time.Unix(1_700_000_000, 0))
	l := admission.NewLogLimiter(clk)
	logged := 0
	for range 25 {
		if ok, _ := l.Allow("flood"); ok {
			logged++
		}
	}
	if logged != 10 {
		t.Fatalf("%d of 25 lines at once let through, want the burst of 10", logged)
	}
	if ok, _ := l.Allow("other"); !ok {
		t.Fatal("a flood of one kind held back another kind")
	}
	clk.Advance(time.Second)
	ok, dropped := l.Allow("flood")
	if !ok || dropped != 15 {
		t.Fatalf("after a second: let through %v, dropped %d; want true, 15", ok, dropped)
	}
	if ok, _ := l.Allow("flood"); ok {
		t.Fatal("a second line within the same second was let through")
	}
}

// A Unix socket server with LocalServerOptions: the connection cap closes the connection past
// it, names who was refused, and a stream's handler learns its peer.
func TestUnixPeerCredentials(t *testing.T) {
	t.Parallel()
	dir, err := os.MkdirTemp("", "adm")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	path := filepath.Join(dir, "s")
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	gate, err := admission.NewGate(admission.Limits{Connections: 1})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var refused []string
	srv := grpc.NewServer(append(admission.LocalServerOptions(gate, 10, 1<<10, func(who string, err error) {
		mu.Lock()
		defer mu.Unlock()
		refused = append(refused, who+": "+err.Error())
	}),
		grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			if p := admission.Peer(ctx); !strings.Contains(p, "pid="+strconv.Itoa(os.Getpid())) {
				return nil, status.Errorf(codes.Internal, "peer %q does not name this process", p)
			}
			return h(ctx, req)
		}))...)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)

	dial := func() *grpc.ClientConn {
		conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		return conn
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	first := dial()
	if _, err := healthpb.NewHealthClient(first).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("the first connection: %v", err)
	}
	short, cancelShort := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancelShort()
	_, err = healthpb.NewHealthClient(dial()).Check(short, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(false))
	if status.Code(err) != codes.Unavailable && status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("a second connection past the cap of 1: %v, want it closed", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(refused) == 0 || !strings.Contains(refused[0], "pid=") || !strings.Contains(refused[0], admission.ErrTooManyConnections.Error()) {
		t.Fatalf("refused connections reported as %q, want the peer and the reason", refused)
	}
}
