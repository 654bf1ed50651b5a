package controlplane_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"os"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/testutil"
)

// A call still in flight when Run's context ends is given controlplane.ShutdownGrace on the
// injected clock, then cut: Run returns once the fake clock has moved past the grace, well
// before that much real time has passed, and the call ends Unavailable. The call is one whose
// request never comes, so that its handler waits on it for as long as the connection lives.
func TestStopCutsCallsPastTheGraceOnTheClock(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(time.Now().Truncate(time.Second))
	cfg := testConfig(t.TempDir())
	cfg.Clock = clk
	cp, err := controlplane.New(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- cp.Run(ctx) }()
	select {
	case <-cp.Ready():
	case err := <-done:
		t.Fatalf("control plane ended before serving: %v", err)
	}

	rootPEM, err := os.ReadFile(ca.RootCertPath(cfg.StateDir))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(rootPEM)
	conn, err := grpc.NewClient(cp.GRPCAddr(), grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
		RootCAs: pool, ServerName: "istiod.istio-system.svc", MinVersion: tls.VersionTLS12, Time: clk.Now,
	})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	// The headers go out as NewStream returns, on a connection that is up, ahead of anything the
	// client sends later: the server's graceful stop counts the call as in flight.
	stream, err := conn.NewStream(t.Context(), &grpc.StreamDesc{ClientStreams: true, ServerStreams: true},
		"/istio.v1.auth.IstioCertificateService/CreateCertificate")
	if err != nil {
		t.Fatal(err)
	}

	stopped, realStart := clk.Now(), time.Now()
	cancel()
	if err := testutil.Drive(t, clk, controlplane.ShutdownGrace, 0, done); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	if waited := clk.Now().Sub(stopped); waited < controlplane.ShutdownGrace {
		t.Errorf("Run returned %s after its context ended, on the clock; want the grace, %s", waited, controlplane.ShutdownGrace)
	}
	// A grace on the real clock would have kept Run that long whatever the fake clock did.
	if took := time.Since(realStart); took >= controlplane.ShutdownGrace {
		t.Errorf("Run took %s of real time to stop: the grace is not on the injected clock", took)
	}
	if err := stream.RecvMsg(new(struct{})); status.Code(err) != codes.Unavailable {
		t.Errorf("the call in flight ended with %v, want Unavailable", err)
	}
}
