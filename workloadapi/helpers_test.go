package workloadapi_test

import (
	"context"
	"crypto"
	"crypto/x509"
	"log/slog"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/secretmanager"
	"github.com/meshid/meshid/workloadapi"
)

// waitLimit only bounds how long a broken test hangs: a response that never comes fails the test
// when its call's deadline passes. No test waits on the real clock otherwise.
const waitLimit = 30 * time.Second

const (
	dflt       = secretmanager.WorkloadCertName
	rootCA     = secretmanager.RootCertName
	workloadID = "spiffe://cluster.local/ns/shop/sa/cart"
)

// fakeSecrets is the secret source as the server sees it: the test publishes secrets and
// failures; like the secret manager, it tells each subscriber the current state before Subscribe
// returns, then every change, one call at a time.
type fakeSecrets struct {
	publishMu sync.Mutex // orders the calls to subscribers

	mu     sync.Mutex
	states map[string]fakeState
	subs   map[string]map[int]func(*secretmanager.Secret, error)
	next   int
}

type fakeState struct {
	secret *secretmanager.Secret
	err    error
}

func newFakeSecrets() *fakeSecrets {
	return &fakeSecrets{states: map[string]fakeState{}, subs: map[string]map[int]func(*secretmanager.Secret, error){}}
}

func (f *fakeSecrets) Publish(s *secretmanager.Secret) { f.set(s.Name, fakeState{secret: s}) }
func (f *fakeSecrets) Fail(name string, err error)     { f.set(name, fakeState{err: err}) }

func (f *fakeSecrets) set(name string, st fakeState) {
	f.publishMu.Lock()
	defer f.publishMu.Unlock()
	f.mu.Lock()
	f.states[name] = st
	subs := make([]func(*secretmanager.Secret, error), 0, len(f.subs[name]))
	for _, fn := range f.subs[name] {
		subs = append(subs, fn)
	}
	f.mu.Unlock()
	for _, fn := range subs {
		fn(st.secret, st.err)
	}
}

func (f *fakeSecrets) Subscribe(name string, fn func(*secretmanager.Secret, error)) (func(), error) {
	if name != dflt && name != rootCA {
		return nil, secretmanager.ErrUnknownSecret
	}
	f.publishMu.Lock()
	defer f.publishMu.Unlock()
	f.mu.Lock()
	id := f.next
	f.next++
	if f.subs[name] == nil {
		f.subs[name] = map[int]func(*secretmanager.Secret, error){}
	}
	f.subs[name][id] = fn
	st, known := f.states[name]
	f.mu.Unlock()
	if known {
		fn(st.secret, st.err)
	}
	return func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		delete(f.subs[name], id)
	}, nil
}

// testPKI issues workload key pairs under an intermediate of a test root, and trust bundles.
type testPKI struct {
	root, inter *testutil.CA
}

func newPKI(t testing.TB) *testPKI {
	t.Helper()
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	return &testPKI{root: root, inter: root.NewIntermediate(t, testutil.CAOptions{})}
}

// workload returns a new "default" key pair for id, its chain leaf, intermediate, root (as the
// CA's chain ends).
func (p *testPKI) workload(t testing.TB, id string) *secretmanager.Secret {
	t.Helper()
	leaf, key := p.inter.IssueWorkload(t, id, time.Hour)
	return keyPair(dflt, []*x509.Certificate{leaf, p.inter.Cert, p.root.Cert}, key)
}

func keyPair(name string, chain []*x509.Certificate, key crypto.Signer) *secretmanager.Secret {
	return &secretmanager.Secret{
		Name:    name,
		KeyPair: &secretmanager.KeyPair{Chain: chain, ChainPEM: testutil.CertPEM(chain...), Key: key},
		Version: chain[0].SerialNumber.Text(16),
		Source:  secretmanager.SourceCA,
	}
}

// bundle returns a ROOTCA trust bundle of roots.
func bundle(roots ...*x509.Certificate) *secretmanager.Secret {
	version := ""
	for _, r := range roots {
		version += r.SerialNumber.Text(16) + "."
	}
	return &secretmanager.Secret{
		Name:    rootCA,
		Bundle:  &secretmanager.TrustBundle{Roots: roots, PEM: testutil.CertPEM(roots...)},
		Version: version,
		Source:  secretmanager.SourceCA,
	}
}

// harness is a Workload API server on a gRPC server on a Unix socket, and a client of it.
type harness struct {
	server *workloadapi.Server
	reg    *prometheus.Registry
	logs   *testutil.SyncBuffer
	client workload.SpiffeWorkloadAPIClient
}

func start(t *testing.T, secrets workloadapi.Secrets, adjust ...func(*workloadapi.Config)) *harness {
	t.Helper()
	h := &harness{reg: prometheus.NewRegistry(), logs: &testutil.SyncBuffer{}}
	cfg := workloadapi.Config{
		Secrets:    secrets,
		Logger:     slog.New(slog.NewTextHandler(h.logs, nil)),
		Registerer: h.reg,
		Clock:      testutil.NewFakeClock(time.Now()),
	}
	for _, fn := range adjust {
		fn(&cfg)
	}
	var err error
	if h.server, err = workloadapi.New(cfg); err != nil {
		t.Fatal(err)
	}
	socket := filepath.Join(testutil.ShortTempDir(t), "socket")
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	grpcServer := grpc.NewServer()
	h.server.Register(grpcServer)
	served := make(chan error, 1)
	go func() { served <- grpcServer.Serve(lis) }()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		grpcServer.Stop()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	h.client = workload.NewSpiffeWorkloadAPIClient(conn)
	return h
}

// ctx is a call's context with the security header, bounded by waitLimit.
func ctx(t *testing.T) context.Context {
	t.Helper()
	c, cancel := context.WithTimeout(context.Background(), waitLimit)
	t.Cleanup(cancel)
	return metadata.AppendToOutgoingContext(c, "workload.spiffe.io", "true")
}

// bare is a call's context without the security header.
func bare(t *testing.T) context.Context {
	t.Helper()
	c, cancel := context.WithTimeout(context.Background(), waitLimit)
	t.Cleanup(cancel)
	return c
}

// metric reads a counter or gauge of the server's registry, its series of labels; 0 when it has
// none yet.
func (h *harness) metric(t *testing.T, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := h.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	next:
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if labels[l.GetName()] != l.GetValue() {
					continue next
				}
			}
			if m.GetCounter() != nil {
				return m.GetCounter().GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return 0
}

func (h *harness) refusals(t *testing.T, reason, code string) float64 {
	t.Helper()
	return h.metric(t, "meshid_agent_workload_api_refusals_total", map[string]string{"reason": reason, "code": code})
}

// bareWith is a call's context with one header of the test's choosing.
func bareWith(t *testing.T, key, value string) context.Context {
	t.Helper()
	return metadata.AppendToOutgoingContext(bare(t), key, value)
}
