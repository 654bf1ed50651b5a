package agent

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
