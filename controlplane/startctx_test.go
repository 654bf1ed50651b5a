package controlplane_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/testutil"
)

// silentListener accepts connections and never answers on them: an upstream CA that hangs. It
// tells accepted of each connection.
func silentListener(t *testing.T) (addr string, accepted <-chan struct{}) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ch := make(chan struct{}, 16)
	done := make(chan struct{})
	go func() {
		defer close(done)
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				_ = c.Close()
			}
		}()
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
			select {
			case ch <- struct{}{}:
			default:
			}
		}
	}()
	t.Cleanup(func() {
		_ = lis.Close()
		<-done
	})
	return lis.Addr().String(), ch
}

// silentKubeconfig is a kubeconfig of an API server at addr that never answers.
func silentKubeconfig(t *testing.T, addr string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, fmt.Appendf(nil, `apiVersion: v1
kind: Config
clusters: [{name: silent, cluster: {server: "https://%s", insecure-skip-tls-verify: true}}]
users: [{name: ca, user: {token: a.b.c}}]
contexts: [{name: silent, context: {cluster: silent, user: ca}}]
current-context: silent
`, addr), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// A CA whose start waits on a peer that never answers (its upstream CA's first certificate; on
// Kubernetes the cacerts Secret, or with mounted cacerts the JWT-SVID key's Secret), started with
// a context that is cancelled while it waits (SIGTERM at start), returns at once with
// context.Canceled, not after its start timeout.
func TestNewReturnsWhenItsContextEndsWhileAPeerHangs(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		configure func(t *testing.T, cfg *controlplane.Config, addr string)
	}{
		{"upstream CA", func(t *testing.T, cfg *controlplane.Config, addr string) {
			dir := t.TempDir()
			root := filepath.Join(dir, "upstream-root.pem")
			if err := os.WriteFile(root, testutil.CertPEM(testutil.NewRootCA(t, testutil.CAOptions{}).Cert), 0o600); err != nil {
				t.Fatal(err)
			}
			token := filepath.Join(dir, "upstream-token")
			if err := os.WriteFile(token, []byte("a.b.c"), 0o600); err != nil {
				t.Fatal(err)
			}
			cfg.Upstream.Address, cfg.Upstream.RootCertFile, cfg.Upstream.TokenPath = addr, root, token
			cfg.Upstream.StartTimeout = time.Hour // far past the test's limit below
		}},
		{"Kubernetes cacerts Secret", func(t *testing.T, cfg *controlplane.Config, addr string) {
			cfg.Kubernetes = controlplane.KubernetesConfig{Kubeconfig: silentKubeconfig(t, addr), Identity: "replica-1", StartTimeout: time.Hour}
		}},
		{"Kubernetes JWT-SVID key Secret", func(t *testing.T, cfg *controlplane.Config, addr string) {
			// Mounted cacerts: the key material needs no Secret, the JWT-SVID key does.
			root := testutil.NewRootCA(t, testutil.CAOptions{})
			cfg.CACertsDir = t.TempDir()
			testutil.WriteFiles(t, cfg.CACertsDir, cacertsFiles(t, root.NewIntermediate(t, testutil.CAOptions{}), root))
			cfg.Kubernetes = controlplane.KubernetesConfig{Kubeconfig: silentKubeconfig(t, addr), Identity: "replica-1", StartTimeout: time.Hour}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			addr, accepted := silentListener(t)
			cfg := testConfig(t.TempDir())
			tt.configure(t, &cfg, addr)
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			type result struct {
				cp  *controlplane.ControlPlane
				err error
			}
			done := make(chan result, 1)
			go func() {
				cp, err := controlplane.New(ctx, cfg)
				done <- result{cp, err}
			}()
			select {
			case <-accepted: // New waits on the peer now
			case r := <-done:
				t.Fatalf("New returned before asking the peer: %v", r.err)
			case <-time.After(30 * time.Second):
				t.Fatal("New never reached the peer")
			}
			cancel()
			select {
			case r := <-done:
				if r.err == nil {
					r.cp.Close()
				}
				if !errors.Is(r.err, context.Canceled) {
					t.Fatalf("New: %v, want context.Canceled", r.err)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("New went on waiting for the peer after its context was cancelled")
			}
		})
	}
}
