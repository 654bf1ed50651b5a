package caclient_test

import (
	"context"
	"crypto/tls"
	"path/filepath"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/internal/testutil"
)

// The upstream connection authenticates as the CA client does: the token read for each stream,
// the server verified with the root file as it is at the handshake.
func TestDialUpstream(t *testing.T) {
	t.Parallel()
	f := startFake(t, answer("x"), "istiod.istio-system.svc")
	tokenFile := filepath.Join(t.TempDir(), "istio-token")
	writeFile(t, tokenFile, "first")
	conn, err := caclient.DialUpstream(caclient.UpstreamConfig{Address: f.addr, RootCertFile: f.rootFile, TokenPath: tokenFile, ClusterID: "Kubernetes"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	call := func() error {
		_, err := pb.NewIstioCertificateServiceClient(conn).CreateCertificate(context.Background(), &pb.IstioCertificateRequest{Csr: "x"})
		return err
	}
	if err := call(); err != nil {
		t.Fatal(err)
	}
	writeFile(t, tokenFile, "second")
	if err := call(); err != nil {
		t.Fatal(err)
	}
	calls := f.recorded()
	if got := []string{calls[0].md.Get("authorization")[0], calls[1].md.Get("authorization")[0]}; got[0] != "Bearer first" || got[1] != "Bearer second" {
		t.Errorf("tokens sent %v, want each stream to read the file", got)
	}
	if got := calls[0].md.Get("clusterid"); len(got) != 1 || got[0] != "Kubernetes" {
		t.Errorf("ClusterID %v", got)
	}
}

func TestDialUpstreamRefusals(t *testing.T) {
	t.Parallel()
	f := startFake(t, answer("x"), "istiod.istio-system.svc")
	other := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "another root"})
	otherRoot := filepath.Join(t.TempDir(), "root-cert.pem")
	writeFile(t, otherRoot, string(testutil.CertPEM(other.Cert)))
	for _, tt := range []struct {
		name string
		cfg  caclient.UpstreamConfig
		want codes.Code
	}{
		{"another root", caclient.UpstreamConfig{Address: f.addr, RootCertFile: otherRoot, Token: func(context.Context) (string, error) { return "t", nil }}, codes.Unavailable},
		{"another name", caclient.UpstreamConfig{Address: f.addr, RootCertFile: f.rootFile, ServerName: "evil.example", Token: func(context.Context) (string, error) { return "t", nil }}, codes.Unavailable},
		{"no token, no certificate", caclient.UpstreamConfig{Address: f.addr, RootCertFile: f.rootFile, TokenPath: filepath.Join(t.TempDir(), "missing"),
			ClientCertificate: func() *tls.Certificate { return nil }}, codes.Unauthenticated},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			conn, err := caclient.DialUpstream(tt.cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = conn.Close() }()
			_, err = pb.NewIstioCertificateServiceClient(conn).CreateCertificate(context.Background(), &pb.IstioCertificateRequest{Csr: "x"})
			if status.Code(err) != tt.want {
				t.Fatalf("error %v, want %v", err, tt.want)
			}
		})
	}
	if n := len(f.recorded()); n != 0 {
		t.Errorf("%d calls reached the server", n)
	}
}
