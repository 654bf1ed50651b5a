//go:build !external

package spire_test

import (
	"os"
	"path/filepath"
	"testing"
)

// Every test of this package runs SPIRE's spire-agent, which hack/spire-env.sh builds from the
// module proxy: they are built with -tags external, as make test does, so that a plain go test
// needs nothing from outside.
func TestSpireAgentNeedsTagExternal(t *testing.T) {
	// What the message tells to run must be there to run.
	script := filepath.Join("..", "..", "hack", "spire-env.sh")
	if info, err := os.Stat(script); err != nil || info.Mode().Perm()&0o100 == 0 {
		t.Fatalf("%s, which make test runs for these tests, is not an executable script: %v", script, err)
	}
	t.Skip("the tests with SPIRE's spire-agent are built with -tags external: run make test (or MESHID_SPIRE_BIN=$(hack/spire-env.sh) go test -tags external ./interop/spire/)")
}
