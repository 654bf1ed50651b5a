// Package controlplanetest runs a real meshid control plane for tests, as httptest runs a real
// HTTP server. Only _test.go files import it.
package controlplanetest

import (
	"context"
	"testing"
	"time"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/controlplane"
)

// Config returns a control-plane configuration with a fresh state dir and both servers on
// 127.0.0.1 ports chosen by the kernel.
func Config(t testing.TB) controlplane.Config {
	t.Helper()
	cfg := controlplane.DefaultConfig()
	cfg.StateDir = t.TempDir()
	cfg.GRPCAddr = "127.0.0.1:0"
	cfg.MonitoringAddr = "127.0.0.1:0"
	return cfg
}

// Start builds a control plane from cfg, runs it until the test ends, and returns once it serves.
func Start(t testing.TB, cfg controlplane.Config) *controlplane.ControlPlane {
	t.Helper()
	cp, err := controlplane.New(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- cp.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("control plane Run: %v", err)
		}
	})
	select {
	case <-cp.Ready():
	case err := <-done:
		done <- err // for the cleanup
		t.Fatalf("control plane ended before serving: %v", err)
	}
	return cp
}

// Token mints a service-account token for ns/sa, audience istio-ca, with the local token key of
// the control plane whose state dir is stateDir.
func Token(t testing.TB, stateDir, ns, sa string, now time.Time, ttl time.Duration) string {
	t.Helper()
	minter, err := token.LoadMinter(ca.TokenKeyPath(stateDir))
	if err != nil {
		t.Fatal(err)
	}
	tok, err := minter.Mint(token.MintParams{
		Issuer: token.DefaultIssuer, Audiences: []string{token.DefaultAudience},
		Namespace: ns, ServiceAccount: sa, TTL: ttl, Now: now,
	})
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// Embed is the agent's embedded control plane, as `meshid agent` supplies it.
func Embed(e agent.EmbedConfig) (agent.ControlPlane, error) {
	cp, err := controlplane.NewEmbedded(controlplane.EmbeddedConfig{
		StateDir: e.StateDir, SocketPath: e.SocketPath, TrustDomain: e.TrustDomain,
		Identity: e.Identity, NodeAgent: e.NodeAgent, Clock: e.Clock, Logger: e.Logger,
	})
	if err != nil {
		return nil, err
	}
	return cp, nil
}
