//go:build !linux

package attest

import (
	"fmt"
	"net"
)

// peerCred needs Linux's SO_PEERCRED; elsewhere no caller is known.
func peerCred(net.Conn) (pid int32, uid, gid uint32, err error) {
	return 0, 0, 0, fmt.Errorf("%w: peer credentials are read on Linux only", ErrPeerUnknown)
}
