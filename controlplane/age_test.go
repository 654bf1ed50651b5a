package controlplane_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/internal/testutil"
)

// Attack (issue 24, item 2): a discovery stream opened with a credential that has since expired
// (a token past its exp, a client certificate whose root's overlap has ended) kept getting
// pushes for as long as it stayed open. Its connection now ends at --max-connection-age (plus
// the grace), and the reconnect is refused. The credential's expiry is on the fake clock; the
// connection's age is gRPC's own timer, in real time: the test waits for the stream's end, an
// event, within streamLimit.
func TestDiscoveryStreamsEndWhenTheirCredentialDoes(t *testing.T) {
	t.Parallel()
	withDiscovery := func(t *testing.T, cfg *controlplane.Config) {
		t.Helper()
		cfg.XDSConfig = filepath.Join(t.TempDir(), "xds.yaml")
		if err := os.WriteFile(cfg.XDSConfig, []byte("clusters: [{name: backend, connect_timeout: 1s}]"), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg.MaxConnectionAge, cfg.MaxConnectionAgeGrace = time.Second, time.Second
	}
	for _, tc := range []struct {
		name string
		// setup starts the control plane and returns it with the credential of the stream:
		// a token, or a client certificate.
		setup func(t *testing.T, clk *testutil.FakeClock) (cp *controlplane.ControlPlane, rootFile, tok string, client *tls.Certificate)
		// expire moves the clock past the credential's end.
		expire time.Duration
	}{
		{
			name: "a token that expires",
			setup: func(t *testing.T, clk *testutil.FakeClock) (*controlplane.ControlPlane, string, string, *tls.Certificate) {
				cfg := testConfig(t.TempDir())
				cfg.Clock = clk
				withDiscovery(t, &cfg)
				cp := start(t, cfg)
				return cp, filepath.Join(cfg.StateDir, ca.RootCertFile),
					controlplanetest.Token(t, cfg.StateDir, "default", "demo", clk.Now(), time.Hour), nil
			},
			expire: 2 * time.Hour,
		},
		{
			name: "a client certificate whose root's overlap ends",
			setup: func(t *testing.T, clk *testutil.FakeClock) (*controlplane.ControlPlane, string, string, *tls.Certificate) {
				oldRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "old root"})
				oldInt := oldRoot.NewIntermediate(t, testutil.CAOptions{CommonName: "old intermediate"})
				newRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "new root"})
				newInt := newRoot.NewIntermediate(t, testutil.CAOptions{CommonName: "new intermediate"})
				base := t.TempDir()
				cfg := testConfig(filepath.Join(base, "state"))
				cfg.CACertsDir = filepath.Join(base, "cacerts")
				cfg.TrustBundleOverlap = time.Hour
				cfg.Clock = clk
				testutil.WriteFiles(t, cfg.CACertsDir, cacertsFiles(t, oldInt, oldRoot))
				// A certificate under the old root, then the new CA plugged in.
				cp, stop := runUntilStopped(t, cfg)
				held, err := renew(t, cp, cfg.StateDir, clk, controlplanetest.Token(t, cfg.StateDir, "default", "demo", clk.Now(), time.Hour), nil)
				if err != nil {
					t.Fatal(err)
				}
				stop()
				testutil.WriteFiles(t, cfg.CACertsDir, cacertsFiles(t, newInt, newRoot))
				withDiscovery(t, &cfg)
				return start(t, cfg), filepath.Join(cfg.StateDir, ca.RootCertFile), "", held
			},
			expire: 2 * time.Hour,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			clk := testutil.NewFakeClock(time.Now().Truncate(time.Second))
			cp, rootFile, tok, client := tc.setup(t, clk)
			ads := adsClient(t, cp.GRPCAddr(), rootFile, clk, client)
			stream, _, err := firstClusters(t, ads, tok)
			if err != nil {
				t.Fatalf("the credential, still good: %v", err)
			}
			clk.Advance(tc.expire)
			// The stream gets nothing more; it ends with its connection.
			if resp, err := stream.Recv(); err == nil || status.Code(err) == codes.DeadlineExceeded {
				t.Fatalf("the stream of an expired credential: %v, %v; want it ended by the connection's age", resp, err)
			}
			if _, _, err := firstClusters(t, ads, tok); status.Code(err) != codes.Unauthenticated {
				t.Fatalf("the reconnect with the expired credential: %v, want Unauthenticated", err)
			}
		})
	}
}

// The gRPC port's transport bounds: a message over 4 MiB is refused before any handler runs
// (its headers too, over 64 KiB), whoever sends it.
func TestGRPCPortTransportBounds(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t.TempDir())
	cfg.XDSConfig = filepath.Join(t.TempDir(), "xds.yaml")
	if err := os.WriteFile(cfg.XDSConfig, []byte("clusters: [{name: backend, connect_timeout: 1s}]"), 0o600); err != nil {
		t.Fatal(err)
	}
	cp := start(t, cfg)
	ads := adsClient(t, cp.GRPCAddr(), filepath.Join(cfg.StateDir, ca.RootCertFile), nil, nil)
	tok := controlplanetest.Token(t, cfg.StateDir, "default", "demo", time.Now(), time.Hour)
	for _, tc := range []struct {
		name  string
		extra string // a header of this size besides the token
		names int    // resource names of 1 kB in the request
		want  codes.Code
	}{
		{"an ordinary request", "", 0, codes.OK},
		{"a request over 4 MiB", "", 5 << 10, codes.ResourceExhausted},
		{"headers over 64 KiB", strings.Repeat("h", 80<<10), 0, codes.Internal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(t.Context(), streamLimit)
			defer cancel()
			ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
			if tc.extra != "" {
				ctx = metadata.AppendToOutgoingContext(ctx, "x-padding", tc.extra)
			}
			stream, err := ads.StreamAggregatedResources(ctx)
			if err != nil {
				// The client knows the server's header limit, and keeps to it itself.
				if tc.extra == "" {
					t.Fatal(err)
				}
				return
			}
			names := make([]string, tc.names)
			for i := range names {
				names[i] = fmt.Sprintf("%04d-%s", i, strings.Repeat("n", 1<<10))
			}
			_ = stream.Send(&discoveryv3.DiscoveryRequest{Node: &corev3.Node{Id: "sidecar"}, TypeUrl: resource.ClusterType, ResourceNames: names})
			_, err = stream.Recv()
			if got := status.Code(err); got != tc.want {
				t.Fatalf("%s: %v, want %v", tc.name, err, tc.want)
			}
		})
	}
}
