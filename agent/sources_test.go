package agent_test

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	secretservice "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
)

const (
	embeddedID = "spiffe://cluster.local/ns/default/sa/default"
	// secretType is Envoy's type URL for SDS, spelled out: the client below is independent of ours.
	secretType = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
	// wait bounds, in real time, how long a test waits for something that should come at once.
	wait = 30 * time.Second
)

var secretNames = []string{"default", "ROOTCA"}

// ---- the agent under test ----

// logSink captures an agent's logs as JSON lines and lets a test wait for a message.
type logSink struct {
	buf     testutil.SyncBuffer
	mu      sync.Mutex
	seen    map[string]int
	changed chan struct{} // closed and replaced at every record
}

func newLogSink(t *testing.T) *logSink {
	s := &logSink{seen: map[string]int{}, changed: make(chan struct{})}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("agent logs:\n%s", s.buf.String())
		}
	})
	return s
}

func (s *logSink) logger() *slog.Logger {
	return slog.New(&teeHandler{Handler: slog.NewJSONHandler(&s.buf, &slog.HandlerOptions{Level: slog.LevelDebug}), sink: s})
}

func (s *logSink) saw(msg string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seen[msg]++
	close(s.changed)
	s.changed = make(chan struct{})
}

// await waits until msg has been logged n times.
func (s *logSink) await(t *testing.T, msg string, n int) {
	t.Helper()
	giveUp := time.NewTimer(wait)
	defer giveUp.Stop()
	for {
		s.mu.Lock()
		count, changed := s.seen[msg], s.changed
		s.mu.Unlock()
		if count >= n {
			return
		}
		select {
		case <-changed:
		case <-giveUp.C:
			t.Fatalf("%q logged %d times, want %d", msg, count, n)
		}
	}
}

// records returns the decoded log records whose message is msg.
func (s *logSink) records(t *testing.T, msg string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for line := range strings.Lines(s.buf.String()) {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if rec["msg"] == msg {
			out = append(out, rec)
		}
	}
	return out
}

// teeHandler writes records with its Handler and tells the sink which message it saw.
type teeHandler struct {
	slog.Handler
	sink *logSink
}

func (h *teeHandler) Handle(ctx context.Context, r slog.Record) error {
	err := h.Handler.Handle(ctx, r)
	h.sink.saw(r.Message)
	return err
}

func (h *teeHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &teeHandler{Handler: h.Handler.WithAttrs(attrs), sink: h.sink}
}

func (h *teeHandler) WithGroup(name string) slog.Handler {
	return &teeHandler{Handler: h.Handler.WithGroup(name), sink: h.sink}
}

// testConfig is an agent in fresh short directories (the embedded CA's socket lives under the
// root dir), on clk, with its servers on loopback ports chosen by the kernel. With nothing
// more it runs the embedded control plane.
func testConfig(t *testing.T, clk *testutil.FakeClock, logs *logSink) agent.Config {
	t.Helper()
	cfg := agent.DefaultConfig(testutil.ShortTempDir(t))
	cfg.WorkloadSocketDir = testutil.ShortTempDir(t)
	cfg.StatusAddr, cfg.DebugAddr = "127.0.0.1:0", "127.0.0.1:0"
	cfg.GraceRatioJitter = 0
	cfg.Clock = clk
	if logs != nil {
		cfg.Logger = logs.logger()
	}
	return cfg
}

func newFakeClock() *testutil.FakeClock {
	return testutil.NewFakeClock(time.Now().Truncate(time.Second))
}

func newAgent(t *testing.T, cfg agent.Config) *agent.Agent {
	t.Helper()
	a, err := agent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// runAgent runs a until stop is called or the test ends; stop returns Run's result.
func runAgent(t *testing.T, a *agent.Agent) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	var (
		once sync.Once
		err  error
	)
	stop = func() error {
		once.Do(func() {
			cancel()
			err = <-done
		})
		return err
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return stop
}

// rotate moves the fake clock to the renewal time of the certificate in service, once its
// renewal timer is armed (the embedded CA's hourly root check is the other pending timer), so
// that exactly one renewal fires.
func rotate(t *testing.T, clk *testutil.FakeClock, a *agent.Agent) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	if err := clk.WaitForTimers(ctx, 2); err != nil {
		t.Fatalf("the renewal timer was never armed: %v", err)
	}
	for _, s := range a.Secrets().Snapshot() {
		if s.Name == "default" {
			clk.Advance(s.RenewAt.Sub(clk.Now()))
			return
		}
	}
	t.Fatal("no workload certificate in service")
}

// ---- key material ----

// credentials is a workload key pair and its root, as files for --credentials-dir.
type credentials struct {
	files  map[string][]byte
	serial string
	root   *x509.Certificate
}

func newCredentials(t *testing.T, ca *testutil.CA, id string) credentials {
	t.Helper()
	leaf, key := ca.IssueWorkload(t, id, 24*time.Hour)
	return credentials{
		files: map[string][]byte{
			"cert-chain.pem": testutil.CertPEM(leaf, ca.Cert),
			"key.pem":        testutil.KeyPEM(t, key),
			"root-cert.pem":  testutil.CertPEM(ca.Cert),
		},
		serial: leaf.SerialNumber.Text(16),
		root:   ca.Cert,
	}
}

// credentialsDir writes c into a fresh directory and returns it.
func credentialsDir(t *testing.T, c credentials) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "credentials")
	testutil.WriteFiles(t, dir, c.files)
	return dir
}

// workloadChain parses a tls_certificate secret and fails unless its key matches its leaf.
func workloadChain(t *testing.T, s *tlsv3.Secret) []*x509.Certificate {
	t.Helper()
	tc := s.GetTlsCertificate()
	if tc == nil {
		t.Fatalf("secret %q holds no tls_certificate", s.GetName())
	}
	chain, err := pki.ParseCertificates(tc.GetCertificateChain().GetInlineBytes())
	if err != nil {
		t.Fatalf("secret %q: %v", s.GetName(), err)
	}
	key, err := pki.ParsePrivateKey(tc.GetPrivateKey().GetInlineBytes())
	if err != nil {
		t.Fatalf("secret %q: %v", s.GetName(), err)
	}
	if !pki.PublicKeysEqual(key.Public(), chain[0].PublicKey) {
		t.Fatalf("secret %q: the key does not match the leaf %s", s.GetName(), serialOf(chain))
	}
	return chain
}

func trustedRoots(t *testing.T, s *tlsv3.Secret) []*x509.Certificate {
	t.Helper()
	roots, err := pki.ParseCertificates(s.GetValidationContext().GetTrustedCa().GetInlineBytes())
	if err != nil {
		t.Fatalf("secret %q: %v", s.GetName(), err)
	}
	return roots
}

func serialOf(chain []*x509.Certificate) string { return chain[0].SerialNumber.Text(16) }

// checkVerifies fails unless chain names id and verifies against roots at now.
func checkVerifies(t *testing.T, chain, roots []*x509.Certificate, id string, now time.Time) {
	t.Helper()
	if len(chain[0].URIs) != 1 || chain[0].URIs[0].String() != id {
		t.Fatalf("leaf names %v, want %s", chain[0].URIs, id)
	}
	rootPool, inter := x509.NewCertPool(), x509.NewCertPool()
	for _, r := range roots {
		rootPool.AddCert(r)
	}
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	if _, err := chain[0].Verify(x509.VerifyOptions{Roots: rootPool, Intermediates: inter, CurrentTime: now,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Fatalf("the chain of %s does not verify against ROOTCA: %v", serialOf(chain), err)
	}
}

func readRoots(t *testing.T, path string) []*x509.Certificate {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	roots, err := pki.ParseCertificates(data)
	if err != nil {
		t.Fatal(err)
	}
	return roots
}

// sdsGet fetches names from the socket with our own SDS client.
func sdsGet(t *testing.T, socket string, names ...string) map[string]*tlsv3.Secret {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	got, err := sds.Get(ctx, socket, "test", names...)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// ---- an independent, Envoy-style SDS client on the generated stubs ----

// envoy speaks SDS as Envoy does: the node on a stream's first request only, then an ACK (the
// version and nonce of the response) or a NACK (the last accepted version, the rejected nonce and
// an error_detail) for every response.
type envoy struct {
	client secretservice.SecretDiscoveryServiceClient
	node   *core.Node
}

func dialEnvoy(t *testing.T, socket string) *envoy {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return &envoy{
		client: secretservice.NewSecretDiscoveryServiceClient(conn),
		node:   &core.Node{Id: "sidecar~10.0.0.7~web-7d4.default~default.svc.cluster.local", Cluster: "web.default"},
	}
}

func decodeSecret(t *testing.T, a *anypb.Any) *tlsv3.Secret {
	t.Helper()
	if a.GetTypeUrl() != secretType {
		t.Fatalf("resource of type %s, want %s", a.GetTypeUrl(), secretType)
	}
	s := &tlsv3.Secret{}
	if err := a.UnmarshalTo(s); err != nil {
		t.Fatal(err)
	}
	return s
}

type received[T any] struct {
	resp T
	err  error
}

// pump delivers what recv returns on a channel until it fails or ctx ends.
func pump[T any](ctx context.Context, recv func() (T, error)) <-chan received[T] {
	ch := make(chan received[T], 16)
	go func() {
		for {
			resp, err := recv()
			select {
			case ch <- received[T]{resp, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	return ch
}

func next[T any](t *testing.T, ch <-chan received[T], what string) T {
	t.Helper()
	giveUp := time.NewTimer(wait)
	defer giveUp.Stop()
	select {
	case r := <-ch:
		if r.err != nil {
			t.Fatalf("%s: %v", what, r.err)
		}
		return r.resp
	case <-giveUp.C:
	}
	t.Fatalf("%s: nothing received in %s", what, wait)
	var zero T
	return zero
}

// sotwStream is a StreamSecrets stream.
type sotwStream struct {
	stream   secretservice.SecretDiscoveryService_StreamSecretsClient
	names    []string
	recv     <-chan received[*discovery.DiscoveryResponse]
	accepted string // version_info of the last response accepted
}

func (e *envoy) streamSecrets(t *testing.T, names ...string) *sotwStream {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	stream, err := e.client.StreamSecrets(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&discovery.DiscoveryRequest{Node: e.node, ResourceNames: names, TypeUrl: secretType}); err != nil {
		t.Fatal(err)
	}
	return &sotwStream{stream: stream, names: names, recv: pump(ctx, stream.Recv)}
}

// next returns the next response, with its secrets by name.
func (s *sotwStream) next(t *testing.T) (*discovery.DiscoveryResponse, map[string]*tlsv3.Secret) {
	t.Helper()
	resp := next(t, s.recv, "StreamSecrets")
	return resp, s.secrets(t, resp)
}

// secrets checks a response and returns its secrets by name.
func (s *sotwStream) secrets(t *testing.T, resp *discovery.DiscoveryResponse) map[string]*tlsv3.Secret {
	t.Helper()
	if resp.GetTypeUrl() != secretType || resp.GetNonce() == "" {
		t.Fatalf("response of type %q with nonce %q", resp.GetTypeUrl(), resp.GetNonce())
	}
	got := map[string]*tlsv3.Secret{}
	for _, r := range resp.GetResources() {
		sec := decodeSecret(t, r)
		got[sec.GetName()] = sec
	}
	return got
}

func (s *sotwStream) ack(t *testing.T, resp *discovery.DiscoveryResponse) {
	t.Helper()
	s.accepted = resp.GetVersionInfo()
	if err := s.stream.Send(&discovery.DiscoveryRequest{VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce(),
		ResourceNames: s.names, TypeUrl: secretType}); err != nil {
		t.Fatal(err)
	}
}

func (s *sotwStream) nack(t *testing.T, resp *discovery.DiscoveryResponse, why string) {
	t.Helper()
	if err := s.stream.Send(&discovery.DiscoveryRequest{VersionInfo: s.accepted, ResponseNonce: resp.GetNonce(),
		ResourceNames: s.names, TypeUrl: secretType,
		ErrorDetail: &rpcstatus.Status{Code: int32(codes.InvalidArgument), Message: why}}); err != nil {
		t.Fatal(err)
	}
}

// collect ACKs responses until every subscribed name has arrived, and returns the latest of each.
func (s *sotwStream) collect(t *testing.T) map[string]*tlsv3.Secret {
	t.Helper()
	all := map[string]*tlsv3.Secret{}
	for len(all) < len(s.names) {
		resp, got := s.next(t)
		for name, sec := range got {
			all[name] = sec
		}
		s.ack(t, resp)
	}
	return all
}

// deltaStream is a DeltaSecrets stream.
type deltaStream struct {
	stream secretservice.SecretDiscoveryService_DeltaSecretsClient
	recv   <-chan received[*discovery.DeltaDiscoveryResponse]
}

func (e *envoy) deltaSecrets(t *testing.T, names ...string) *deltaStream {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	stream, err := e.client.DeltaSecrets(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&discovery.DeltaDiscoveryRequest{Node: e.node, TypeUrl: secretType, ResourceNamesSubscribe: names}); err != nil {
		t.Fatal(err)
	}
	return &deltaStream{stream: stream, recv: pump(ctx, stream.Recv)}
}

// next returns the next response's secrets by name, ACKing it.
func (d *deltaStream) next(t *testing.T) map[string]*tlsv3.Secret {
	t.Helper()
	resp := next(t, d.recv, "DeltaSecrets")
	got := map[string]*tlsv3.Secret{}
	for _, r := range resp.GetResources() {
		sec := decodeSecret(t, r.GetResource())
		if sec.GetName() != r.GetName() || r.GetVersion() == "" {
			t.Fatalf("delta resource %q (version %q) holds secret %q", r.GetName(), r.GetVersion(), sec.GetName())
		}
		got[r.GetName()] = sec
	}
	// No node: Istio's Envoy sets set_node_on_first_message_only for SDS.
	if err := d.stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: secretType, ResponseNonce: resp.GetNonce()}); err != nil {
		t.Fatal(err)
	}
	return got
}

func (d *deltaStream) collect(t *testing.T, n int) map[string]*tlsv3.Secret {
	t.Helper()
	all := map[string]*tlsv3.Secret{}
	for len(all) < n {
		for name, sec := range d.next(t) {
			all[name] = sec
		}
	}
	return all
}

func (e *envoy) fetchSecrets(t *testing.T, names ...string) map[string]*tlsv3.Secret {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	resp, err := e.client.FetchSecrets(ctx, &discovery.DiscoveryRequest{Node: e.node, ResourceNames: names, TypeUrl: secretType})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]*tlsv3.Secret{}
	for _, r := range resp.GetResources() {
		sec := decodeSecret(t, r)
		got[sec.GetName()] = sec
	}
	return got
}

// ---- the tests ----

const sourceChosen = "SDS source chosen"

func TestAgentSourceDecisionFlow(t *testing.T) {
	t.Parallel()
	filesCA := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "files root"})
	tests := []struct {
		name   string
		source agent.Source
		reason string
		// setup prepares the directories and the configuration, and returns the checks to run
		// against the running agent.
		setup func(t *testing.T, cfg *agent.Config) func(t *testing.T, a *agent.Agent, logs *logSink)
	}{
		{
			name:   "live external socket",
			source: agent.SourceExternalSDS,
			reason: "another server answers on ",
			setup: func(t *testing.T, cfg *agent.Config) func(*testing.T, *agent.Agent, *logSink) {
				// The external server is another agent, serving its files on the same socket.
				theirs := newCredentials(t, filesCA, "spiffe://cluster.local/ns/default/sa/theirs")
				extCfg := testConfig(t, newFakeClock(), nil)
				extCfg.WorkloadSocketDir = cfg.WorkloadSocketDir
				extCfg.CredentialsDir = credentialsDir(t, theirs)
				stopExternal := runAgent(t, newAgent(t, extCfg))
				// Ours would serve other files, were it to serve at all.
				cfg.CredentialsDir = credentialsDir(t, newCredentials(t, filesCA, "spiffe://cluster.local/ns/default/sa/ours"))
				return func(t *testing.T, a *agent.Agent, _ *logSink) {
					if a.Secrets() != nil {
						t.Fatal("the agent built a secret manager although another server serves SDS")
					}
					if got := serialOf(workloadChain(t, sdsGet(t, a.SocketPath(), "default")["default"])); got != theirs.serial {
						t.Fatalf("the socket serves %s, want the external server's %s", got, theirs.serial)
					}
					ready := "http://" + a.StatusAddr() + "/healthz/ready"
					if code, body := httpGet(t, ready); code != http.StatusOK {
						t.Fatalf("/healthz/ready with the external socket answering = %d %q, want 200", code, body)
					}
					if err := stopExternal(); err != nil {
						t.Fatal(err)
					}
					if code, body := httpGet(t, ready); code != http.StatusServiceUnavailable || !strings.Contains(body, "does not accept connections") {
						t.Fatalf("/healthz/ready with the external socket closed = %d %q, want 503 with the reason", code, body)
					}
				}
			},
		},
		{
			name:   "stale socket file is removed",
			source: agent.SourceFiles,
			reason: "credential files found in ",
			setup: func(t *testing.T, cfg *agent.Config) func(*testing.T, *agent.Agent, *logSink) {
				path := filepath.Join(cfg.WorkloadSocketDir, "socket")
				lis, err := net.Listen("unix", path)
				if err != nil {
					t.Fatal(err)
				}
				lis.(*net.UnixListener).SetUnlinkOnClose(false)
				if err := lis.Close(); err != nil {
					t.Fatal(err)
				}
				if _, err := os.Lstat(path); err != nil {
					t.Fatalf("no stale socket left: %v", err)
				}
				creds := newCredentials(t, filesCA, embeddedID)
				cfg.CredentialsDir = credentialsDir(t, creds)
				return func(t *testing.T, a *agent.Agent, logs *logSink) {
					if n := len(logs.records(t, "removed a stale SDS socket")); n != 1 {
						t.Fatalf("stale socket removal logged %d times, want 1", n)
					}
					if got := serialOf(workloadChain(t, sdsGet(t, a.SocketPath(), "default")["default"])); got != creds.serial {
						t.Fatalf("serves %s, want %s", got, creds.serial)
					}
				}
			},
		},
		{
			name:   "credential files",
			source: agent.SourceFiles,
			reason: "credential files found in ",
			setup: func(t *testing.T, cfg *agent.Config) func(*testing.T, *agent.Agent, *logSink) {
				creds := newCredentials(t, filesCA, "spiffe://cluster.local/ns/shop/sa/cart")
				cfg.CredentialsDir = credentialsDir(t, creds)
				cfg.CAAddress = closedAddress(t) // never contacted: a CA request would never succeed
				cfg.Namespace, cfg.ServiceAccount = "shop", "cart"
				return func(t *testing.T, a *agent.Agent, logs *logSink) {
					got := sdsGet(t, a.SocketPath(), secretNames...)
					if serial := serialOf(workloadChain(t, got["default"])); serial != creds.serial {
						t.Fatalf("serves %s, want the files' %s", serial, creds.serial)
					}
					if roots := trustedRoots(t, got["ROOTCA"]); len(roots) != 1 || !roots[0].Equal(creds.root) {
						t.Fatalf("ROOTCA holds %d roots, want root-cert.pem's", len(roots))
					}
					if n := len(logs.records(t, "CA source")); n != 0 {
						t.Fatal("the agent set up a CA client in file mode")
					}
				}
			},
		},
		{
			name:   "FILE_MOUNTED_CERTS serves etc/certs",
			source: agent.SourceFiles,
			reason: "FILE_MOUNTED_CERTS is set",
			setup: func(t *testing.T, cfg *agent.Config) func(*testing.T, *agent.Agent, *logSink) {
				mounted := newCredentials(t, filesCA, "spiffe://cluster.local/ns/shop/sa/mounted")
				testutil.WriteFiles(t, filepath.Join(cfg.RootDir, "etc/certs"), mounted.files)
				cfg.CredentialsDir = credentialsDir(t, newCredentials(t, filesCA, "spiffe://cluster.local/ns/shop/sa/other"))
				cfg.FileMountedCerts = true
				return func(t *testing.T, a *agent.Agent, _ *logSink) {
					if got := serialOf(workloadChain(t, sdsGet(t, a.SocketPath(), "default")["default"])); got != mounted.serial {
						t.Fatalf("serves %s, want etc/certs' %s", got, mounted.serial)
					}
				}
			},
		},
		{
			name:   "a CA address and no credential files",
			source: agent.SourceCA,
			reason: "no credential files in ",
			setup: func(t *testing.T, cfg *agent.Config) func(*testing.T, *agent.Agent, *logSink) {
				e := newEnv(t)
				cfg.Clock = e.clock
				cfg.Namespace, cfg.ServiceAccount = "default", "demo"
				cfg.CAAddress = e.ca.GRPCAddr()
				cfg.CARootCert = filepath.Join(e.stateDir, "root-cert.pem")
				cfg.TokenPath = e.tokenFile(t)
				return func(t *testing.T, a *agent.Agent, logs *logSink) {
					if r := logs.records(t, sourceChosen); !strings.Contains(fmt.Sprint(r[0]["reason"]), e.ca.GRPCAddr()) {
						t.Fatalf("the reason %q does not name the CA", r[0]["reason"])
					}
					got := sdsGet(t, a.SocketPath(), secretNames...)
					chain := workloadChain(t, got["default"])
					checkVerifies(t, chain, readRoots(t, cfg.CARootCert), demoID, e.clock.Now())
					checkVerifies(t, chain, trustedRoots(t, got["ROOTCA"]), demoID, e.clock.Now())
				}
			},
		},
		{
			name:   "no CA address: the embedded CA",
			source: agent.SourceEmbeddedCA,
			reason: "running the control plane in-process",
			setup: func(t *testing.T, cfg *agent.Config) func(*testing.T, *agent.Agent, *logSink) {
				return func(t *testing.T, a *agent.Agent, _ *logSink) {
					got := sdsGet(t, a.SocketPath(), secretNames...)
					chain := workloadChain(t, got["default"])
					roots := trustedRoots(t, got["ROOTCA"])
					now := cfg.Clock.Now()
					checkVerifies(t, chain, roots, embeddedID, now)
					// The trust bundle is the embedded CA's, from its state dir under --root-dir.
					stateRoots := readRoots(t, filepath.Join(cfg.RootDir, "var/lib/meshid/root-cert.pem"))
					if len(roots) != len(stateRoots) || !roots[0].Equal(stateRoots[0]) {
						t.Fatal("ROOTCA is not the embedded CA's root")
					}
					ctx, cancel := context.WithTimeout(t.Context(), wait)
					defer cancel()
					report, err := agent.InspectSDS(ctx, a.SocketPath(), now)
					if err != nil {
						t.Fatal(err)
					}
					if !report.Verified || report.SPIFFEID != embeddedID || report.Serial != serialOf(chain) {
						t.Fatalf("InspectSDS: %+v", report)
					}
				}
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			logs := newLogSink(t)
			cfg := testConfig(t, newFakeClock(), logs)
			check := tt.setup(t, &cfg)
			a := newAgent(t, cfg)
			if a.Source() != tt.source {
				t.Fatalf("source %s, want %s", a.Source(), tt.source)
			}
			chosen := logs.records(t, sourceChosen)
			if len(chosen) != 1 {
				t.Fatalf("%q logged %d times, want once", sourceChosen, len(chosen))
			}
			if chosen[0]["source"] != string(tt.source) || !strings.Contains(fmt.Sprint(chosen[0]["reason"]), tt.reason) {
				t.Fatalf("logged source %v, reason %q; want %s, a reason with %q", chosen[0]["source"], chosen[0]["reason"], tt.source, tt.reason)
			}
			runAgent(t, a)
			check(t, a, logs)
		})
	}
}

// closedAddress returns a loopback address nothing listens on.
func closedAddress(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	_ = lis.Close()
	return addr
}

// The issue's "done when": an independent Envoy-style client gets default and ROOTCA from the
// embedded pipeline by StreamSecrets, DeltaSecrets and FetchSecrets, sees rotations pushed with
// a short TTL, and sees a NACK answered with silence.
func TestEnvoyStyleClientAgainstEmbeddedAgent(t *testing.T) {
	t.Parallel()
	clk := newFakeClock() // shared by the agent and its embedded CA
	logs := newLogSink(t)
	cfg := testConfig(t, clk, logs)
	cfg.SecretTTL = time.Minute
	a := newAgent(t, cfg)
	runAgent(t, a)
	envoy := dialEnvoy(t, a.SocketPath())

	sotw := envoy.streamSecrets(t, secretNames...)
	initial := sotw.collect(t)
	roots := trustedRoots(t, initial["ROOTCA"])
	chain := workloadChain(t, initial["default"])
	checkVerifies(t, chain, roots, embeddedID, clk.Now())
	serial0 := serialOf(chain)
	if life := chain[0].NotAfter.Sub(clk.Now()); life > time.Minute || life < 50*time.Second {
		t.Fatalf("certificate valid for %s more, want the 1m SECRET_TTL", life)
	}

	delta := envoy.deltaSecrets(t, secretNames...)
	viaDelta := delta.collect(t, len(secretNames))
	if got := serialOf(workloadChain(t, viaDelta["default"])); got != serial0 {
		t.Fatalf("DeltaSecrets default %s, StreamSecrets %s", got, serial0)
	}
	if got := trustedRoots(t, viaDelta["ROOTCA"]); len(got) != len(roots) || !got[0].Equal(roots[0]) {
		t.Fatal("DeltaSecrets ROOTCA differs from StreamSecrets'")
	}
	fetched := envoy.fetchSecrets(t, secretNames...)
	if got := serialOf(workloadChain(t, fetched["default"])); got != serial0 {
		t.Fatalf("FetchSecrets default %s, StreamSecrets %s", got, serial0)
	}
	if got := trustedRoots(t, fetched["ROOTCA"]); len(got) != len(roots) || !got[0].Equal(roots[0]) {
		t.Fatal("FetchSecrets ROOTCA differs from StreamSecrets'")
	}

	// A rotation reaches both open streams, with a new serial.
	rotate(t, clk, a)
	resp1, pushed := sotw.next(t)
	if pushed["default"] == nil {
		t.Fatalf("rotation pushed %d secrets, none of them default", len(pushed))
	}
	chain1 := workloadChain(t, pushed["default"])
	checkVerifies(t, chain1, roots, embeddedID, clk.Now())
	serial1 := serialOf(chain1)
	if serial1 == serial0 {
		t.Fatal("the rotation pushed the same serial")
	}
	if got := serialOf(workloadChain(t, delta.next(t)["default"])); got != serial1 {
		t.Fatalf("DeltaSecrets got %s on rotation, StreamSecrets %s", got, serial1)
	}

	// Envoy rejects it: no reply until the secret changes, so the next response is the next
	// rotation, not the rejected certificate sent again.
	sotw.nack(t, resp1, "rejected by the test")
	logs.await(t, "Envoy rejected secrets (NACK); not sending them again until they change", 1)
	rotate(t, clk, a)
	_, pushed = sotw.next(t)
	if pushed["default"] == nil {
		t.Fatalf("after the NACK: %d secrets, none of them default", len(pushed))
	}
	serial2 := serialOf(workloadChain(t, pushed["default"]))
	if serial2 == serial1 {
		t.Fatal("the NACKed certificate was sent again")
	}
	if got := serialOf(workloadChain(t, delta.next(t)["default"])); got != serial2 {
		t.Fatalf("DeltaSecrets got %s on the second rotation, StreamSecrets %s", got, serial2)
	}
}

// Credential files swapped the Kubernetes way reach an open stream, each push a matching pair.
func TestFileModeSwapsArePushed(t *testing.T) {
	t.Parallel()
	const swaps = 10
	ca := testutil.NewRootCA(t, testutil.CAOptions{})
	id := "spiffe://cluster.local/ns/shop/sa/cart"
	clk := newFakeClock() // the file watcher debounces on it
	logs := newLogSink(t)
	cfg := testConfig(t, clk, logs)
	mount := testutil.NewSecretVolume(t, filepath.Join(t.TempDir(), "credentials"))
	first := newCredentials(t, ca, id)
	mount.Update(first.files)
	cfg.CredentialsDir = mount.Dir
	a := newAgent(t, cfg)
	if a.Source() != agent.SourceFiles {
		t.Fatalf("source %s, want files", a.Source())
	}
	runAgent(t, a)
	sotw := dialEnvoy(t, a.SocketPath()).streamSecrets(t, secretNames...)
	initial := sotw.collect(t)
	if got := serialOf(workloadChain(t, initial["default"])); got != first.serial {
		t.Fatalf("serves %s, want %s", got, first.serial)
	}

	for i := range swaps {
		want := newCredentials(t, ca, id)
		mount.Update(want.files)
		// Drive the debounce until the new pair arrives; anything pushed on the way must be a
		// matching pair too (workloadChain checks it).
		for {
			r := testutil.Drive(t, clk, 100*time.Millisecond, 0, sotw.recv)
			if r.err != nil {
				t.Fatalf("swap %d: %v", i+1, r.err)
			}
			sotw.ack(t, r.resp)
			pushed := sotw.secrets(t, r.resp)
			if pushed["default"] == nil {
				t.Fatalf("swap %d pushed %d secrets, none of them default", i+1, len(pushed))
			}
			got := serialOf(workloadChain(t, pushed["default"]))
			if got == want.serial {
				break
			}
			t.Logf("swap %d: pushed %s while waiting for %s", i+1, got, want.serial)
		}
	}
}

// debugSecrets is /debug/secrets, as an operator's script reads it.
type debugSecrets struct {
	Source  string `json:"source"`
	Secrets []struct {
		Name         string    `json:"name"`
		SPIFFEID     string    `json:"spiffe_id"`
		Serial       string    `json:"serial"`
		NotBefore    time.Time `json:"not_before"`
		NotAfter     time.Time `json:"not_after"`
		NextRotation time.Time `json:"next_rotation"`
		Roots        int       `json:"roots"`
		Source       string    `json:"source"`
		Streams      int       `json:"subscribed_streams"`
	} `json:"secrets"`
}

func TestDebugSecretsShowsSecretsAndStreams(t *testing.T) {
	t.Parallel()
	clk := newFakeClock()
	cfg := testConfig(t, clk, newLogSink(t))
	a := newAgent(t, cfg)
	runAgent(t, a)
	envoy := dialEnvoy(t, a.SocketPath())
	both := envoy.streamSecrets(t, secretNames...)
	chain := workloadChain(t, both.collect(t)["default"])
	envoy.streamSecrets(t, "ROOTCA").collect(t)
	envoy.deltaSecrets(t, "default").collect(t, 1) // SotW and delta number their streams apart

	code, body := httpGet(t, "http://"+a.DebugAddr()+"/debug/secrets")
	if code != http.StatusOK {
		t.Fatalf("/debug/secrets = %d %q", code, body)
	}
	var got debugSecrets
	if err := json.Unmarshal([]byte(body), &got); err != nil {
		t.Fatalf("/debug/secrets is not JSON: %v\n%s", err, body)
	}
	if got.Source != string(agent.SourceEmbeddedCA) {
		t.Errorf("source %q, want %s", got.Source, agent.SourceEmbeddedCA)
	}
	seen := map[string]bool{}
	for _, s := range got.Secrets {
		seen[s.Name] = true
		switch s.Name {
		case "default":
			leaf := chain[0]
			if s.SPIFFEID != embeddedID || s.Serial != serialOf(chain) || !s.NotAfter.Equal(leaf.NotAfter) || s.Source != "ca" {
				t.Errorf("default: %+v, want %s %s until %s from ca", s, embeddedID, serialOf(chain), leaf.NotAfter)
			}
			// Half of the lifetime, counted from when it was received (now: the clock stands still).
			if want := leaf.NotAfter.Add(-leaf.NotAfter.Sub(clk.Now()) / 2); !s.NextRotation.Equal(want) {
				t.Errorf("default: next rotation %s, want %s", s.NextRotation, want)
			}
			if s.Streams != 2 {
				t.Errorf("default: %d subscribed streams, want 2", s.Streams)
			}
		case "ROOTCA":
			if s.Roots != 1 || s.Streams != 2 {
				t.Errorf("ROOTCA: %d roots and %d subscribed streams, want 1 and 2", s.Roots, s.Streams)
			}
		default:
			t.Errorf("unexpected secret %q", s.Name)
		}
	}
	if !seen["default"] || !seen["ROOTCA"] {
		t.Fatalf("/debug/secrets lacks default or ROOTCA:\n%s", body)
	}
	if code, _ := httpGet(t, "http://"+a.StatusAddr()+"/debug/secrets"); code != http.StatusNotFound {
		t.Errorf("the status server answers /debug/secrets with %d, want 404: it is reachable off the host", code)
	}
}

func TestMetricsCountStreamsAndPushes(t *testing.T) {
	t.Parallel()
	a := newAgent(t, testConfig(t, newFakeClock(), newLogSink(t)))
	runAgent(t, a)
	envoy := dialEnvoy(t, a.SocketPath())
	envoy.streamSecrets(t, secretNames...).collect(t)
	envoy.deltaSecrets(t, "default").collect(t, 1)
	// Both secrets are cached now: a new stream gets them in one response, counted as two pushes.
	if resp, got := envoy.streamSecrets(t, secretNames...).next(t); len(got) != 2 {
		t.Fatalf("a stream opened once both secrets exist got %d of them in its first response (%v)", len(got), resp.GetVersionInfo())
	}

	_, metrics := httpGet(t, "http://"+a.StatusAddr()+"/metrics")
	for _, want := range []string{
		`meshid_sds_streams{protocol="sotw"} 2`,
		`meshid_sds_streams{protocol="delta"} 1`,
		"meshid_sds_secrets_pushed_total 5",
	} {
		if !strings.Contains(metrics, want+"\n") {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	if t.Failed() {
		t.Logf("/metrics:\n%s", metrics)
	}
}

// Cancelling Run with a stream open ends the stream and returns promptly with DrainDuration 0,
// leaving nothing that accepts connections on the socket.
func TestShutdownEndsOpenStreams(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t, newFakeClock(), newLogSink(t))
	cfg.DrainDuration = 0
	a := newAgent(t, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	sotw := dialEnvoy(t, a.SocketPath()).streamSecrets(t, secretNames...)
	sotw.collect(t)

	cancel()
	giveUp := time.NewTimer(wait) // generous: this is not a timing test
	defer giveUp.Stop()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-giveUp.C:
		t.Fatalf("Run still running %s after its context ended, with a stream open", wait)
	}
	select {
	case r := <-sotw.recv:
		if r.err == nil {
			t.Fatalf("the open stream received a response instead of ending")
		}
	case <-giveUp.C:
		t.Fatal("the open stream did not end")
	}
	if conn, err := net.Dial("unix", a.SocketPath()); err == nil {
		_ = conn.Close()
		t.Fatal("the SDS socket still accepts connections after Run returned")
	}
}
