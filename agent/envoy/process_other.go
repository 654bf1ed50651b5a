//go:build !linux

package envoy

import "syscall"

// sysProcAttr puts Envoy in a process group of its own, so that a terminal's ^C reaches the
// agent alone, which drains Envoy first.
func sysProcAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Setpgid: true} }
