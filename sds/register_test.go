package sds_test

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/sds"
)

// Another service registered on the server is served on the SDS socket, next to SDS, and
// behind its bounds: its calls and streams count toward MaxStreams with SDS's, one past it is
// refused with ResourceExhausted, counted and logged with the method and the peer, and a place
// freed lets the next in.
func TestRegisteredServiceSharesTheSocketAndItsBounds(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1 := p.workload(t)
	f.Publish(d1)
	h := newHarness(t, f, func(c *sds.Config) { c.MaxStreams = 2 })
	h.server.RegisterService(&healthpb.Health_ServiceDesc, health.NewServer())
	h.start(t)

	conn, err := grpc.NewClient("unix://"+h.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	client := healthpb.NewHealthClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	if resp, err := client.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("Check on the SDS socket: %v, %v; want SERVING", resp, err)
	}

	s := h.sotw()
	s.Subscribe(dflt)
	expect(t, s.Recv(), d1)
	watchCtx, endWatch := context.WithCancel(ctx)
	watch, err := client.Watch(watchCtx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := watch.Recv(); err != nil {
		t.Fatalf("Watch: %v", err)
	}
	// Two open: the SDS stream and the Watch.
	if _, err := client.Check(ctx, &healthpb.HealthCheckRequest{}); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("Check past the limit: %v, want ResourceExhausted", err)
	}
	over := h.sotw()
	over.Subscribe(dflt)
	if st := over.RecvErr(); st.Code() != codes.ResourceExhausted {
		t.Fatalf("SDS stream past the limit: %v, want ResourceExhausted", st)
	}
	checkRefusals(t, h, map[string]float64{"too_many_streams/ResourceExhausted": 2})
	if logs := h.logs.String(); !strings.Contains(logs, "protocol=grpc.health.v1.Health/Check") || !strings.Contains(logs, "peer=") {
		t.Fatalf("the refused call was not logged with its method and peer:\n%s", logs)
	}

	// The Watch's end frees its place; the server may not have released it when the client
	// sees the end, so the next call is retried until the place is free.
	endWatch()
	for {
		_, err := client.Check(ctx, &healthpb.HealthCheckRequest{})
		if err == nil {
			break
		}
		if status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("Check after the Watch ended: %v", err)
		}
	}
}

// A service registered after Run began would never be served: a programming error that panics,
// as it does with grpc.Server.
func TestRegisterServiceAfterRunPanics(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1 := p.workload(t)
	f.Publish(d1)
	h := startServer(t, f)
	s := h.sotw() // served: Run has begun
	s.Subscribe(dflt)
	expect(t, s.Recv(), d1)
	defer func() {
		if r := recover(); r == nil || !strings.Contains(r.(string), "after Run") {
			t.Fatalf("recovered %v, want a panic that says RegisterService came after Run", r)
		}
	}()
	h.server.RegisterService(&healthpb.Health_ServiceDesc, health.NewServer())
}
