package sds_test

import (
	"bytes"
	"context"
	"crypto"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	secretservice "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	"github.com/prometheus/client_golang/prometheus"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/secretmanager"
)

// waitLimit only bounds how long a broken test hangs (a push that never comes fails the test when
// the stream's deadline passes); no test waits on the real clock otherwise.
const waitLimit = 30 * time.Second

const (
	nodeID     = "sidecar~10.0.0.1~cart-1.shop~shop.svc.cluster.local"
	dflt       = secretmanager.WorkloadCertName
	rootCA     = secretmanager.RootCertName
	workloadID = "spiffe://cluster.local/ns/shop/sa/cart"
	// fileCert is a file resource name as Envoy sends it; the fake serves it like any other name.
	fileCert = "file-cert:/etc/certs/cert.pem~/etc/certs/key.pem"
	// spare is one more name the fake serves, to subscribe to something new.
	spare = "file-root:/etc/certs/root.pem"
)

// fakeSecrets is the secret manager behind the server: the test publishes secrets (valid or not)
// and refuses the names it chooses.
type fakeSecrets struct {
	mu      sync.Mutex
	current map[string]*secretmanager.Secret
	changed chan struct{} // closed and replaced at every publication
	subs    map[int]func(*secretmanager.Secret)
	nextSub int
	refuse  map[string]error
	calls   chan string                           // told of every GenerateSecret call, when set
	hold    map[string]chan struct{}              // GenerateSecret for the name returns only once closed
	held    map[string]chan *secretmanager.Secret // told what a held call is about to return
}

func newFakeSecrets() *fakeSecrets {
	return &fakeSecrets{
		current: map[string]*secretmanager.Secret{},
		changed: make(chan struct{}),
		subs:    map[int]func(*secretmanager.Secret){},
		refuse:  map[string]error{},
		hold:    map[string]chan struct{}{},
		held:    map[string]chan *secretmanager.Secret{},
	}
}

// Publish makes s the current secret of its name and tells the subscribers at once, as the secret
// manager does after a rotation.
func (f *fakeSecrets) Publish(s *secretmanager.Secret) {
	f.mu.Lock()
	f.current[s.Name] = s
	close(f.changed)
	f.changed = make(chan struct{})
	subs := slices.Collect(maps.Values(f.subs))
	f.mu.Unlock()
	for _, fn := range subs {
		fn(s)
	}
}

// Refuse makes CheckName refuse name with err (ErrUnknownSecret or ErrForbiddenPath).
func (f *fakeSecrets) Refuse(name string, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.refuse[name] = err
}

// Hold makes the next GenerateSecret for name find its secret, report it on the returned channel,
// and return it only once release is called.
func (f *fakeSecrets) Hold(name string) (found <-chan *secretmanager.Secret, release func()) {
	f.mu.Lock()
	defer f.mu.Unlock()
	gate, ch := make(chan struct{}), make(chan *secretmanager.Secret, 1)
	f.hold[name], f.held[name] = gate, ch
	return ch, sync.OnceFunc(func() { close(gate) })
}

// Calls returns a channel told of every later GenerateSecret call.
func (f *fakeSecrets) Calls() <-chan string {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = make(chan string, 64)
	return f.calls
}

func (f *fakeSecrets) Subscribe(fn func(*secretmanager.Secret)) func() {
	f.mu.Lock()
	defer f.mu.Unlock()
	id := f.nextSub
	f.nextSub++
	f.subs[id] = fn
	return func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		delete(f.subs, id)
	}
}

func (f *fakeSecrets) CheckName(name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.refuse[name]; err != nil {
		return fmt.Errorf("%w: %q", err, name)
	}
	return nil
}

// GenerateSecret waits until a secret of that name is published or ctx ends.
func (f *fakeSecrets) GenerateSecret(ctx context.Context, name string) (*secretmanager.Secret, error) {
	f.mu.Lock()
	calls, gate, held := f.calls, f.hold[name], f.held[name]
	delete(f.hold, name)
	delete(f.held, name)
	f.mu.Unlock()
	if calls != nil {
		select {
		case calls <- name:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	for {
		f.mu.Lock()
		s, changed := f.current[name], f.changed
		f.mu.Unlock()
		if s != nil {
			if gate != nil {
				held <- s
				select {
				case <-gate:
				case <-ctx.Done():
					return nil, ctx.Err()
				}
			}
			return s, nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// testPKI makes the secrets: workload key pairs issued by one test root, and trust bundles.
type testPKI struct {
	root *testutil.CA
}

func newPKI(t *testing.T) *testPKI {
	t.Helper()
	return &testPKI{root: testutil.NewRootCA(t, testutil.CAOptions{})}
}

// workload returns a new, valid "default" key pair.
func (p *testPKI) workload(t *testing.T) *secretmanager.Secret {
	t.Helper()
	leaf, key := p.root.IssueWorkload(t, workloadID, time.Hour)
	return keyPair(t, dflt, []*x509.Certificate{leaf, p.root.Cert}, key)
}

// roots returns a new trust bundle of one fresh root, named name.
func (p *testPKI) roots(t *testing.T, name string) *secretmanager.Secret {
	t.Helper()
	cert := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "root " + name}).Cert
	return &secretmanager.Secret{
		Name:     name,
		Roots:    []*x509.Certificate{cert},
		RootsPEM: testutil.CertPEM(cert),
		Version:  cert.SerialNumber.Text(16),
	}
}

// keyPair builds a key-pair secret as the secret manager does: Version is the leaf's serial.
func keyPair(t *testing.T, name string, chain []*x509.Certificate, key crypto.Signer) *secretmanager.Secret {
	t.Helper()
	s := &secretmanager.Secret{Name: name, Chain: chain, ChainPEM: testutil.CertPEM(chain...), Key: key}
	if key != nil {
		s.KeyPEM = testutil.KeyPEM(t, key)
	}
	if len(chain) > 0 {
		s.Version = chain[0].SerialNumber.Text(16)
		s.ExpiresAt = chain[0].NotAfter
	}
	return s
}

// harness is a running SDS server on a Unix socket in a short temp dir, and a connection to it.
type harness struct {
	socket string
	server *sds.Server
	reg    *prometheus.Registry
	logs   *testutil.SyncBuffer
	conn   *grpc.ClientConn
	client secretservice.SecretDiscoveryServiceClient
	cancel context.CancelFunc // ends Run's context
	done   chan error         // Run's result
}

func startServer(t *testing.T, secrets sds.Secrets, adjust ...func(*sds.Config)) *harness {
	t.Helper()
	h := &harness{
		socket: filepath.Join(testutil.ShortTempDir(t), "sds", sds.SocketName),
		reg:    prometheus.NewRegistry(),
		logs:   &testutil.SyncBuffer{},
		done:   make(chan error, 1),
	}
	cfg := sds.Config{
		SocketPath: h.socket,
		Secrets:    secrets,
		Logger:     slog.New(slog.NewTextHandler(h.logs, nil)),
		Registerer: h.reg,
	}
	for _, fn := range adjust {
		fn(&cfg)
	}
	var err error
	if h.server, err = sds.New(cfg); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	go func() { h.done <- h.server.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := h.wait(); err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	h.conn = dial(t, h.socket)
	h.client = secretservice.NewSecretDiscoveryServiceClient(h.conn)
	return h
}

// wait returns Run's result, failing after waitLimit.
func (h *harness) wait() error {
	select {
	case err := <-h.done:
		h.done <- err // for the next caller
		return err
	case <-time.After(waitLimit):
		return errors.New("Run did not return")
	}
}

func dial(t *testing.T, socket string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// nacks reads meshid_sds_nacks_total.
func (h *harness) nacks(t *testing.T) float64 {
	t.Helper()
	families, err := h.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == "meshid_sds_nacks_total" {
			return f.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatal("meshid_sds_nacks_total is not registered")
	return 0
}

// push is one response as the client saw it.
type push struct {
	version  string // version_info (SotW) or system_version_info (delta)
	nonce    string
	secrets  map[string]*tlsv3.Secret
	versions map[string]string // per resource (delta only)
}

func (p push) names() []string { return slices.Sorted(maps.Keys(p.secrets)) }

// decode reads the secrets of a response: delta resources, or SotW ones (anys).
func decode(t testing.TB, resources []*discovery.Resource, anys []*anypb.Any) map[string]*tlsv3.Secret {
	t.Helper()
	out := map[string]*tlsv3.Secret{}
	for _, r := range resources {
		anys = append(anys, r.GetResource())
	}
	for _, a := range anys {
		if a.GetTypeUrl() != sds.SecretTypeURL {
			t.Fatalf("resource of type %s", a.GetTypeUrl())
		}
		s := &tlsv3.Secret{}
		if err := a.UnmarshalTo(s); err != nil {
			t.Fatal(err)
		}
		if _, dup := out[s.GetName()]; dup {
			t.Fatalf("secret %s twice in one response", s.GetName())
		}
		out[s.GetName()] = s
	}
	return out
}

// checkSecret reports how got differs from the secret want, as Envoy would read it.
func checkSecret(got *tlsv3.Secret, want *secretmanager.Secret) error {
	if got == nil {
		return fmt.Errorf("secret %s missing", want.Name)
	}
	if got.GetName() != want.Name {
		return fmt.Errorf("secret named %q, want %q", got.GetName(), want.Name)
	}
	if len(want.Roots) > 0 {
		vc := got.GetValidationContext()
		if vc == nil {
			return fmt.Errorf("secret %s: no validation_context in %v", want.Name, got)
		}
		if !bytes.Equal(vc.GetTrustedCa().GetInlineBytes(), want.RootsPEM) {
			return fmt.Errorf("secret %s: trusted_ca is not the published roots (version %s)", want.Name, want.Version)
		}
		return nil
	}
	tc := got.GetTlsCertificate()
	if tc == nil {
		return fmt.Errorf("secret %s: no tls_certificate in %v", want.Name, got)
	}
	if !bytes.Equal(tc.GetCertificateChain().GetInlineBytes(), want.ChainPEM) {
		return fmt.Errorf("secret %s: certificate_chain is not the published chain (version %s)", want.Name, want.Version)
	}
	if !bytes.Equal(tc.GetPrivateKey().GetInlineBytes(), want.KeyPEM) {
		return fmt.Errorf("secret %s: private_key is not the published key (version %s)", want.Name, want.Version)
	}
	return nil
}

// expect fails unless p carries exactly want, each with its content.
func expect(t *testing.T, p push, want ...*secretmanager.Secret) {
	t.Helper()
	var names []string
	for _, s := range want {
		names = append(names, s.Name)
	}
	slices.Sort(names)
	if !slices.Equal(p.names(), names) {
		t.Fatalf("pushed %v (version %q), want %v", p.names(), p.version, names)
	}
	for _, s := range want {
		if err := checkSecret(p.secrets[s.Name], s); err != nil {
			t.Fatal(err)
		}
		if p.versions != nil && p.versions[s.Name] != s.Version {
			t.Fatalf("secret %s pushed as version %q, want %q", s.Name, p.versions[s.Name], s.Version)
		}
	}
	if p.nonce == "" {
		t.Fatal("response without a nonce")
	}
	if p.version == "" {
		t.Fatal("response without a version")
	}
	for _, s := range want {
		if !strings.Contains(p.version, s.Version) {
			t.Fatalf("version %q does not carry %s's version %s", p.version, s.Name, s.Version)
		}
	}
}

// sotwStream is an Envoy-style StreamSecrets client; the test chooses every nonce and version.
type sotwStream struct {
	t      *testing.T
	stream secretservice.SecretDiscoveryService_StreamSecretsClient
	cancel context.CancelFunc
}

// openSotW opens a stream with a deadline: a push that never comes fails the test then.
func (h *harness) openSotW(t *testing.T) *sotwStream {
	t.Helper()
	return openSotWOn(t, h.client)
}

func openSotWOn(t *testing.T, client secretservice.SecretDiscoveryServiceClient) *sotwStream {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	t.Cleanup(cancel)
	st, err := client.StreamSecrets(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return &sotwStream{t: t, stream: st, cancel: cancel}
}

func (s *sotwStream) send(req *discovery.DiscoveryRequest) {
	s.t.Helper()
	if req.TypeUrl == "" {
		req.TypeUrl = sds.SecretTypeURL
	}
	if err := s.stream.Send(req); err != nil {
		s.t.Fatalf("Send: %v", err)
	}
}

// subscribe sends a stream's first request: the node, and the names.
func (s *sotwStream) subscribe(names ...string) {
	s.t.Helper()
	s.send(&discovery.DiscoveryRequest{Node: &core.Node{Id: nodeID}, ResourceNames: names})
}

// ack accepts p and (re)states the names, as Envoy does, without the node.
func (s *sotwStream) ack(p push, names ...string) {
	s.t.Helper()
	s.send(&discovery.DiscoveryRequest{VersionInfo: p.version, ResponseNonce: p.nonce, ResourceNames: names})
}

// nack rejects p, naming the last accepted version.
func (s *sotwStream) nack(p push, accepted, detail string, names ...string) {
	s.t.Helper()
	s.send(&discovery.DiscoveryRequest{
		VersionInfo: accepted, ResponseNonce: p.nonce, ResourceNames: names,
		ErrorDetail: &rpcstatus.Status{Code: int32(codes.InvalidArgument), Message: detail},
	})
}

func (s *sotwStream) recv() push {
	s.t.Helper()
	resp, err := s.stream.Recv()
	if err != nil {
		s.t.Fatalf("Recv: %v", err)
	}
	if resp.GetTypeUrl() != sds.SecretTypeURL {
		s.t.Fatalf("response of type %s", resp.GetTypeUrl())
	}
	return push{version: resp.GetVersionInfo(), nonce: resp.GetNonce(), secrets: decode(s.t, nil, resp.GetResources())}
}

// recvAll receives pushes, acknowledging each, until every name has come; it returns the last
// push (not yet acknowledged) and every secret received.
func (s *sotwStream) recvAll(names ...string) (last push, got map[string]*tlsv3.Secret) {
	s.t.Helper()
	got = map[string]*tlsv3.Secret{}
	for {
		last = s.recv()
		maps.Copy(got, last.secrets)
		if len(got) >= len(names) {
			return last, got
		}
		s.ack(last, names...)
	}
}

// recvErr waits for the stream to end and returns its status.
func (s *sotwStream) recvErr() *status.Status {
	s.t.Helper()
	resp, err := s.stream.Recv()
	if err == nil {
		s.t.Fatalf("got a response (%d resources), want the stream to end", len(resp.GetResources()))
	}
	return status.Convert(err)
}

// deltaStream is an Envoy-style DeltaSecrets client.
type deltaStream struct {
	t      *testing.T
	stream secretservice.SecretDiscoveryService_DeltaSecretsClient
}

func (h *harness) openDelta(t *testing.T) *deltaStream {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	t.Cleanup(cancel)
	st, err := h.client.DeltaSecrets(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return &deltaStream{t: t, stream: st}
}

func (d *deltaStream) send(req *discovery.DeltaDiscoveryRequest) {
	d.t.Helper()
	if req.TypeUrl == "" {
		req.TypeUrl = sds.SecretTypeURL
	}
	if err := d.stream.Send(req); err != nil {
		d.t.Fatalf("Send: %v", err)
	}
}

func (d *deltaStream) recv() push {
	d.t.Helper()
	resp, err := d.stream.Recv()
	if err != nil {
		d.t.Fatalf("Recv: %v", err)
	}
	if resp.GetTypeUrl() != sds.SecretTypeURL {
		d.t.Fatalf("response of type %s", resp.GetTypeUrl())
	}
	p := push{version: resp.GetSystemVersionInfo(), nonce: resp.GetNonce(), secrets: decode(d.t, resp.GetResources(), nil), versions: map[string]string{}}
	for _, r := range resp.GetResources() {
		if r.GetName() == "" || r.GetVersion() == "" {
			d.t.Fatalf("delta resource without a name or version: %v", r)
		}
		p.versions[r.GetName()] = r.GetVersion()
	}
	return p
}

func (d *deltaStream) ack(p push) {
	d.t.Helper()
	d.send(&discovery.DeltaDiscoveryRequest{ResponseNonce: p.nonce})
}

// recvAll receives pushes, acknowledging each, until every name has come; the last push is not
// acknowledged.
func (d *deltaStream) recvAll(names ...string) (last push, versions map[string]string, got map[string]*tlsv3.Secret) {
	d.t.Helper()
	versions, got = map[string]string{}, map[string]*tlsv3.Secret{}
	for {
		last = d.recv()
		maps.Copy(got, last.secrets)
		maps.Copy(versions, last.versions)
		if len(got) >= len(names) {
			return last, versions, got
		}
		d.ack(last)
	}
}

func (d *deltaStream) recvErr() *status.Status {
	d.t.Helper()
	resp, err := d.stream.Recv()
	if err == nil {
		d.t.Fatalf("got a response (%d resources), want the stream to end", len(resp.GetResources()))
	}
	return status.Convert(err)
}

// checkAll fails unless got holds exactly want.
func checkAll(t *testing.T, got map[string]*tlsv3.Secret, want ...*secretmanager.Secret) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("got secrets %v, want %d", slices.Sorted(maps.Keys(got)), len(want))
	}
	for _, s := range want {
		if err := checkSecret(got[s.Name], s); err != nil {
			t.Fatal(err)
		}
	}
}
