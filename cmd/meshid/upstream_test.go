package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshid/meshid/cmd/internal/cli"
	"github.com/meshid/meshid/internal/testutil"
)

// The upstream CA's flags are refused before anything runs, exit 2, naming the flag, when they
// contradict each other or one would do nothing.
func TestUpstreamFlagsRefused(t *testing.T) {
	t.Parallel()
	base := func(dir string, more ...string) []string {
		return append([]string{"ca", "--state-dir", filepath.Join(dir, "state"), "--grpc-addr", "127.0.0.1:0", "--monitoring-addr", ""}, more...)
	}
	rootFile := func(t *testing.T, dir string) string {
		t.Helper()
		path := filepath.Join(dir, "root.pem")
		if err := os.WriteFile(path, testutil.CertPEM(testutil.NewRootCA(t, testutil.CAOptions{}).Cert), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	tests := []struct {
		name string
		args func(t *testing.T, dir string) []string
		want []string
	}{
		{"upstream and cacerts", func(t *testing.T, dir string) []string {
			return base(dir, "--upstream-ca-address", "127.0.0.1:15012", "--upstream-ca-root-cert", rootFile(t, dir),
				"--upstream-token-path", filepath.Join(dir, "token"), "--cacerts-dir", dir)
		}, []string{"--cacerts-dir", "--upstream-ca-address", "choose one"}},
		{"upstream without root and token", func(_ *testing.T, dir string) []string {
			return base(dir, "--upstream-ca-address", "127.0.0.1:15012")
		}, []string{"--upstream-ca-root-cert is required", "--upstream-token-path is required"}},
		{"upstream root missing", func(_ *testing.T, dir string) []string {
			return base(dir, "--upstream-ca-address", "127.0.0.1:15012", "--upstream-ca-root-cert", filepath.Join(dir, "nope.pem"),
				"--upstream-token-path", filepath.Join(dir, "token"))
		}, []string{"--upstream-ca-root-cert", "nope.pem"}},
		{"upstream address bad", func(t *testing.T, dir string) []string {
			return base(dir, "--upstream-ca-address", "https://upstream", "--upstream-ca-root-cert", rootFile(t, dir),
				"--upstream-token-path", filepath.Join(dir, "token"))
		}, []string{"--upstream-ca-address", "https://upstream"}},
		{"root cert without upstream", func(t *testing.T, dir string) []string {
			return base(dir, "--upstream-ca-root-cert", rootFile(t, dir))
		}, []string{"--upstream-ca-root-cert needs --upstream-ca-address"}},
		{"token without upstream", func(_ *testing.T, dir string) []string {
			return base(dir, "--upstream-token-path", filepath.Join(dir, "token"))
		}, []string{"--upstream-token-path needs --upstream-ca-address"}},
		{"requested TTL without upstream", func(_ *testing.T, dir string) []string {
			return base(dir, "--requested-ca-cert-ttl", "48h")
		}, []string{"--requested-ca-cert-ttl needs --upstream-ca-address"}},
		{"identities without signing", func(_ *testing.T, dir string) []string {
			return base(dir, "--ca-cert-identities", "spiffe://cluster.local/ns/a/sa/b")
		}, []string{"--ca-cert-identities needs --sign-ca-certs"}},
		{"signing without identities", func(_ *testing.T, dir string) []string {
			return base(dir, "--sign-ca-certs")
		}, []string{"--sign-ca-certs needs --ca-cert-identities"}},
		{"signing under an upstream", func(t *testing.T, dir string) []string {
			return base(dir, "--sign-ca-certs", "--ca-cert-identities", "spiffe://cluster.local/ns/a/sa/b", "--upstream-ca-address", "127.0.0.1:15012",
				"--upstream-ca-root-cert", rootFile(t, dir), "--upstream-token-path", filepath.Join(dir, "token"))
		}, []string{"--sign-ca-certs with --upstream-ca-address", "path length 0"}},
		{"identity not a SPIFFE ID", func(_ *testing.T, dir string) []string {
			return base(dir, "--sign-ca-certs", "--ca-cert-identities", "spiffe://cluster.local/ns/a/sa/b,istio-ca")
		}, []string{"--ca-cert-identities", "istio-ca"}},
		{"identity of another trust domain", func(_ *testing.T, dir string) []string {
			return base(dir, "--sign-ca-certs", "--ca-cert-identities", "spiffe://other.example/ns/a/sa/b")
		}, []string{"--ca-cert-identities", "other.example", "cluster.local"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			code, stderr := mainMeshid(t, nil, tt.args(t, testutil.ShortTempDir(t))...)
			var missing []string
			for _, w := range tt.want {
				if !strings.Contains(stderr, w) {
					missing = append(missing, w)
				}
			}
			if code != cli.ExitUsage || len(missing) > 0 {
				t.Errorf("exit code %d, want %d; stderr does not say %q:\n%s", code, cli.ExitUsage, missing, stderr)
			}
		})
	}
}
