package fsutil

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
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
