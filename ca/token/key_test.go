package token_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/fsutil"
)

// The local token key is read only when it is ours alone.
func TestLoadOrCreateTokenKeyRefusesAKeyNotOurs(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "token-key.pem")
	if _, _, err := token.LoadOrCreateKey(path); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, 0o666); err != nil {
		t.Fatal(err)
	}
	if _, _, err := token.LoadOrCreateKey(path); !errors.Is(err, fsutil.ErrNotOwned) {
		t.Fatalf("%v, want ErrNotOwned", err)
	}
}
