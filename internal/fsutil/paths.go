package fsutil

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

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
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("does not exist (%s)", absent)
	case err != nil:
		return fmt.Errorf("cannot be read: %w", err)
	case !info.IsDir():
		return errors.New("is not a directory")
	}
	return nil
}
