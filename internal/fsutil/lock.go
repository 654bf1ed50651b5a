//go:build unix

package fsutil

import (
	"fmt"
	"os"
	"syscall"
)

// Lock takes an exclusive advisory lock on path (created 0600 if missing), blocking until it is
// free, so that processes sharing a directory take turns; call the returned function to release it.
func Lock(path string) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, PrivateFileMode)
	if err != nil {
		return nil, fmt.Errorf("open lock file %s: %w", path, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return func() {
		_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		_ = f.Close()
	}, nil
}
