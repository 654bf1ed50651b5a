//go:build !linux

package fsutil

import "net"

// PeerProcess names the process at the other end of a Unix connection; only Linux is asked.
func PeerProcess(net.Conn) string { return "" }
