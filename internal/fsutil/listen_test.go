package fsutil

import (
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// shortDir is a temp dir short enough for a socket path (t.TempDir's can pass 107 bytes).
func shortDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "fs")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

// checkSocket fails unless path is a socket file with exactly mode that accepts connections.
func checkSocket(t *testing.T, path string, mode os.FileMode) {
	t.Helper()
	info, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	if info.Mode().Type() != os.ModeSocket || info.Mode().Perm() != mode {
		t.Fatalf("%s is %v, want a socket with %v", path, info.Mode(), mode)
	}
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("dial %s: %v", path, err)
	}
	_ = conn.Close()
}

func TestListenUnixMode(t *testing.T) {
	t.Parallel()
	for _, mode := range []os.FileMode{0o600, 0o660, 0o640, 0o666} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			path := filepath.Join(shortDir(t), "socket")
			lis, err := ListenUnix(path, mode)
			if err != nil {
				t.Fatal(err)
			}
			checkSocket(t, path, mode)
			if _, err := ListenUnix(path, mode); err == nil {
				t.Fatal("a second ListenUnix took the path of a live socket")
			}
			_ = lis.Close()
			if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("Close left the socket file: %v", err)
			}
		})
	}
	if _, err := ListenUnix("/"+strings.Repeat("s", MaxSocketPath), 0o600); err == nil {
		t.Fatal("a path over the kernel's limit was accepted")
	}
}

// The socket gets exactly the mode asked whatever the umask, stricter or looser. Not parallel:
// the umask is the process's, and parallel tests wait until the sequential ones have finished.
func TestListenUnixModeUnderUmask(t *testing.T) {
	for _, umask := range []int{0o077, 0o027, 0o000} {
		for _, mode := range []os.FileMode{0o600, 0o660} {
			path := filepath.Join(shortDir(t), "socket")
			old := syscall.Umask(umask)
			lis, err := ListenUnix(path, mode)
			syscall.Umask(old)
			if err != nil {
				t.Fatal(err)
			}
			checkSocket(t, path, mode)
			_ = lis.Close()
		}
	}
}

func TestCheckSocketDir(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		mode   os.FileMode
		shared bool
	}{
		{"private", 0o700, false},
		{"group", 0o770, false},
		{"everyone, sticky", 0o777 | os.ModeSticky, false},
		{"everyone", 0o777, true},
		{"everyone may write only", 0o733, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := shortDir(t)
			if err := os.Chmod(dir, tc.mode); err != nil {
				t.Fatal(err)
			}
			err := CheckSocketDir(dir)
			if tc.shared != errors.Is(err, ErrSharedDir) || (!tc.shared && err != nil) {
				t.Fatalf("CheckSocketDir(%v): %v, want shared %v", tc.mode, err, tc.shared)
			}
			if tc.shared && !strings.Contains(err.Error(), dir) {
				t.Fatalf("error %q does not name the directory", err)
			}
		})
	}
	if err := CheckSocketDir(filepath.Join(shortDir(t), "missing")); err == nil {
		t.Fatal("a missing directory passed")
	}
}

// ListenAddr listens on TCP for HOST:PORT and on a private socket, in a directory it makes
// private, for unix:///path; a directory others may write in is refused.
func TestListenAddr(t *testing.T) {
	t.Parallel()
	log := slog.New(slog.DiscardHandler)
	lis, socket, err := ListenAddr("127.0.0.1:0", log)
	if err != nil || socket != nil || lis.Addr().Network() != "tcp" {
		t.Fatalf("TCP: %v, %v, %v", lis, socket, err)
	}
	_ = lis.Close()

	dir := shortDir(t)
	path := filepath.Join(dir, "new", "ca.sock")
	lis, socket, err = ListenAddr(UnixScheme+path, log)
	if err != nil || socket == nil || lis.Addr().String() != path {
		t.Fatalf("Unix: %v, %v, %v", lis, socket, err)
	}
	socket.Close()
	if info, err := os.Stat(filepath.Dir(path)); err != nil || info.Mode().Perm() != PrivateDirMode {
		t.Fatalf("the socket's directory: %v, %v", info, err)
	}

	shared := filepath.Join(dir, "shared")
	if err := os.Mkdir(shared, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(shared, 0o777); err != nil {
		t.Fatal(err)
	}
	if _, _, err := ListenAddr(UnixScheme+filepath.Join(shared, "ca.sock"), log); !errors.Is(err, ErrSharedDir) {
		t.Fatalf("a socket in a directory anyone may write in: %v, want ErrSharedDir", err)
	}
}
