package sds_test

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	secretservice "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/sds/sdstest"
	"github.com/meshid/meshid/secretmanager"
)

// fuzzNames are the names the fuzzer asks for: served ones, refused ones (unknown, a forbidden
// file), the wildcard and the empty name. Names made of the input's bytes are refused as unknown.
var fuzzNames = []string{dflt, rootCA, spare, fileCert, "unknown", "file-root:/etc/passwd", "*", ""}

// fuzzServed are the names the fuzzer's secret manager serves, each with two versions to rotate
// between.
var fuzzServed = []string{dflt, rootCA, spare, fileCert}

// FuzzStreamRequests drives a real server, over its Unix socket, with arbitrary sequences of SotW
// and delta requests (names, types, nodes, nonces, versions, NACKs, subscribe and unsubscribe),
// fetches, rotations and failures of the secrets, and streams closed and reopened. Whatever
// comes, the server must not panic, must send secrets only, only ones the stream subscribed to,
// must end a stream its client closes, and must go on serving.
func FuzzStreamRequests(f *testing.F) {
	// Seeds, op by op, in the bytes run reads (see run and fuzzInput).
	var (
		sotwSubscribe = []byte{0, 0x03, 0, 3, 2, 3, 3, 1}                    // default and ROOTCA, with a node
		sotwAck       = []byte{0, 0x03, 0, 3, 1, 0, 0, 1}                    // the last nonce and version
		sotwNack      = []byte{0, 0x03, 0, 3, 1, 0, 3, 0, 3, 'b', 'a', 'd'}  // the last nonce, a detail
		sotwOther     = []byte{0, 0x41, 1, 3, 'x', 'y', 'z', 1, 1, 0, 0, 1}  // the wildcard, a made-up name, a cluster type
		deltaSub      = []byte{1, 0x0c, 0, 3, 1, 2, 0, 2, 'v', '1', 0, 3, 1} // spare (at version v1) and file-cert
		deltaUnsub    = []byte{1, 0x01, 0, 3, 0, 0x08, 0, 1, 0, 1}           // default in, file-cert out
		deltaNack     = []byte{1, 0x00, 0, 3, 1, 1, 0, 0, 2, 'n', 'o'}
		fetch         = []byte{2, 0x03, 0, 2}
		rotate        = []byte{3, 0, 1} // default's second version
		fail          = []byte{3, 1, 2} // ROOTCA fails
		closeSotW     = []byte{4, 0}
	)
	for _, ops := range [][][]byte{
		{},
		{sotwSubscribe, fetch, sotwAck, rotate, fetch, sotwNack, rotate, fetch},
		{deltaSub, fetch, deltaUnsub, fetch, rotate, fetch, deltaNack, fail, fetch},
		{sotwSubscribe, deltaSub, fetch, closeSotW, sotwSubscribe, fetch, sotwOther, fetch},
	} {
		f.Add(slices.Concat(ops...))
	}
	fz := newFuzzServer(f)
	f.Fuzz(func(t *testing.T, input []byte) {
		fz.run(t, &fuzzInput{b: input})
	})
}

// fuzzServer is one server for the whole fuzzing process, and one client connection to it.
type fuzzServer struct {
	secrets  *fakeSecrets
	versions map[string][2]*secretmanager.Secret
	client   secretservice.SecretDiscoveryServiceClient
}

func newFuzzServer(f testing.TB) *fuzzServer {
	p := newPKI(f)
	fz := &fuzzServer{secrets: newFakeSecrets(), versions: map[string][2]*secretmanager.Secret{}}
	for _, name := range fuzzServed {
		var v [2]*secretmanager.Secret
		for i := range v {
			if name == rootCA || name == spare {
				v[i] = p.roots(f, name)
			} else {
				v[i] = p.workload(f)
				v[i].Name = name
			}
		}
		fz.versions[name] = v
	}
	socket := filepath.Join(testutil.ShortTempDir(f), sds.SocketName)
	srv, err := sds.New(sds.Config{SocketPath: socket, Secrets: servedOnly{fz.secrets}, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		f.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	f.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			f.Errorf("Run: %v", err)
		}
	})
	fz.client = sdstest.Dial(f, socket).Client
	return fz
}

// servedOnly refuses, as the secret manager does, every name but the fuzzer's served ones.
type servedOnly struct{ *fakeSecrets }

func (s servedOnly) Subscribe(name string, fn func(*secretmanager.Secret, error)) (func(), error) {
	for _, served := range fuzzServed {
		if name == served {
			return s.fakeSecrets.Subscribe(name, fn)
		}
	}
	if strings.HasPrefix(name, "file-") {
		return nil, fmt.Errorf("%w: %q", secretmanager.ErrForbiddenPath, name)
	}
	return nil, fmt.Errorf("%w: %q", secretmanager.ErrUnknownSecret, name)
}

// fuzzInput reads the input a byte at a time; past its end, every byte is 0.
type fuzzInput struct{ b []byte }

func (in *fuzzInput) byte() byte {
	if len(in.b) == 0 {
		return 0
	}
	c := in.b[0]
	in.b = in.b[1:]
	return c
}

// str is a string of up to 31 bytes of the input.
func (in *fuzzInput) str() string {
	n := min(int(in.byte()%32), len(in.b))
	s := string(in.b[:n])
	in.b = in.b[n:]
	return s
}

// names picks some of fuzzNames, and sometimes one made of the input.
func (in *fuzzInput) names() []string {
	mask := in.byte()
	var out []string
	for i, name := range fuzzNames {
		if mask&(1<<i) != 0 {
			out = append(out, name)
		}
	}
	if in.byte()%4 == 1 {
		out = append(out, in.str())
	}
	return out
}

// typeURL is mostly the secret type, else none, another type, or one made of the input.
func (in *fuzzInput) typeURL() string {
	switch in.byte() % 8 {
	case 0:
		return ""
	case 1:
		return "type.googleapis.com/envoy.config.cluster.v3.Cluster"
	case 2:
		return in.str()
	default:
		return sds.SecretTypeURL
	}
}

// node is mostly Envoy's, else none or one without an id.
func (in *fuzzInput) node() *core.Node {
	switch in.byte() % 8 {
	case 0:
		return nil
	case 1:
		return &core.Node{Cluster: "cart.shop"}
	default:
		return &core.Node{Id: nodeID}
	}
}

// pick is one of what the stream was sent (the last, an earlier one), nothing, or a string made
// of the input: for nonces and versions.
func (in *fuzzInput) pick(seen []string) string {
	switch c := in.byte() % 4; {
	case c == 0 && len(seen) > 0:
		return seen[len(seen)-1]
	case c == 1 && len(seen) > 0:
		return seen[int(in.byte())%len(seen)]
	case c == 2:
		return in.str()
	default:
		return ""
	}
}

func (in *fuzzInput) errorDetail() *rpcstatus.Status {
	if in.byte()%4 != 0 {
		return nil
	}
	return &rpcstatus.Status{Code: 3, Message: in.str()}
}

// fuzzStream is one stream's record: what it subscribed to, what it was sent, what went wrong.
type fuzzStream struct {
	send      func(req any) error
	closeSend func() error
	done      chan struct{} // closed when the server has ended the stream

	mu         sync.Mutex
	subscribed map[string]bool // every name the stream ever asked for
	nonces     []string
	versions   []string
	problems   []string
}

func (s *fuzzStream) subscribe(names []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, n := range names {
		s.subscribed[n] = true
	}
}

// seen returns the nonces and versions the stream was sent so far.
func (s *fuzzStream) seen() (nonces, versions []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.nonces...), append([]string(nil), s.versions...)
}

// received checks a response's secrets: of the secret type, and named as subscribed (by the
// delta resource's name too, when there is one).
func (s *fuzzStream) received(typeURL, nonce, version string, anys []*anypb.Any, names []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nonces, s.versions = append(s.nonces, nonce), append(s.versions, version)
	if typeURL != sds.SecretTypeURL {
		s.problems = append(s.problems, fmt.Sprintf("response of type %q", typeURL))
	}
	for i, a := range anys {
		secret := &tlsv3.Secret{}
		if a.GetTypeUrl() != sds.SecretTypeURL || a.UnmarshalTo(secret) != nil {
			s.problems = append(s.problems, fmt.Sprintf("resource of type %q", a.GetTypeUrl()))
			continue
		}
		if names != nil && names[i] != secret.GetName() {
			s.problems = append(s.problems, fmt.Sprintf("delta resource %q holds secret %q", names[i], secret.GetName()))
		}
		if !s.subscribed[secret.GetName()] {
			s.problems = append(s.problems, fmt.Sprintf("secret %q sent, never subscribed to", secret.GetName()))
		}
	}
}

func (fz *fuzzServer) openSotW(ctx context.Context) (*fuzzStream, error) {
	st, err := fz.client.StreamSecrets(ctx)
	if err != nil {
		return nil, err
	}
	send := func(req any) error { return st.Send(req.(*discovery.DiscoveryRequest)) }
	return newFuzzStream(send, st.CloseSend, func(s *fuzzStream) error {
		resp, err := st.Recv()
		if err == nil {
			s.received(resp.GetTypeUrl(), resp.GetNonce(), resp.GetVersionInfo(), resp.GetResources(), nil)
		}
		return err
	}), nil
}

func (fz *fuzzServer) openDelta(ctx context.Context) (*fuzzStream, error) {
	st, err := fz.client.DeltaSecrets(ctx)
	if err != nil {
		return nil, err
	}
	send := func(req any) error { return st.Send(req.(*discovery.DeltaDiscoveryRequest)) }
	return newFuzzStream(send, st.CloseSend, func(s *fuzzStream) error {
		resp, err := st.Recv()
		if err != nil {
			return err
		}
		anys := make([]*anypb.Any, 0, len(resp.GetResources()))
		names := make([]string, 0, len(resp.GetResources()))
		for _, r := range resp.GetResources() {
			anys, names = append(anys, r.GetResource()), append(names, r.GetName())
		}
		s.received(resp.GetTypeUrl(), resp.GetNonce(), resp.GetSystemVersionInfo(), anys, names)
		return nil
	}), nil
}

// newFuzzStream records what recvOne receives, one response a call, until the server ends the
// stream.
func newFuzzStream(send func(any) error, closeSend func() error, recvOne func(*fuzzStream) error) *fuzzStream {
	s := &fuzzStream{send: send, closeSend: closeSend, done: make(chan struct{}), subscribed: map[string]bool{}}
	go func() {
		defer close(s.done)
		for recvOne(s) == nil {
		}
	}()
	return s
}

// ended reports whether the server has ended s.
func ended(s *fuzzStream) bool {
	select {
	case <-s.done:
		return true
	default:
		return false
	}
}

func (fz *fuzzServer) publishAll() {
	for _, name := range fuzzServed {
		fz.secrets.Publish(fz.versions[name][0])
	}
}

func (fz *fuzzServer) run(t *testing.T, in *fuzzInput) {
	const maxOps = 64
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	fz.publishAll()
	var all []*fuzzStream
	var sotw, delta *fuzzStream
	current := func(s **fuzzStream, open func(context.Context) (*fuzzStream, error)) (*fuzzStream, bool) {
		if *s == nil || ended(*s) {
			st, err := open(ctx)
			if err != nil {
				t.Fatal(err)
			}
			*s = st
			all = append(all, st)
			return st, true
		}
		return *s, false
	}
	for op := 0; op < maxOps && len(in.b) > 0; op++ {
		switch in.byte() % 6 {
		case 0:
			s, first := current(&sotw, fz.openSotW)
			nonces, versions := s.seen()
			req := &discovery.DiscoveryRequest{ResourceNames: in.names(), TypeUrl: in.typeURL()}
			if first || in.byte()%8 == 0 {
				req.Node = in.node()
			}
			req.ResponseNonce, req.VersionInfo, req.ErrorDetail = in.pick(nonces), in.pick(versions), in.errorDetail()
			s.subscribe(req.GetResourceNames())
			_ = s.send(req) // the stream may have been ended: its receiver sees why
		case 1:
			s, first := current(&delta, fz.openDelta)
			nonces, _ := s.seen()
			req := &discovery.DeltaDiscoveryRequest{ResourceNamesSubscribe: in.names(), TypeUrl: in.typeURL()}
			if in.byte()%4 == 0 {
				req.ResourceNamesUnsubscribe = in.names()
			}
			if first || in.byte()%8 == 0 {
				req.Node = in.node()
			}
			if first && in.byte()%4 == 0 {
				req.InitialResourceVersions = map[string]string{}
				for _, name := range req.GetResourceNamesSubscribe() {
					req.InitialResourceVersions[name] = in.str()
				}
			}
			req.ResponseNonce, req.ErrorDetail = in.pick(nonces), in.errorDetail()
			s.subscribe(req.GetResourceNamesSubscribe())
			_ = s.send(req)
		case 2:
			names, node := in.names(), in.node()
			resp, err := fz.client.FetchSecrets(ctx, &discovery.DiscoveryRequest{Node: node, ResourceNames: names})
			if ctx.Err() != nil {
				t.Fatalf("FetchSecrets(%q) did not answer: %v", names, err)
			}
			if err == nil {
				fetched := &fuzzStream{subscribed: map[string]bool{}}
				fetched.subscribe(names)
				fetched.received(resp.GetTypeUrl(), "", "", resp.GetResources(), nil)
				for _, p := range fetched.problems {
					t.Errorf("FetchSecrets(%q): %s", names, p)
				}
			}
		case 3:
			name := fuzzServed[int(in.byte())%len(fuzzServed)]
			switch v := in.byte() % 3; v {
			case 2:
				fz.secrets.Fail(name, fmt.Errorf("%s cannot be renewed", name))
			default:
				fz.secrets.Publish(fz.versions[name][v])
			}
		case 4, 5:
			s := sotw
			if in.byte()%2 == 1 {
				s = delta
			}
			if s != nil {
				_ = s.closeSend()
			}
		}
	}
	// A round trip gives the server a moment to push what it owes before the streams close.
	_, _ = fz.client.FetchSecrets(ctx, &discovery.DiscoveryRequest{Node: &core.Node{Id: nodeID}})
	for _, s := range all {
		_ = s.closeSend()
	}
	for i, s := range all {
		select {
		case <-s.done:
		case <-ctx.Done():
			t.Fatalf("stream %d did not end after its client closed it", i)
		}
		for _, p := range s.problems {
			t.Errorf("stream %d: %s", i, p)
		}
	}
	// The server goes on serving.
	fz.publishAll()
	resp, err := fz.client.FetchSecrets(ctx, &discovery.DiscoveryRequest{Node: &core.Node{Id: nodeID}, ResourceNames: []string{dflt, rootCA}})
	if err != nil || len(resp.GetResources()) != 2 {
		t.Fatalf("after the sequence, FetchSecrets: %v (%d secrets)", err, len(resp.GetResources()))
	}
}
