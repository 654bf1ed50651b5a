package sds_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	secretservice "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/sds/sdsclient"
	"github.com/meshid/meshid/sds/sdstest"
	"github.com/meshid/meshid/secretmanager"
)

func TestShutdown(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		drain time.Duration
		// clientsEnd: the streams end on their own once the drain has begun; otherwise the
		// server ends them (at once, or when the drain runs out on its clock).
		clientsEnd bool
	}{
		{name: "no drain: streams end at once"},
		{name: "drain: streams are served until they end", drain: time.Hour, clientsEnd: true},
		{name: "drain runs out: streams are ended", drain: time.Hour},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, f := newPKI(t), newFakeSecrets()
			d1 := p.workload(t)
			f.Publish(d1)
			clk := testutil.NewFakeClock(time.Now())
			h := startServer(t, f, func(c *sds.Config) { c.DrainDuration, c.Clock = tc.drain, clk })
			streams := make([]*sdstest.Stream, 3)
			for i := range streams {
				streams[i] = sdstest.Dial(t, h.socket).StreamSecrets()
				streams[i].Subscribe(dflt)
				first := streams[i].Recv()
				expect(t, first, d1)
				streams[i].Ack(first, dflt)
			}
			h.cancel()
			if tc.drain > 0 {
				// The drain has begun once its timer is set: the server's only timer.
				ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
				defer cancel()
				if err := clk.WaitForTimers(ctx, 1); err != nil {
					t.Fatalf("the drain did not begin: %v", err)
				}
			}
			switch {
			case tc.clientsEnd:
				// Still served: a rotation reaches every open stream.
				d2 := p.workload(t)
				f.Publish(d2)
				for _, s := range streams {
					expect(t, s.Recv(), d2)
					s.CloseSend()
				}
			case tc.drain > 0:
				clk.Advance(tc.drain)
			}
			if err := h.wait(); err != nil {
				t.Fatalf("Run: %v", err)
			}
			for i, s := range streams {
				_, err := s.Stream.Recv()
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
			if n := f.Active(dflt); n != 0 {
				t.Fatalf("%d subscriptions to default outlive Run", n)
			}
		})
	}
}

// Run returns only once every goroutine it started has: stream handlers (SotW, delta, a fetch
// that waits), the gRPC server's, the drain's. Not parallel: it counts the goroutines of the
// whole process, so nothing else may run meanwhile (parallel tests wait until every sequential
// top-level test has finished).
func TestRunLeavesNoGoroutines(t *testing.T) {
	for _, tc := range []struct {
		name       string
		drain      time.Duration
		clientsEnd bool
	}{
		{name: "no drain"},
		{name: "drain: clients end", drain: time.Hour, clientsEnd: true},
		{name: "drain runs out", drain: time.Hour},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const pending = "file-root:/etc/certs/pending.pem" // nothing is ever known of it
			p, f := newPKI(t), newFakeSecrets()
			d1, r1 := p.workload(t), p.roots(t, rootCA)
			f.Publish(d1)
			f.Publish(r1)
			f.Fail(spare, errors.New("the CA is unreachable"))
			clk := testutil.NewFakeClock(time.Now())
			ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
			defer cancel()

			before := runtime.NumGoroutine()
			h := startServer(t, f, func(c *sds.Config) { c.DrainDuration, c.Clock = tc.drain, clk })
			s := h.sotw()
			s.Subscribe(dflt, spare) // spare's state is an error: the stream waits for it
			first := s.Recv()
			expect(t, first, d1)
			s.Ack(first, dflt, spare)
			d := h.delta()
			d.Subscribe(rootCA)
			expect(t, d.Recv(), r1)
			fetchCtx, cancelFetch := context.WithCancel(ctx)
			defer cancelFetch()
			fetched := make(chan error, 1)
			go func() {
				_, err := h.envoy.Client.FetchSecrets(fetchCtx, &discovery.DiscoveryRequest{
					Node: &core.Node{Id: nodeID}, ResourceNames: []string{pending}, TypeUrl: sdstest.TypeURL,
				})
				fetched <- err
			}()
			// The fetch is in the server, waiting, once the server follows its name.
			f.awaitActive(t, pending, 1)

			h.cancel()
			if tc.drain > 0 {
				if err := clk.WaitForTimers(ctx, 1); err != nil {
					t.Fatalf("the drain did not begin: %v", err)
				}
			}
			switch {
			case tc.clientsEnd:
				s.CloseSend()
				d.CloseSend()
				cancelFetch()
			case tc.drain > 0:
				clk.Advance(tc.drain)
			}
			if err := h.wait(); err != nil {
				t.Fatalf("Run: %v", err)
			}
			if err := receive(t, fetched); status.Code(err) != codes.Unavailable && status.Code(err) != codes.Canceled {
				t.Fatalf("the waiting fetch ended with %v, want Unavailable (server stopped) or Canceled", err)
			}
			for _, name := range []string{dflt, rootCA, spare, pending} {
				if n := f.Active(name); n != 0 {
					t.Fatalf("%d subscriptions to %s outlive Run", n, name)
				}
			}
			// The client's own goroutines end with its connection.
			h.envoy.Close()
			settleGoroutines(t, before)
		})
	}
}

// settleGoroutines waits until no more than want goroutines run. Goroutines that have been told
// to end take a moment to do so; the real-time limit only fails a test in which some never do.
func settleGoroutines(t *testing.T, want int) {
	t.Helper()
	limit := time.Now().Add(waitLimit)
	for runtime.NumGoroutine() > want {
		if time.Now().After(limit) {
			var dump strings.Builder
			_ = pprof.Lookup("goroutine").WriteTo(&dump, 1)
			t.Fatalf("%d goroutines still run, want at most %d:\n%s", runtime.NumGoroutine(), want, dump.String())
		}
		runtime.Gosched()
	}
}

// However many streams ask for a name, SotW, delta or fetch, the server subscribes to it once,
// even when they all ask while its first subscription is being made; Run cancels it.
func TestOneSubscriptionPerName(t *testing.T) {
	t.Parallel()
	const streams = 50
	p, f := newPKI(t), newFakeSecrets()
	d1 := p.workload(t)
	f.Publish(d1)
	h := startServer(t, f)
	// The first subscription is held open while the other streams ask.
	inside, release := f.Hold(t, dflt)
	sotw := make([]*sdstest.Stream, streams)
	for i := range sotw {
		sotw[i] = h.sotw()
		sotw[i].Subscribe(dflt)
	}
	delta := h.delta()
	delta.Subscribe(dflt)
	receive(t, inside)
	release()
	for _, s := range sotw {
		first := s.Recv()
		expect(t, first, d1)
		s.Ack(first, dflt)
	}
	first := delta.Recv()
	expect(t, first, d1)
	delta.Ack(first)
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	got, err := h.envoy.Fetch(ctx, dflt)
	if err != nil {
		t.Fatal(err)
	}
	checkAll(t, got, d1)
	if n := f.Calls(dflt); n != 1 {
		t.Fatalf("the server subscribed to default %d times, want once", n)
	}
	if n := h.server.Subscriptions()[dflt]; n != streams+1 {
		t.Fatalf("Subscriptions()[default] = %d, want %d", n, streams+1)
	}

	// The one subscription carries a rotation to every stream.
	d2 := p.workload(t)
	f.Publish(d2)
	for _, s := range sotw {
		expect(t, s.Recv(), d2)
	}
	expect(t, delta.Recv(), d2)
	if n := f.Calls(dflt); n != 1 {
		t.Fatalf("the server subscribed to default %d times, want once", n)
	}
	h.stop(t)
	if n := f.Active(dflt); n != 0 {
		t.Fatalf("%d subscriptions to default outlive Run", n)
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
	// Far more streams on each connection than Envoy opens: the limits are raised to fit.
	h := startServer(t, f, func(c *sds.Config) { c.MaxStreams, c.MaxStreamsPerConnection = streams, streams })
	clients := make([]secretservice.SecretDiscoveryServiceClient, conns)
	for i := range clients {
		clients[i] = sdstest.Dial(t, h.socket).Client
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()

	// Each stream is driven from its own goroutine, which returns errors rather than failing.
	check := func(resp *discovery.DiscoveryResponse, want *secretmanager.Secret) error {
		got, err := sdstest.Parse(nil, resp.GetResources())
		if err != nil {
			return err
		}
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
	if n := f.Calls(dflt); n != 1 {
		t.Fatalf("the server subscribed to default %d times, want once", n)
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
			return dir + "/" + strings.Repeat("s", fsutil.MaxSocketPath-len(dir))
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
				if tc.err != nil && !fsutil.SocketServing(path) {
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
			if !fsutil.SocketServing(path) {
				t.Fatal("nothing listens on the socket")
			}
		})
	}
	if n := f.Calls(dflt); n != 0 {
		t.Fatalf("New subscribed to default %d times; it must wait for a request", n)
	}
}

func TestCheckSocketPath(t *testing.T) {
	t.Parallel()
	if err := fsutil.CheckSocketPath("/" + strings.Repeat("s", fsutil.MaxSocketPath-1)); err != nil {
		t.Fatalf("a %d-byte path: %v", fsutil.MaxSocketPath, err)
	}
	long := "/" + strings.Repeat("s", fsutil.MaxSocketPath)
	if err := fsutil.CheckSocketPath(long); err == nil {
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

	a, b := h.sotw(), h.sotw()
	a.Subscribe(dflt)
	expect(t, a.Recv(), d1)
	b.Subscribe(dflt, rootCA)
	b.RecvAll(dflt, rootCA)
	c := h.delta()
	c.Subscribe(rootCA, spare)
	last, _, _ := c.RecvAll(rootCA, spare)
	check(map[string]int{dflt: 2, rootCA: 2, spare: 1})

	// The end of a stream is seen by the server before the client reads it.
	a.CloseSend()
	if _, err := a.Stream.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("Recv: %v, want the end of the stream", err)
	}
	check(map[string]int{dflt: 1, rootCA: 2, spare: 1})

	c.Update(last, []string{fileCert}, []string{rootCA})
	expect(t, c.Recv(), fc)
	check(map[string]int{dflt: 1, rootCA: 1, spare: 1, fileCert: 1})
	c.CloseSend()
	if _, err := c.Stream.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("Recv: %v, want the end of the stream", err)
	}
	check(map[string]int{dflt: 1, rootCA: 1})
}

func TestGet(t *testing.T) {
	t.Parallel()
	const failing = "file-root:/etc/certs/failing.pem"
	p, f := newPKI(t), newFakeSecrets()
	d1, r1 := p.workload(t), p.roots(t, rootCA)
	f.Publish(d1)
	f.Publish(r1)
	f.Refuse("nonexistent", secretmanager.ErrUnknownSecret)
	f.Fail(failing, errors.New("root file unreadable"))
	h := startServer(t, f)
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()

	// The first call finds the server's cache cold, the second warm.
	for range 2 {
		got, err := sdsclient.Get(ctx, h.socket, nodeID, dflt, rootCA)
		if err != nil {
			t.Fatal(err)
		}
		checkAll(t, got, d1, r1)
	}

	if _, err := sdsclient.Get(ctx, h.socket, nodeID, dflt, "nonexistent"); status.Code(errors.Unwrap(err)) != codes.InvalidArgument || !strings.Contains(err.Error(), "nonexistent") {
		t.Fatalf("Get of an unknown name: %v, want InvalidArgument naming it", err)
	}
	// A name with no valid secret is reported at once, with the manager's reason.
	if _, err := sdsclient.Get(ctx, h.socket, nodeID, dflt, failing); status.Code(errors.Unwrap(err)) != codes.Unavailable || !strings.Contains(err.Error(), "root file unreadable") {
		t.Fatalf("Get of a failing name: %v, want Unavailable with the reason", err)
	}
	if _, err := sdsclient.Get(ctx, filepath.Join(testutil.ShortTempDir(t), "none"), nodeID, dflt); err == nil {
		t.Fatal("Get with no server answered")
	}
}

// streamOnlySDS is an SDS server without FetchSecrets, as Istio's agent is: it sends each secret
// in a response of its own and waits for the ACK of one before sending the next.
type streamOnlySDS struct {
	secretservice.UnimplementedSecretDiscoveryServiceServer
	secrets []*tlsv3.Secret
}

func (s streamOnlySDS) StreamSecrets(st secretservice.SecretDiscoveryService_StreamSecretsServer) error {
	req, err := st.Recv()
	if err != nil {
		return err
	}
	if req.GetNode().GetId() == "" {
		return status.Error(codes.InvalidArgument, "no node")
	}
	for i, secret := range s.secrets {
		res, err := anypb.New(secret)
		if err != nil {
			return err
		}
		nonce := fmt.Sprint(i + 1)
		if err := st.Send(&discovery.DiscoveryResponse{VersionInfo: nonce, Nonce: nonce, Resources: []*anypb.Any{res}, TypeUrl: sdstest.TypeURL}); err != nil {
			return err
		}
		ack, err := st.Recv()
		if err != nil {
			return err
		}
		if ack.GetResponseNonce() != nonce || ack.GetErrorDetail() != nil {
			return status.Errorf(codes.InvalidArgument, "request %v does not acknowledge nonce %s", ack, nonce)
		}
	}
	<-st.Context().Done()
	return nil
}

// Get asks a server without FetchSecrets over StreamSecrets, acknowledging as Envoy does, until
// every name has come.
func TestGetOverStream(t *testing.T) {
	t.Parallel()
	inline := func(b []byte) *core.DataSource {
		return &core.DataSource{Specifier: &core.DataSource_InlineBytes{InlineBytes: b}}
	}
	p := newPKI(t)
	d1, r1 := p.workload(t), p.roots(t, rootCA)
	socket := filepath.Join(testutil.ShortTempDir(t), sds.SocketName)
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	secretservice.RegisterSecretDiscoveryServiceServer(srv, streamOnlySDS{secrets: []*tlsv3.Secret{
		{Name: dflt, Type: &tlsv3.Secret_TlsCertificate{TlsCertificate: &tlsv3.TlsCertificate{
			CertificateChain: inline(d1.KeyPair.ChainPEM), PrivateKey: inline(d1.KeyPair.KeyPEM),
		}}},
		{Name: rootCA, Type: &tlsv3.Secret_ValidationContext{ValidationContext: &tlsv3.CertificateValidationContext{
			TrustedCa: inline(r1.Bundle.PEM),
		}}},
	}})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	t.Cleanup(func() {
		srv.Stop()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	got, err := sdsclient.Get(ctx, socket, nodeID, dflt, rootCA)
	if err != nil {
		t.Fatal(err)
	}
	checkAll(t, got, d1, r1)
}

// What the manager says of a name while a stream subscribes to it is neither lost nor sent out
// of order: the secret manager tells the new subscriber the current state, and more may come
// before Subscribe returns.
func TestStateDuringSubscribe(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// before is what the manager says of default before the stream subscribes; during, while
		// it subscribes (after telling the current state), returning the secret the stream must
		// get first, if any; after, once the stream has had ROOTCA alone.
		before, during, after func(t *testing.T, p *testPKI, f *fakeSecrets) *secretmanager.Secret
	}{
		{
			name:   "a rotation",
			before: publish, during: publish,
		},
		{
			name:   "a failure",
			before: publish, during: fail, after: publish,
		},
		{
			name:   "a recovery",
			before: fail, during: publish,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, f := newPKI(t), newFakeSecrets()
			r1 := p.roots(t, rootCA)
			f.Publish(r1)
			h := startServer(t, f)
			tc.before(t, p, f)
			inside, release := f.Hold(t, dflt)
			s := h.sotw()
			s.Subscribe(dflt, rootCA)
			receive(t, inside)
			want := tc.during(t, p, f)
			release()
			first := s.Recv()
			if want != nil {
				expect(t, first, want, r1)
				return
			}
			// Nothing valid: ROOTCA comes alone, and default once the manager has it.
			expect(t, first, r1)
			s.Ack(first, dflt, rootCA)
			later := tc.after(t, p, f)
			expect(t, s.Recv(), later)
		})
	}
}

// publish publishes a new default key pair and returns it.
func publish(t *testing.T, p *testPKI, f *fakeSecrets) *secretmanager.Secret {
	t.Helper()
	s := p.workload(t)
	f.Publish(s)
	return s
}

// fail makes default fail and returns nil.
func fail(_ *testing.T, _ *testPKI, f *fakeSecrets) *secretmanager.Secret {
	f.Fail(dflt, errors.New("the CA refused to sign"))
	return nil
}

// A name whose state is an error: FetchSecrets answers at once with Unavailable and the manager's
// reason; a stream gets nothing until a valid secret comes, then gets it; a stream that has a
// secret keeps it when the state turns to an error.
func TestNoValidSecret(t *testing.T) {
	t.Parallel()
	const reason = "the CA at ca.example:15012 is unreachable"
	p, f := newPKI(t), newFakeSecrets()
	r1 := p.roots(t, rootCA)
	f.Publish(r1)
	f.Fail(dflt, errors.New(reason))
	h := startServer(t, f)
	// The deadline only bounds a failure: a server that waits for a secret fails with
	// DeadlineExceeded, far later than the answer it owes.
	fetchUnavailable := func(t *testing.T, reason string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := h.envoy.Fetch(ctx, dflt, rootCA)
		if st := status.Convert(err); st.Code() != codes.Unavailable || !strings.Contains(st.Message(), reason) || !strings.Contains(st.Message(), dflt) {
			t.Fatalf("FetchSecrets: %v, want Unavailable naming default, with %q", err, reason)
		}
	}
	fetchUnavailable(t, reason)

	a, d := h.sotw(), h.delta()
	a.Subscribe(dflt, rootCA)
	d.Subscribe(dflt, rootCA)
	firstA, firstD := a.Recv(), d.Recv()
	expect(t, firstA, r1)
	expect(t, firstD, r1)
	a.Ack(firstA, dflt, rootCA)
	d.Ack(firstD)

	d1 := p.workload(t)
	f.Publish(d1)
	pushedA, pushedD := a.Recv(), d.Recv()
	expect(t, pushedA, d1)
	expect(t, pushedD, d1)
	a.Ack(pushedA, dflt, rootCA)
	d.Ack(pushedD)
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	got, err := h.envoy.Fetch(ctx, dflt)
	if err != nil {
		t.Fatal(err)
	}
	checkAll(t, got, d1)

	// The state turns to an error: the streams keep d1 (nothing is sent), a new one waits.
	const again = "renewal failed: the CA refused to sign"
	f.Fail(dflt, errors.New(again))
	fetchUnavailable(t, again)
	b := h.sotw()
	b.Subscribe(dflt, rootCA)
	firstB := b.Recv()
	expect(t, firstB, r1)
	b.Ack(firstB, dflt, rootCA)
	d2 := p.workload(t)
	f.Publish(d2)
	for _, s := range []*sdstest.Stream{a, b} {
		expect(t, s.Recv(), d2)
	}
	expect(t, d.Recv(), d2)
}

// A secret that expired while cached is not sent to a stream that subscribes afterwards, nor
// fetched.
func TestExpiredCachedSecretIsNotSent(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1, sp := p.workload(t), p.roots(t, spare) // d1 is valid for an hour
	f.Publish(d1)
	f.Publish(sp)
	clk := testutil.NewFakeClock(time.Now())
	h := startServer(t, f, func(c *sds.Config) { c.Clock = clk })
	a := h.sotw()
	a.Subscribe(dflt)
	expect(t, a.Recv(), d1)

	clk.Advance(2 * time.Hour) // d1 has expired; the manager has not said so
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	if _, err := h.envoy.Fetch(ctx, dflt); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), secretmanager.ErrExpired.Error()) {
		t.Fatalf("FetchSecrets of an expired secret: %v, want Unavailable: expired", err)
	}
	b := h.sotw()
	b.Subscribe(dflt, spare)
	first := b.Recv()
	expect(t, first, sp)
	b.Ack(first, dflt, spare)
	d2 := p.workloadFor(t, 24*time.Hour)
	f.Publish(d2)
	expect(t, b.Recv(), d2)
}

// FetchSecrets waits only while the manager has said nothing of a name: its first word, a secret
// or a failure, answers the call.
func TestFetchWaitsWhileNothingIsKnown(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// tell is the manager's first word on spare; it returns the secret Fetch must get, or nil
		// for Unavailable with the reason.
		tell func(t *testing.T, p *testPKI, f *fakeSecrets) *secretmanager.Secret
	}{
		{name: "a secret", tell: func(t *testing.T, p *testPKI, f *fakeSecrets) *secretmanager.Secret {
			t.Helper()
			s := p.roots(t, spare)
			f.Publish(s)
			return s
		}},
		{name: "a failure", tell: func(_ *testing.T, _ *testPKI, f *fakeSecrets) *secretmanager.Secret {
			f.Fail(spare, errors.New("root file unreadable"))
			return nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, f := newPKI(t), newFakeSecrets()
			h := startServer(t, f)
			ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
			defer cancel()
			type result struct {
				resp *discovery.DiscoveryResponse
				err  error
			}
			fetched := make(chan result, 1)
			go func() {
				resp, err := h.envoy.Client.FetchSecrets(ctx, &discovery.DiscoveryRequest{
					Node: &core.Node{Id: nodeID}, ResourceNames: []string{spare}, TypeUrl: sdstest.TypeURL,
				})
				fetched <- result{resp, err}
			}()
			// The fetch waits in the server once the server follows the name.
			f.awaitActive(t, spare, 1)
			want := tc.tell(t, p, f)
			r := receive(t, fetched)
			if want == nil {
				if st := status.Convert(r.err); st.Code() != codes.Unavailable || !strings.Contains(st.Message(), "root file unreadable") {
					t.Fatalf("FetchSecrets: %v, want Unavailable with the manager's reason", r.err)
				}
				return
			}
			if r.err != nil {
				t.Fatal(r.err)
			}
			checkAll(t, sdstest.Decode(t, nil, r.resp.GetResources()), want)
		})
	}
}
