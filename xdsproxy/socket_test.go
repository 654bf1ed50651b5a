package xdsproxy_test

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/xdsproxy"
)

func dialUpstream(t *testing.T) *grpc.ClientConn {
	t.Helper()
	// Never used: these tests do not get as far as a stream.
	conn, err := grpc.NewClient("127.0.0.1:1", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

func TestNewRefusesBadConfig(t *testing.T) {
	t.Parallel()
	conn := dialUpstream(t)
	socket := filepath.Join(testutil.ShortTempDir(t), "XDS")
	for _, tc := range []struct {
		name string
		cfg  xdsproxy.Config
	}{
		{"no socket", xdsproxy.Config{Upstream: conn}},
		{"socket path too long", xdsproxy.Config{Socket: "/tmp/" + strings.Repeat("x", 120), Upstream: conn}},
		{"no upstream", xdsproxy.Config{Socket: socket}},
		{"negative debug timeout", xdsproxy.Config{Socket: socket, Upstream: conn, DebugTimeout: -1}},
	} {
		if _, err := xdsproxy.New(tc.cfg); err == nil {
			t.Errorf("%s: New accepted it", tc.name)
		}
	}
}

func TestRunSocket(t *testing.T) {
	t.Parallel()
	up := startUpstream(t)
	h := startProxy(t, up.addr)
	ctx := testContext(t)
	openCDS(t, ctx, h) // Run is serving

	info, err := os.Lstat(h.socket)
	if err != nil {
		t.Fatal(err)
	}
	if info.Mode()&os.ModeSocket == 0 || info.Mode().Perm() != xdsproxy.DefaultSocketMode {
		t.Errorf("socket mode %v, want a socket with %o", info.Mode(), xdsproxy.DefaultSocketMode)
	}

	// A second proxy on the same socket is refused (by New, which binds), and leaves the first
	// one's socket alone.
	if _, err := xdsproxy.New(xdsproxy.Config{Socket: h.socket, Upstream: h.upstream}); !errors.Is(err, xdsproxy.ErrSocketInUse) {
		t.Errorf("second New: %v, want ErrSocketInUse", err)
	}
	openCDS(t, ctx, h)

	// Once the first has stopped, its socket is gone, and a new proxy takes the path.
	h.stop()
	if _, err := os.Lstat(h.socket); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket after Run: %v", err)
	}
	third, err := xdsproxy.New(xdsproxy.Config{Socket: h.socket, Upstream: h.upstream})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- third.Run(runCtx) }()
	cancel()
	if err := <-done; err != nil {
		t.Errorf("third Run: %v", err)
	}
}

func TestNewRemovesAStaleSocket(t *testing.T) {
	t.Parallel()
	socket := filepath.Join(testutil.ShortTempDir(t), "XDS")
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	lis.(*net.UnixListener).SetUnlinkOnClose(false)
	_ = lis.Close() // a socket file nobody answers on, as a killed agent leaves
	up := startUpstream(t)
	h := startProxy(t, up.addr, func(c *xdsproxy.Config) { c.Socket = socket })
	openCDS(t, testContext(t), h)
	if got := h.logs.Records(t, "removed a stale socket"); len(got) != 1 {
		t.Errorf("stale socket logged %d times, want once", len(got))
	}
}
