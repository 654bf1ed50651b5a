package fsutil

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// PeerProcess names the process at the other end of a Unix connection, as the kernel saw it
// connect ("pid=P uid=U"), or "" when it cannot tell.
func PeerProcess(conn net.Conn) string {
	uc, ok := conn.(*net.UnixConn)
	if !ok {
		return ""
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return ""
	}
	var cred *unix.Ucred
	_ = raw.Control(func(fd uintptr) {
		cred, _ = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	})
	if cred == nil {
		return ""
	}
	return fmt.Sprintf("pid=%d uid=%d", cred.Pid, cred.Uid)
}
