package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/cmd/internal/cli"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/secretmanager"
)

// mainExit runs the meshid command line as main does, with the real CA, and returns its exit
// code and what it printed on stderr.
func mainExit(t *testing.T, args ...string) (int, string) {
	t.Helper()
	root := newRootCommand(runCA, func(context.Context, agent.Config) error { return nil }, func(string) (string, bool) { return "", false }, nil)
	var stdout, stderr bytes.Buffer
	root.SetOut(&stdout)
	root.SetErr(&stderr)
	root.SetArgs(args)
	return cli.Main(root), stderr.String()
}

// openDir is a directory that its group and others can write in, as a Kubernetes emptyDir is.
func openDir(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(testutil.ShortTempDir(t), "open")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	return dir
}

// A state dir another user could write in is refused as called: exit 2, naming the directory
// and what to do, and nothing is written to it.
func TestCARefusesAStateDirNotOurs(t *testing.T) {
	t.Parallel()
	dir := openDir(t)
	code, stderr := mainExit(t, "ca", "--state-dir", dir, "--grpc-addr", "127.0.0.1:0", "--monitoring-addr", "")
	if code != cli.ExitUsage {
		t.Fatalf("exit code %d, want %d; stderr:\n%s", code, cli.ExitUsage, stderr)
	}
	for _, want := range []string{dir, "mode 0777", "another user could have put their own keys there", "chown"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("stderr does not say %q:\n%s", want, stderr)
		}
	}
	if entries, err := os.ReadDir(dir); err != nil || len(entries) != 0 {
		t.Errorf("the refused state dir holds %v (%v)", entries, err)
	}
}

// stateDirWithKey is the state dir of a CA that has run once, made open to others by mode.
func stateDirWithKey(t *testing.T, dirMode, keyMode os.FileMode) string {
	t.Helper()
	dir, _ := vmStateDir(t)
	if err := os.Chmod(filepath.Join(dir, "token-key.pem"), keyMode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, dirMode); err != nil {
		t.Fatal(err)
	}
	return dir
}

// meshid token and meshid vm bootstrap sign with the state dir's token key only when the state
// dir and the key are ours alone, and vm bootstrap writes only into a directory of ours.
func TestTokenAndVMRefuseDirectoriesNotOurs(t *testing.T) {
	t.Parallel()
	identity := []string{"--namespace", "vm", "--service-account", "billing"}
	vm := func(stateDir, out string) []string {
		return append([]string{"vm", "bootstrap", "--state-dir", stateDir, "--ca-addr", "ca:15012", "--out", out}, identity...)
	}
	tests := []struct {
		name          string
		args          func(t *testing.T) ([]string, string) // the arguments, and the path the refusal names
		outStaysEmpty bool
	}{
		{"token, state dir open", func(t *testing.T) ([]string, string) {
			dir := stateDirWithKey(t, 0o777, 0o600)
			return append([]string{"token", "--state-dir", dir}, identity...), dir
		}, false},
		{"token, key open", func(t *testing.T) ([]string, string) {
			dir := stateDirWithKey(t, 0o700, 0o644)
			return append([]string{"token", "--state-dir", dir}, identity...), filepath.Join(dir, "token-key.pem")
		}, false},
		{"vm, state dir group-writable", func(t *testing.T) ([]string, string) {
			dir := stateDirWithKey(t, 0o770, 0o600)
			return vm(dir, filepath.Join(t.TempDir(), "out")), dir
		}, false},
		{"vm, out open", func(t *testing.T) ([]string, string) {
			out := openDir(t)
			return vm(stateDirWithKey(t, 0o700, 0o600), out), out
		}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			args, path := tt.args(t)
			code, stderr := mainExit(t, args...)
			if code != cli.ExitUsage || !strings.Contains(stderr, path) || !strings.Contains(stderr, "another user could have put their own keys there") {
				t.Fatalf("exit code %d, want %d with a refusal naming %s; stderr:\n%s", code, cli.ExitUsage, path, stderr)
			}
			if tt.outStaysEmpty {
				if entries, err := os.ReadDir(path); err != nil || len(entries) != 0 {
					t.Errorf("the refused --out holds %v (%v)", entries, err)
				}
			}
		})
	}
}

// The agent's embedded state dir, <root-dir>/var/lib/meshid, open to others is refused as called.
func TestAgentRefusesAnEmbeddedStateDirNotOurs(t *testing.T) {
	t.Parallel()
	rootDir := testutil.ShortTempDir(t)
	stateDir := filepath.Join(rootDir, "var", "lib", "meshid")
	if err := os.MkdirAll(stateDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(stateDir, 0o770); err != nil {
		t.Fatal(err)
	}
	root := newRootCommand(runCA, cli.RunAgent, func(string) (string, bool) { return "", false }, nil)
	var stderr bytes.Buffer
	root.SetOut(new(bytes.Buffer))
	root.SetErr(&stderr)
	root.SetArgs([]string{"agent", "--root-dir", rootDir, "--status-addr", "127.0.0.1:0", "--debug-addr", ""})
	if code := cli.Main(root); code != cli.ExitUsage || !strings.Contains(stderr.String(), stateDir) {
		t.Fatalf("exit code %d, want %d with a refusal naming %s; stderr:\n%s", code, cli.ExitUsage, stateDir, stderr.String())
	}
}

// startAndStop is an agent runner that builds the agent and, when it starts at all, stops it at
// once: what is refused is refused by agent.New.
func startAndStop(ctx context.Context, cfg agent.Config) error {
	a, err := agent.New(cfg)
	if err != nil {
		return err
	}
	stopped, cancel := context.WithCancel(ctx)
	cancel()
	return a.Run(stopped)
}

// OUTPUT_CERTS that another user could write in, or that another agent holds, is refused as
// called: exit 2, naming the directory, and for a held one the pid of the agent holding it.
func TestAgentRefusesOutputCertsNotOursOrInUse(t *testing.T) {
	t.Parallel()
	held := filepath.Join(t.TempDir(), "certs")
	if err := os.Mkdir(held, 0o700); err != nil {
		t.Fatal(err)
	}
	unlock, err := fsutil.TryLockPID(filepath.Join(held, secretmanager.OutputLockFile)) // as a running agent holds it
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(unlock)
	for _, tc := range []struct {
		name string
		dir  string
		says []string
	}{
		{"open to others", openDir(t), []string{"mode 0777", "another user could have put their own keys there"}},
		{"held by another agent", held, []string{"pid " + strconv.Itoa(os.Getpid()), "give each agent its own --output-certs"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			root := newRootCommand(runCA, startAndStop, func(string) (string, bool) { return "", false }, nil)
			var stderr bytes.Buffer
			root.SetOut(new(bytes.Buffer))
			root.SetErr(&stderr)
			root.SetArgs([]string{"agent", "--root-dir", testutil.ShortTempDir(t), "--output-certs", tc.dir,
				"--status-addr", "127.0.0.1:0", "--debug-addr", ""})
			code := cli.Main(root)
			if code != cli.ExitUsage {
				t.Fatalf("exit code %d, want %d; stderr:\n%s", code, cli.ExitUsage, stderr.String())
			}
			for _, want := range append(tc.says, tc.dir) {
				if !strings.Contains(stderr.String(), want) {
					t.Errorf("stderr does not say %q:\n%s", want, stderr.String())
				}
			}
		})
	}
}
