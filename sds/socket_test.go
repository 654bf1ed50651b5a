package sds_test

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
)

// Attack: whoever can write in the socket directory swaps the new socket for a symlink to another
// file (here, a CA key) in the moment between the listen and the setting of the socket's mode,
// and that file took the socket's mode: the key went 0600 → 0660. The server sets the mode as the
// socket is created, so there is no such moment: however the swap falls, the key keeps its mode.
func TestNewSocketModeFollowsNoSymlink(t *testing.T) {
	t.Parallel()
	const attempts = 200
	victim := filepath.Join(t.TempDir(), "ca-key.pem")
	testutil.WriteFiles(t, filepath.Dir(victim), map[string][]byte{filepath.Base(victim): []byte("key")})
	if err := os.Chmod(victim, 0o600); err != nil {
		t.Fatal(err)
	}
	f := newFakeSecrets()
	for i := range attempts {
		path := filepath.Join(testutil.ShortTempDir(t), sds.SocketName)
		// The racer polls without pause and swaps the socket the moment it appears.
		stop, swapped := make(chan struct{}), make(chan bool, 1)
		go func() {
			for {
				select {
				case <-stop:
					swapped <- false
					return
				default:
				}
				if info, err := os.Lstat(path); err == nil && info.Mode().Type() == os.ModeSocket {
					_ = os.Remove(path)
					swapped <- os.Symlink(victim, path) == nil
					return
				}
			}
		}()
		srv, err := sds.New(sds.Config{SocketPath: path, Secrets: f})
		close(stop)
		<-swapped
		if err == nil {
			srv.Close()
		}
		info, err := os.Stat(victim)
		if err != nil {
			t.Fatal(err)
		}
		if info.Mode().Perm() != 0o600 {
			t.Fatalf("attempt %d: the symlink swap made the CA key %v", i, info.Mode().Perm())
		}
	}
}

// A socket directory writable by everyone (a Kubernetes emptyDir is 0777) is served, with a
// warning naming it: any local user could replace the socket there.
func TestNewWarnsOfASharedSocketDir(t *testing.T) {
	t.Parallel()
	dir := testutil.ShortTempDir(t)
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	logs := &testutil.SyncBuffer{}
	srv, err := sds.New(sds.Config{
		SocketPath: filepath.Join(dir, sds.SocketName),
		Secrets:    newFakeSecrets(),
		Logger:     slog.New(slog.NewTextHandler(logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	srv.Close()
	if got := logs.String(); !strings.Contains(got, "writable by every user") || !strings.Contains(got, "dir="+dir) {
		t.Fatalf("no warning naming %s:\n%s", dir, got)
	}
}
