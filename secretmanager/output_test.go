package secretmanager

import (
	"bufio"
	"bytes"
	"crypto/x509"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/testutil"
)

func TestProactiveRotationRewritesOutputCerts(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dir := filepath.Join(t.TempDir(), "missing", "out") // created on the first write
	e.cfg.OutputDir = dir
	r := e.start()
	s := r.next(t)
	e.idle()
	serials := map[string]bool{}
	// Nobody calls GenerateSecret: the clock alone drives three renewals.
	for i := range 4 {
		if i > 0 {
			if !e.set(s.RenewAt) {
				t.Fatalf("renewal %d did not happen at %s", i, s.RenewAt)
			}
			s = r.next(t)
		}
		leaf, _ := readPair(t, dir)
		serial := leaf.SerialNumber.Text(16)
		if serial != s.Version || serials[serial] {
			t.Fatalf("write %d: cert-chain.pem holds serial %s, want the new %s", i, serial, s.Version)
		}
		serials[serial] = true
		if roots := readRoots(t, dir); !sameCerts(roots, []*x509.Certificate{s.Chain[len(s.Chain)-1]}) {
			t.Errorf("write %d: root-cert.pem = %s", i, names(roots))
		}
		checkModes(t, dir)
		if got := generations(t, dir); len(got) != 1 {
			t.Errorf("write %d: generations %v, want exactly one", i, got)
		}
	}
	if e.signer.Calls() != 4 {
		t.Errorf("%d Sign calls for 4 certificates", e.signer.Calls())
	}
}

// checkModes checks OUTPUT_CERTS: a private directory, a private key, public certificates, each
// visible name a symlink through ..data.
func checkModes(t *testing.T, dir string) {
	t.Helper()
	for name, want := range map[string]fs.FileMode{".": 0o700, KeyFile: 0o600, CertChainFile: 0o644, RootCertFile: 0o644} {
		p := filepath.Join(dir, name)
		info, err := os.Stat(p) // follows the symlink to the file written
		if err != nil {
			t.Fatal(err)
		}
		if got := info.Mode().Perm(); got != want {
			t.Errorf("%s: mode %v, want %v", name, got, want)
		}
		if name == "." {
			continue
		}
		if link, err := os.Readlink(p); err != nil || link != filepath.Join(dataLink, name) {
			t.Errorf("%s is not a symlink through %s: %q, %v", name, dataLink, link, err)
		}
	}
	for _, gen := range generations(t, dir) {
		if info, err := os.Stat(filepath.Join(dir, gen)); err != nil || info.Mode().Perm() != 0o700 {
			t.Errorf("generation %s: %v, %v", gen, info.Mode(), err)
		}
	}
}

// writeLoopEnv names the directory TestHelperProcessWriteLoop writes to; unset, it does nothing.
const writeLoopEnv = "MESHID_TEST_WRITE_LOOP_DIR"

// TestHelperProcessWriteLoop is not a test: TestTornOutputWrite runs the test binary with it as a
// child that writes OUTPUT_CERTS in a loop until it is killed, printing a line per write.
func TestHelperProcessWriteLoop(t *testing.T) {
	dir := os.Getenv(writeLoopEnv)
	if dir == "" {
		return
	}
	ca := testutil.NewRootCA(t, testutil.CAOptions{})
	rootPEM := testutil.CertPEM(ca.Cert)
	for i := 0; ; i++ {
		leaf, key := ca.IssueWorkload(t, testID.String(), time.Hour)
		if err := writeOutput(dir, testutil.KeyPEM(t, key), testutil.CertPEM(leaf, ca.Cert), rootPEM); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(3)
		}
		fmt.Printf("wrote %d\n", i)
	}
}

// A writer killed at any moment leaves a matching key pair behind the visible names.
func TestTornOutputWrite(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "out")
	const rounds = 25
	for round := range rounds {
		k := 1 + round*29/(rounds-1) // 1 … 30 completed writes before the kill
		cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcessWriteLoop$")
		cmd.Env = append(os.Environ(), writeLoopEnv+"="+dir)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		written := 0
		for sc := bufio.NewScanner(stdout); written < k && sc.Scan(); {
			if strings.HasPrefix(sc.Text(), "wrote ") {
				written++
			}
		}
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if written < k {
			t.Fatalf("round %d: the writer stopped after %d writes: %s", round, written, stderr.String())
		}
		leaf, _ := readPair(t, dir)
		if len(leaf.URIs) != 1 || leaf.URIs[0].String() != testID.String() {
			t.Fatalf("round %d: leaf names %v", round, leaf.URIs)
		}
		readRoots(t, dir)
	}
	// Whatever a killed writer left behind, the next write cleans up.
	ca := testutil.NewRootCA(t, testutil.CAOptions{})
	leaf, key := ca.IssueWorkload(t, testID.String(), time.Hour)
	if err := writeOutput(dir, testutil.KeyPEM(t, key), testutil.CertPEM(leaf, ca.Cert), testutil.CertPEM(ca.Cert)); err != nil {
		t.Fatal(err)
	}
	if got, _ := readPair(t, dir); !got.Equal(leaf) {
		t.Fatal("the last write is not visible")
	}
	if got := generations(t, dir); len(got) != 1 {
		t.Errorf("generations after a clean write: %v", got)
	}
}

func TestFailedOutputWriteKeepsPreviousPair(t *testing.T) {
	t.Parallel()
	ca := testutil.NewRootCA(t, testutil.CAOptions{})
	pair := func() (keyPEM, chainPEM []byte, leaf *x509.Certificate) {
		leaf, key := ca.IssueWorkload(t, testID.String(), time.Hour)
		return testutil.KeyPEM(t, key), testutil.CertPEM(leaf, ca.Cert), leaf
	}
	rootPEM := testutil.CertPEM(ca.Cert)
	dir := filepath.Join(t.TempDir(), "out")
	keyPEM, chainPEM, leaf := pair()
	if err := writeOutput(dir, keyPEM, chainPEM, rootPEM); err != nil {
		t.Fatal(err)
	}
	// The next generation is written in full, but the ..data swap fails: the temporary link's
	// name is taken by a directory that cannot be removed. (Mode bits would not stop root.)
	obstacle := filepath.Join(dir, dataLink+".tmp")
	if err := os.MkdirAll(filepath.Join(obstacle, "busy"), 0o700); err != nil {
		t.Fatal(err)
	}
	newKey, newChain, newLeaf := pair()
	if err := writeOutput(dir, newKey, newChain, rootPEM); err == nil {
		t.Fatal("the write did not fail")
	}
	if got, _ := readPair(t, dir); !got.Equal(leaf) {
		t.Error("a failed write changed the visible pair")
	}
	if got := generations(t, dir); len(got) != 1 {
		t.Errorf("generations after a failed write: %v", got)
	}
	if err := os.RemoveAll(obstacle); err != nil {
		t.Fatal(err)
	}
	if err := writeOutput(dir, newKey, newChain, rootPEM); err != nil {
		t.Fatal(err)
	}
	if got, _ := readPair(t, dir); !got.Equal(newLeaf) {
		t.Error("the write after the failure is not visible")
	}
}

// A certificate that cannot be written out is still served, and the next renewal writes again.
func TestOutputWriteFailureKeepsServing(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// obstruct makes writes to dir fail from now on, and returns how to undo it.
		obstruct func(t *testing.T, dir string) (undo func())
		first    bool // obstruct before the first certificate
	}{
		{"directory under a file", func(t *testing.T, dir string) func() {
			if err := os.WriteFile(filepath.Dir(dir), nil, 0o600); err != nil {
				t.Fatal(err)
			}
			return func() {
				if err := os.Remove(filepath.Dir(dir)); err != nil {
					t.Fatal(err)
				}
			}
		}, true},
		{"swap fails", func(t *testing.T, dir string) func() {
			obstacle := filepath.Join(dir, dataLink+".tmp")
			if err := os.MkdirAll(filepath.Join(obstacle, "busy"), 0o700); err != nil {
				t.Fatal(err)
			}
			return func() {
				if err := os.RemoveAll(obstacle); err != nil {
					t.Fatal(err)
				}
			}
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			dir := filepath.Join(t.TempDir(), "parent", "out")
			e.cfg.OutputDir = dir
			var undo func()
			if tc.first {
				undo = tc.obstruct(t, dir)
			}
			r := e.start()
			s := r.next(t)
			e.idle()
			if !tc.first {
				undo = tc.obstruct(t, dir)
				if !e.set(s.RenewAt) {
					t.Fatal("no renewal")
				}
				old := s
				s = r.next(t)
				if got, _ := readPair(t, dir); got.SerialNumber.Text(16) != old.Version {
					t.Errorf("OUTPUT_CERTS holds serial %s, want the previous %s", got.SerialNumber.Text(16), old.Version)
				}
			}
			if got, err := r.m.GenerateSecret(cancelledCtx(), WorkloadCertName); err != nil || got.Version != s.Version || !r.m.Ready() {
				t.Fatalf("the certificate that could not be written is not served: (%v, %v)", got, err)
			}
			if !strings.Contains(e.logs.String(), "cannot write OUTPUT_CERTS") {
				t.Error("the write failure was not logged")
			}
			undo()
			if !e.set(s.RenewAt) {
				t.Fatal("no renewal")
			}
			s = r.next(t)
			if got, _ := readPair(t, dir); got.SerialNumber.Text(16) != s.Version {
				t.Errorf("OUTPUT_CERTS holds serial %s after the obstacle went, want %s", got.SerialNumber.Text(16), s.Version)
			}
		})
	}
}
