//go:build external

package interop_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// childEnv marks a test binary re-executed in a network namespace of its own; its value is the
// name of the test to run there.
const childEnv = "MESHID_INTEROP_NETNS"

// parentNetnsEnv carries the parent's network namespace to the child, which checks that it has
// another.
const parentNetnsEnv = "MESHID_INTEROP_PARENT_NETNS"

// childLimit bounds a child when the test has no deadline of its own.
const childLimit = 5 * time.Minute

// isolated runs the calling test in a private network namespace. pilot-agent's status server
// listens on *:15020, a fixed port on every interface that cannot be moved to 0 or to loopback;
// tests must listen on 127.0.0.1 only and parallel runs must not collide. So the test re-executes
// its own binary, running only itself, with CLONE_NEWNET (and CLONE_NEWUSER when not root), and
// the whole scenario (CA, discovery server, pilot-agent, clients) runs there, on a loopback of
// its own.
//
// In the parent isolated returns false once the child has passed, and fails the test with the
// child's output otherwise. In the child it brings the loopback up and returns true: the caller
// then runs the scenario.
//
//	if !isolated(t) {
//		return
//	}
func isolated(t *testing.T) bool {
	t.Helper()
	if name, ok := os.LookupEnv(childEnv); ok {
		if name != t.Name() {
			t.Fatalf("child for %s ran %s", name, t.Name())
		}
		if ns, err := os.Readlink("/proc/self/ns/net"); err != nil || ns == os.Getenv(parentNetnsEnv) {
			t.Fatalf("not in a network namespace of its own: %s (%v), the parent's %s", ns, err, os.Getenv(parentNetnsEnv))
		}
		if err := loopbackUp(); err != nil {
			t.Fatalf("bring up the loopback of the private network namespace: %v", err)
		}
		return true
	}

	limit := childLimit
	if deadline, ok := t.Deadline(); ok {
		// Leaves the parent time to report the child's output.
		limit = max(time.Until(deadline)-10*time.Second, time.Second)
	}
	// The child's own -test.timeout comes first, so that its output says where it was stuck.
	ctx, cancel := context.WithTimeout(context.Background(), limit+5*time.Second)
	defer cancel()
	args := []string{"-test.run=^" + regexp.QuoteMeta(t.Name()) + "$", "-test.count=1", "-test.timeout=" + limit.String()}
	if testing.Verbose() {
		args = append(args, "-test.v")
	}
	cmd := exec.CommandContext(ctx, os.Args[0], args...)
	netns, err := os.Readlink("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	cmd.Env = append(os.Environ(), childEnv+"="+t.Name(), parentNetnsEnv+"="+netns)
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWNET,
		// Killed with the test binary, however it ends; the child's pilot-agent dies with it.
		Pdeathsig: syscall.SIGKILL,
	}
	if uid, gid := os.Getuid(), os.Getgid(); uid != 0 {
		// Root of a user namespace of its own, mapped to us, to bring its loopback up.
		cmd.SysProcAttr.Cloneflags |= syscall.CLONE_NEWUSER
		cmd.SysProcAttr.UidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: uid, Size: 1}}
		cmd.SysProcAttr.GidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: gid, Size: 1}}
		cmd.SysProcAttr.GidMappingsEnableSetgroups = false
	}
	cmd.WaitDelay = 10 * time.Second
	out, err := cmd.CombinedOutput()
	switch {
	case err == nil:
		if testing.Verbose() {
			t.Logf("in a private network namespace:\n%s", out)
		}
	case cmd.ProcessState == nil: // it never started
		t.Fatalf("cannot run the test in a private network namespace (pilot-agent listens on *:15020, so it must have one): %v\n"+
			"This needs user namespaces (or root); check kernel.unprivileged_userns_clone, user.max_user_namespaces "+
			"and any seccomp or AppArmor profile that forbids unshare.", err)
	default:
		t.Fatalf("in a private network namespace: %v\n%s", err, out)
	}
	return false
}

// loopbackUp sets the IFF_UP flag of lo, which a new network namespace has down.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("socket: %w", err)
	}
	defer func() { _ = unix.Close(fd) }()
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("SIOCGIFFLAGS: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("SIOCSIFFLAGS: %w", err)
	}
	return nil
}
