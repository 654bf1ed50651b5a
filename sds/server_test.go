package sds_test

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	secretservice "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/secretmanager"
)

// receive returns the next value from ch, failing after waitLimit.
func receive[T any](t *testing.T, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(waitLimit):
		t.Fatal("nothing came")
		panic("unreachable")
	}
}

func TestShutdown(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		drain time.Duration
		// clientsEnd: the streams end on their own once Run's context is cancelled, before the
		// drain duration; otherwise the server ends them.
		clientsEnd bool
	}{
		{name: "no drain: streams end at once"},
		{name: "drain: Run returns when the streams end", drain: time.Hour, clientsEnd: true},
		// A drain that runs out on real time: it is the server's own timer.
		{name: "drain runs out: streams are ended", drain: 10 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, f := newPKI(t), newFakeSecrets()
			d1 := p.workload(t)
			f.Publish(d1)
			h := startServer(t, f, func(c *sds.Config) { c.DrainDuration = tc.drain })
			streams := make([]*sotwStream, 3)
			for i := range streams {
				streams[i] = openSotWOn(t, secretservice.NewSecretDiscoveryServiceClient(dial(t, h.socket)))
				streams[i].subscribe(dflt)
				expect(t, streams[i].recv(), d1)
			}
			h.cancel()
			if tc.clientsEnd {
				for _, s := range streams {
					if err := s.stream.CloseSend(); err != nil {
						t.Fatal(err)
					}
				}
			}
			if err := h.wait(); err != nil {
				t.Fatalf("Run: %v", err)
			}
			for i, s := range streams {
				_, err := s.stream.Recv()
				if tc.clientsEnd && !errors.Is(err, io.EOF) {
					t.Fatalf("stream %d: %v, want its end", i, err)
				}
				if !tc.clientsEnd && status.Code(err) != codes.Unavailable {
					t.Fatalf("stream %d: %v, want Unavailable", i, err)
				}
			}
			if _, err := os.Lstat(h.socket); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("socket left behind: %v", err)
			}
		})
	}
}

// 1,000 concurrent streams, on a few connections, are all served, and one rotation reaches them
// all.
func TestThousandStreams(t *testing.T) {
	t.Parallel()
	const streams, conns = 1000, 4
	p, f := newPKI(t), newFakeSecrets()
	d1 := p.workload(t)
	f.Publish(d1)
	h := startServer(t, f)
	clients := make([]secretservice.SecretDiscoveryServiceClient, conns)
	for i := range clients {
		clients[i] = secretservice.NewSecretDiscoveryServiceClient(dial(t, h.socket))
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()

	// Each stream is driven from its own goroutine, which returns errors rather than failing.
	check := func(resp *discovery.DiscoveryResponse, want *secretmanager.Secret) error {
		got := decode(t, nil, resp.GetResources())
		if len(got) != 1 {
			return fmt.Errorf("pushed %d secrets, want 1", len(got))
		}
		return checkSecret(got[want.Name], want)
	}
	start := time.Now()
	opened := make([]secretservice.SecretDiscoveryService_StreamSecretsClient, streams)
	var g errgroup.Group
	for i := range opened {
		g.Go(func() error {
			st, err := clients[i%conns].StreamSecrets(ctx)
			if err != nil {
				return err
			}
			opened[i] = st
			if err := st.Send(&discovery.DiscoveryRequest{Node: &core.Node{Id: fmt.Sprintf("node-%d", i)}, ResourceNames: []string{dflt}, TypeUrl: sds.SecretTypeURL}); err != nil {
				return err
			}
			resp, err := st.Recv()
			if err != nil {
				return fmt.Errorf("stream %d: %w", i, err)
			}
			if err := check(resp, d1); err != nil {
				return fmt.Errorf("stream %d: %w", i, err)
			}
			return st.Send(&discovery.DiscoveryRequest{VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce(), ResourceNames: []string{dflt}, TypeUrl: sds.SecretTypeURL})
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	served := time.Since(start)
	if n := h.server.Subscriptions()[dflt]; n != streams {
		t.Fatalf("Subscriptions()[default] = %d, want %d", n, streams)
	}

	start = time.Now()
	d2 := p.workload(t)
	f.Publish(d2)
	for i, st := range opened {
		g.Go(func() error {
			resp, err := st.Recv()
			if err != nil {
				return fmt.Errorf("stream %d: %w", i, err)
			}
			if err := check(resp, d2); err != nil {
				return fmt.Errorf("stream %d: %w", i, err)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d streams served in %s; a rotation reached them all in %s", streams, served, time.Since(start))
}

func TestNewSocket(t *testing.T) {
	t.Parallel()
	f := newFakeSecrets()
	for _, tc := range []struct {
		name string
		// prepare readies the socket directory and returns the socket path.
		prepare func(t *testing.T, dir string) string
		mode    os.FileMode
		err     error // errors.Is; or any error when errAny
		errAny  bool
	}{
		{name: "directory created", prepare: func(_ *testing.T, dir string) string {
			return filepath.Join(dir, "a", "b", sds.SocketName)
		}},
		{name: "custom mode", mode: 0o600, prepare: func(_ *testing.T, dir string) string {
			return filepath.Join(dir, sds.SocketName)
		}},
		{name: "stale regular file removed", prepare: func(t *testing.T, dir string) string {
			path := filepath.Join(dir, sds.SocketName)
			testutil.WriteFiles(t, dir, map[string][]byte{sds.SocketName: []byte("left over")})
			return path
		}},
		{name: "dead socket removed", prepare: func(t *testing.T, dir string) string {
			path := filepath.Join(dir, sds.SocketName)
			lis, err := net.Listen("unix", path)
			if err != nil {
				t.Fatal(err)
			}
			lis.(*net.UnixListener).SetUnlinkOnClose(false) // as a killed agent leaves it
			_ = lis.Close()
			if _, err := os.Lstat(path); err != nil {
				t.Fatal(err)
			}
			return path
		}},
		{name: "live server", err: sds.ErrSocketInUse, prepare: func(t *testing.T, dir string) string {
			path := filepath.Join(dir, sds.SocketName)
			other, err := sds.New(sds.Config{SocketPath: path, Secrets: f})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(other.Close)
			return path
		}},
		{name: "path too long", errAny: true, prepare: func(_ *testing.T, dir string) string {
			return dir + "/" + strings.Repeat("s", sds.MaxSocketPath-len(dir))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			path := tc.prepare(t, testutil.ShortTempDir(t))
			srv, err := sds.New(sds.Config{SocketPath: path, SocketMode: tc.mode, Secrets: f})
			switch {
			case tc.err != nil || tc.errAny:
				if err == nil || (tc.err != nil && !errors.Is(err, tc.err)) {
					t.Fatalf("New: %v, want %v", err, tc.err)
				}
				if tc.err != nil && !sds.SocketServing(path) {
					t.Fatal("the live server's socket was taken away")
				}
				return
			case err != nil:
				t.Fatal(err)
			}
			defer srv.Close()
			info, err := os.Lstat(path)
			if err != nil {
				t.Fatal(err)
			}
			want := tc.mode
			if want == 0 {
				want = sds.DefaultSocketMode
			}
			if info.Mode().Type() != os.ModeSocket || info.Mode().Perm() != want {
				t.Fatalf("socket mode %v, want a socket with %v", info.Mode(), want)
			}
			if !sds.SocketServing(path) {
				t.Fatal("nothing listens on the socket")
			}
		})
	}
}

func TestCheckSocketPath(t *testing.T) {
	t.Parallel()
	if err := sds.CheckSocketPath("/" + strings.Repeat("s", sds.MaxSocketPath-1)); err != nil {
		t.Fatalf("a %d-byte path: %v", sds.MaxSocketPath, err)
	}
	long := "/" + strings.Repeat("s", sds.MaxSocketPath)
	if err := sds.CheckSocketPath(long); err == nil {
		t.Fatalf("a %d-byte path was accepted", len(long))
	}
	if _, err := sds.New(sds.Config{SocketPath: long, Secrets: newFakeSecrets()}); err == nil {
		t.Fatal("New accepted a path the kernel cannot bind")
	}
	if _, err := sds.New(sds.Config{SocketPath: filepath.Join(testutil.ShortTempDir(t), "s")}); err == nil {
		t.Fatal("New accepted a server with no secrets")
	}
}

// Subscriptions counts the streams subscribed to each name, SotW and delta together, and forgets
// a stream once it ends.
func TestSubscriptions(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1, r1, sp, fc := p.workload(t), p.roots(t, rootCA), p.roots(t, spare), p.workload(t)
	fc.Name = fileCert
	for _, s := range []*secretmanager.Secret{d1, r1, sp, fc} {
		f.Publish(s)
	}
	h := startServer(t, f)
	check := func(want map[string]int) {
		t.Helper()
		got := h.server.Subscriptions()
		for name, n := range want {
			if got[name] != n {
				t.Fatalf("Subscriptions() = %v, want %v", got, want)
			}
		}
		if len(got) > len(want) {
			t.Fatalf("Subscriptions() = %v, want %v", got, want)
		}
	}

	a, b := h.openSotW(t), h.openSotW(t)
	a.subscribe(dflt)
	expect(t, a.recv(), d1)
	b.subscribe(dflt, rootCA)
	b.recvAll(dflt, rootCA)
	c := h.openDelta(t)
	c.send(&discovery.DeltaDiscoveryRequest{Node: &core.Node{Id: nodeID}, ResourceNamesSubscribe: []string{rootCA, spare}})
	last, _, _ := c.recvAll(rootCA, spare)
	check(map[string]int{dflt: 2, rootCA: 2, spare: 1})

	// The end of a stream is seen by the server before the client reads it.
	if err := a.stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := a.stream.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("Recv: %v, want the end of the stream", err)
	}
	check(map[string]int{dflt: 1, rootCA: 2, spare: 1})

	c.send(&discovery.DeltaDiscoveryRequest{ResponseNonce: last.nonce, ResourceNamesSubscribe: []string{fileCert}, ResourceNamesUnsubscribe: []string{rootCA}})
	expect(t, c.recv(), fc)
	check(map[string]int{dflt: 1, rootCA: 1, spare: 1, fileCert: 1})
	if err := c.stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.stream.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("Recv: %v, want the end of the stream", err)
	}
	check(map[string]int{dflt: 1, rootCA: 1})
}

func TestGet(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1, r1 := p.workload(t), p.roots(t, rootCA)
	f.Publish(d1)
	f.Publish(r1)
	f.Refuse("nonexistent", secretmanager.ErrUnknownSecret)
	h := startServer(t, f)
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()

	// The first call finds the server's cache cold (the secrets may come in two responses);
	// the second finds it warm (both in one).
	for range 2 {
		got, err := sds.Get(ctx, h.socket, nodeID, dflt, rootCA)
		if err != nil {
			t.Fatal(err)
		}
		checkAll(t, got, d1, r1)
	}

	if _, err := sds.Get(ctx, h.socket, nodeID, dflt, "nonexistent"); status.Code(errors.Unwrap(err)) != codes.InvalidArgument || !strings.Contains(err.Error(), "nonexistent") {
		t.Fatalf("Get of an unknown name: %v, want InvalidArgument naming it", err)
	}
	if _, err := sds.Get(ctx, filepath.Join(testutil.ShortTempDir(t), "none"), nodeID, dflt); err == nil {
		t.Fatal("Get with no server answered")
	}
}

// hookHandler logs to next and tells a channel of each record with a given message.
type hookHandler struct {
	slog.Handler
	msg  string
	seen chan struct{}
}

// Enabled lets every level through: the awaited record may be a debug one.
func (hookHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h hookHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == h.msg {
		select {
		case h.seen <- struct{}{}:
		default:
		}
	}
	return h.Handler.Handle(ctx, r)
}

func (h hookHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return hookHandler{Handler: h.Handler.WithAttrs(attrs), msg: h.msg, seen: h.seen}
}

func (h hookHandler) WithGroup(name string) slog.Handler {
	return hookHandler{Handler: h.Handler.WithGroup(name), msg: h.msg, seen: h.seen}
}

// A secret the server generated for a stream's first request never replaces a newer one that
// was published while it was being generated.
func TestRotationDuringFirstGeneration(t *testing.T) {
	t.Parallel()
	const late = "file-root:/etc/certs/late.pem"
	p, f := newPKI(t), newFakeSecrets()
	d1 := p.workload(t)
	f.Publish(d1)
	dropped := make(chan struct{}, 1)
	h := startServer(t, f, func(c *sds.Config) {
		c.Logger = slog.New(hookHandler{Handler: c.Logger.Handler(), msg: "generated secret superseded by a newer one", seen: dropped})
	})
	found, release := f.Hold(dflt)

	s := h.openSotW(t)
	s.subscribe(dflt)
	if got := receive(t, found); got != d1 {
		t.Fatalf("generating %s, want %s", got.Version, d1.Version)
	}
	// d2 comes while d1 is still on its way out of GenerateSecret.
	d2 := p.workload(t)
	f.Publish(d2)
	first := s.recv()
	expect(t, first, d2)
	// The stream now also waits for a secret that does not exist yet; once the server
	// generates it, the stream's watch is in place.
	calls := f.Calls()
	s.ack(first, dflt, late)
	if name := receive(t, calls); name != late {
		t.Fatalf("generating %s, want %s", name, late)
	}

	pushed := make(chan *discovery.DiscoveryResponse, 1)
	go func() {
		resp, _ := s.stream.Recv()
		pushed <- resp
	}()
	release()
	select {
	case <-dropped:
	case resp := <-pushed:
		t.Fatalf("the stale secret was pushed: %v", push{secrets: decode(t, nil, resp.GetResources())}.names())
	case <-time.After(waitLimit):
		t.Fatal("the generated secret was neither dropped nor pushed")
	}
	lt := p.roots(t, late)
	f.Publish(lt)
	resp := receive(t, pushed)
	checkAll(t, decode(t, nil, resp.GetResources()), lt)
}

// A secret that expired while cached is not sent to a stream that subscribes afterwards.
func TestExpiredCachedSecretIsNotSent(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1, sp := p.workload(t), p.roots(t, spare) // d1 is valid for an hour
	f.Publish(d1)
	f.Publish(sp)
	clk := testutil.NewFakeClock(time.Now())
	h := startServer(t, f, func(c *sds.Config) { c.Clock = clk })
	a := h.openSotW(t)
	a.subscribe(dflt)
	expect(t, a.recv(), d1)

	clk.Advance(2 * time.Hour) // d1 has expired; the manager has not renewed it
	b := h.openSotW(t)
	b.subscribe(dflt, spare)
	first := b.recv()
	expect(t, first, sp)
	b.ack(first, dflt, spare)
	leaf, key := p.root.IssueWorkload(t, workloadID, 24*time.Hour)
	d2 := keyPair(t, dflt, []*x509.Certificate{leaf, p.root.Cert}, key)
	f.Publish(d2)
	expect(t, b.recv(), d2)
}
