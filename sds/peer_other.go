//go:build !linux

package sds

import "net"

// peerProcess names the process at the other end of a Unix connection; only Linux is asked.
func peerProcess(net.Conn) string { return "" }
