package attest

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// peerCred returns the credentials the kernel recorded when the peer of conn connected.
func peerCred(conn net.Conn) (pid int32, uid, gid uint32, err error) {
	uc, ok := conn.(*net.UnixConn)
	if !ok {
		return 0, 0, 0, fmt.Errorf("%w: a %T is not a Unix connection", ErrPeerUnknown, conn)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return 0, 0, 0, fmt.Errorf("%w: %w", ErrPeerUnknown, err)
	}
	var (
		cred    *unix.Ucred
		credErr error
	)
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, 0, 0, fmt.Errorf("%w: %w", ErrPeerUnknown, err)
	}
	if credErr != nil {
		return 0, 0, 0, fmt.Errorf("%w: SO_PEERCRED: %w", ErrPeerUnknown, credErr)
	}
	if cred == nil {
		return 0, 0, 0, fmt.Errorf("%w: SO_PEERCRED returned nothing", ErrPeerUnknown)
	}
	return cred.Pid, cred.Uid, cred.Gid, nil
}
