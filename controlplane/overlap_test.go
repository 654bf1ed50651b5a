package controlplane_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// runUntilStopped runs a control plane on cfg until the returned stop is called.
func runUntilStopped(t *testing.T, cfg controlplane.Config) (*controlplane.ControlPlane, func()) {
	t.Helper()
	cp, err := controlplane.New(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- cp.Run(ctx) }()
	select {
	case <-cp.Ready():
	case err := <-done:
		cancel()
		t.Fatalf("control plane ended before serving: %v", err)
	}
	return cp, func() {
		t.Helper()
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("Run: %v", err)
		}
	}
}

// renew asks cp for a certificate for default/demo as Istio's agent does, with a bearer token or
// a client certificate, seeing the time of clk.
func renew(t *testing.T, cp *controlplane.ControlPlane, stateDir string, clk *testutil.FakeClock, tok string, client *tls.Certificate) (*tls.Certificate, error) {
	t.Helper()
	rootPEM, err := os.ReadFile(filepath.Join(stateDir, ca.RootCertFile))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(rootPEM)
	cfg := &tls.Config{RootCAs: pool, ServerName: "istiod.istio-system.svc", MinVersion: tls.VersionTLS12, Time: clk.Now}
	if client != nil {
		cfg.Certificates = []tls.Certificate{*client}
	}
	conn, err := grpc.NewClient(cp.GRPCAddr(), grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	id, err := pki.NewSPIFFEID("cluster.local", "default", "demo")
	if err != nil {
		t.Fatal(err)
	}
	csr, err := pki.CreateCSR(key, id)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if tok != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	}
	resp, err := pb.NewIstioCertificateServiceClient(conn).CreateCertificate(ctx, &pb.IstioCertificateRequest{Csr: string(csr)})
	if err != nil {
		return nil, err
	}
	issued := &tls.Certificate{PrivateKey: key}
	for _, p := range resp.CertChain[:len(resp.CertChain)-1] {
		certs, err := pki.ParseCertificates([]byte(p))
		if err != nil {
			t.Fatal(err)
		}
		issued.Certificate = append(issued.Certificate, certs[0].Raw)
	}
	return issued, nil
}

// Attack: a CA restarted more often than --trust-bundle-overlap (a crash loop, a daily rollout)
// counted the overlap afresh at each start, and so renewed client certificates under a replaced
// root for ever. The replacement time now survives restarts.
func TestRestartsDoNotExtendTheOverlap(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(time.Now().Truncate(time.Second))
	oldRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "old root"})
	oldInt := oldRoot.NewIntermediate(t, testutil.CAOptions{CommonName: "old intermediate"})
	newRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "new root"})
	newInt := newRoot.NewIntermediate(t, testutil.CAOptions{CommonName: "new intermediate"})
	cacerts := func(signer, root *testutil.CA) map[string][]byte {
		return map[string][]byte{
			ca.CACertFile:    testutil.CertPEM(signer.Cert),
			ca.CAKeyFile:     testutil.KeyPEM(t, signer.Key),
			ca.CertChainFile: testutil.CertPEM(signer.Cert, root.Cert),
			ca.RootCertFile:  testutil.CertPEM(root.Cert),
		}
	}
	base := t.TempDir()
	cfg := testConfig(filepath.Join(base, "state"))
	cfg.CACertsDir = filepath.Join(base, "cacerts")
	cfg.TrustBundleOverlap = time.Hour
	cfg.Clock = clk
	testutil.WriteFiles(t, cfg.CACertsDir, cacerts(oldInt, oldRoot))

	// A workload gets a certificate under the old root with its token.
	cp, stop := runUntilStopped(t, cfg)
	tok := controlplanetest.Token(t, cfg.StateDir, "default", "demo", clk.Now(), 24*time.Hour)
	held, err := renew(t, cp, cfg.StateDir, clk, tok, nil)
	if err != nil {
		t.Fatal(err)
	}
	stop()

	// The operator plugs in a new CA; the CA restarts every twenty minutes.
	testutil.WriteFiles(t, cfg.CACertsDir, cacerts(newInt, newRoot))
	replaced := clk.Now()
	for _, step := range []struct {
		after time.Duration
		want  codes.Code
	}{
		{0, codes.OK},
		{20 * time.Minute, codes.OK},
		{40 * time.Minute, codes.OK},
		{59 * time.Minute, codes.OK},
		{80 * time.Minute, codes.Unauthenticated},
		{100 * time.Minute, codes.Unauthenticated},
	} {
		clk.Set(replaced.Add(step.after))
		cp, stop := runUntilStopped(t, cfg)
		_, err := renew(t, cp, cfg.StateDir, clk, "", held)
		stop()
		if got := status.Code(err); got != step.want {
			t.Fatalf("renewal over mTLS with the old root's leaf, %s after the replacement (overlap 1h, restarted since): %v, want %v",
				step.after, err, step.want)
		}
	}
}
