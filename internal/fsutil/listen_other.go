//go:build unix && !linux

package fsutil

import (
	"fmt"
	"net"
	"os"
	"sync"
	"syscall"
)

// umaskMu serialises ListenUnix's changes of the umask, which belongs to the process.
var umaskMu sync.Mutex //nolint:gochecknoglobals // guards process-wide state: the umask

// ListenUnix listens on a new Unix socket at path whose file has exactly mode, and removes the
// file on Close. The mode is never set through path once the file exists: whoever can write in
// the directory could by then have put a symlink there, and the mode would land on the file it
// points to. Outside Linux, bind gives the file 0777 less the umask, so the umask is set for the
// call; files other goroutines create meanwhile get it too.
func ListenUnix(path string, mode os.FileMode) (net.Listener, error) {
	lis, _, err := listenUnix(path, mode)
	return lis, err
}

// listenUnix is ListenUnix, also returning the identity of the socket file it made.
func listenUnix(path string, mode os.FileMode) (net.Listener, fileID, error) {
	if err := CheckSocketPath(path); err != nil {
		return nil, fileID{}, err
	}
	umaskMu.Lock()
	old := syscall.Umask(int(0o777 &^ mode.Perm()))
	lis, err := net.Listen("unix", path)
	syscall.Umask(old)
	umaskMu.Unlock()
	if err != nil {
		return nil, fileID{}, fmt.Errorf("listen on %s: %w", path, err)
	}
	info, err := os.Lstat(path)
	if err != nil {
		_ = lis.Close()
		return nil, fileID{}, fmt.Errorf("stat the socket %s: %w", path, err)
	}
	return lis, idOf(info), nil
}
