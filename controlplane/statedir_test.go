package controlplane_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/fsutil"
)

// A state dir that another user owns or can write in, or a key in it that is not ours alone, is
// refused before anything is read from it or written to it: whoever could write there could have
// put their own CA key or token key in it.
func TestStateDirNotOursIsRefused(t *testing.T) {
	t.Parallel()
	elsewhere := t.TempDir()
	if err := os.WriteFile(filepath.Join(elsewhere, "key.pem"), []byte("theirs"), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		prepare func(t *testing.T, dir string) // dir exists, 0700
		names   string                         // what the refusal names
	}{
		{"writable by others", func(t *testing.T, dir string) { chmod(t, dir, 0o777) }, "mode 0777"},
		{"group-writable", func(t *testing.T, dir string) { chmod(t, dir, 0o2770) }, "mode 0770"},
		{"CA key open to others", func(t *testing.T, dir string) {
			writeFile(t, filepath.Join(dir, "ca-cert.pem"), 0o644)
			writeFile(t, filepath.Join(dir, "ca-key.pem"), 0o644)
		}, "ca-key.pem"},
		{"token key a link", func(t *testing.T, dir string) {
			if err := os.Symlink(filepath.Join(elsewhere, "key.pem"), filepath.Join(dir, "token-key.pem")); err != nil {
				t.Fatal(err)
			}
		}, "token-key.pem"},
		{"secrets a link", func(t *testing.T, dir string) {
			if err := os.Symlink(elsewhere, filepath.Join(dir, "secrets")); err != nil {
				t.Fatal(err)
			}
		}, "secrets"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := filepath.Join(t.TempDir(), "state")
			if err := os.Mkdir(dir, 0o700); err != nil {
				t.Fatal(err)
			}
			tt.prepare(t, dir)
			before := entries(t, dir)
			cp, err := controlplane.New(t.Context(), testConfig(dir))
			if err == nil {
				cp.Close()
				t.Fatal("the control plane started")
			}
			if !errors.Is(err, fsutil.ErrNotOwned) || !strings.Contains(err.Error(), tt.names) {
				t.Fatalf("%v, want ErrNotOwned naming %q", err, tt.names)
			}
			if after := entries(t, dir); after != before {
				t.Errorf("the state dir changed from %q to %q", before, after)
			}
		})
	}
}

func chmod(t *testing.T, path string, mode os.FileMode) {
	t.Helper()
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
}

func writeFile(t *testing.T, path string, mode os.FileMode) {
	t.Helper()
	if err := os.WriteFile(path, []byte("not ours"), mode); err != nil {
		t.Fatal(err)
	}
	chmod(t, path, mode)
}

// entries lists a directory's names.
func entries(t *testing.T, dir string) string {
	t.Helper()
	list, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range list {
		names = append(names, e.Name())
	}
	return strings.Join(names, ",")
}
