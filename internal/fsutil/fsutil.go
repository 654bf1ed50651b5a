// Package fsutil writes files the way key material must be written: atomically, privately and synced.
package fsutil

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// Modes for files and directories that hold key material and for public files next to them.
const (
	PrivateFileMode os.FileMode = 0o600
	PublicFileMode  os.FileMode = 0o644
	PrivateDirMode  os.FileMode = 0o700
)

// WriteFileAtomic replaces path with data so that a reader sees either the old content or the new,
// never a mix: it writes a temporary file in the same directory with mode perm, syncs it, renames
// it over path, and syncs the directory so that the rename survives a crash.
func WriteFileAtomic(path string, data []byte, perm os.FileMode) (err error) {
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("create temporary file for %s: %w", path, err)
	}
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	// CreateTemp makes the file 0600; set the final mode before any byte is written.
	if err := tmp.Chmod(perm); err != nil {
		return fmt.Errorf("set mode of %s: %w", tmp.Name(), err)
	}
	if _, err := tmp.Write(data); err != nil {
		return fmt.Errorf("write %s: %w", tmp.Name(), err)
	}
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", tmp.Name(), err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("close %s: %w", tmp.Name(), err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("rename %s to %s: %w", tmp.Name(), path, err)
	}
	return SyncDir(dir)
}

// WritePrivateFile atomically writes data readable by the owner only.
func WritePrivateFile(path string, data []byte) error {
	return WriteFileAtomic(path, data, PrivateFileMode)
}

// SyncDir flushes a directory's entries, making renames and creations in it durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open directory %s: %w", dir, err)
	}
	syncErr := d.Sync()
	closeErr := d.Close()
	if err := errors.Join(syncErr, closeErr); err != nil {
		return fmt.Errorf("sync directory %s: %w", dir, err)
	}
	return nil
}

// EnsureDir creates dir and its parents with perm when missing. An existing directory is left as it is.
func EnsureDir(dir string, perm os.FileMode) error {
	if err := os.MkdirAll(dir, perm); err != nil {
		return fmt.Errorf("create directory %s: %w", dir, err)
	}
	return nil
}

// ReadOptional reads path; a missing file is reported as (nil, false, nil).
func ReadOptional(path string) ([]byte, bool, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("read %s: %w", path, err)
	}
	return data, true, nil
}
