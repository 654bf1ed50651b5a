package fsutil

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
)

func TestWriteFileAtomicModesAndContent(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		perm os.FileMode
	}{
		{"private", PrivateFileMode},
		{"public", PublicFileMode},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			path := filepath.Join(dir, "key.pem")
			if err := WriteFileAtomic(path, []byte("first"), tt.perm); err != nil {
				t.Fatal(err)
			}
			if err := WriteFileAtomic(path, []byte("second"), tt.perm); err != nil {
				t.Fatal(err)
			}
			got, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, []byte("second")) {
				t.Fatalf("content = %q, want %q", got, "second")
			}
			info, err := os.Stat(path)
			if err != nil {
				t.Fatal(err)
			}
			if info.Mode().Perm() != tt.perm {
				t.Fatalf("mode = %v, want %v", info.Mode().Perm(), tt.perm)
			}
			entries, err := os.ReadDir(dir)
			if err != nil {
				t.Fatal(err)
			}
			if len(entries) != 1 {
				t.Fatalf("directory holds %d entries, want only the target (temporary files left behind?)", len(entries))
			}
		})
	}
}

func TestWriteFileAtomicMissingDirFailsCleanly(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "absent", "key.pem")
	if err := WritePrivateFile(path, []byte("k")); err == nil {
		t.Fatal("write into a missing directory succeeded")
	}
}

func TestReadOptional(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if _, ok, err := ReadOptional(filepath.Join(dir, "none")); ok || err != nil {
		t.Fatalf("missing file: ok=%v err=%v, want false, nil", ok, err)
	}
	path := filepath.Join(dir, "f")
	if err := os.WriteFile(path, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	data, ok, err := ReadOptional(path)
	if !ok || err != nil || string(data) != "x" {
		t.Fatalf("existing file: %q ok=%v err=%v", data, ok, err)
	}
	if _, _, err := ReadOptional(dir); err == nil {
		t.Fatal("reading a directory succeeded")
	}
}

func TestLockIsExclusive(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), ".lock")
	unlock, err := Lock(path)
	if err != nil {
		t.Fatal(err)
	}
	// Another open file description (as another process has) cannot take it meanwhile.
	other, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Close() }()
	if err := syscall.Flock(int(other.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); !errors.Is(err, syscall.EWOULDBLOCK) {
		t.Fatalf("second lock while held: %v, want EWOULDBLOCK", err)
	}
	unlock()
	if err := syscall.Flock(int(other.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		t.Fatalf("lock after release: %v", err)
	}
	info, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if info.Mode().Perm() != PrivateFileMode {
		t.Fatalf("lock file mode %v", info.Mode().Perm())
	}
}

func TestRemoveTempFiles(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	outside := filepath.Join(t.TempDir(), "target")
	write := func(name string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte("x"), PrivateFileMode); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(outside, []byte("keep"), PrivateFileMode); err != nil {
		t.Fatal(err)
	}
	// What a killed WriteFileAtomic leaves, named by os.CreateTemp itself.
	tmp, err := os.CreateTemp(dir, "."+"root-cert.pem"+".tmp-*")
	if err != nil {
		t.Fatal(err)
	}
	_ = tmp.Close()
	removable := []string{tmp.Name(), filepath.Join(dir, ".ca-key.pem.tmp-123"), filepath.Join(dir, "..lock.tmp-4294967295")}
	for _, p := range removable[1:] {
		write(filepath.Base(p))
	}
	kept := []string{
		"ca-key.pem",
		"ca-key.pem.tmp-123",  // no leading dot
		".ca-key.pem.tmp-",    // no random part
		".ca-key.pem.tmp-12a", // not digits
		".tmp-123",            // no base name
		".ca-key.pem.tmp-1.bak",
	}
	for _, name := range kept {
		write(name)
	}
	if err := os.Symlink(outside, filepath.Join(dir, ".link.pem.tmp-7")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, ".sub.pem.tmp-8"), PrivateDirMode); err != nil {
		t.Fatal(err)
	}
	kept = append(kept, ".link.pem.tmp-7", ".sub.pem.tmp-8")

	removed, err := RemoveTempFiles(dir)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(removed)
	slices.Sort(removable)
	if !slices.Equal(removed, removable) {
		t.Fatalf("removed %q, want %q", removed, removable)
	}
	for _, p := range removable {
		if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s is still there (%v)", p, err)
		}
	}
	for _, name := range kept {
		if _, err := os.Lstat(filepath.Join(dir, name)); err != nil {
			t.Errorf("%s was removed: %v", name, err)
		}
	}
	if data, err := os.ReadFile(outside); err != nil || string(data) != "keep" {
		t.Fatalf("the symlink's target was touched: %q, %v", data, err)
	}

	if removed, err := RemoveTempFiles(dir); err != nil || len(removed) != 0 {
		t.Fatalf("second sweep removed %q (%v), want nothing", removed, err)
	}
	if _, err := RemoveTempFiles(filepath.Join(dir, "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("sweep of a missing dir: %v, want ErrNotExist", err)
	}
}

func TestTryLock(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "agent.lock")
	unlock, err := TryLock(path)
	if err != nil {
		t.Fatal(err)
	}
	// flock locks belong to open files: a second open, as a second process makes, is refused.
	if _, err := TryLock(path); !errors.Is(err, ErrLocked) {
		t.Fatalf("second lock: %v, want ErrLocked", err)
	}
	unlock()
	again, err := TryLock(path)
	if err != nil {
		t.Fatalf("lock after unlock: %v", err)
	}
	again()
}

func TestIsDirIsRegular(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := filepath.Join(dir, "f")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(file, link); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		path         string
		dir, regular bool
	}{{dir, true, false}, {file, false, true}, {link, false, true}, {filepath.Join(dir, "missing"), false, false}} {
		if IsDir(tc.path) != tc.dir || IsRegular(tc.path) != tc.regular {
			t.Errorf("%s: IsDir %v, IsRegular %v; want %v, %v", tc.path, IsDir(tc.path), IsRegular(tc.path), tc.dir, tc.regular)
		}
	}
}

// TestSyncerWriteData: WriteData flushes every file of a generation, the generation and dir
// through its Syncer, each before the swap makes it visible; a failed flush fails the write and
// leaves the generation in service as it was.
func TestSyncerWriteData(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "out")
	files := []DataFile{{Name: "a", Data: []byte("one"), Mode: PrivateFileMode}, {Name: "b", Data: []byte("two"), Mode: PublicFileMode}}
	if err := WriteData(dir, "..gen_", PrivateDirMode, files); err != nil {
		t.Fatal(err)
	}
	first, err := os.Readlink(filepath.Join(dir, DataLink))
	if err != nil {
		t.Fatal(err)
	}

	errFlush := errors.New("flush failed")
	failing := Syncer(func(f *os.File) error {
		if filepath.Base(f.Name()) == "b" {
			return errFlush
		}
		return f.Sync()
	})
	next := []DataFile{{Name: "a", Data: []byte("three"), Mode: PrivateFileMode}, {Name: "b", Data: []byte("four"), Mode: PublicFileMode}}
	if err := failing.WriteData(dir, "..gen_", PrivateDirMode, next); !errors.Is(err, errFlush) {
		t.Fatalf("WriteData with a failing flush = %v, want errFlush", err)
	}
	if got, err := os.Readlink(filepath.Join(dir, DataLink)); err != nil || got != first {
		t.Fatalf("%s = %q (%v) after a failed flush, want the first generation %q", DataLink, got, err, first)
	}

	var (
		mu      sync.Mutex // the files are flushed concurrently
		flushed []string
	)
	recording := Syncer(func(f *os.File) error {
		mu.Lock()
		flushed = append(flushed, f.Name())
		mu.Unlock()
		return f.Sync()
	})
	if err := recording.WriteData(dir, "..gen_", PrivateDirMode, next); err != nil {
		t.Fatal(err)
	}
	gen, err := os.Readlink(filepath.Join(dir, DataLink))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{filepath.Join(dir, gen, "a"), filepath.Join(dir, gen, "b"), filepath.Join(dir, gen), dir}
	slices.Sort(want)
	slices.Sort(flushed)
	if !slices.Equal(flushed, want) {
		t.Errorf("flushed %v, want %v", flushed, want)
	}
	if DataOnDisk(dir, files) || !DataOnDisk(dir, next) {
		t.Error("the generation in service is not the last one written")
	}
}

// TestWriteFileAtomicSyncer: WriteFileAtomic flushes the file and then its directory through its
// Syncer; with NoSync it replaces the file all the same.
func TestWriteFileAtomicSyncer(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	var flushed []string
	recording := Syncer(func(f *os.File) error {
		flushed = append(flushed, f.Name())
		return f.Sync()
	})
	if err := recording.WriteFileAtomic(path, []byte("one"), PublicFileMode); err != nil {
		t.Fatal(err)
	}
	if len(flushed) != 2 || !isTempName(filepath.Base(flushed[0])) || flushed[1] != dir {
		t.Errorf("flushed %v, want the temporary file, then %s", flushed, dir)
	}
	if err := Syncer(NoSync).WriteFileAtomic(path, []byte("two"), PublicFileMode); err != nil {
		t.Fatal(err)
	}
	if data, err := os.ReadFile(path); err != nil || string(data) != "two" {
		t.Errorf("after a NoSync write: %q, %v", data, err)
	}
	if entries, err := os.ReadDir(dir); err != nil || len(entries) != 1 {
		t.Errorf("%s holds %v (%v), want the file alone", dir, entries, err)
	}
}
