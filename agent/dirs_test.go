package agent_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/fsutil"
)

// The embedded control plane's state dir, <root-dir>/var/lib/meshid, is refused when another
// user could write in it, before the agent puts anything there (its lock, the CA's socket): that
// user could have put their own CA key and token key there.
func TestEmbeddedStateDirNotOursIsRefused(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t, newFakeClock(), nil, nil)
	stateDir := filepath.Join(cfg.RootDir, agent.DefaultEmbeddedDir)
	if err := os.MkdirAll(stateDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(stateDir, 0o777); err != nil {
		t.Fatal(err)
	}
	_, err := agent.New(cfg)
	if err == nil {
		t.Fatal("the agent started")
	}
	if !errors.Is(err, fsutil.ErrNotOwned) || !strings.Contains(err.Error(), stateDir) {
		t.Fatalf("%v, want ErrNotOwned naming %s", err, stateDir)
	}
	if entries, err := os.ReadDir(stateDir); err != nil || len(entries) != 0 {
		t.Errorf("the refused state dir holds %v (%v)", entries, err)
	}
}
