package filewatch

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/testutil"
)

type harness struct {
	clock   *testutil.FakeClock
	changes chan []string
	watcher *Watcher
}

// start runs a Watcher of paths with a hub of its own, on a fake clock, until the test ends.
func start(t *testing.T, paths ...string) *harness {
	t.Helper()
	return startOn(t, nil, testutil.NewFakeClock(time.Now()), paths...)
}

// next lets debounce intervals pass until a notification comes, and returns what changed.
func (h *harness) next(t *testing.T) []string {
	t.Helper()
	return testutil.Drive(t, h.clock, DefaultDebounce, 0, h.changes)
}

// until collects notifications until want is among the changed paths. Stray notifications from
// the tail of an earlier burst are allowed; a missing one fails by the test's deadline.
func (h *harness) until(t *testing.T, want string) {
	t.Helper()
	for !slices.Contains(h.next(t), want) {
	}
}

func write(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestFileRewriteIsReported(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := filepath.Join(dir, "root-cert.pem")
	write(t, file, "one")
	h := start(t, file)
	write(t, filepath.Join(dir, "unrelated"), "x")
	write(t, file, "two")
	got := h.next(t)
	for !slices.Contains(got, file) {
		got = h.next(t)
	}
	if !slices.Equal(got, []string{file}) {
		t.Fatalf("changed %v, want only %s (the unrelated file is not watched)", got, file)
	}
}

func TestFileCreatedLaterIsReported(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := filepath.Join(dir, "token")
	h := start(t, file)
	write(t, file, "jwt")
	h.until(t, file)
}

// Kubernetes updates a mounted secret by writing a new timestamped directory and renaming a
// "..data" symlink over the old one; the visible files are symlinks through "..data".
func TestKubernetesDataSwapIsReported(t *testing.T) {
	t.Parallel()
	for _, watchDir := range []bool{false, true} {
		name := "watch file"
		if watchDir {
			name = "watch directory"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			mountSecret(t, dir, "..2026_01", "v1")
			target := filepath.Join(dir, "tls.crt")
			if watchDir {
				target = dir
			}
			h := start(t, target)
			for i := 2; i <= 4; i++ { // the second rotation is where others have broken
				version := "..2026_0" + string(rune('0'+i))
				mountSecret(t, dir, version, "v"+string(rune('0'+i)))
				h.until(t, target)
				if got, err := os.ReadFile(filepath.Join(dir, "tls.crt")); err != nil || string(got) != "v"+string(rune('0'+i)) {
					t.Fatalf("after swap %d the file reads %q (%v)", i, got, err)
				}
			}
		})
	}
}

func TestDirectoryAppearingLaterIsWatched(t *testing.T) {
	t.Parallel()
	parent := t.TempDir()
	dir := filepath.Join(parent, "cacerts")
	h := start(t, dir)
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	h.until(t, dir)
	// Files written inside the new directory are seen too: it is watched now.
	write(t, filepath.Join(dir, "ca-cert.pem"), "pem")
	h.until(t, dir)
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	h.until(t, dir)
}

// A path added while the watcher runs is watched once Add returns; every file of a mounted
// secret is reported when its "..data" link is swapped.
func TestAddWhileRunning(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	mountSecret(t, dir, "..2026_01", "v1")
	other := filepath.Join(t.TempDir(), "root-cert.pem")
	h := start(t, other)
	crt := filepath.Join(dir, "tls.crt")
	if err := h.watcher.Add(t.Context(), crt); err != nil {
		t.Fatal(err)
	}
	key := filepath.Join(dir, "tls.key")
	if err := h.watcher.Add(t.Context(), key); err != nil {
		t.Fatal(err)
	}
	mountSecret(t, dir, "..2026_02", "v2")
	got := h.next(t)
	for !slices.Contains(got, crt) {
		got = h.next(t)
	}
	if !slices.Contains(got, key) {
		t.Fatalf("a ..data swap reported %v, want both files of the secret", got)
	}
	// A path whose directory does not exist yet is watched through its nearest ancestor.
	late := filepath.Join(t.TempDir(), "no", "parent")
	if err := h.watcher.Add(t.Context(), late); err != nil {
		t.Fatalf("Add of a path whose parent does not exist yet: %v", err)
	}
	if err := os.Mkdir(filepath.Dir(late), 0o700); err != nil {
		t.Fatal(err)
	}
	write(t, late, "x")
	h.until(t, late)
}

// mountSecret publishes tls.crt holding content as generation version of a kubelet-style volume
// in dir (see testutil.SecretVolume).
func mountSecret(t *testing.T, dir, version, content string) {
	t.Helper()
	testutil.WriteFiles(t, filepath.Join(dir, version), map[string][]byte{"tls.crt": []byte(content)})
	testutil.NewSecretVolume(t, dir).Swap(version)
}

// A file whose directories do not exist yet is reported once they and it appear, whether the
// directories are made one by one or a whole tree is renamed into place.
func TestFileInDirectoriesThatDoNotExistYet(t *testing.T) {
	t.Parallel()
	t.Run("made one by one", func(t *testing.T) {
		t.Parallel()
		base := t.TempDir()
		file := filepath.Join(base, "a", "b", "cert.pem")
		h := start(t, file)
		if err := os.MkdirAll(filepath.Join(base, "a", "b"), 0o700); err != nil {
			t.Fatal(err)
		}
		write(t, file, "one")
		h.until(t, file)
		// Watched directly now: a rewrite is seen.
		write(t, file, "two")
		h.until(t, file)
	})
	t.Run("tree renamed into place", func(t *testing.T) {
		t.Parallel()
		base := t.TempDir()
		file := filepath.Join(base, "certs", "sub", "cert.pem")
		h := start(t, file)
		staged := filepath.Join(t.TempDir(), "certs")
		if err := os.MkdirAll(filepath.Join(staged, "sub"), 0o700); err != nil {
			t.Fatal(err)
		}
		write(t, filepath.Join(staged, "sub", "cert.pem"), "one")
		if err := os.Rename(staged, filepath.Join(base, "certs")); err != nil {
			t.Fatal(err)
		}
		h.until(t, file)
	})
	t.Run("directory removed and made again", func(t *testing.T) {
		t.Parallel()
		base := t.TempDir()
		dir := filepath.Join(base, "certs")
		file := filepath.Join(dir, "cert.pem")
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		write(t, file, "one")
		h := start(t, file)
		if err := os.RemoveAll(dir); err != nil {
			t.Fatal(err)
		}
		h.until(t, file)
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		write(t, file, "two")
		h.until(t, file)
	})
}

// A removed path is no longer reported, a path next to it still is, and the removed path can be
// watched again.
func TestRemove(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	gone, kept := filepath.Join(dir, "gone.pem"), filepath.Join(dir, "kept.pem")
	write(t, gone, "one")
	write(t, kept, "one")
	h := start(t, gone, kept)
	if err := h.watcher.Remove(t.Context(), gone); err != nil {
		t.Fatal(err)
	}
	if err := h.watcher.Remove(t.Context(), filepath.Join(dir, "never-watched")); err != nil {
		t.Fatalf("Remove of a path not watched: %v", err)
	}
	write(t, gone, "two")
	write(t, kept, "two")
	for reported := false; !reported; {
		got := h.next(t)
		if slices.Contains(got, gone) {
			t.Fatalf("changed %v: the removed %s was reported", got, gone)
		}
		reported = slices.Contains(got, kept)
	}
	if err := h.watcher.Add(t.Context(), gone); err != nil {
		t.Fatal(err)
	}
	write(t, gone, "three")
	h.until(t, gone)
}
