package token_test

import (
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/meshid/meshid/ca/token"
)

// Without a file of issuer keys, the CA trusts its own local key, made on first use and the same
// afterwards; with one, that file's keys only, and no local key is made.
func TestTrustedKeys(t *testing.T) {
	t.Parallel()
	log := slog.New(slog.DiscardHandler)
	dir := t.TempDir()
	local := filepath.Join(dir, "token-key.pem")
	keys, err := token.TrustedKeys("", local, log)
	if err != nil || keys.Len() != 1 {
		t.Fatalf("local key: %v keys, %v", keys, err)
	}
	minter, err := token.LoadMinter(local)
	if err != nil {
		t.Fatal(err)
	}
	again, err := token.TrustedKeys("", local, log)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := minter.Mint(token.MintParams{Issuer: token.DefaultIssuer, Audiences: []string{token.DefaultAudience},
		Namespace: "default", ServiceAccount: "web", TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	v, err := token.NewVerifier(token.VerifierConfig{Keys: again, Audience: token.DefaultAudience})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(raw); err != nil {
		t.Fatalf("a token of the local key, after a restart: %v", err)
	}

	other := filepath.Join(t.TempDir(), "token-key.pem")
	if _, err := token.TrustedKeys(local+".missing", other, log); err == nil {
		t.Fatal("a missing issuer key file was accepted")
	}
	if _, err := os.Stat(other); !os.IsNotExist(err) {
		t.Fatalf("a local key was made although a key file was given: %v", err)
	}
}
