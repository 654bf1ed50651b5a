package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/cmd/internal/cli"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/testutil"
)

// mainMeshid runs the meshid command line as the process does: through cli.Main, which chooses
// the exit code, and the production runners on a context that has already ended, so that a
// command they accept starts and stops at once. It returns the exit code and stderr.
func mainMeshid(t *testing.T, env map[string]string, args ...string) (int, string) {
	t.Helper()
	root := newRootCommand(func(ctx context.Context, cfg controlplane.Config) error {
		ctx, cancel := context.WithCancel(ctx)
		cancel()
		return runCA(ctx, cfg)
	}, func(ctx context.Context, cfg agent.Config) error {
		ctx, cancel := context.WithCancel(ctx)
		cancel()
		return cli.RunAgent(ctx, cfg)
	}, func(k string) (string, bool) { v, ok := env[k]; return v, ok }, nil)
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs(args)
	return cli.Main(root), out.String()
}

// probe returns the arguments of `meshid probe` with args.
func probe(args ...string) func(string) []string {
	return func(string) []string { return append([]string{"probe"}, args...) }
}

// A newcomer's mistakes are refused before anything runs, exit 2 (README: refused as called),
// with a message naming the flag and the value, rather than a failure once running (exit 1).
func TestMistakesExitTwo(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		args func(dir string) []string // dir: a fresh temp dir, short enough for sockets
		want []string                  // each in the message
	}{
		// Item 2: listen addresses are HOST:PORT with a port from 0 to 65535.
		{"CA gRPC port out of range", func(dir string) []string {
			return []string{"ca", "--state-dir", filepath.Join(dir, "state"), "--grpc-addr", "127.0.0.1:99999", "--monitoring-addr", ""}
		}, []string{"--grpc-addr", `"127.0.0.1:99999"`, "from 0 to 65535"}},
		{"CA monitoring port out of range", func(dir string) []string {
			return []string{"ca", "--state-dir", filepath.Join(dir, "state"), "--grpc-addr", "127.0.0.1:0", "--monitoring-addr", "127.0.0.1:99999"}
		}, []string{"--monitoring-addr", `"127.0.0.1:99999"`, "from 0 to 65535"}},
		{"CA gRPC address with a scheme", func(dir string) []string {
			return []string{"ca", "--state-dir", filepath.Join(dir, "state"), "--grpc-addr", "https://127.0.0.1:15012", "--monitoring-addr", ""}
		}, []string{"--grpc-addr", "https://", `give HOST:PORT, as in "127.0.0.1:15012"`}},
		// Item 6: the CA's directories exist; it used to fail once running, exit 1.
		{"CA cacerts dir missing", func(dir string) []string {
			return []string{"ca", "--state-dir", filepath.Join(dir, "state"), "--grpc-addr", "127.0.0.1:0", "--monitoring-addr", "", "--cacerts-dir", filepath.Join(dir, "cacerts")}
		}, []string{"--cacerts-dir", "cacerts: file does not exist"}},
		{"CA manifests missing", func(dir string) []string {
			return []string{"ca", "--state-dir", filepath.Join(dir, "state"), "--grpc-addr", "127.0.0.1:0", "--monitoring-addr", "", "--manifests", filepath.Join(dir, "manifests")}
		}, []string{"--manifests", "manifests does not exist"}},
		{"CA both missing", func(dir string) []string {
			return []string{"ca", "--state-dir", filepath.Join(dir, "state"), "--grpc-addr", "127.0.0.1:0", "--monitoring-addr", "",
				"--manifests", filepath.Join(dir, "manifests"), "--cacerts-dir", filepath.Join(dir, "cacerts")}
		}, []string{"--manifests", "manifests does not exist", "--cacerts-dir", "cacerts: file does not exist"}},
		{"CA manifests a file", func(dir string) []string {
			return []string{"ca", "--state-dir", filepath.Join(dir, "state"), "--grpc-addr", "127.0.0.1:0", "--monitoring-addr", "", "--manifests", os.Args[0]}
		}, []string{"--manifests", "is not a directory"}},
		{"CA targets manifests missing", func(dir string) []string {
			return []string{"ca", "targets", "--manifests", filepath.Join(dir, "manifests")}
		}, []string{"--manifests", "manifests does not exist"}},
		// Item 1: `meshid agent --credentials-dir <typo>` used to run the embedded CA and serve
		// spiffe://cluster.local/ns/default/sa/default instead of the credentials meant.
		{"agent credentials dir typo", func(dir string) []string {
			return []string{"agent", "--root-dir", dir, "--status-addr", "127.0.0.1:0", "--debug-addr", "", "--credentials-dir", filepath.Join(dir, "credentals-typo")}
		}, []string{"--credentials-dir", "credentals-typo does not exist"}},
		// Node mode's Kubernetes source: a node, and exactly one API.
		{"agent pods without a node", func(dir string) []string {
			return []string{"agent", "--root-dir", dir, "--status-addr", "127.0.0.1:0", "--debug-addr", "", "--workload-attestation-pods", "--in-cluster"}
		}, []string{"--node-name (NODE_NAME) is required with --workload-attestation-pods"}},
		{"agent pods without an API", func(dir string) []string {
			return []string{"agent", "--root-dir", dir, "--status-addr", "127.0.0.1:0", "--debug-addr", "", "--workload-attestation-pods", "--node-name", "n1"}
		}, []string{"--workload-attestation-pods reads the pods from the Kubernetes API: give --kubeconfig or --in-cluster"}},
		{"agent pods with two APIs", func(dir string) []string {
			return []string{"agent", "--root-dir", dir, "--status-addr", "127.0.0.1:0", "--debug-addr", "", "--workload-attestation-pods", "--node-name", "n1",
				"--kubeconfig", filepath.Join(dir, "kubeconfig"), "--in-cluster"}
		}, []string{"--kubeconfig", "and --in-cluster both name the Kubernetes API: give one"}},
		{"agent pods with a kubeconfig that is not there", func(dir string) []string {
			return []string{"agent", "--root-dir", dir, "--status-addr", "127.0.0.1:0", "--debug-addr", "", "--workload-attestation-pods", "--node-name", "n1",
				"--kubeconfig", filepath.Join(dir, "kubeconfig")}
		}, []string{"--kubeconfig", "kubeconfig\": does not exist"}},
		{"agent kubeconfig without pods", func(dir string) []string {
			return []string{"agent", "--root-dir", dir, "--status-addr", "127.0.0.1:0", "--debug-addr", "", "--kubeconfig", filepath.Join(dir, "kubeconfig")}
		}, []string{"--kubeconfig", "is the API of --workload-attestation-pods, which is not set"}},
		{"agent in-cluster without pods", func(dir string) []string {
			return []string{"agent", "--root-dir", dir, "--status-addr", "127.0.0.1:0", "--debug-addr", "", "--in-cluster"}
		}, []string{"--in-cluster", "is the API of --workload-attestation-pods, which is not set"}},
		{"agent node name without pods", func(dir string) []string {
			return []string{"agent", "--root-dir", dir, "--status-addr", "127.0.0.1:0", "--debug-addr", "", "--node-name", "n1"}
		}, []string{"--node-name names the node whose pods --workload-attestation-pods reads, which is not given"}},
		{"agent pods with output certs", func(dir string) []string {
			return []string{"agent", "--root-dir", dir, "--status-addr", "127.0.0.1:0", "--debug-addr", "", "--workload-attestation-pods", "--node-name", "n1",
				"--in-cluster", "--output-certs", filepath.Join(dir, "out")}
		}, []string{"--workload-attestation-pods serves each caller its own identity, so there is no one key pair to write to --output-certs"}},
		// Item 2: the probe dials HOST:PORT.
		{"probe without a port", probe("--addr", "127.0.0.1"), []string{"--addr", `"127.0.0.1"`, "no port", "HOST:PORT"}},
		{"probe with a scheme", probe("--addr", "http://127.0.0.1:15020"), []string{"--addr", "http://", `give HOST:PORT, as in "127.0.0.1:15020"`}},
		// Item 5: the probe's flags are checked before it runs.
		{"probe without an address", probe(), []string{"--addr (or --probe-path) is required"}},
		{"probe file without an interval", probe("--probe-path", "/tmp/alive"), []string{"--interval must be positive with --probe-path"}},
		{"probe interval without a file", probe("--addr", "127.0.0.1:15020", "--interval", "1m"), []string{"--interval needs --probe-path"}},
		{"probe address and file", probe("--addr", "127.0.0.1:15020", "--probe-path", "/tmp/alive", "--interval", "1m"), []string{"give either --addr or --probe-path, not both"}},
		{"probe without time", probe("--addr", "127.0.0.1:15020", "--timeout", "0s"), []string{"--timeout 0s must be positive"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			code, stderr := mainMeshid(t, nil, tt.args(testutil.ShortTempDir(t))...)
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
