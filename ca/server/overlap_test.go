package server_test

import (
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/ca/server"
	"github.com/meshid/meshid/internal/testutil"
)

func cacertsFiles(t *testing.T, signer, root *testutil.CA) map[string][]byte {
	t.Helper()
	return map[string][]byte{
		ca.CACertFile:    testutil.CertPEM(signer.Cert),
		ca.CAKeyFile:     testutil.KeyPEM(t, signer.Key),
		ca.CertChainFile: testutil.CertPEM(signer.Cert, root.Cert),
		ca.RootCertFile:  testutil.CertPEM(root.Cert),
	}
}

// Attack: a workload holding a leaf under a replaced root renewed it over mTLS, and so got a leaf
// under the new root, after --trust-bundle-overlap had ended: the root stayed in the pool until
// the key manager's next root check (an hour by default). The root is now checked per call.
func TestMTLSRefusesARootPastItsOverlap(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(time.Now().Truncate(time.Second))
	oldRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "old root"})
	oldInt := oldRoot.NewIntermediate(t, testutil.CAOptions{CommonName: "old intermediate"})
	newRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "new root"})
	newInt := newRoot.NewIntermediate(t, testutil.CAOptions{CommonName: "new intermediate"})
	cacerts, stateDir := filepath.Join(t.TempDir(), "cacerts"), t.TempDir()
	authority := ca.New(ca.Config{Clock: clk}, nil)
	start := func() {
		t.Helper()
		if _, err := ca.NewKeyManager(ca.KeyManagerConfig{
			Authority: authority, CACertsDir: cacerts, StateDir: stateDir, TrustBundleOverlap: time.Hour, Clock: clk,
		}); err != nil {
			t.Fatal(err)
		}
	}
	testutil.WriteFiles(t, cacerts, cacertsFiles(t, oldInt, oldRoot))
	start()
	leaf, key := oldInt.IssueWorkload(t, demoID(), 24*time.Hour)
	// The operator plugs in the new CA and restarts the CA: the old root is retained for an hour.
	testutil.WriteFiles(t, cacerts, cacertsFiles(t, newInt, newRoot))
	start()

	registry := prometheus.NewRegistry()
	metrics, err := server.NewMetrics(registry)
	if err != nil {
		t.Fatal(err)
	}
	logs := &testutil.SyncBuffer{}
	srv := server.New(server.Config{
		Signer:         authority,
		Authenticators: []server.Authenticator{server.NewMTLSAuthenticator(authority, trustDomain, clk)},
		Targeting:      controller.NewTargeting(controller.TargetingConfig{CANamespace: "istio-system", EnabledByDefault: true}),
		Metrics:        metrics,
		Logger:         slog.New(slog.NewTextHandler(logs, nil)),
	})
	addr := serveTLS(t, srv, authority, clk)
	pool := x509.NewCertPool()
	pool.AddCert(newRoot.Cert)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
		RootCAs: pool, ServerName: "istiod.istio-system.svc", MinVersion: tls.VersionTLS12, Time: clk.Now,
		Certificates: []tls.Certificate{*tlsCert([]*x509.Certificate{leaf, oldInt.Cert}, key)},
	})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	client := pb.NewIstioCertificateServiceClient(conn)

	clk.Advance(59 * time.Minute)
	if _, err := client.CreateCertificate(t.Context(), request(t, p256(t), []string{demoID()}, nil, 0)); err != nil {
		t.Fatalf("renewal within the overlap refused: %v", err)
	}
	// No root check has run since: the old root is still in the pool.
	clk.Advance(time.Minute)
	_, err = client.CreateCertificate(t.Context(), request(t, p256(t), []string{demoID()}, nil, 0))
	if status.Code(err) != codes.Unauthenticated || !strings.Contains(err.Error(), "trust overlap has ended") {
		t.Fatalf("renewal at the end of the overlap: %v, want Unauthenticated saying the overlap ended", err)
	}
	labels := map[string]string{"reason": "client_root_retired", "code": codes.Unauthenticated.String()}
	if got := promtest.ToFloat64(counter(t, registry, "meshid_ca_requests_refused_total", labels)); got != 1 {
		t.Fatalf("refusal counted %v times under %v, want 1", got, labels)
	}
	if got := strings.Count(logs.String(), "reason=client_root_retired"); got != 1 {
		t.Fatalf("refusal logged %d times, want once:\n%s", got, logs)
	}
}
