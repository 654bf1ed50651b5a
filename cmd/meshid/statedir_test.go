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
	"github.com/meshid/meshid/internal/testutil"
)

// mainExit runs the meshid command line as main does, with the real CA, and returns its exit
// code and what it printed on stderr.
func mainExit(t *testing.T, args ...string) (int, string) {
	t.Helper()
	root := newRootCommand(runCA, func(context.Context, agent.Config) error { return nil }, func(string) (string, bool) { return "", false })
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
