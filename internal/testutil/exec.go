package testutil

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// StandInFor replaces, in args, the value of flag (given as "--flag value" or "--flag=value")
// with an executable in a temp dir, for a command line that names a binary of another machine
// (an image's Envoy) and is checked as it is here. It returns the new args and the value replaced.
func StandInFor(t testing.TB, flag string, args []string) ([]string, string) {
	t.Helper()
	exe := filepath.Join(t.TempDir(), filepath.Base(flag))
	if err := os.WriteFile(exe, []byte("#!/bin/sh\nexit 0\n"), 0o755); err != nil { //nolint:gosec // an executable
		t.Fatal(err)
	}
	out := slices.Clone(args)
	for i, a := range out {
		if a == "--"+flag && i+1 < len(out) {
			old := out[i+1]
			out[i+1] = exe
			return out, old
		}
		if old, ok := strings.CutPrefix(a, "--"+flag+"="); ok {
			out[i] = "--" + flag + "=" + exe
			return out, old
		}
	}
	t.Fatalf("no --%s in %q", flag, args)
	return nil, ""
}
