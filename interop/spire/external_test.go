//go:build !external

package spire_test

import (
	"os"
	"path/filepath"
	"testing"
)

// Every test of this package runs SPIRE's spire-agent or SPIFFE's spiffe-helper, which
// hack/spire-env.sh and hack/spiffe-helper-env.sh build from the module proxy: they are built
// with -tags external, as make test does, so that a plain go test needs nothing from outside.
func TestSpireAgentNeedsTagExternal(t *testing.T) {
	// What the message tells to run must be there to run.
	for _, name := range []string{"spire-env.sh", "spiffe-helper-env.sh"} {
		script := filepath.Join("..", "..", "hack", name)
		if info, err := os.Stat(script); err != nil || info.Mode().Perm()&0o100 == 0 {
			t.Fatalf("%s, which make test runs for these tests, is not an executable script: %v", script, err)
		}
	}
	t.Skip("the tests with SPIRE's spire-agent and SPIFFE's spiffe-helper are built with -tags external: run make test (or MESHID_SPIRE_BIN=$(hack/spire-env.sh) MESHID_SPIFFE_HELPER_BIN=$(hack/spiffe-helper-env.sh) go test -tags external ./interop/spire/)")
}
