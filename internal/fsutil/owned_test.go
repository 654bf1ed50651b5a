package fsutil

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// mkdir makes a directory with exactly mode, whatever the umask.
func mkdir(t *testing.T, path string, mode os.FileMode) string {
	t.Helper()
	if err := os.Mkdir(path, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
	return path
}

// writeMode writes a file with exactly mode, whatever the umask.
func writeMode(t *testing.T, path string, mode os.FileMode) string {
	t.Helper()
	if err := os.WriteFile(path, []byte("key"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
	return path
}

// assertRefused checks a refusal: ErrNotOwned, naming the path, the owner and the mode, and
// saying what to do.
func assertRefused(t *testing.T, err error, path, mode string) {
	t.Helper()
	if !errors.Is(err, ErrNotOwned) {
		t.Fatalf("%s: %v, want ErrNotOwned", path, err)
	}
	msg := err.Error()
	for _, want := range []string{path, "owner uid " + strconv.Itoa(os.Geteuid()), "mode " + mode, "chown"} {
		if !strings.Contains(msg, want) {
			t.Errorf("%q does not say %q", msg, want)
		}
	}
}

// A directory we trust is ours alone: owned by the effective uid, writable by no one else.
func TestCheckOwnedDir(t *testing.T) {
	t.Parallel()
	me := os.Geteuid()
	tests := []struct {
		name    string
		mode    os.FileMode
		euid    int
		refused string // the mode the refusal names; "" when accepted
	}{
		{"private", 0o700, me, ""},
		{"readable by all", 0o755, me, ""},
		{"readable by the group", 0o750, me, ""},
		{"group-writable", 0o770, me, "0770"},
		{"writable by others", 0o707, me, "0707"},
		{"everyone's", 0o777, me, "0777"},
		{"sticky, writable by everyone", os.ModeSticky | 0o777, me, "1777"},
		{"another user's", 0o700, me + 1, "0700"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := mkdir(t, filepath.Join(t.TempDir(), "state"), tt.mode)
			for _, check := range []func(string, int) error{checkOwnedDir, checkOwnedSubdir} {
				err := check(dir, tt.euid)
				if tt.refused == "" {
					if err != nil {
						t.Fatalf("refused: %v", err)
					}
					continue
				}
				assertRefused(t, err, dir, tt.refused)
				if tt.euid != me && !strings.Contains(err.Error(), "uid "+strconv.Itoa(tt.euid)) {
					t.Errorf("%q does not name the uid this process runs as", err)
				}
			}
		})
	}
}

// A missing directory holds nothing to distrust; a link is followed only where the operator
// named the directory, never inside a directory we trust.
func TestCheckOwnedDirLinksAndMissing(t *testing.T) {
	t.Parallel()
	base := t.TempDir()
	missing := filepath.Join(base, "missing")
	if err := CheckOwnedDir(missing); err != nil {
		t.Errorf("missing directory: %v", err)
	}
	if err := CheckOwnedSubdir(missing); err != nil {
		t.Errorf("missing subdirectory: %v", err)
	}
	own := mkdir(t, filepath.Join(base, "own"), 0o700)
	link := filepath.Join(base, "link")
	if err := os.Symlink(own, link); err != nil {
		t.Fatal(err)
	}
	if err := CheckOwnedDir(link); err != nil {
		t.Errorf("a link the operator names to a directory of ours: %v", err)
	}
	err := CheckOwnedSubdir(link)
	if !errors.Is(err, ErrNotOwned) || !strings.Contains(err.Error(), link) || !strings.Contains(err.Error(), "symbolic link") {
		t.Errorf("a link inside a trusted directory: %v, want ErrNotOwned naming it as a link", err)
	}
	file := writeMode(t, filepath.Join(base, "file"), 0o600)
	for _, check := range []func(string) error{CheckOwnedDir, CheckOwnedSubdir} {
		if err := check(file); err == nil || !strings.Contains(err.Error(), "not a directory") {
			t.Errorf("a file for a directory: %v", err)
		}
	}
}

// EnsureOwnedDir makes a missing directory private, and checks an existing one: MkdirAll leaves
// it as it finds it, so another user's directory made first is refused, never used.
func TestEnsureOwnedDir(t *testing.T) {
	t.Parallel()
	base := t.TempDir()
	made := filepath.Join(base, "a", "b")
	if err := EnsureOwnedDir(made, PrivateDirMode); err != nil {
		t.Fatal(err)
	}
	if info, err := os.Stat(made); err != nil || info.Mode().Perm() != PrivateDirMode {
		t.Fatalf("made %v (%v), want mode 0700", info.Mode(), err)
	}
	if err := EnsureOwnedDir(made, PrivateDirMode); err != nil {
		t.Fatalf("an existing directory of ours: %v", err)
	}
	open := mkdir(t, filepath.Join(base, "open"), 0o777)
	assertRefused(t, EnsureOwnedDir(open, PrivateDirMode), open, "0777")
	if info, err := os.Stat(open); err != nil || info.Mode().Perm() != 0o777 {
		t.Fatalf("the refused directory was changed: %v (%v)", info.Mode(), err)
	}
	theirs := mkdir(t, filepath.Join(base, "theirs"), 0o700)
	assertRefused(t, ensureOwnedDir(theirs, PrivateDirMode, os.Geteuid()+1), theirs, "0700")

	sub := filepath.Join(made, "sub")
	if err := EnsureOwnedSubdir(sub, PrivateDirMode); err != nil {
		t.Fatal(err)
	}
	if info, err := os.Lstat(sub); err != nil || !info.IsDir() || info.Mode().Perm() != PrivateDirMode {
		t.Fatalf("subdirectory %v (%v), want a 0700 directory", info.Mode(), err)
	}
	link := filepath.Join(made, "link")
	if err := os.Symlink(base, link); err != nil {
		t.Fatal(err)
	}
	if err := EnsureOwnedSubdir(link, PrivateDirMode); !errors.Is(err, ErrNotOwned) {
		t.Fatalf("a link for a subdirectory: %v, want ErrNotOwned", err)
	}
}

// A key file in a trusted directory is a regular file of ours that no one else can write nor
// others read (the group may read: OUTPUT_CERTS can be made so on purpose).
func TestCheckKeyFile(t *testing.T) {
	t.Parallel()
	me := os.Geteuid()
	tests := []struct {
		name    string
		mode    os.FileMode
		euid    int
		refused string
	}{
		{"private", 0o600, me, ""},
		{"read-only", 0o400, me, ""},
		{"group-readable", 0o640, me, ""},
		{"group-writable", 0o660, me, "0660"},
		{"readable by others", 0o644, me, "0644"},
		{"executable by others", 0o601, me, "0601"},
		{"another user's", 0o600, me + 1, "0600"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			path := writeMode(t, filepath.Join(t.TempDir(), "ca-key.pem"), tt.mode)
			err := checkKeyFile(path, tt.euid)
			if tt.refused == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			assertRefused(t, err, path, tt.refused)
		})
	}
	dir := t.TempDir()
	if err := CheckKeyFile(filepath.Join(dir, "missing.pem")); err != nil {
		t.Errorf("a missing key file: %v", err)
	}
	target := writeMode(t, filepath.Join(t.TempDir(), "theirs.pem"), 0o600)
	link := filepath.Join(dir, "token-key.pem")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if err := CheckKeyFile(link); !errors.Is(err, ErrNotOwned) || !strings.Contains(err.Error(), "symbolic link") {
		t.Errorf("a link for a key file: %v, want ErrNotOwned naming it as a link", err)
	}
	sub := mkdir(t, filepath.Join(dir, "ca-key.pem"), 0o700)
	if err := CheckKeyFile(sub); !errors.Is(err, ErrNotOwned) || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("a directory for a key file: %v, want ErrNotOwned", err)
	}
}

// The key a "..data" layout serves is checked where it is, through links that stay inside the
// directory, and any other link is refused.
func TestCheckDataKeyFile(t *testing.T) {
	t.Parallel()
	layout := func(t *testing.T, dirMode, keyMode os.FileMode) string {
		t.Helper()
		dir := filepath.Join(t.TempDir(), "certs")
		if err := WriteData(dir, "..meshid_", dirMode, []DataFile{{Name: "key.pem", Data: []byte("k"), Mode: keyMode}}); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	generation := func(t *testing.T, dir string) string {
		t.Helper()
		gen, err := os.Readlink(filepath.Join(dir, DataLink))
		if err != nil {
			t.Fatal(err)
		}
		return filepath.Join(dir, gen)
	}
	relink := func(t *testing.T, path, target string) {
		t.Helper()
		if err := os.Remove(path); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(target, path); err != nil {
			t.Fatal(err)
		}
	}
	outside := mkdir(t, filepath.Join(t.TempDir(), "outside"), 0o700)
	writeMode(t, filepath.Join(outside, "key.pem"), 0o600)

	tests := []struct {
		name   string
		make   func(t *testing.T) string
		refuse string // in the error; "" when accepted
	}{
		{"private", func(t *testing.T) string { return layout(t, 0o700, 0o600) }, ""},
		{"group-readable", func(t *testing.T) string { return layout(t, 0o750, 0o640) }, ""},
		{"missing", func(t *testing.T) string { return t.TempDir() }, ""},
		{"a plain file", func(t *testing.T) string {
			dir := t.TempDir()
			writeMode(t, filepath.Join(dir, "key.pem"), 0o600)
			return dir
		}, ""},
		{"key readable by others", func(t *testing.T) string {
			dir := layout(t, 0o700, 0o600)
			if err := os.Chmod(filepath.Join(generation(t, dir), "key.pem"), 0o644); err != nil {
				t.Fatal(err)
			}
			return dir
		}, "0644"},
		{"generation writable by others", func(t *testing.T) string {
			dir := layout(t, 0o700, 0o600)
			if err := os.Chmod(generation(t, dir), 0o777); err != nil {
				t.Fatal(err)
			}
			return dir
		}, "0777"},
		{"key.pem linked out", func(t *testing.T) string {
			dir := layout(t, 0o700, 0o600)
			relink(t, filepath.Join(dir, "key.pem"), filepath.Join(outside, "key.pem"))
			return dir
		}, "not through " + DataLink},
		{"..data linked out", func(t *testing.T) string {
			dir := layout(t, 0o700, 0o600)
			relink(t, filepath.Join(dir, DataLink), outside)
			return dir
		}, "out of"},
		{"..data linked up", func(t *testing.T) string {
			dir := layout(t, 0o700, 0o600)
			relink(t, filepath.Join(dir, DataLink), "..")
			return dir
		}, "out of"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := tt.make(t)
			err := CheckDataKeyFile(dir, "key.pem")
			if tt.refuse == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if !errors.Is(err, ErrNotOwned) || !strings.Contains(err.Error(), tt.refuse) || !strings.Contains(err.Error(), dir) {
				t.Fatalf("%v, want ErrNotOwned naming %s and saying %q", err, dir, tt.refuse)
			}
		})
	}
}

// TryLockPID records its holder, so that the process it refuses can name it; two opens in one
// process conflict as two processes do (flock locks belong to open files).
func TestTryLockPID(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, ".lock")
	if _, ok := LockHolder(path); ok {
		t.Fatal("a holder for a missing lock file")
	}
	unlock, err := TryLockPID(path)
	if err != nil {
		t.Fatal(err)
	}
	if pid, ok := LockHolder(path); !ok || pid != os.Getpid() {
		t.Fatalf("holder %d (%v), want this process, %d", pid, ok, os.Getpid())
	}
	if _, err := TryLockPID(path); !errors.Is(err, ErrLocked) {
		t.Fatalf("second lock: %v, want ErrLocked", err)
	}
	if pid, ok := LockHolder(path); !ok || pid != os.Getpid() {
		t.Fatalf("the refused attempt changed the holder: %d (%v)", pid, ok)
	}
	unlock()
	again, err := TryLockPID(path)
	if err != nil {
		t.Fatalf("lock after unlock: %v", err)
	}
	again()

	// A lock file is never opened through a link: the lock would land on another file.
	link := filepath.Join(dir, "link.lock")
	if err := os.Symlink(writeMode(t, filepath.Join(t.TempDir(), "target"), 0o600), link); err != nil {
		t.Fatal(err)
	}
	if _, err := TryLockPID(link); err == nil {
		t.Fatal("locked through a symbolic link")
	}
	if _, err := TryLock(link); err == nil {
		t.Fatal("TryLock locked through a symbolic link")
	}
}

// A key is created once, 0600, then read as it is; a key others can read is refused, not
// replaced.
func TestLoadOrCreateKeyFile(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "key.pem")
	creates := 0
	create := func() ([]byte, error) { creates++; return []byte("key " + strconv.Itoa(creates)), nil }
	data, created, err := LoadOrCreateKeyFile(path, create)
	if err != nil || !created || string(data) != "key 1" {
		t.Fatalf("first start: %q, created %v, %v; want key 1 created", data, created, err)
	}
	if info, err := os.Stat(path); err != nil || info.Mode().Perm() != 0o600 {
		t.Fatalf("the key file: %v, %v; want mode 0600", info, err)
	}
	data, created, err = LoadOrCreateKeyFile(path, create)
	if err != nil || created || string(data) != "key 1" || creates != 1 {
		t.Fatalf("restart: %q, created %v, %v (%d creations); want key 1 read back", data, created, err, creates)
	}
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, _, err := LoadOrCreateKeyFile(path, create); !errors.Is(err, ErrNotOwned) || creates != 1 {
		t.Fatalf("a key others can read: %v (%d creations), want ErrNotOwned and no new key", err, creates)
	}
	failed := errors.New("no entropy")
	if _, _, err := LoadOrCreateKeyFile(filepath.Join(t.TempDir(), "key.pem"), func() ([]byte, error) { return nil, failed }); !errors.Is(err, failed) {
		t.Fatalf("a failed creation: %v, want %v", err, failed)
	}
}

// Two processes starting on one state dir: the one that creates the key second reads the first
// one's, and never replaces it (a replaced key is one the first goes on signing with, on no disk).
func TestLoadOrCreateKeyFileRace(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "key.pem")
	// The other process creates its key while this one generates its own.
	create := func() ([]byte, error) {
		if _, _, err := LoadOrCreateKeyFile(path, func() ([]byte, error) { return []byte("first"), nil }); err != nil {
			return nil, err
		}
		return []byte("second"), nil
	}
	data, created, err := LoadOrCreateKeyFile(path, create)
	if err != nil || created || string(data) != "first" {
		t.Fatalf("the later process: %q, created %v, %v; want the first key, not created", data, created, err)
	}
	if got, err := os.ReadFile(path); err != nil || string(got) != "first" {
		t.Fatalf("the key file: %q, %v; want the first key, kept", got, err)
	}
	if left, err := filepath.Glob(filepath.Join(filepath.Dir(path), ".*")); err != nil || len(left) != 0 {
		t.Fatalf("temporary files left: %v, %v", left, err)
	}
}
