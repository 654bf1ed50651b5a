package sdsclient_test

import (
	"context"
	"net"
	"path/filepath"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	secretservice "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds/sdsclient"
)

// waitLimit bounds how long a broken test hangs; no test waits on it to pass.
const waitLimit = 30 * time.Second

// stubSDS is an SDS server whose every move is the test's: each stream it accepts is handed to
// the test, which reads the requests and sends the responses it chooses. FetchSecrets answers
// with fetch, or Unimplemented when fetch is nil (as Istio's agent does).
type stubSDS struct {
	secretservice.UnimplementedSecretDiscoveryServiceServer
	fetch  func(*discovery.DiscoveryRequest) (*discovery.DiscoveryResponse, error)
	sotw   chan *stubStream
	deltas chan *stubDelta
}

// stubStream is one StreamSecrets stream on the server's side.
type stubStream struct {
	reqs <-chan *discovery.DiscoveryRequest
	send chan<- *discovery.DiscoveryResponse
}

// stubDelta is one DeltaSecrets stream on the server's side.
type stubDelta struct {
	reqs <-chan *discovery.DeltaDiscoveryRequest
	send chan<- *discovery.DeltaDiscoveryResponse
}

func newStub() *stubSDS {
	return &stubSDS{sotw: make(chan *stubStream), deltas: make(chan *stubDelta)}
}

func (s *stubSDS) FetchSecrets(_ context.Context, req *discovery.DiscoveryRequest) (*discovery.DiscoveryResponse, error) {
	if s.fetch == nil {
		return s.UnimplementedSecretDiscoveryServiceServer.FetchSecrets(context.Background(), req)
	}
	return s.fetch(req)
}

func (s *stubSDS) StreamSecrets(st secretservice.SecretDiscoveryService_StreamSecretsServer) error {
	reqs, send := make(chan *discovery.DiscoveryRequest, 16), make(chan *discovery.DiscoveryResponse)
	go pumpRequests(st.Recv, reqs)
	select {
	case s.sotw <- &stubStream{reqs: reqs, send: send}:
	case <-st.Context().Done():
		return nil
	}
	return pumpResponses(st.Context(), st.Send, send)
}

func (s *stubSDS) DeltaSecrets(st secretservice.SecretDiscoveryService_DeltaSecretsServer) error {
	reqs, send := make(chan *discovery.DeltaDiscoveryRequest, 16), make(chan *discovery.DeltaDiscoveryResponse)
	go pumpRequests(st.Recv, reqs)
	select {
	case s.deltas <- &stubDelta{reqs: reqs, send: send}:
	case <-st.Context().Done():
		return nil
	}
	return pumpResponses(st.Context(), st.Send, send)
}

// pumpRequests hands what the client sends to the test, and closes reqs when the stream ends.
func pumpRequests[R any](recv func() (R, error), reqs chan<- R) {
	defer close(reqs)
	for {
		req, err := recv()
		if err != nil {
			return
		}
		reqs <- req
	}
}

// pumpResponses sends what the test gives it until the stream ends.
func pumpResponses[R any](ctx context.Context, send func(R) error, resps <-chan R) error {
	for {
		select {
		case r := <-resps:
			if err := send(r); err != nil {
				return err
			}
		case <-ctx.Done():
			return nil
		}
	}
}

// serve runs stub on a Unix socket at path until stop (or the test's end).
func serve(t *testing.T, path string, stub *stubSDS) (stop func()) {
	t.Helper()
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	secretservice.RegisterSecretDiscoveryServiceServer(srv, stub)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	stop = func() {
		srv.Stop()
		<-done
	}
	t.Cleanup(stop)
	return stop
}

// socketPath is a fresh socket path, short enough for the kernel.
func socketPath(t *testing.T) string {
	return filepath.Join(testutil.ShortTempDir(t), "sds")
}

// dial makes a client of the socket that reconnects at once, closed with the test.
func dial(t *testing.T, path string, node *core.Node) *sdsclient.Client {
	t.Helper()
	c, err := sdsclient.Dial(path, sdsclient.WithNode(node), sdsclient.WithDialOptions(
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.Config{BaseDelay: time.Millisecond, Multiplier: 1, MaxDelay: 10 * time.Millisecond},
			MinConnectTimeout: waitLimit})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// within is a context the test's waits end with.
func within(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), waitLimit)
	t.Cleanup(cancel)
	return ctx
}

// next waits for what ch yields; a closed channel or the wait limit fails the test.
func next[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v, ok := <-ch:
		if !ok {
			t.Fatalf("%s: the channel closed", what)
		}
		return v
	case <-time.After(waitLimit):
		t.Fatalf("waited %s for %s", waitLimit, what)
	}
	var zero T
	return zero
}

// secretAny is a secret of name as a SotW resource; roots makes it a validation context.
func secretAny(t *testing.T, name string) *anypb.Any {
	t.Helper()
	a, err := anypb.New(&tlsv3.Secret{Name: name, Type: &tlsv3.Secret_ValidationContext{ValidationContext: &tlsv3.CertificateValidationContext{}}})
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// response is a SotW response of the secrets named.
func response(t *testing.T, version, nonce string, names ...string) *discovery.DiscoveryResponse {
	t.Helper()
	r := &discovery.DiscoveryResponse{VersionInfo: version, Nonce: nonce, TypeUrl: sdsclient.TypeURL}
	for _, n := range names {
		r.Resources = append(r.Resources, secretAny(t, n))
	}
	return r
}
