package kubetest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// A test process killed before its Stop leaves its API server's directory behind; the next
// Start removes it, and keeps those of processes that still run.
func TestStartSweepsTheDirectoriesOfDeadTestProcesses(t *testing.T) {
	t.Parallel()
	tmp := t.TempDir()
	now := time.Now()
	exited := exec.Command("true")
	if err := exited.Run(); err != nil {
		t.Fatal(err)
	}
	dirs := map[string]struct {
		owner string        // "" for no owner file
		age   time.Duration // of the directory
		kept  bool
	}{
		"dead":          {owner: strconv.Itoa(exited.Process.Pid), kept: false},
		"running":       {owner: strconv.Itoa(os.Getpid()), kept: true},
		"unowned-old":   {age: 2 * staleUnowned, kept: false},
		"unowned-young": {age: staleUnowned / 2, kept: true}, // another process's, being made
		"garbled":       {owner: "not a pid", kept: true},
	}
	for name, d := range dirs {
		dir := filepath.Join(tmp, dirPrefix+name)
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if d.owner != "" {
			if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(d.owner), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Chtimes(dir, now.Add(-d.age), now.Add(-d.age)); err != nil {
			t.Fatal(err)
		}
	}
	other := filepath.Join(tmp, "not-kubetest")
	if err := os.Mkdir(other, 0o700); err != nil {
		t.Fatal(err)
	}
	// Another user's, its owner gone: not this user's to remove.
	foreign := filepath.Join(tmp, dirPrefix+"foreign")
	if err := os.Mkdir(foreign, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(foreign, ownerFile), []byte(strconv.Itoa(exited.Process.Pid)), 0o600); err != nil {
		t.Fatal(err)
	}
	if os.Getuid() == 0 {
		if err := os.Chown(foreign, 65534, 65534); err != nil {
			t.Fatal(err)
		}
	}

	sweepStale(tmp, now)

	for name, d := range dirs {
		_, err := os.Stat(filepath.Join(tmp, dirPrefix+name))
		if kept := err == nil; kept != d.kept {
			t.Errorf("%s: kept %t, want %t (%v)", name, kept, d.kept, err)
		}
	}
	if _, err := os.Stat(other); err != nil {
		t.Errorf("a directory not of Start's was touched: %v", err)
	}
	if _, err := os.Stat(foreign); os.Getuid() == 0 && err != nil {
		t.Errorf("another user's directory was removed: %v", err)
	}
}
