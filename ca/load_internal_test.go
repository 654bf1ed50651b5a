package ca

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// Defect: a CA killed (SIGKILL, a node lost) between writing ca-key.pem and ca-cert.pem on its
// first start left a key without a certificate, and every later start refused the state dir. The
// pair is now written as one unit: a start that finds the state a kill between the two writes
// leaves completes it with the root generated for that key, and says so.
func TestFirstStartKilledBetweenKeyAndCert(t *testing.T) {
	t.Parallel()
	now := time.Date(2031, time.March, 14, 15, 9, 26, 0, time.UTC)
	stateDir := filepath.Join(t.TempDir(), "state")
	if err := os.MkdirAll(stateDir, 0o700); err != nil {
		t.Fatal(err)
	}
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	root, err := NewRootCertificate(key, "example.org", 24*time.Hour, now)
	if err != nil {
		t.Fatal(err)
	}
	// persistPair's first two steps, then the kill.
	if err := stagePendingRoot(stateDir, root); err != nil {
		t.Fatal(err)
	}
	if err := persistKey(stateDir, key); err != nil {
		t.Fatal(err)
	}
	keyPEM := readFile(t, filepath.Join(stateDir, CAKeyFile))

	logs := &testutil.SyncBuffer{}
	b, origin, err := LoadOrCreate(StartupConfig{StateDir: stateDir, Now: now.Add(time.Minute), Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatalf("the start after the kill: %v", err)
	}
	if origin != OriginPersisted || !b.Root().Equal(root) {
		t.Fatalf("origin %q, root %v; want the root generated for the persisted key", origin, b.Root().Subject)
	}
	if !bytes.Equal(readFile(t, filepath.Join(stateDir, CAKeyFile)), keyPEM) {
		t.Fatal("ca-key.pem was replaced")
	}
	if got := readFile(t, filepath.Join(stateDir, CACertFile)); !bytes.Equal(got, pki.EncodeCertificate(root)) {
		t.Fatal("ca-cert.pem is not the pending root")
	}
	if _, err := os.Stat(filepath.Join(stateDir, pendingRootFile)); !os.IsNotExist(err) {
		t.Fatalf("the pending root is still there (stat: %v)", err)
	}
	if !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), "interrupted") {
		t.Fatalf("the start did not say what it did:\n%s", logs)
	}
}

// What a start must not take for an interrupted write of its own: a key next to no pending root,
// or next to one its key did not sign. Both are refused, and nothing is replaced.
func TestKeyWithoutItsCertStillRefused(t *testing.T) {
	t.Parallel()
	now := time.Date(2031, time.March, 14, 15, 9, 26, 0, time.UTC)
	other, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	otherRoot, err := NewRootCertificate(other, "example.org", 24*time.Hour, now)
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name    string
		pending []byte // nil: none
	}{
		{"no pending root", nil},
		{"a pending root of another key", pki.EncodeCertificate(otherRoot)},
		{"a damaged pending root", []byte("garbage")},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			stateDir := t.TempDir()
			key, err := pki.GenerateKey(pki.ECDSA, 0)
			if err != nil {
				t.Fatal(err)
			}
			if err := persistKey(stateDir, key); err != nil {
				t.Fatal(err)
			}
			if tt.pending != nil {
				testutil.WriteFiles(t, stateDir, map[string][]byte{pendingRootFile: tt.pending})
			}
			keyPEM := readFile(t, filepath.Join(stateDir, CAKeyFile))
			_, _, err = LoadOrCreate(StartupConfig{StateDir: stateDir, Now: now})
			if err == nil || !strings.Contains(err.Error(), CACertFile) {
				t.Fatalf("LoadOrCreate = %v, want a refusal naming the missing %s", err, CACertFile)
			}
			if !bytes.Equal(readFile(t, filepath.Join(stateDir, CAKeyFile)), keyPEM) {
				t.Fatal("ca-key.pem was replaced")
			}
			if _, err := os.Stat(filepath.Join(stateDir, CACertFile)); !os.IsNotExist(err) {
				t.Fatalf("a ca-cert.pem was written (stat: %v)", err)
			}
		})
	}
}

// A plugged-in CA is the operator's: one missing its certificate is refused, never completed or
// replaced, whatever the state dir holds.
func TestPluggedInKeyWithoutCertStillRefused(t *testing.T) {
	t.Parallel()
	now := time.Date(2031, time.March, 14, 15, 9, 26, 0, time.UTC)
	root := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "corp root", NotBefore: now.Add(-time.Hour)})
	inter := root.NewIntermediate(t, testutil.CAOptions{CommonName: "mesh intermediate", NotBefore: now.Add(-time.Hour)})
	cacerts, stateDir := t.TempDir(), filepath.Join(t.TempDir(), "state")
	files := map[string][]byte{
		CAKeyFile:     testutil.KeyPEM(t, inter.Key),
		CertChainFile: testutil.CertPEM(inter.Cert, root.Cert),
		RootCertFile:  testutil.CertPEM(root.Cert),
		// The pending root of an interrupted write, as if copied along: it is not looked for here.
		pendingRootFile: testutil.CertPEM(inter.Cert),
	}
	testutil.WriteFiles(t, cacerts, files)
	_, _, err := LoadOrCreate(StartupConfig{CACertsDir: cacerts, StateDir: stateDir, Now: now})
	if err == nil || !strings.Contains(err.Error(), "missing "+CACertFile) {
		t.Fatalf("LoadOrCreate = %v, want a refusal naming the missing %s", err, CACertFile)
	}
	for name, want := range files {
		if got := readFile(t, filepath.Join(cacerts, name)); !bytes.Equal(got, want) {
			t.Fatalf("%s in the cacerts dir changed", name)
		}
	}
	if _, err := os.Stat(filepath.Join(cacerts, CACertFile)); !os.IsNotExist(err) {
		t.Fatalf("a %s was written into the cacerts dir (stat: %v)", CACertFile, err)
	}
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}
