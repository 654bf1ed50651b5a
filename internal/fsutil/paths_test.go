package fsutil

import (
	"os"
	"path/filepath"
	"testing"
)

func TestResolveExisting(t *testing.T) {
	t.Parallel()
	dir, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	real := filepath.Join(dir, "real")
	if err := os.Mkdir(real, 0o700); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(real, link); err != nil {
		t.Fatal(err)
	}
	dangling := filepath.Join(dir, "dangling")
	if err := os.Symlink(filepath.Join(dir, "nowhere"), dangling); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ path, want string }{
		{link, real},
		{filepath.Join(link, "a", "b"), filepath.Join(real, "a", "b")},
		{filepath.Join(dangling, "a"), filepath.Join(dir, "dangling", "a")},
		{filepath.Join(dir, "missing", "x"), filepath.Join(dir, "missing", "x")},
	} {
		if got := resolveExisting(tc.path); got != tc.want {
			t.Errorf("resolveExisting(%s) = %s, want %s", tc.path, got, tc.want)
		}
	}
}

func TestOverlap(t *testing.T) {
	t.Parallel()
	dir, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(dir, "var", "lib", "meshid")
	if err := os.MkdirAll(state, 0o700); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(filepath.Join(dir, "var"), link); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		a    string
		want bool
	}{
		{state, true},
		{state + "/", true},
		{filepath.Join(state, "sub"), true},
		{filepath.Join(dir, "var"), true},
		{"/", true},
		{link, true},
		{filepath.Join(dir, "var", "lib", "meshid2"), false},
		{filepath.Join(dir, "etc"), false},
	} {
		if got := Overlap(tc.a, state); got != tc.want {
			t.Errorf("Overlap(%s, %s) = %v, want %v", tc.a, state, got, tc.want)
		}
	}
}

func TestCheckDir(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := filepath.Join(dir, "f")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := CheckDir(dir, "never"); err != nil {
		t.Fatal(err)
	}
	if err := CheckDir(filepath.Join(dir, "missing"), "it may be"); err == nil || err.Error() != "does not exist (it may be)" {
		t.Fatalf("missing: %v", err)
	}
	if err := CheckDir(file, "never"); err == nil || err.Error() != "is not a directory" {
		t.Fatalf("a file: %v", err)
	}
}
