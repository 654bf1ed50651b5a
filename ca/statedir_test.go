package ca_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/pki"
)

// The self-signed CA is read only from a state dir of ours, and only a key of ours: a state dir
// another user can write in, or a CA key they could have put there, is refused (ErrNotOwned)
// and left as it is.
func TestLoadOrCreateRefusesAStateDirNotOurs(t *testing.T) {
	t.Parallel()
	now := time.Now()
	for _, tc := range []struct {
		name    string
		prepare func(t *testing.T, dir string)
	}{
		{"state dir writable by others", func(t *testing.T, dir string) {
			if err := os.Chmod(dir, 0o777); err != nil {
				t.Fatal(err)
			}
		}},
		{"CA key readable by others", func(t *testing.T, dir string) {
			if err := os.Chmod(filepath.Join(dir, ca.CAKeyFile), 0o644); err != nil {
				t.Fatal(err)
			}
		}},
		{"CA key a link", func(t *testing.T, dir string) {
			key := filepath.Join(dir, ca.CAKeyFile)
			moved := filepath.Join(t.TempDir(), "elsewhere.pem")
			if err := os.Rename(key, moved); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(moved, key); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := filepath.Join(t.TempDir(), "state")
			if _, err := ca.CreateSelfSigned(dir, ca.SelfSignedConfig{KeyAlgorithm: pki.ECDSA, Org: "test", TTL: time.Hour}, now); err != nil {
				t.Fatal(err)
			}
			tc.prepare(t, dir)
			if _, _, err := ca.LoadOrCreate(ca.StartupConfig{StateDir: dir, Now: now}); !errors.Is(err, fsutil.ErrNotOwned) {
				t.Fatalf("%v, want ErrNotOwned", err)
			}
			if _, err := os.Lstat(filepath.Join(dir, ca.RootCertFile)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the trust bundle was written into the refused state dir (%v)", err)
			}
		})
	}
}

// A state dir another user made first is refused rather than created over: the CA never writes
// its first key into a directory it does not own alone.
func TestCreateSelfSignedRefusesAnOpenDir(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "state")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o770); err != nil {
		t.Fatal(err)
	}
	if _, err := ca.CreateSelfSigned(dir, ca.SelfSignedConfig{KeyAlgorithm: pki.ECDSA, Org: "test", TTL: time.Hour}, time.Now()); !errors.Is(err, fsutil.ErrNotOwned) {
		t.Fatalf("%v, want ErrNotOwned", err)
	}
	if _, err := os.Lstat(filepath.Join(dir, ca.CAKeyFile)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a key was written into the open directory (%v)", err)
	}
}
