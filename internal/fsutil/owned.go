//go:build unix

package fsutil

// Directories we trust are ours, as OpenSSH's StrictModes has it (auth.c, secure_filename): a
// state, output or key directory that another user owns or can write in is refused, since that
// user could have put their own keys there, and a key file in one must be a file of ours that no
// one else can change. The checks stop at the directory: its parents are the operator's choice.

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// ErrNotOwned reports a directory or key file that another user owns or can change.
var ErrNotOwned = errors.New("another user could have put their own keys there")

// Advice that ends a refusal.
const (
	dirAdvice = "use a directory of your own, or chown it to this user and chmod it go-w"
	keyAdvice = "chown it to this user and chmod it 0600, or remove it"
)

// CheckOwnedDir refuses dir (ErrNotOwned) unless it is a directory owned by the effective uid
// that neither its group nor others can write. A link at dir itself is followed, since the
// operator named it; the directory it leads to is checked. A missing dir passes: there is
// nothing in it yet, and EnsureOwnedDir makes it.
func CheckOwnedDir(dir string) error { return checkOwnedDir(dir, os.Geteuid()) }

// CheckOwnedSubdir is CheckOwnedDir for a directory inside one we trust, where a symbolic link
// is refused: nothing follows a link out of a trusted directory.
func CheckOwnedSubdir(path string) error { return checkOwnedSubdir(path, os.Geteuid()) }

// EnsureOwnedDir makes dir and its missing parents with perm, then checks dir as CheckOwnedDir
// does. MkdirAll leaves an existing directory as it finds it, so a directory another user made
// first is refused, never used.
func EnsureOwnedDir(dir string, perm os.FileMode) error {
	return ensureOwnedDir(dir, perm, os.Geteuid())
}

// EnsureOwnedSubdir makes path, a directory inside one we trust, with perm when it is missing,
// then checks it as CheckOwnedSubdir does.
func EnsureOwnedSubdir(path string, perm os.FileMode) error {
	if err := os.Mkdir(path, perm); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("create directory %s: %w", path, err)
	}
	return checkDir(path, os.Lstat, os.Geteuid(), false)
}

// CheckKeyFile refuses a key file in a trusted directory (ErrNotOwned) unless it is a regular
// file (a symbolic link is refused, not followed) owned by the effective uid, that its group
// cannot write and others can neither read, write nor execute: a group-readable key is allowed,
// for OUTPUT_CERTS made so on purpose. A missing file passes.
func CheckKeyFile(path string) error { return checkKeyFile(path, os.Geteuid()) }

func checkOwnedDir(dir string, euid int) error     { return checkDir(dir, os.Stat, euid, true) }
func checkOwnedSubdir(path string, euid int) error { return checkDir(path, os.Lstat, euid, true) }

func ensureOwnedDir(dir string, perm os.FileMode, euid int) error {
	if err := EnsureDir(dir, perm); err != nil {
		return err
	}
	return checkDir(dir, os.Stat, euid, false)
}

func checkDir(path string, stat func(string) (os.FileInfo, error), euid int, missingOK bool) error {
	info, err := stat(path)
	if missingOK && errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("directory %s: %w", path, err)
	}
	switch {
	case info.Mode()&os.ModeSymlink != 0:
		return fmt.Errorf("directory %s is a symbolic link, not followed inside a trusted directory: %w: remove it", path, ErrNotOwned)
	case !info.IsDir():
		return fmt.Errorf("%s is not a directory", path)
	}
	uid := owner(info)
	switch {
	case uid != euid:
		return refusal("directory", path, info, fmt.Sprintf("is owned by uid %d, not by uid %d that this process runs as", uid, euid), dirAdvice)
	case info.Mode().Perm()&0o022 != 0:
		return refusal("directory", path, info, "is writable by its group or by others", dirAdvice)
	}
	return nil
}

func checkKeyFile(path string, euid int) error {
	info, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("key file %s: %w", path, err)
	}
	switch uid := owner(info); {
	case info.Mode()&os.ModeSymlink != 0:
		return fmt.Errorf("key file %s is a symbolic link, not followed: %w: replace it with the file itself", path, ErrNotOwned)
	case !info.Mode().IsRegular():
		return refusal("key file", path, info, "is not a regular file", keyAdvice)
	case uid != euid:
		return refusal("key file", path, info, fmt.Sprintf("is owned by uid %d, not by uid %d that this process runs as", uid, euid), keyAdvice)
	case info.Mode().Perm()&0o027 != 0:
		return refusal("key file", path, info, "is writable by its group, or open to others", keyAdvice)
	}
	return nil
}

// refusal names the path, its owner and its mode, says what is wrong and what to do.
func refusal(kind, path string, info os.FileInfo, why, advice string) error {
	mode := info.Mode().Perm()
	if info.Mode()&os.ModeSticky != 0 {
		mode |= 0o1000
	}
	return fmt.Errorf("%s %s (owner uid %d, mode %04o) %s: %w: %s", kind, path, owner(info), uint32(mode), why, ErrNotOwned, advice)
}

// owner is the uid that owns what info describes.
func owner(info os.FileInfo) int {
	if st, ok := info.Sys().(*syscall.Stat_t); ok {
		return int(st.Uid)
	}
	return -1
}

// CheckDataKeyFile checks, as CheckKeyFile does, the file that a "..data" layout in dir (see
// WriteData) serves as name, following only the links the layout makes: name a link to
// DataLink/name (or a regular file), DataLink a link to a directory in dir (one name), which is
// checked as CheckOwnedSubdir does. Any other link is refused. A missing file passes.
func CheckDataKeyFile(dir, name string) error {
	path := filepath.Join(dir, name)
	info, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("key file %s: %w", path, err)
	}
	if info.Mode()&os.ModeSymlink == 0 {
		return CheckKeyFile(path)
	}
	want := filepath.Join(DataLink, name)
	if target, err := os.Readlink(path); err != nil {
		return fmt.Errorf("key file %s: %w", path, err)
	} else if target != want {
		return fmt.Errorf("key file %s links to %s, not through %s: %w: remove it", path, target, DataLink, ErrNotOwned)
	}
	data := filepath.Join(dir, DataLink)
	info, err = os.Lstat(data)
	if errors.Is(err, fs.ErrNotExist) {
		return nil // a dangling link serves nothing
	}
	if err != nil {
		return fmt.Errorf("%s: %w", data, err)
	}
	generation := data
	if info.Mode()&os.ModeSymlink != 0 {
		target, err := os.Readlink(data)
		if err != nil {
			return fmt.Errorf("%s: %w", data, err)
		}
		if target == "" || target == "." || target == ".." || strings.ContainsRune(target, filepath.Separator) {
			return fmt.Errorf("%s links to %s, out of %s: %w: remove it", data, target, dir, ErrNotOwned)
		}
		generation = filepath.Join(dir, target)
	}
	if err := CheckOwnedSubdir(generation); err != nil {
		return err
	}
	return CheckKeyFile(filepath.Join(generation, name))
}

// LoadOrCreateKeyFile returns the key file at path (checked as CheckKeyFile checks it) or, when
// there is none, writes what create returns there (0600, CreateFileAtomic) and returns that,
// reporting that it did: the start-up of a key a process keeps in its own state dir. Of processes
// starting together on one state dir, one creates the key and the others read it.
func LoadOrCreateKeyFile(path string, create func() ([]byte, error)) (data []byte, created bool, err error) {
	if err := CheckKeyFile(path); err != nil {
		return nil, false, err
	}
	if data, ok, err := ReadOptional(path); err != nil || ok {
		return data, false, err
	}
	if data, err = create(); err != nil {
		return nil, false, err
	}
	if created, err = CreateFileAtomic(path, data, PrivateFileMode); err != nil || created {
		return data, created, err
	}
	if err := CheckKeyFile(path); err != nil {
		return nil, false, err
	}
	data, _, err = ReadOptional(path)
	return data, false, err
}
