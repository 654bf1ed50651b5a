package fsutil

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
)

// ErrSharedDir reports a directory in which any local user can replace a file: it is writable by
// everyone and lacks the sticky bit.
var ErrSharedDir = errors.New("writable by every user without the sticky bit: any local user can replace the socket in it")

// CheckSocketDir reports a socket directory in which another user could swap the socket for one
// of their own (ErrSharedDir), naming the directory and its mode.
func CheckSocketDir(dir string) error {
	info, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("socket directory: %w", err)
	}
	if !info.IsDir() {
		return fmt.Errorf("socket directory %s is not a directory", dir)
	}
	if info.Mode().Perm()&0o002 != 0 && info.Mode()&os.ModeSticky == 0 {
		return fmt.Errorf("socket directory %s (mode %v) is %w", dir, info.Mode(), ErrSharedDir)
	}
	return nil
}

// UnixScheme marks an address that is a Unix socket path: unix:///path.
const UnixScheme = "unix://"

// ListenAddr opens a TCP address, or for "unix:///path" a private Unix socket through
// ListenSocket (a stale socket file replaced, a live one refused, the file removed at the end only
// while it is still ours; Socket is nil for TCP), in a directory created private when missing. The
// directory is the server's own: one that others may write in is refused, not served with a
// warning.
func ListenAddr(addr string, log *slog.Logger) (net.Listener, *Socket, error) {
	path, ok := strings.CutPrefix(addr, UnixScheme)
	if !ok {
		lis, err := net.Listen("tcp", addr)
		return lis, nil, err
	}
	// The directory may not exist yet: an embedding agent puts the socket in a state dir a first
	// start has not made.
	if err := EnsureDir(filepath.Dir(path), PrivateDirMode); err != nil {
		return nil, nil, err
	}
	if err := CheckSocketDir(filepath.Dir(path)); err != nil {
		return nil, nil, err
	}
	socket, err := ListenSocket(path, PrivateFileMode, log)
	if err != nil {
		return nil, nil, err
	}
	return socket.Listener(), socket, nil
}
