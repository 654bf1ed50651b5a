//go:build unix

package fsutil

import (
	"errors"
	"fmt"
	"os"
	"syscall"
)

// Lock takes an exclusive advisory lock on path (created 0600 if missing), blocking until it is
// free, so that processes sharing a directory take turns; call the returned function to release it.
func Lock(path string) (unlock func(), err error) {
	return flock(path, syscall.LOCK_EX)
}

// ErrLocked reports a lock that another process holds.
var ErrLocked = errors.New("held by another process")

// TryLock takes an exclusive advisory lock on path (created 0600 if missing) without waiting: it
// fails with ErrLocked while another process holds it. The lock lasts until unlock is called or
// the process ends.
func TryLock(path string) (unlock func(), err error) {
	return flock(path, syscall.LOCK_EX|syscall.LOCK_NB)
}

func flock(path string, how int) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, PrivateFileMode)
	if err != nil {
		return nil, fmt.Errorf("open lock file %s: %w", path, err)
	}
	if err := syscall.Flock(int(f.Fd()), how); err != nil {
		_ = f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("lock %s: %w", path, ErrLocked)
		}
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return func() {
		_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		_ = f.Close()
	}, nil
}
