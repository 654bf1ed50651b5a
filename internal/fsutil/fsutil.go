// Package fsutil writes files the way key material must be written: atomically, privately and synced.
package fsutil

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// Modes for files and directories that hold key material and for public files next to them.
const (
	PrivateFileMode os.FileMode = 0o600
	PublicFileMode  os.FileMode = 0o644
	PrivateDirMode  os.FileMode = 0o700
)

// tempInfix is in the name of every temporary file of WriteFileAtomic: "." + base + tempInfix +
// the random digits of os.CreateTemp.
const tempInfix = ".tmp-"

// WriteFileAtomic replaces path with data so that a reader sees either the old content or the new,
// never a mix: it writes a temporary file in the same directory with mode perm, syncs it, renames
// it over path, and syncs the directory so that the rename survives a crash. A process killed
// before the rename leaves the temporary file behind; see RemoveTempFiles.
func WriteFileAtomic(path string, data []byte, perm os.FileMode) error {
	return Syncer(nil).WriteFileAtomic(path, data, perm)
}

// WriteFileAtomic is the package's WriteFileAtomic, the file and its directory flushed with s.
func (s Syncer) WriteFileAtomic(path string, data []byte, perm os.FileMode) error {
	tmp, err := s.writeTemp(path, data, perm)
	if err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("rename %s to %s: %w", tmp, path, err)
	}
	return s.SyncDir(filepath.Dir(path))
}

// NoSync is the Syncer of a file that needs to be replaced atomically but not durably: one its
// writer writes again at every start before anything reads it, such as Envoy's bootstrap. Such a
// write never waits for the disk.
func NoSync(*os.File) error { return nil }

// CreateFileAtomic is WriteFileAtomic that never replaces: when path already exists (another
// process created it first) it writes nothing and reports created false.
func CreateFileAtomic(path string, data []byte, perm os.FileMode) (created bool, err error) {
	tmp, err := Syncer(nil).writeTemp(path, data, perm)
	if err != nil {
		return false, err
	}
	defer func() { _ = os.Remove(tmp) }()
	// A hard link, unlike a rename, fails on an existing name: of processes racing to create
	// path, exactly one wins, and the others read what it wrote.
	if err := os.Link(tmp, path); errors.Is(err, os.ErrExist) {
		return false, nil
	} else if err != nil {
		return false, fmt.Errorf("link %s to %s: %w", tmp, path, err)
	}
	return true, SyncDir(filepath.Dir(path))
}

// writeTemp writes data, flushed with s, to a new temporary file beside path with mode perm, and
// returns its name.
func (s Syncer) writeTemp(path string, data []byte, perm os.FileMode) (name string, err error) {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+tempInfix+"*")
	if err != nil {
		return "", fmt.Errorf("create temporary file for %s: %w", path, err)
	}
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	// CreateTemp makes the file 0600; set the final mode before any byte is written.
	if err := tmp.Chmod(perm); err != nil {
		return "", fmt.Errorf("set mode of %s: %w", tmp.Name(), err)
	}
	if _, err := tmp.Write(data); err != nil {
		return "", fmt.Errorf("write %s: %w", tmp.Name(), err)
	}
	if err := s.sync(tmp); err != nil {
		return "", fmt.Errorf("sync %s: %w", tmp.Name(), err)
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("close %s: %w", tmp.Name(), err)
	}
	return tmp.Name(), nil
}

// RemoveTempFiles removes the temporary files of WriteFileAtomic left in dir by a process killed
// while writing, and returns their paths. It removes only regular files named as WriteFileAtomic
// names them, and follows no symlink. Call it when no WriteFileAtomic into dir can be running
// (under the lock of the processes sharing dir): it cannot tell a leftover from a file in use.
// It goes on past a file it cannot remove, and reports every failure.
func RemoveTempFiles(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", dir, err)
	}
	var removed []string
	var errs []error
	for _, e := range entries {
		// Type comes from the directory entry (lstat, not stat): a symlink is not regular.
		if !e.Type().IsRegular() || !isTempName(e.Name()) {
			continue
		}
		path := filepath.Join(dir, e.Name())
		if err := os.Remove(path); err != nil {
			if !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("remove %s: %w", path, err))
			}
			continue
		}
		removed = append(removed, path)
	}
	return removed, errors.Join(errs...)
}

// isTempName reports whether name is "." + base + tempInfix + digits, with base not empty.
func isTempName(name string) bool {
	rest, ok := strings.CutPrefix(name, ".")
	if !ok {
		return false
	}
	i := strings.LastIndex(rest, tempInfix)
	if i <= 0 {
		return false
	}
	digits := rest[i+len(tempInfix):]
	if digits == "" {
		return false
	}
	for _, c := range digits {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// WritePrivateFile atomically writes data readable by the owner only.
func WritePrivateFile(path string, data []byte) error {
	return WriteFileAtomic(path, data, PrivateFileMode)
}

// Syncer flushes an open file or directory to the disk; nil is (*os.File).Sync. Tests give one
// that blocks or fails, to see what waits for the disk and what a failed flush does.
type Syncer func(*os.File) error

func (s Syncer) sync(f *os.File) error {
	if s == nil {
		return f.Sync()
	}
	return s(f)
}

// SyncDir flushes a directory's entries, making renames and creations in it durable.
func SyncDir(dir string) error { return Syncer(nil).SyncDir(dir) }

// SyncDir is the package's SyncDir, the directory flushed with s.
func (s Syncer) SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open directory %s: %w", dir, err)
	}
	syncErr := s.sync(d)
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

// MaxSocketPath is the longest Unix socket path the kernel takes (sun_path holds 108 bytes with
// the terminating NUL).
const MaxSocketPath = 107

// CheckSocketPath refuses a socket path the kernel cannot bind.
func CheckSocketPath(path string) error {
	if len(path) > MaxSocketPath {
		return fmt.Errorf("socket path %s is %d bytes, over the kernel's limit of %d: choose a shorter directory", path, len(path), MaxSocketPath)
	}
	return nil
}

// IsDir reports whether path is a directory, following links.
func IsDir(path string) bool {
	info, err := os.Stat(path)
	return err == nil && info.IsDir()
}

// IsRegular reports whether path is a regular file, following links.
func IsRegular(path string) bool {
	info, err := os.Stat(path)
	return err == nil && info.Mode().IsRegular()
}

// Overlap reports whether one of two absolute paths is the other or inside it, as written or
// once the symlinks of their longest existing prefixes are resolved: a directory that reaches
// another through a link overlaps it too.
func Overlap(a, b string) bool {
	a, b = filepath.Clean(a), filepath.Clean(b)
	return overlap(a, b) || overlap(resolveExisting(a), resolveExisting(b))
}

// overlap reports whether one of two clean absolute paths is the other or inside it.
func overlap(a, b string) bool {
	return a == b || strings.HasPrefix(b, strings.TrimSuffix(a, "/")+"/") || strings.HasPrefix(a, strings.TrimSuffix(b, "/")+"/")
}

// resolveExisting resolves the symlinks of path's longest existing prefix. The prefix is found
// with one Lstat per missing component, and resolved once.
func resolveExisting(path string) string {
	rest := ""
	for p := path; ; p = filepath.Dir(p) {
		if _, err := os.Lstat(p); err == nil {
			if resolved, err := filepath.EvalSymlinks(p); err == nil {
				return filepath.Join(resolved, rest)
			}
		}
		if filepath.Dir(p) == p {
			return path
		}
		rest = filepath.Join(filepath.Base(p), rest)
	}
}

// CheckDir says what is wrong with a directory that must exist, completing "PATH ...": it
// does not exist (absent says when it could be), cannot be read, or is not a directory.
func CheckDir(dir, absent string) error {
	info, err := os.Stat(dir)
	if err != nil {
		return GivenPathError(err, absent)
	}
	if !info.IsDir() {
		return errors.New("is not a directory")
	}
	return nil
}

// GivenPathError says what err, from reading a path given explicitly, means to the one who gave
// it, completing "PATH ...": it does not exist (absent says when it could be), or it cannot be
// read, and why.
func GivenPathError(err error, absent string) error {
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("does not exist (%s)", absent)
	}
	return fmt.Errorf("cannot be read: %w", err)
}
