package envoytest_test

import (
	"context"
	"crypto/x509"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/meshid/meshid/internal/envoytest"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/secretmanager"
)

// fakeSecrets serves a workload key pair as "default" and a root as "ROOTCA", as the agent's
// secret manager does, and rotates the key pair on demand.
type fakeSecrets struct {
	t  *testing.T
	ca *testutil.CA

	mu      sync.Mutex
	secrets map[string]*secretmanager.Secret
	subs    map[string][]func(*secretmanager.Secret, error)
}

func newFakeSecrets(t *testing.T) *fakeSecrets {
	f := &fakeSecrets{t: t, ca: testutil.NewRootCA(t, testutil.CAOptions{}), secrets: map[string]*secretmanager.Secret{}, subs: map[string][]func(*secretmanager.Secret, error){}}
	f.secrets["ROOTCA"] = &secretmanager.Secret{
		Name: "ROOTCA", Bundle: &secretmanager.TrustBundle{Roots: []*x509.Certificate{f.ca.Cert}, PEM: testutil.CertPEM(f.ca.Cert)},
		Version: f.ca.Cert.SerialNumber.Text(16), Source: secretmanager.SourceCA,
	}
	f.secrets["default"] = f.issue()
	return f
}

func (f *fakeSecrets) issue() *secretmanager.Secret {
	leaf, key := f.ca.IssueWorkload(f.t, "spiffe://cluster.local/ns/ns/sa/app", time.Hour)
	return &secretmanager.Secret{
		Name:    "default",
		KeyPair: &secretmanager.KeyPair{Chain: []*x509.Certificate{leaf, f.ca.Cert}, ChainPEM: testutil.CertPEM(leaf, f.ca.Cert), Key: key, KeyPEM: testutil.KeyPEM(f.t, key)},
		Version: leaf.SerialNumber.Text(16), Source: secretmanager.SourceCA, Received: time.Now(),
	}
}

func (f *fakeSecrets) Subscribe(name string, fn func(*secretmanager.Secret, error)) (func(), error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.secrets[name]
	if !ok {
		return nil, fmt.Errorf("%w %q", secretmanager.ErrUnknownSecret, name)
	}
	f.subs[name] = append(f.subs[name], fn)
	fn(s, nil)
	return func() {}, nil
}

func (f *fakeSecrets) rotate() {
	s := f.issue()
	f.mu.Lock()
	f.secrets["default"] = s
	subs := f.subs["default"]
	f.mu.Unlock()
	for _, fn := range subs {
		fn(s, nil)
	}
}

// TestMeshidSDS runs the stand-in against meshid's own SDS server, as the agent serves it: the
// stand-in must reach LIVE on its secrets, take a rotation and never NACK, over both protocols.
func TestMeshidSDS(t *testing.T) {
	t.Parallel()
	for name, api := range map[string]corev3.ApiConfigSource_ApiType{"sotw": corev3.ApiConfigSource_GRPC, "delta": corev3.ApiConfigSource_DELTA_GRPC} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			secrets := newFakeSecrets(t)
			socket := filepath.Join(testutil.ShortTempDir(t), "sds", sds.SocketName)
			server, err := sds.New(sds.Config{SocketPath: socket, Secrets: secrets, Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- server.Run(ctx) }()
			t.Cleanup(func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("SDS Run: %v", err)
				}
			})

			cp := newControlPlane(t)
			p := envoytest.Start(t, "-c", envoytest.WriteBootstrap(t, envoytest.NewBootstrap(t, nodeID, cp.ads, socket)))
			res := meshOver(t, api)
			delete(res, resource.SecretType)
			cp.set(t, "1", res)
			waitState(t, p.Admin, "LIVE")

			secrets.rotate()
			waitStat(t, p.Admin, "sds.default.update_success", 2)
			stats, err := p.Admin.Stats(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if stats["sds.default.update_rejected"] != 0 || stats["sds.ROOTCA.update_rejected"] != 0 || stats["sds.ROOTCA.update_success"] != 1 {
				t.Errorf("SDS stats %v: want no rejection and ROOTCA once", stats)
			}
		})
	}
}
