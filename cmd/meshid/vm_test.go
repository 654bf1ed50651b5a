package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/cmd/internal/cli"
	"github.com/meshid/meshid/internal/testutil"
)

// vmStateDir is the state dir of a CA that has run once: its token key and trust bundle.
func vmStateDir(t *testing.T) (dir string, verifier *token.Verifier) {
	t.Helper()
	dir = t.TempDir()
	key, _, err := token.LoadOrCreateKey(filepath.Join(dir, "token-key.pem"))
	if err != nil {
		t.Fatal(err)
	}
	keys, err := token.NewKeySet(key.Public())
	if err != nil {
		t.Fatal(err)
	}
	verifier, err = token.NewVerifier(token.VerifierConfig{Keys: keys, Audience: token.DefaultAudience})
	if err != nil {
		t.Fatal(err)
	}
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	testutil.WriteFiles(t, dir, map[string][]byte{"root-cert.pem": testutil.CertPEM(root.Cert)})
	return dir, verifier
}

// The bundle holds a token for the VM's identity only its owner reads, the CA's roots and the
// agent's environment.
func TestVMBootstrapWritesTheBundle(t *testing.T) {
	t.Parallel()
	stateDir, verifier := vmStateDir(t)
	out := filepath.Join(t.TempDir(), "billing-vm")
	if _, _, stderr, err := execute(t, "vm", "bootstrap", "--state-dir", stateDir, "--namespace", "vm", "--service-account", "billing",
		"--ca-addr", "ca.example.com:15012", "--out", out, "--ttl", "2h"); err != nil {
		t.Fatalf("%v\n%s", err, stderr)
	}
	for name, mode := range map[string]os.FileMode{"istio-token": 0o600, "root-cert.pem": 0o644, "agent.env": 0o644} {
		info, err := os.Stat(filepath.Join(out, name))
		if err != nil || info.Mode().Perm() != mode {
			t.Errorf("%s: %v, mode %v, want %v", name, err, info.Mode().Perm(), mode)
		}
	}
	if info, err := os.Stat(out); err != nil || info.Mode().Perm() != 0o700 {
		t.Errorf("the bundle directory: %v, want mode 0700", err)
	}
	raw, err := os.ReadFile(filepath.Join(out, "istio-token"))
	if err != nil {
		t.Fatal(err)
	}
	claims, err := verifier.Verify(string(raw))
	if err != nil {
		t.Fatalf("the token does not verify with the CA's key: %v", err)
	}
	if ns, sa, _ := claims.ServiceAccount(); ns != "vm" || sa != "billing" || claims.ExpiresAt.Sub(claims.IssuedAt.Time) != 2*time.Hour {
		t.Errorf("token for %s/%s valid %s, want vm/billing for 2h", ns, sa, claims.ExpiresAt.Sub(claims.IssuedAt.Time))
	}
	if got, want := readFile(t, filepath.Join(out, "root-cert.pem")), readFile(t, filepath.Join(stateDir, "root-cert.pem")); got != want {
		t.Error("root-cert.pem is not the CA's trust bundle")
	}
}

// The unit in deploy/vm, given the environment the bundle holds, configures the slim agent as
// the guide says: the CA at --ca-addr verified by the bundle's roots, the identity of the token,
// the key pair kept across reboots, and the sockets in /run/meshid.
func TestVMUnitAndBundleConfigureTheAgent(t *testing.T) {
	t.Parallel()
	stateDir, _ := vmStateDir(t)
	out := t.TempDir()
	if _, _, stderr, err := execute(t, "vm", "bootstrap", "--state-dir", stateDir, "--namespace", "vm", "--service-account", "billing",
		"--ca-addr", "ca.example.com:15012", "--out", out); err != nil {
		t.Fatalf("%v\n%s", err, stderr)
	}
	unitPath := filepath.Join("..", "..", "deploy", "vm", "meshid-agent.service")
	unit := unitSettings(t, unitPath)
	// Environment= of the unit, then the bundle's EnvironmentFile=, which wins as in systemd.
	env := map[string]string{}
	for _, kv := range unit["Environment"] {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	maps.Copy(env, envFile(t, filepath.Join(out, "agent.env")))
	args := unitExecStart(t, unitPath)
	if args[0] != "/usr/local/bin/meshid-agent" {
		t.Fatalf("ExecStart runs %s, want the slim agent", args[0])
	}

	var got agent.Config
	g := &cli.Globals{}
	root := cli.NewRoot("meshid-agent", "", "", g)
	root.AddCommand(cli.NewAgentCommand(g, func(_ context.Context, cfg agent.Config) error { got = cfg; return nil },
		func(k string) (string, bool) { v, ok := env[k]; return v, ok }, nil, nil, nil))
	var stderr bytes.Buffer
	root.SetErr(&stderr)
	// The unit's Envoy is the VM's; here a stand-in, so that the command line is checked as it is.
	local, envoyPath := testutil.StandInFor(t, "envoy-path", args[1:])
	if envoyPath != "/usr/local/bin/envoy" {
		t.Errorf("--envoy-path %s, want /usr/local/bin/envoy", envoyPath)
	}
	root.SetArgs(local)
	if err := root.ExecuteContext(t.Context()); err != nil {
		t.Fatalf("meshid-agent refuses the unit's command line with the bundle's environment: %v\n%s", err, stderr.String())
	}
	if strings.Contains(stderr.String(), "not implemented") {
		t.Errorf("the agent ignores variables the unit sets:\n%s", stderr.String())
	}
	agentCmd, _, err := root.Find([]string{"agent"})
	if err != nil {
		t.Fatal(err)
	}
	// The agent runs Envoy, and writes its bootstrap where ProtectSystem=strict lets it write.
	for flag, want := range map[string]string{"envoy-bootstrap": "/run/meshid/envoy-rev.json"} {
		if f := agentCmd.Flags().Lookup(flag); f == nil || f.Value.String() != want {
			t.Errorf("--%s: %v, want %s", flag, f, want)
		}
	}
	checkVMUnitStop(t, unit, env)
	for what, pair := range map[string][2]string{
		"CA address":      {got.CA.Address, "ca.example.com:15012"},
		"CA root":         {got.CA.RootCert, "/etc/meshid/root-cert.pem"},
		"token":           {got.CA.TokenPath, "/etc/meshid/istio-token"},
		"namespace":       {got.Identity.Namespace, "vm"},
		"service account": {got.Identity.ServiceAccount, "billing"},
		"trust domain":    {got.Identity.TrustDomain, "cluster.local"},
		"OUTPUT_CERTS":    {got.Output.Dir, "/var/lib/meshid/certs"},
		"SDS socket dir":  {got.SDS.SocketDir, "/run/meshid"},
		"XDS socket":      {got.XDS.Socket, "/run/meshid/XDS"},
		"status address":  {got.Servers.StatusAddr, "127.0.0.1:15020"},
	} {
		if pair[0] != pair[1] {
			t.Errorf("%s: %q, want %q", what, pair[0], pair[1])
		}
	}
}

func TestVMBootstrapRefusesBadInput(t *testing.T) {
	t.Parallel()
	stateDir, _ := vmStateDir(t)
	base := []string{"vm", "bootstrap", "--state-dir", stateDir, "--namespace", "vm", "--service-account", "billing", "--ca-addr", "ca:15012", "--out", t.TempDir()}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"vm", "bootstrap", "--out", t.TempDir()}, "--namespace is required"},
		{append(base, "--ca-addr", "ca.example.com"), "want HOST:PORT"},
		{append(base, "--ttl", "0s"), "--ttl 0s must be positive"},
		{append(base, "--install-dir", "etc/meshid"), "must be an absolute path"},
		{append(base, "--service-account", "bill ing"), "must not hold spaces"},
		{append(base, "--root-cert", filepath.Join(stateDir, "token-key.pem")), "trust bundle"},
		{append(base, "--state-dir", t.TempDir()), "start `meshid ca --state-dir"},
	} {
		if _, _, _, err := execute(t, tc.args...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want an error saying %q", tc.args[2:], err, tc.want)
		}
	}
}

// checkVMUnitStop checks that systemd stops the agent as the agent stops Envoy: SIGTERM to the
// agent alone (which drains Envoy, its child, then stops it), and no SIGKILL before the longest
// drain is over.
func checkVMUnitStop(t *testing.T, unit map[string][]string, env map[string]string) {
	t.Helper()
	if !slices.Equal(unit["KillMode"], []string{"mixed"}) {
		t.Errorf("KillMode=%v, want mixed: SIGTERM to the agent only, which stops Envoy after the drain", unit["KillMode"])
	}
	minDrain, err := time.ParseDuration(env["MINIMUM_DRAIN_DURATION"])
	if err != nil {
		t.Fatalf("MINIMUM_DRAIN_DURATION: %v", err)
	}
	seconds, err := strconv.Atoi(env["TERMINATION_DRAIN_DURATION_SECONDS"])
	if err != nil {
		t.Fatalf("TERMINATION_DRAIN_DURATION_SECONDS: %v", err)
	}
	if len(unit["TimeoutStopSec"]) != 1 {
		t.Fatalf("TimeoutStopSec=%v, want one value", unit["TimeoutStopSec"])
	}
	stop, err := time.ParseDuration(unit["TimeoutStopSec"][0])
	if err != nil {
		t.Fatalf("TimeoutStopSec: %v", err)
	}
	if drain := max(minDrain, time.Duration(seconds)*time.Second); stop <= drain {
		t.Errorf("TimeoutStopSec=%s: systemd kills Envoy before its drain (%s) is over", stop, drain)
	}
}

// unitSettings returns a unit's one-line Key=Value settings, each key's values in order.
func unitSettings(t *testing.T, path string) map[string][]string {
	t.Helper()
	settings := map[string][]string{}
	for _, line := range strings.Split(readFile(t, path), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, "[") || strings.HasSuffix(line, `\`) {
			continue
		}
		if k, v, ok := strings.Cut(line, "="); ok {
			settings[k] = append(settings[k], v)
		}
	}
	return settings
}

// envFile reads KEY=VALUE lines as systemd's EnvironmentFile= does (no quotes are used).
func envFile(t *testing.T, path string) map[string]string {
	t.Helper()
	env := map[string]string{}
	for _, line := range strings.Split(readFile(t, path), "\n") {
		if line = strings.TrimSpace(line); line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			t.Fatalf("%s: %q is not KEY=VALUE", path, line)
		}
		env[k] = v
	}
	return env
}

// unitExecStart returns the words of a unit's ExecStart=, continuation lines joined.
func unitExecStart(t *testing.T, path string) []string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	var cmd string
	inExec := false
	for sc := bufio.NewScanner(f); sc.Scan(); {
		line := strings.TrimSpace(sc.Text())
		if rest, ok := strings.CutPrefix(line, "ExecStart="); ok {
			line, inExec = rest, true
		}
		if !inExec {
			continue
		}
		more := strings.HasSuffix(line, `\`)
		cmd += " " + strings.TrimSuffix(line, `\`)
		if !more {
			break
		}
	}
	if cmd == "" {
		t.Fatalf("%s has no ExecStart=", path)
	}
	return strings.Fields(cmd)
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

// A control character in any value that ends up in agent.env or names a file is refused, naming
// the flag: a newline would add a line of its own to agent.env (CA_ADDR=, say).
func TestVMBootstrapRefusesControlCharacters(t *testing.T) {
	t.Parallel()
	stateDir, _ := vmStateDir(t)
	values := map[string]string{
		"--namespace": "vm", "--service-account": "billing", "--ca-addr": "ca:15012", "--trust-domain": "cluster.local",
		"--install-dir": "/etc/meshid", "--output-certs": "/var/lib/meshid/certs", "--state-dir": stateDir,
		"--root-cert": filepath.Join(stateDir, "root-cert.pem"), "--key": filepath.Join(stateDir, "token-key.pem"),
	}
	for flag := range values {
		for _, bad := range []string{"\nCA_ADDR=evil:1", "\r", "\x00", "\t", "\x7f", "\u0085", "\u2028"} {
			t.Run(flag+strconv.Quote(bad), func(t *testing.T) {
				t.Parallel()
				args := []string{"vm", "bootstrap", "--out", filepath.Join(t.TempDir(), "out")}
				for f, v := range values {
					if f == flag {
						v += bad
					}
					args = append(args, f, v)
				}
				code, stderr := mainExit(t, args...)
				if code != cli.ExitUsage || !strings.Contains(stderr, flag+" ") || !strings.Contains(stderr, "control character") {
					t.Fatalf("exit code %d, want %d with a refusal naming %s; stderr:\n%s", code, cli.ExitUsage, flag, stderr)
				}
			})
		}
	}
	t.Run("--out", func(t *testing.T) {
		t.Parallel()
		out := filepath.Join(t.TempDir(), "out\nx")
		code, stderr := mainExit(t, "vm", "bootstrap", "--state-dir", stateDir, "--namespace", "vm", "--service-account", "billing",
			"--ca-addr", "ca:15012", "--out", out)
		if code != cli.ExitUsage || !strings.Contains(stderr, "--out ") {
			t.Fatalf("exit code %d, want %d naming --out; stderr:\n%s", code, cli.ExitUsage, stderr)
		}
		if _, err := os.Lstat(out); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%q was made (%v)", out, err)
		}
	})
}
