//go:build unix

package fsutil

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// Lock takes an exclusive advisory lock on path (created 0600 if missing), blocking until it is
// free, so that processes sharing a directory take turns; call the returned function to release it.
func Lock(path string) (unlock func(), err error) {
	f, err := flock(path, syscall.LOCK_EX)
	if err != nil {
		return nil, err
	}
	return release(f), nil
}

// ErrLocked reports a lock that another process holds.
var ErrLocked = errors.New("held by another process")

// TryLock takes an exclusive advisory lock on path (created 0600 if missing) without waiting: it
// fails with ErrLocked while another process holds it. The lock lasts until unlock is called or
// the process ends.
func TryLock(path string) (unlock func(), err error) {
	f, err := flock(path, syscall.LOCK_EX|syscall.LOCK_NB)
	if err != nil {
		return nil, err
	}
	return release(f), nil
}

// TryLockPID is TryLock that then writes this process's id into the lock file, so that a
// process it refuses can say which one holds it (LockHolder).
func TryLockPID(path string) (unlock func(), err error) {
	f, err := flock(path, syscall.LOCK_EX|syscall.LOCK_NB)
	if err != nil {
		return nil, err
	}
	// Through a descriptor of its own, closed at once: the lock's is read-only, so that holding
	// it never keeps the file system from being remounted read-only. A flock lock belongs to its
	// open file, and closing another one does not release it.
	w, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC|syscall.O_NOFOLLOW, 0)
	if err == nil {
		_, err = w.Write([]byte(strconv.Itoa(os.Getpid()) + "\n"))
		if closeErr := w.Close(); err == nil {
			err = closeErr
		}
	}
	if err != nil {
		release(f)()
		return nil, fmt.Errorf("record the holder of %s: %w", path, err)
	}
	return release(f), nil
}

// LockHolder returns the process id TryLockPID recorded in path, if it holds one. The holder
// may be gone: the lock, not the file, says whether it is held.
func LockHolder(path string) (int, bool) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return 0, false
	}
	defer func() { _ = f.Close() }()
	data, err := io.ReadAll(io.LimitReader(f, 32))
	if err != nil {
		return 0, false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || pid <= 0 {
		return 0, false
	}
	return pid, true
}

// flock opens path, never through a symbolic link (the lock would land on another file), and
// locks it. The file is open for reading only: a file open for writing would keep its file
// system from being remounted read-only for as long as the lock is held.
func flock(path string, how int) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDONLY|syscall.O_NOFOLLOW, PrivateFileMode)
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
	return f, nil
}

func release(f *os.File) func() {
	return func() {
		_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		_ = f.Close()
	}
}
