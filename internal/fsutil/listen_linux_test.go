package fsutil

import (
	"os"
	"path/filepath"
	"testing"
)

// Attack: the socket is swapped, before its mode is set, for a symlink to a CA key, a hard link
// to it, or another user's file. The mode is set through the file's own descriptor, and only on
// a socket this process owns: the swap is refused and the key keeps its mode.
func TestListenUnixSetsNoModeOnAReplacement(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		plant func(t *testing.T, victim, path string)
	}{
		{"symlink", func(t *testing.T, victim, path string) {
			if err := os.Symlink(victim, path); err != nil {
				t.Fatal(err)
			}
		}},
		{"hard link", func(t *testing.T, victim, path string) {
			if err := os.Link(victim, path); err != nil {
				t.Fatal(err)
			}
		}},
		{"regular file", func(t *testing.T, _, path string) {
			if err := os.WriteFile(path, nil, 0o600); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := shortDir(t)
			victim := filepath.Join(dir, "ca-key.pem")
			if err := os.WriteFile(victim, []byte("key"), 0o600); err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(dir, "socket")
			tc.plant(t, victim, path)
			if _, err := addUmaskBits(path, 0o660); err == nil {
				t.Fatal("the mode was set on what replaced the socket")
			}
			info, err := os.Stat(victim)
			if err != nil {
				t.Fatal(err)
			}
			if info.Mode().Perm() != 0o600 {
				t.Fatalf("the CA key is now %v", info.Mode().Perm())
			}
		})
	}
}
