package fsutil

import (
	"errors"
	"fmt"
	"os"
)

// ErrSharedDir reports a directory in which any local user can replace a file: it is writable by
// everyone and lacks the sticky bit.
var ErrSharedDir = errors.New("writable by every user without the sticky bit: any local user can replace the socket in it")

// CheckSocketDir reports a socket directory in which another user could swap the socket for one
// of their own (ErrSharedDir), naming the directory and its mode.
func CheckSocketDir(dir string) error {
	info, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("socket directory: %w", err)
	}
	if !info.IsDir() {
		return fmt.Errorf("socket directory %s is not a directory", dir)
	}
	if info.Mode().Perm()&0o002 != 0 && info.Mode()&os.ModeSticky == 0 {
		return fmt.Errorf("socket directory %s (mode %v) is %w", dir, info.Mode(), ErrSharedDir)
	}
	return nil
}
