package fsutil

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// ListenUnix listens on a new Unix socket at path whose file has exactly mode, and removes the
// file on Close. The mode is never set through path once the file exists: whoever can write in
// the directory could by then have put a symlink there, and the mode would land on the file it
// points to (a CA key, say).
func ListenUnix(path string, mode os.FileMode) (net.Listener, error) {
	lis, _, err := listenUnix(path, mode)
	return lis, err
}

// listenUnix is ListenUnix, also returning the identity of the socket file it made: checked to be
// a socket of this process's user, through a descriptor of the file itself.
func listenUnix(path string, mode os.FileMode) (net.Listener, fileID, error) {
	if err := CheckSocketPath(path); err != nil {
		return nil, fileID{}, err
	}
	mode = mode.Perm()
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		// Before bind: the file bind creates takes the socket's own mode, less the umask, so
		// it is never more open than mode, not even for a moment.
		var err error
		if cerr := c.Control(func(fd uintptr) { err = syscall.Fchmod(int(fd), uint32(mode)) }); cerr != nil {
			return cerr
		}
		return err
	}}
	lis, err := lc.Listen(context.Background(), "unix", path)
	if err != nil {
		return nil, fileID{}, fmt.Errorf("listen on %s: %w", path, err)
	}
	id, err := addUmaskBits(path, mode)
	if err != nil {
		_ = lis.Close()
		return nil, fileID{}, err
	}
	return lis, id, nil
}

// addUmaskBits gives the socket file at path the bits of mode that the umask took away, through
// a descriptor of the file itself, not its name: if anything but a socket of ours is there now (a
// symlink, a hard link to another file, another user's socket), it is refused, never changed.
// It returns the identity of the socket file.
func addUmaskBits(path string, mode os.FileMode) (fileID, error) {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fileID{}, fmt.Errorf("open the socket %s to set its mode: %w", path, err)
	}
	defer func() { _ = unix.Close(fd) }()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fileID{}, fmt.Errorf("stat the socket %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK || int(st.Uid) != os.Geteuid() {
		return fileID{}, fmt.Errorf("%s was replaced as the socket was made: refusing to set the mode of what is there now", path)
	}
	id := fileID{dev: st.Dev, ino: st.Ino}
	if os.FileMode(st.Mode).Perm() == mode {
		return id, nil
	}
	// fchmod takes no O_PATH descriptor; its /proc link reaches the same inode, whatever the
	// name now points to.
	if err := os.Chmod("/proc/self/fd/"+strconv.Itoa(fd), mode); err != nil {
		return fileID{}, fmt.Errorf("set the mode of the socket %s: %w", path, err)
	}
	return id, nil
}
