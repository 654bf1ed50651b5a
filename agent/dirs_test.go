package agent_test

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/fsutil"
)

// The embedded control plane's state dir, <root-dir>/var/lib/meshid, is refused when another
// user could write in it, before the agent puts anything there (its lock, the CA's socket): that
// user could have put their own CA key and token key there.
func TestEmbeddedStateDirNotOursIsRefused(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t, newFakeClock(), nil, nil)
	stateDir := filepath.Join(cfg.RootDir, agent.DefaultEmbeddedDir)
	if err := os.MkdirAll(stateDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(stateDir, 0o777); err != nil {
		t.Fatal(err)
	}
	_, err := agent.New(cfg)
	if err == nil {
		t.Fatal("the agent started")
	}
	if !errors.Is(err, fsutil.ErrNotOwned) || !strings.Contains(err.Error(), stateDir) {
		t.Fatalf("%v, want ErrNotOwned naming %s", err, stateDir)
	}
	if entries, err := os.ReadDir(stateDir); err != nil || len(entries) != 0 {
		t.Errorf("the refused state dir holds %v (%v)", entries, err)
	}
}

// OUTPUT_CERTS is refused at start when another user could have put a key pair there that a
// restart would serve: the directory not ours alone, or the key in it a link out, another user's
// or open to others. Nothing is put in it.
func TestOutputCertsNotOursIsRefused(t *testing.T) {
	t.Parallel()
	elsewhere := filepath.Join(t.TempDir(), "key.pem")
	if err := os.WriteFile(elsewhere, []byte("theirs"), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		prepare func(t *testing.T, dir string) // dir exists, 0700
		names   string
	}{
		{"writable by others", func(t *testing.T, dir string) { chmod(t, dir, 0o777) }, "mode 0777"},
		{"key open to others", func(t *testing.T, dir string) {
			path := filepath.Join(dir, "key.pem")
			if err := os.WriteFile(path, []byte("theirs"), 0o600); err != nil {
				t.Fatal(err)
			}
			chmod(t, path, 0o644)
		}, "key.pem"},
		{"key linked out", func(t *testing.T, dir string) {
			if err := os.Symlink(elsewhere, filepath.Join(dir, "key.pem")); err != nil {
				t.Fatal(err)
			}
		}, "key.pem"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := testConfig(t, newFakeClock(), nil, nil)
			cfg.Output.Dir = filepath.Join(t.TempDir(), "out")
			if err := os.Mkdir(cfg.Output.Dir, 0o700); err != nil {
				t.Fatal(err)
			}
			tt.prepare(t, cfg.Output.Dir)
			before := dirEntries(t, cfg.Output.Dir)
			a, err := agent.New(cfg)
			if err == nil {
				t.Fatalf("the agent started (its Run: %v)", runAgent(t, a)())
			}
			if !errors.Is(err, fsutil.ErrNotOwned) || !strings.Contains(err.Error(), cfg.Output.Dir) || !strings.Contains(err.Error(), tt.names) {
				t.Fatalf("%v, want ErrNotOwned naming %s and %q", err, cfg.Output.Dir, tt.names)
			}
			if after := dirEntries(t, cfg.Output.Dir); after != before {
				t.Errorf("OUTPUT_CERTS changed from %q to %q", before, after)
			}
		})
	}
}

// Two agents on one OUTPUT_CERTS would overwrite each other's key pair: the second is refused at
// start, naming the directory and the first agent's pid, for as long as the first runs.
func TestSecondAgentOnOutputCertsIsRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := e.config(t, e.tokenFile(t, "default", "demo"), nil)
	first := newAgent(t, cfg)
	stop := runAgent(t, first)

	second := e.config(t, cfg.CA.TokenPath, nil) // its own sockets and root dir, the same OUTPUT_CERTS
	_, err := agent.New(second)
	if !errors.Is(err, fsutil.ErrLocked) {
		t.Fatalf("second agent on %s: %v, want ErrLocked", cfg.Output.Dir, err)
	}
	for _, want := range []string{"OUTPUT_CERTS " + cfg.Output.Dir + " is held by another process, the agent with pid " + strconv.Itoa(os.Getpid()), "--output-certs"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q does not say %q", err, want)
		}
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	runAgent(t, newAgent(t, second)) // the first is gone: the directory is free
}

func chmod(t *testing.T, path string, mode os.FileMode) {
	t.Helper()
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
}

// dirEntries lists a directory's entries.
func dirEntries(t *testing.T, dir string) string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return strings.Join(out, ",")
}
