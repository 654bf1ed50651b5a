package envoy

import "syscall"

// sysProcAttr puts Envoy in a process group of its own, so that a terminal's ^C reaches the
// agent alone, which drains Envoy first; and has the kernel send Envoy SIGTERM if the agent
// dies, so that no Envoy outlives its agent.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
}
