package caclient_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/internal/meshcapb"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// fakeCA is an IstioCertificateService, and a MeshCertificateService, that records what reaches
// it and answers as told.
type fakeCA struct {
	pb.UnimplementedIstioCertificateServiceServer
	addr     string
	rootFile string // verifies the fake's serving certificate
	respond  func(ctx context.Context, call int) (*pb.IstioCertificateResponse, error)

	accepted *atomic.Int64 // connections accepted
	onAccept chan struct{} // a connection was accepted

	mu    sync.Mutex
	calls []fakeCall
}

// connections counts the connections the fake accepted.
func (f *fakeCA) connections() int64 { return f.accepted.Load() }

// countingListener counts the connections it accepts, and tells of each on onAccept.
type countingListener struct {
	net.Listener
	accepted *atomic.Int64
	onAccept chan struct{}
}

func (l countingListener) Accept() (net.Conn, error) {
	conn, err := l.Listener.Accept()
	if err == nil {
		l.accepted.Add(1)
		select {
		case l.onAccept <- struct{}{}:
		default:
		}
	}
	return conn, err
}

type fakeCall struct {
	md       metadata.MD
	req      *pb.IstioCertificateRequest
	meshReq  *meshcapb.MeshCertificateRequest // instead of req, for a Mesh CA call
	deadline time.Duration                    // time left when the call arrived; 0 without a deadline
}

func (f *fakeCA) CreateCertificate(ctx context.Context, req *pb.IstioCertificateRequest) (*pb.IstioCertificateResponse, error) {
	return f.record(ctx, fakeCall{req: req})
}

// fakeMeshCA is the fake's Mesh CA service: recorded and answered as the Istio one.
type fakeMeshCA struct {
	meshcapb.UnimplementedMeshCertificateServiceServer
	f *fakeCA
}

func (m fakeMeshCA) CreateCertificate(ctx context.Context, req *meshcapb.MeshCertificateRequest) (*meshcapb.MeshCertificateResponse, error) {
	resp, err := m.f.record(ctx, fakeCall{meshReq: req})
	if err != nil {
		return nil, err
	}
	return &meshcapb.MeshCertificateResponse{CertChain: resp.GetCertChain()}, nil
}

func (f *fakeCA) record(ctx context.Context, call fakeCall) (*pb.IstioCertificateResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	call.md = md.Copy()
	if d, ok := ctx.Deadline(); ok {
		call.deadline = time.Until(d)
	}
	f.mu.Lock()
	n := len(f.calls)
	f.calls = append(f.calls, call)
	f.mu.Unlock()
	return f.respond(ctx, n)
}

func (f *fakeCA) recorded() []fakeCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]fakeCall(nil), f.calls...)
}

// answer returns a respond function that gives chain to every call.
func answer(chain ...string) func(context.Context, int) (*pb.IstioCertificateResponse, error) {
	return func(context.Context, int) (*pb.IstioCertificateResponse, error) {
		return &pb.IstioCertificateResponse{CertChain: chain}, nil
	}
}

// startFake serves a fakeCA over TLS on 127.0.0.1:0 with a certificate for hosts.
func startFake(t *testing.T, respond func(context.Context, int) (*pb.IstioCertificateResponse, error), hosts ...string) *fakeCA {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := serveFake(t, lis, respond, hosts...)
	f.addr = lis.Addr().String()
	return f
}

func serveFake(t *testing.T, lis net.Listener, respond func(context.Context, int) (*pb.IstioCertificateResponse, error), hosts ...string) *fakeCA {
	t.Helper()
	root := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "fake CA root"})
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	serving := root.Issue(t, &x509.Certificate{
		DNSNames:    hosts,
		NotBefore:   now.Add(-time.Hour),
		NotAfter:    now.Add(time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, key.Public())
	f := &fakeCA{rootFile: filepath.Join(t.TempDir(), "root-cert.pem"), respond: respond, accepted: &atomic.Int64{},
		onAccept: make(chan struct{}, 1)}
	lis = countingListener{Listener: lis, accepted: f.accepted, onAccept: f.onAccept}
	writeFile(t, f.rootFile, string(testutil.CertPEM(root.Cert)))

	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{
		MinVersion:   tls.VersionTLS12,
		Certificates: []tls.Certificate{{Certificate: [][]byte{serving.Raw}, PrivateKey: key, Leaf: serving}},
	})))
	pb.RegisterIstioCertificateServiceServer(srv, f)
	meshcapb.RegisterMeshCertificateServiceServer(srv, fakeMeshCA{f: f})
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return f
}

// testChain is a leaf, an intermediate and a root from a test CA, and their PEM.
type testChain struct {
	certs []*x509.Certificate
	pem   []string
}

func newTestChain(t *testing.T) testChain {
	t.Helper()
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	inter := root.NewIntermediate(t, testutil.CAOptions{})
	leaf, _ := inter.IssueWorkload(t, spiffeID("ns1", "sa1").String(), time.Hour)
	c := testChain{certs: []*x509.Certificate{leaf, inter.Cert, root.Cert}}
	for _, cert := range c.certs {
		c.pem = append(c.pem, string(testutil.CertPEM(cert)))
	}
	return c
}

func TestRequestOnTheWire(t *testing.T) {
	t.Parallel()
	chain := newTestChain(t)
	id := spiffeID("ns1", "sa1")

	tests := []struct {
		name          string
		clusterID     string
		token         *string // nil: no token file, a client certificate instead
		callTimeout   time.Duration
		wantAuth      []string
		wantClusterID []string
	}{
		{
			name:          "cluster ID and token",
			clusterID:     "Kubernetes-east",
			token:         ptr("tok-abc\n"),
			callTimeout:   30 * time.Second,
			wantAuth:      []string{"Bearer tok-abc"},
			wantClusterID: []string{"Kubernetes-east"},
		},
		{
			name:        "no cluster ID, a certificate instead of a token, default deadline",
			callTimeout: 0,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			f := startFake(t, answer(chain.pem...), caclient.DefaultServerName)
			tokenPath := filepath.Join(t.TempDir(), "token")
			if tt.token != nil {
				writeFile(t, tokenPath, *tt.token)
			}
			cfg := caclient.Config{
				Address: f.addr, RootCertFile: f.rootFile, TokenPath: tokenPath,
				ClusterID: tt.clusterID, CallTimeout: tt.callTimeout,
			}
			if tt.token == nil {
				pair := newTestPair(t, testutil.NewRootCA(t, testutil.CAOptions{}), id)
				cfg.ClientCertificate = pair.tlsCertificate
			}
			c := newClient(t, cfg)
			csr, key := newCSR(t, pki.ECDSA, id)
			if res := c.sign(t, csr, 90*time.Minute); res.err != nil {
				t.Fatal(res.err)
			}

			calls := f.recorded()
			if len(calls) != 1 {
				t.Fatalf("the CA saw %d calls, want 1", len(calls))
			}
			got := calls[0]
			if a := got.md.Get("authorization"); !equalStrings(a, tt.wantAuth) {
				t.Errorf("authorization %q, want %q", a, tt.wantAuth)
			}
			if h := got.md.Get("clusterid"); !equalStrings(h, tt.wantClusterID) {
				t.Errorf("ClusterID header %q, want %q", h, tt.wantClusterID)
			}
			meta := got.req.GetMetadata().GetFields()["ClusterID"].GetStringValue()
			if meta != tt.clusterID {
				t.Errorf("request metadata ClusterID %q, want %q", meta, tt.clusterID)
			}
			if tt.clusterID == "" && got.req.GetMetadata() != nil {
				t.Errorf("request metadata %v sent without a cluster ID", got.req.GetMetadata())
			}
			if got.req.GetValidityDuration() != 5400 {
				t.Errorf("validity_duration %d, want 5400 s", got.req.GetValidityDuration())
			}
			parsed, err := pki.ParseCSR([]byte(got.req.GetCsr()))
			if err != nil {
				t.Fatalf("the CA got a CSR that does not parse: %v", err)
			}
			if len(parsed.URIs) != 1 || parsed.URIs[0].String() != id.String() || !pki.PublicKeysEqual(parsed.PublicKey, key.Public()) {
				t.Errorf("the CA got a CSR for %v, not the one signed", parsed.URIs)
			}
			wantTimeout := tt.callTimeout
			if wantTimeout == 0 {
				wantTimeout = caclient.DefaultCallTimeout
			}
			if got.deadline <= 0 || got.deadline > wantTimeout {
				t.Errorf("call arrived with %s left, want a deadline of at most %s", got.deadline, wantTimeout)
			}
		})
	}
}

func ptr[T any](v T) *T { return &v }

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestResponseChainParsing(t *testing.T) {
	t.Parallel()
	chain := newTestChain(t)
	badDER := "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"

	tests := []struct {
		name    string
		answer  []string
		want    []*x509.Certificate
		wantErr string
	}{
		{"one certificate per element", chain.pem, chain.certs, ""},
		{"several certificates in one element", []string{chain.pem[0] + chain.pem[1], chain.pem[2]}, chain.certs, ""},
		{"the whole chain in one element", []string{strings.Join(chain.pem, "")}, chain.certs, ""},
		{"empty chain", nil, nil, "empty certificate chain"},
		{"garbage element", []string{chain.pem[0], "garbage"}, nil, "element 1"},
		{"undecodable certificate", []string{badDER, chain.pem[1]}, nil, "element 0"},
		{"empty element", []string{""}, nil, "element 0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			f := startFake(t, answer(tt.answer...), caclient.DefaultServerName)
			c := newClient(t, caclient.Config{Address: f.addr, RootCertFile: f.rootFile})
			csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))
			res := c.sign(t, csr, time.Hour)
			if n := len(f.recorded()); n != 1 || res.backoffs != 0 {
				t.Errorf("%d calls, %d backoffs; want 1, 0", n, res.backoffs)
			}
			if tt.wantErr != "" {
				if res.err == nil || !strings.Contains(res.err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want one mentioning %q", res.err, tt.wantErr)
				}
				if res.chain != nil {
					t.Error("a chain was returned with the error")
				}
				return
			}
			if res.err != nil {
				t.Fatal(res.err)
			}
			if len(res.chain) != len(tt.want) {
				t.Fatalf("chain of %d, want %d", len(res.chain), len(tt.want))
			}
			for i := range tt.want {
				if !res.chain[i].Equal(tt.want[i]) {
					t.Errorf("chain[%d] is %s, want %s", i, res.chain[i].Subject, tt.want[i].Subject)
				}
			}
		})
	}
}

func TestOnlyTransientCodesAreRetried(t *testing.T) {
	t.Parallel()
	chain := newTestChain(t)

	tests := []struct {
		code        codes.Code
		failures    int // the fake fails this many calls with code, then answers
		maxAttempts int
		wantCalls   int
		want        outcome
	}{
		{codes.Unavailable, 2, 3, 3, succeeded},
		{codes.ResourceExhausted, 1, 3, 2, succeeded},
		{codes.Aborted, 1, 3, 2, succeeded},
		{codes.DeadlineExceeded, 1, 3, 2, succeeded},
		{codes.Unavailable, 3, 3, 3, unreachable},
		{codes.DeadlineExceeded, 9, 2, 2, unreachable},
		{codes.Unauthenticated, 1, 3, 1, rejected},
		{codes.PermissionDenied, 1, 3, 1, rejected},
		{codes.InvalidArgument, 1, 3, 1, rejected},
		{codes.Internal, 1, 3, 1, failedOtherwise},
		{codes.Unimplemented, 1, 3, 1, failedOtherwise},
	}
	// Both protocols retry, and explain, alike.
	for _, provider := range []string{caclient.ProviderCitadel, caclient.ProviderGoogleCA} {
		for _, tt := range tests {
			name := fmt.Sprintf("%s %s %d times of %d attempts", provider, tt.code, tt.failures, tt.maxAttempts)
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				f := startFake(t, func(_ context.Context, call int) (*pb.IstioCertificateResponse, error) {
					if call < tt.failures {
						return nil, status.Error(tt.code, "told to fail")
					}
					return &pb.IstioCertificateResponse{CertChain: chain.pem}, nil
				}, caclient.DefaultServerName)
				c := newClient(t, caclient.Config{Address: f.addr, RootCertFile: f.rootFile, MaxAttempts: tt.maxAttempts, Provider: provider})
				csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))

				res := c.sign(t, csr, time.Hour)
				calls := f.recorded()
				if len(calls) != tt.wantCalls || res.backoffs != tt.wantCalls-1 {
					t.Errorf("%d calls after %d backoffs, want %d calls", len(calls), res.backoffs, tt.wantCalls)
				}
				for i, call := range calls {
					if (call.meshReq != nil) != (provider == caclient.ProviderGoogleCA) {
						t.Errorf("call %d went to the other protocol's service", i)
					}
				}
				if got := outcomeOf(res.err); got != tt.want {
					t.Fatalf("error %v: %s, want %s", res.err, got, tt.want)
				}
				if res.err != nil {
					if status.Code(res.err) != tt.code {
						t.Errorf("code %s, want %s kept in the error", status.Code(res.err), tt.code)
					}
					for _, want := range []string{f.addr, "told to fail"} {
						if !strings.Contains(res.err.Error(), want) {
							t.Errorf("error %q does not mention %q", res.err, want)
						}
					}
				}
			})
		}
	}
}

// outcome classifies a Sign result by the sentinel its error wraps.
type outcome string

const (
	succeeded       outcome = "success"
	rejected        outcome = "ErrRejected"
	unreachable     outcome = "ErrUnreachable"
	failedOtherwise outcome = "an error that is neither ErrRejected nor ErrUnreachable"
	failedAsBoth    outcome = "both ErrRejected and ErrUnreachable"
)

func outcomeOf(err error) outcome {
	r, u := errors.Is(err, caclient.ErrRejected), errors.Is(err, caclient.ErrUnreachable)
	switch {
	case err == nil:
		return succeeded
	case r && u:
		return failedAsBoth
	case r:
		return rejected
	case u:
		return unreachable
	default:
		return failedOtherwise
	}
}

func TestCallTimeoutBoundsOneAttempt(t *testing.T) {
	t.Parallel()
	chain := newTestChain(t)
	f := startFake(t, func(ctx context.Context, call int) (*pb.IstioCertificateResponse, error) {
		if call == 0 { // hang until the client gives up on this attempt
			<-ctx.Done()
			return nil, ctx.Err()
		}
		return &pb.IstioCertificateResponse{CertChain: chain.pem}, nil
	}, caclient.DefaultServerName)
	// The per-attempt deadline runs on real time; keep it short.
	c := newClient(t, caclient.Config{Address: f.addr, RootCertFile: f.rootFile, CallTimeout: 200 * time.Millisecond, MaxAttempts: 2})
	csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))
	res := c.sign(t, csr, time.Hour)
	if res.err != nil {
		t.Fatalf("Sign after a timed-out attempt: %v", res.err)
	}
	if calls := len(f.recorded()); calls != 2 || res.backoffs != 1 {
		t.Errorf("%d calls after %d backoffs, want 2 after 1", calls, res.backoffs)
	}
}

func TestDefaultServerName(t *testing.T) {
	t.Parallel()
	chain := newTestChain(t)

	tests := []struct {
		name       string
		hosts      []string // in the fake's certificate
		serverName string
		wantErr    string // "" for success
	}{
		{"default matches istiod.istio-system.svc", []string{"istiod.istio-system.svc"}, "", ""},
		{"default does not match another name", []string{"other.example"}, "", "istiod.istio-system.svc"},
		{"override matches", []string{"other.example"}, "other.example", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			f := startFake(t, answer(chain.pem...), tt.hosts...)
			c := newClient(t, caclient.Config{Address: f.addr, RootCertFile: f.rootFile, ServerName: tt.serverName, MaxAttempts: 1})
			csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))
			res := c.sign(t, csr, time.Hour)
			if tt.wantErr == "" {
				if res.err != nil {
					t.Fatal(res.err)
				}
				return
			}
			if res.err == nil || !strings.Contains(res.err.Error(), tt.wantErr) {
				t.Fatalf("error %v, want a name mismatch mentioning %q", res.err, tt.wantErr)
			}
			if n := len(f.recorded()); n != 0 {
				t.Errorf("the CA saw %d calls over a connection that should not be trusted", n)
			}
		})
	}
}

func TestUnixSocketAddress(t *testing.T) {
	t.Parallel()
	chain := newTestChain(t)
	path := filepath.Join(testutil.ShortTempDir(t), "ca.sock")
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	f := serveFake(t, lis, answer(chain.pem...), caclient.DefaultServerName)
	c := newClient(t, caclient.Config{Address: "unix://" + path, RootCertFile: f.rootFile})
	csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))
	if res := c.sign(t, csr, time.Hour); res.err != nil {
		t.Fatal(res.err)
	}
	if n := len(f.recorded()); n != 1 {
		t.Fatalf("the CA saw %d calls, want 1", n)
	}
}

func TestCancelDuringAnAttemptIsNotRetried(t *testing.T) {
	t.Parallel()
	arrived := make(chan struct{}, 1)
	f := startFake(t, func(ctx context.Context, _ int) (*pb.IstioCertificateResponse, error) {
		select {
		case arrived <- struct{}{}:
		default:
		}
		<-ctx.Done()
		return nil, ctx.Err()
	}, caclient.DefaultServerName)
	c := newClient(t, caclient.Config{Address: f.addr, RootCertFile: f.rootFile, MaxAttempts: 3})
	csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan signed, 1)
	go func() {
		chain, err := c.Sign(ctx, csr, time.Hour)
		done <- signed{chain: chain, err: err}
	}()
	<-arrived
	cancel()
	res := testutil.Drive(t, c.clock, backoffStep, 0, done)
	if !errors.Is(res.err, context.Canceled) {
		t.Fatalf("error %v, want context.Canceled (as when cancelled during a backoff wait)", res.err)
	}
	if n := c.clock.Armed(); n != 0 || len(f.recorded()) != 1 {
		t.Errorf("%d backoff waits and %d calls after the caller cancelled, want 0 and 1", n, len(f.recorded()))
	}
}
