package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/agent/envoy/bootstrapcheck"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/pki"
)

// execute runs the meshid command line with args, capturing the CA config instead of running it.
func execute(t *testing.T, args ...string) (controlplane.Config, string, string, error) {
	t.Helper()
	var got controlplane.Config
	root := newRootCommand(func(_ context.Context, cfg controlplane.Config) error {
		got = cfg
		return nil
	}, func(context.Context, agent.Config) error { return nil }, func(string) (string, bool) { return "", false }, nil)
	var stdout, stderr bytes.Buffer
	root.SetOut(&stdout)
	root.SetErr(&stderr)
	root.SetArgs(args)
	err := root.ExecuteContext(t.Context())
	return got, stdout.String(), stderr.String(), err
}

func TestCAFlagsBuildConfig(t *testing.T) {
	t.Parallel()
	cfg, _, _, err := execute(t, "ca", "--state-dir", "/tmp/x")
	if err != nil {
		t.Fatal(err)
	}
	want := controlplane.DefaultConfig()
	if cfg.StateDir != "/tmp/x" || cfg.GRPCAddr != want.GRPCAddr || cfg.MonitoringAddr != want.MonitoringAddr ||
		cfg.TrustDomain != "cluster.local" || cfg.JWTAudience != "istio-ca" || !cfg.EnableNamespacesByDefault ||
		cfg.WorkloadCertTTL != 24*time.Hour || cfg.MaxWorkloadCertTTL != 2160*time.Hour || cfg.JWTSVIDTTL != 5*time.Minute ||
		cfg.SelfSigned.KeyAlgorithm != pki.ECDSA || cfg.CANamespace != "istio-system" || cfg.Logger == nil ||
		cfg.XDSMaxStreams != 10000 || cfg.XDSMaxStreamsPerCredential != 100 || cfg.MaxConnectionAge != 30*time.Minute ||
		cfg.MaxConnectionAgeGrace != 10*time.Second {
		t.Fatalf("defaults not applied: %+v", cfg)
	}

	cfg, _, _, err = execute(t, "ca", "--state-dir", "/s", "--cacerts-dir", "/c", "--grpc-addr", "127.0.0.1:0",
		"--monitoring-addr", "", "--trust-domain", "example.org", "--jwt-keys", "/k.pem", "--jwt-audience", "aud",
		"--jwt-issuer", "iss", "--ca-namespace", "mesh", "--enable-namespaces-by-default=false",
		"--workload-cert-ttl", "1h", "--max-workload-cert-ttl", "2h", "--self-signed-ca-cert-ttl", "48h",
		"--self-signed-ca-org", "Org", "--grpc-host-identities", "ca.example.org, 10.0.0.1,", "--log-format", "json",
		"--root-check-interval", "10m", "--root-rotation-threshold", "0.3", "--trust-bundle-overlap", "72h",
		"--xds-config", "/x.yaml", "--xds-max-streams", "500", "--xds-max-streams-per-credential", "5", "--max-connection-age", "1h", "--jwt-svid-ttl", "2m")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.CACertsDir != "/c" || cfg.GRPCAddr != "127.0.0.1:0" || cfg.MonitoringAddr != "" || cfg.TrustDomain != "example.org" ||
		cfg.JWTKeysFile != "/k.pem" || cfg.JWTAudience != "aud" || cfg.JWTIssuer != "iss" || cfg.CANamespace != "mesh" ||
		cfg.EnableNamespacesByDefault || cfg.WorkloadCertTTL != time.Hour || cfg.MaxWorkloadCertTTL != 2*time.Hour ||
		cfg.JWTSVIDTTL != 2*time.Minute || cfg.SelfSigned.TTL != 48*time.Hour || cfg.SelfSigned.Org != "Org" ||
		strings.Join(cfg.GRPCHostIdentities, ",") != "ca.example.org,10.0.0.1" ||
		cfg.RootCheckInterval != 10*time.Minute || cfg.RootRotationThreshold != 0.3 || cfg.TrustBundleOverlap != 72*time.Hour ||
		cfg.XDSMaxStreams != 500 || cfg.XDSMaxStreamsPerCredential != 5 || cfg.MaxConnectionAge != time.Hour {
		t.Fatalf("flags not applied: %+v", cfg)
	}
}

func TestCAKeyFlags(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		args    []string
		alg     pki.KeyAlgorithm
		size    int
		wantErr string
	}{
		{"default", nil, pki.ECDSA, 2048, ""},
		{"key size implies RSA", []string{"--key-size", "4096"}, pki.RSA, 4096, ""},
		{"explicit RSA", []string{"--key-algorithm", "rsa"}, pki.RSA, 2048, ""},
		{"ECDSA with a key size", []string{"--key-algorithm", "ECDSA", "--key-size", "4096"}, "", 0, "applies to RSA keys only"},
		{"RSA too small", []string{"--key-size", "1024"}, "", 0, "--key-size: RSA key size 1024 out of range [2048, 8192]"},
		{"unknown algorithm", []string{"--key-algorithm", "dsa"}, "", 0, "unknown key algorithm"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg, _, _, err := execute(t, append([]string{"ca", "--state-dir", "/s"}, tt.args...)...)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if cfg.SelfSigned.KeyAlgorithm != tt.alg || cfg.SelfSigned.RSAKeySize != tt.size {
				t.Fatalf("key %s/%d, want %s/%d", cfg.SelfSigned.KeyAlgorithm, cfg.SelfSigned.RSAKeySize, tt.alg, tt.size)
			}
		})
	}
}

func TestBadInputIsRefusedBeforeRunning(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"log level", []string{"ca", "--log-level", "loud"}, "--log-level"},
		{"log format", []string{"version", "--log-format", "xml"}, "--log-format"},
		{"grpc addr", []string{"ca", "--grpc-addr", "nope"}, "--grpc-addr"},
		{"rotation threshold", []string{"ca", "--root-rotation-threshold", "1.5"}, "--root-rotation-threshold"},
		{"rotation threshold NaN", []string{"ca", "--root-rotation-threshold", "NaN"}, "--root-rotation-threshold"},
		{"negative overlap", []string{"ca", "--trust-bundle-overlap", "-1h"}, "--trust-bundle-overlap"},
		{"no discovery streams", []string{"ca", "--xds-max-streams", "0"}, "--xds-max-streams"},
		{"no discovery streams per credential", []string{"ca", "--xds-max-streams-per-credential", "0"}, "--xds-max-streams-per-credential"},
		{"no connection age", []string{"ca", "--max-connection-age", "0s"}, "--max-connection-age"},
		{"positional argument", []string{"ca", "extra"}, "unknown command"},
		{"token without identity", []string{"token", "--state-dir", "/s"}, "--namespace and --service-account are required"},
		{"token with bad ttl", []string{"token", "--namespace", "a", "--service-account", "b", "--ttl", "-1s"}, "--ttl"},
		{"probe without addr", []string{"probe"}, "addr"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, _, _, err := execute(t, tt.args...)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one mentioning %q", err, tt.want)
			}
		})
	}
}

func TestTokenCommand(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	key, _, err := token.LoadOrCreateKey(filepath.Join(dir, "token-key.pem"))
	if err != nil {
		t.Fatal(err)
	}
	keys, err := token.NewKeySet(key.Public())
	if err != nil {
		t.Fatal(err)
	}
	verifier, err := token.NewVerifier(token.VerifierConfig{Keys: keys, Audience: "istio-ca"})
	if err != nil {
		t.Fatal(err)
	}
	checkToken := func(raw, wantNS, wantSA string) {
		t.Helper()
		claims, err := verifier.Verify(strings.TrimSpace(raw))
		if err != nil {
			t.Fatalf("minted token does not verify: %v", err)
		}
		ns, sa, err := claims.ServiceAccount()
		if err != nil || ns != wantNS || sa != wantSA {
			t.Fatalf("token for %s/%s (%v), want %s/%s", ns, sa, err, wantNS, wantSA)
		}
		if got := claims.ExpiresAt.Sub(claims.IssuedAt.Time); got != 10*time.Minute {
			t.Fatalf("token lifetime %s, want 10m", got)
		}
	}

	_, stdout, _, err := execute(t, "token", "--state-dir", dir, "--namespace", "default", "--service-account", "demo", "--ttl", "10m")
	if err != nil {
		t.Fatal(err)
	}
	checkToken(stdout, "default", "demo")

	out := filepath.Join(dir, "istio-token")
	keyFile := filepath.Join(dir, "token-key.pem")
	if _, _, _, err := execute(t, "token", "--key", keyFile, "--namespace", "vm", "--service-account", "web", "--ttl", "10m", "-o", out); err != nil {
		t.Fatal(err)
	}
	info, err := os.Stat(out)
	if err != nil {
		t.Fatal(err)
	}
	if info.Mode().Perm() != 0o600 {
		t.Fatalf("token file mode %v, want 0600", info.Mode().Perm())
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	checkToken(string(data), "vm", "web")

	empty := t.TempDir()
	if _, _, _, err := execute(t, "token", "--state-dir", empty, "--namespace", "a", "--service-account", "b"); err == nil ||
		!strings.Contains(err.Error(), "start `meshid ca --state-dir "+empty+"` once") {
		t.Fatalf("missing key: %v, want a hint to start meshid ca on %s", err, empty)
	}
	// The hint is for a state dir without a key, not for a bad key nor for --key.
	if err := os.WriteFile(filepath.Join(empty, "token-key.pem"), []byte("not a key"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"--state-dir", empty}, {"--key", filepath.Join(empty, "missing.pem")}} {
		_, _, _, err := execute(t, append([]string{"token", "--namespace", "a", "--service-account", "b"}, args...)...)
		if err == nil || strings.Contains(err.Error(), "start `meshid ca") {
			t.Fatalf("token %v: %v, want an error without the hint", args, err)
		}
	}
}

func TestProbe(t *testing.T) {
	t.Parallel()
	ready := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/healthz/ready" {
			http.NotFound(w, r)
			return
		}
		_, _ = w.Write([]byte("ready"))
	}))
	t.Cleanup(ready.Close)
	notReady := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "not ready: no certificate yet", http.StatusServiceUnavailable)
	}))
	t.Cleanup(notReady.Close)
	closed := httptest.NewServer(http.NotFoundHandler())
	closedAddr := closed.Listener.Addr().String()
	closed.Close()
	// silent accepts connections and never answers; garbage answers something that is not HTTP.
	silent := listen(t, func(net.Conn) {})
	garbage := listen(t, func(c net.Conn) { _, _ = c.Write([]byte("SSH-2.0-OpenSSH_9.6\r\n")) })

	tests := []struct {
		name string
		args []string
		want string // "" means success
	}{
		{"ready", []string{"--addr", ready.Listener.Addr().String()}, ""},
		{"other path", []string{"--addr", ready.Listener.Addr().String(), "--path", "healthz"}, "404"},
		{"not ready", []string{"--addr", notReady.Listener.Addr().String()}, "503 Service Unavailable: not ready: no certificate yet"},
		{"nothing listening", []string{"--addr", closedAddr}, "connection refused"},
		{"no answer", []string{"--addr", silent, "--timeout", "50ms"}, "i/o timeout"},
		{"not HTTP", []string{"--addr", garbage}, "malformed HTTP"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, _, _, err := execute(t, append([]string{"probe"}, tt.args...)...)
			if tt.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want %q", err, tt.want)
			}
		})
	}
}

// listen serves each connection on 127.0.0.1 with handle, holding it open until the test ends,
// and returns the address.
func listen(t *testing.T, handle func(net.Conn)) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { _ = c.Close() })
			handle(c)
		}
	}()
	return l.Addr().String()
}

func TestVersion(t *testing.T) {
	t.Parallel()
	_, stdout, _, err := execute(t, "version")
	if err != nil || !strings.HasPrefix(stdout, "meshid ") {
		t.Fatalf("version printed %q (%v)", stdout, err)
	}
}

// `meshid agent bootstrap` writes the bootstrap of the agent the same flags describe.
func TestAgentBootstrapCommand(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	_, stdout, stderr, err := execute(t, "agent", "bootstrap", "--root-dir", root)
	if err != nil {
		t.Fatalf("%v\n%s", err, stderr)
	}
	if !json.Valid([]byte(stdout)) || !strings.Contains(stdout, `"path": "`+filepath.Join(root, agent.DefaultSocketDir, "socket")+`"`) {
		t.Errorf("not the bootstrap of an agent under %s:\n%s", root, stdout)
	}

	// meshid links Envoy's types: it merges an override, and checks the result.
	override := filepath.Join(root, "override.yaml")
	if err := os.WriteFile(override, []byte("admin: {address: {socket_address: {port_value: 16000}}}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, stdout, stderr, err = execute(t, "agent", "bootstrap", "--root-dir", root, "--bootstrap-override", override)
	if err != nil || !strings.Contains(stdout, `"portValue": 16000`) {
		t.Errorf("--bootstrap-override not merged (%v):\n%s\n%s", err, stdout, stderr)
	}
	if err := bootstrapcheck.Check([]byte(stdout)); err != nil {
		t.Errorf("the merged bootstrap: %v", err)
	}
}

// The agent meshid runs merges the override of the Envoy it starts itself.
func TestAgentMergesTheBootstrapOverride(t *testing.T) {
	t.Parallel()
	var got agent.Config
	root := newRootCommand(nil, func(_ context.Context, cfg agent.Config) error { got = cfg; return nil },
		func(string) (string, bool) { return "", false }, nil)
	root.SetArgs([]string{"agent", "--root-dir", t.TempDir(), "--status-addr", "127.0.0.1:0"})
	if err := root.ExecuteContext(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got.Envoy.CheckBootstrap == nil {
		t.Error("the agent's Envoy.CheckBootstrap is nil: an Envoy it runs would be given the override unmerged")
	}
}
