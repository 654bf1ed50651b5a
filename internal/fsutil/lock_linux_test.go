package fsutil

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// A lock holds its file open for reading only: a file open for writing would keep its file
// system from being remounted read-only (EBUSY) for as long as the lock is held, and OUTPUT_CERTS
// is locked for an agent's life.
func TestLockHoldsNoWritableDescriptor(t *testing.T) {
	t.Parallel()
	for name, lock := range map[string]func(string) (func(), error){"Lock": Lock, "TryLock": TryLock, "TryLockPID": TryLockPID} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			path := filepath.Join(t.TempDir(), ".lock")
			unlock, err := lock(path)
			if err != nil {
				t.Fatal(err)
			}
			defer unlock()
			modes := openModes(t, path)
			if len(modes) != 1 {
				t.Fatalf("%d descriptors open on the lock file, want the one that holds it", len(modes))
			}
			if modes[0] != syscall.O_RDONLY {
				t.Fatalf("the lock file is held open with access mode %#o, want read-only", modes[0])
			}
		})
	}
}

// openModes returns the access mode of each of this process's descriptors open on path.
func openModes(t *testing.T, path string) []int {
	t.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	var modes []int
	for _, fd := range fds {
		if target, err := os.Readlink("/proc/self/fd/" + fd.Name()); err != nil || target != path {
			continue
		}
		info, err := os.ReadFile("/proc/self/fdinfo/" + fd.Name())
		if err != nil {
			t.Fatal(err)
		}
		for line := range strings.Lines(string(info)) {
			if v, ok := strings.CutPrefix(line, "flags:"); ok {
				flags, err := strconv.ParseInt(strings.TrimSpace(v), 8, 64)
				if err != nil {
					t.Fatal(err)
				}
				modes = append(modes, int(flags)&syscall.O_ACCMODE)
			}
		}
	}
	return modes
}
