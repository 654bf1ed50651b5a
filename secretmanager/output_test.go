package secretmanager

import (
	"bufio"
	"bytes"
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/testutil"
)

func TestProactiveRotationRewritesOutputCerts(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dir := filepath.Join(t.TempDir(), "missing", "out") // created on the first write
	e.cfg.Output.Dir = dir
	r := e.start()
	s := r.next(t)
	serials := map[string]bool{}
	// Nobody asks for anything: the clock alone drives three renewals.
	for i := range 4 {
		if i > 0 {
			if ev := e.attempt(s.RenewAt); ev.Kind != EventIssued {
				t.Fatalf("renewal %d did not happen at %s: %+v", i, s.RenewAt, ev)
			}
			s = r.next(t)
		}
		e.awaitOutput(s.Version)
		leaf, _ := readPair(t, dir)
		serial := leaf.SerialNumber.Text(16)
		if serial != s.Version || serials[serial] {
			t.Fatalf("write %d: cert-chain.pem holds serial %s, want the new %s", i, serial, s.Version)
		}
		serials[serial] = true
		if roots := readRoots(t, dir); !sameCerts(roots, []*x509.Certificate{s.KeyPair.Chain[len(s.KeyPair.Chain)-1]}) {
			t.Errorf("write %d: root-cert.pem = %s", i, names(roots))
		}
		checkModes(t, dir, 0o700, Output{}.modes())
		if got := generations(t, dir); len(got) != 1 {
			t.Errorf("write %d: generations %v, want exactly one", i, got)
		}
	}
	if e.signer.Calls() != 4 {
		t.Errorf("%d Sign calls for 4 certificates", e.signer.Calls())
	}
}

// checkModes checks OUTPUT_CERTS: the modes of the directory (top), its generations (want.dir)
// and each file (through its visible name), each visible name a symlink through ..data.
func checkModes(t *testing.T, dir string, top fs.FileMode, want outputModes) {
	t.Helper()
	for name, want := range map[string]fs.FileMode{".": top, KeyFile: want.key, CertChainFile: want.cert, RootCertFile: want.cert} {
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
		if info, err := os.Stat(filepath.Join(dir, gen)); err != nil || info.Mode().Perm() != want.dir {
			t.Errorf("generation %s: %v, %v; want mode %v", gen, info.Mode(), err, want.dir)
		}
	}
}

// TestOutputModes: by default only the agent's user can read OUTPUT_CERTS, but the certificates;
// GroupRead opens the directories and certificates to the group, KeyGroupRead the key too.
func TestOutputModes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		output   Output
		existing fs.FileMode // of the directory, made before the first write; 0: none
		top      fs.FileMode // of the directory after the writes
		want     outputModes // of the generations and files
	}{
		{"default", Output{}, 0, 0o700, outputModes{dir: 0o700, key: 0o600, cert: 0o644}},
		{"default leaves an existing directory as it is", Output{}, 0o755, 0o755, outputModes{dir: 0o700, key: 0o600, cert: 0o644}},
		{"group read", Output{GroupRead: true}, 0, 0o750, outputModes{dir: 0o750, key: 0o600, cert: 0o640}},
		{"group read opens an existing private directory", Output{GroupRead: true}, 0o700, 0o750, outputModes{dir: 0o750, key: 0o600, cert: 0o640}},
		{"group read with the key", Output{GroupRead: true, KeyGroupRead: true}, 0, 0o750, outputModes{dir: 0o750, key: 0o640, cert: 0o640}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			dir := filepath.Join(t.TempDir(), "out")
			if tc.existing != 0 {
				if err := os.Mkdir(dir, tc.existing); err != nil {
					t.Fatal(err)
				}
				if err := os.Chmod(dir, tc.existing); err != nil { // whatever the umask
					t.Fatal(err)
				}
			}
			tc.output.Dir = dir
			e.cfg.Output = tc.output
			r := e.start()
			s := r.next(t)
			e.awaitOutput(s.Version)
			checkModes(t, dir, tc.top, tc.want)
			// A renewal writes a new generation with the same modes.
			e.attempt(s.RenewAt)
			s = r.next(t)
			e.awaitOutput(s.Version)
			checkModes(t, dir, tc.top, tc.want)
			if leaf, _ := readPair(t, dir); leaf.SerialNumber.Text(16) != s.Version {
				t.Errorf("OUTPUT_CERTS holds serial %s, want %s", leaf.SerialNumber.Text(16), s.Version)
			}
		})
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
		if err := writeGeneration(dir, testutil.KeyPEM(t, key), testutil.CertPEM(leaf, ca.Cert), rootPEM); err != nil {
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
	if err := writeGeneration(dir, testutil.KeyPEM(t, key), testutil.CertPEM(leaf, ca.Cert), testutil.CertPEM(ca.Cert)); err != nil {
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
	if err := writeGeneration(dir, keyPEM, chainPEM, rootPEM); err != nil {
		t.Fatal(err)
	}
	// The next generation is written in full, but the ..data swap fails: the temporary link's
	// name is taken by a directory that cannot be removed. (Mode bits would not stop root.)
	obstacle := filepath.Join(dir, dataLink+".tmp")
	if err := os.MkdirAll(filepath.Join(obstacle, "busy"), 0o700); err != nil {
		t.Fatal(err)
	}
	newKey, newChain, newLeaf := pair()
	if err := writeGeneration(dir, newKey, newChain, rootPEM); err == nil {
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
	if err := writeGeneration(dir, newKey, newChain, rootPEM); err != nil {
		t.Fatal(err)
	}
	if got, _ := readPair(t, dir); !got.Equal(newLeaf) {
		t.Error("the write after the failure is not visible")
	}
}

// outputRetry waits until the output writer waits to retry its latest failed write, and returns
// that failure and how many writes have failed so far.
func (e *env) outputRetry() (Event, int) {
	e.t.Helper()
	var last Event
	var n int
	e.until("the output writer waits to retry", func() bool {
		failed := e.events.since(0, kind(EventOutputFailed))
		if len(failed) == 0 {
			return false
		}
		last, n = failed[len(failed)-1], len(failed)
		return slices.ContainsFunc(e.clock.Deadlines(), last.RetryAt.Equal)
	}, false)
	return last, n
}

// TestOutputWriteFailureIsRetried: a certificate that cannot be written to OUTPUT_CERTS is still
// served, but the agent is not ready, saying why, while the write is retried with backoff on the
// clock; once the obstacle is gone the retry writes it and the agent is ready. (Tests run as
// root here, so the obstacles are not mode bits.)
func TestOutputWriteFailureIsRetried(t *testing.T) {
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
			e.cfg.Output = Output{Dir: dir, RetryInitial: time.Second, RetryMax: time.Minute}
			var undo func()
			if tc.first {
				undo = tc.obstruct(t, dir)
			}
			r := e.start()
			s := r.next(t)
			var old *Secret
			if !tc.first {
				e.awaitOutput(s.Version)
				undo = tc.obstruct(t, dir)
				e.attempt(s.RenewAt)
				old, s = s, r.next(t)
			}
			ev, n := e.outputRetry()
			if ev.Version != s.Version || ev.Err == nil {
				t.Fatalf("write failure reported as %+v, want one for version %s with its error", ev, s.Version)
			}
			if got := current(t, r.m, WorkloadCertName); got.s != s {
				t.Fatalf("the certificate that could not be written is not served: %s", got)
			}
			if old != nil {
				if got, _ := readPair(t, dir); got.SerialNumber.Text(16) != old.Version {
					t.Errorf("OUTPUT_CERTS holds serial %s, want the previous %s", got.SerialNumber.Text(16), old.Version)
				}
			}

			failedAt := e.clock.Now()
			var waits []time.Duration
			for range 8 {
				ready(t, r.m, false, "cannot write OUTPUT_CERTS", dir)
				if got := int(e.metric("meshid_agent_output_certs_write_failures_total")); got != n {
					t.Fatalf("write failure counter %d after %d failures", got, n)
				}
				wait := ev.RetryAt.Sub(failedAt)
				backoffWithin(t, n-1, wait, time.Second, time.Minute)
				waits = append(waits, wait)
				failedAt = ev.RetryAt
				e.clock.Set(ev.RetryAt)
				if ev, n = e.outputRetry(); ev.RetryAt.Equal(failedAt) {
					t.Fatal("no retry")
				}
			}
			growing(t, waits)

			undo()
			mark := e.events.mark()
			e.clock.Set(ev.RetryAt)
			if ev, _ := e.events.wait(t, mark, "the retry after the obstacle went", kind(EventOutputWritten, EventOutputFailed)); ev.Kind != EventOutputWritten || ev.Version != s.Version {
				t.Fatalf("the retry after the obstacle went reported %+v, want version %s written", ev, s.Version)
			}
			ready(t, r.m, true)
			if got, _ := readPair(t, dir); got.SerialNumber.Text(16) != s.Version {
				t.Errorf("OUTPUT_CERTS holds serial %s after the obstacle went, want %s", got.SerialNumber.Text(16), s.Version)
			}
			if got := generations(t, dir); len(got) != 1 {
				t.Errorf("generations after the retries: %v", got)
			}
			if n := e.errorLogs(); n == 0 {
				t.Error("the write failures were not logged as errors")
			}
		})
	}
}

// A writer killed mid-generation leaves a directory with a temporary key file; a restart that
// finds the pair in service already on disk writes nothing, and still removes it.
func TestRestartRemovesUnfinishedGenerations(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "out")
	earlier := newEnv(t)
	earlier.cfg.Output.Dir = dir
	er := earlier.start()
	old := er.next(t)
	earlier.awaitOutput(old.Version)
	if err := er.stop(t); err != nil {
		t.Fatal(err)
	}
	unfinished := filepath.Join(dir, versionPrefix+"killed")
	testutil.WriteFiles(t, unfinished, map[string][]byte{".key.pem.tmp-1234": []byte("half a key")})
	dataBefore, err := os.Readlink(filepath.Join(dir, dataLink))
	if err != nil {
		t.Fatal(err)
	}

	e := newEnv(t)
	e.cfg.Output.Dir = dir
	e.succeeds(t, earlier)
	e.clock.Set(t0.Add(time.Minute))
	r := e.start()
	s := r.next(t)
	if s.Source != SourceOutputCerts {
		t.Fatalf("served %s, want the pair in OUTPUT_CERTS", s.Source)
	}
	e.awaitOutput(s.Version)
	if _, err := os.Stat(unfinished); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the unfinished generation is still there: %v", err)
	}
	if after, _ := os.Readlink(filepath.Join(dir, dataLink)); after != dataBefore {
		t.Error("OUTPUT_CERTS was rewritten")
	}
	if got := generations(t, dir); len(got) != 1 {
		t.Errorf("generations %v, want the one in service", got)
	}
}

// The claim on OUTPUT_CERTS: a directory that cannot be made at start is claimed by the first
// write that can make it; the lock then keeps other agents out, and outlives every write and
// every sweep of the directory.
func TestOutputClaim(t *testing.T) {
	t.Parallel()
	blocker := filepath.Join(t.TempDir(), "not-a-dir")
	if err := os.WriteFile(blocker, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(blocker, "out")
	claim, err := ClaimOutput(Output{Dir: dir})
	if err != nil {
		t.Fatalf("a directory that cannot be made yet: %v", err)
	}
	t.Cleanup(claim.Release)
	if claim.held() {
		t.Fatal("held a directory that cannot be made")
	}
	if err := os.Remove(blocker); err != nil {
		t.Fatal(err)
	}
	e := newEnv(t)
	e.cfg.Output.Dir, e.cfg.Output.Claim = dir, claim
	r := e.start()
	s := r.next(t)
	e.awaitOutput(s.Version)
	if !claim.held() {
		t.Fatal("written without the claim")
	}
	if ev := e.attempt(s.RenewAt); ev.Kind != EventIssued {
		t.Fatalf("renewal: %+v", ev)
	}
	e.awaitOutput(r.next(t).Version) // a second generation: the first is pruned
	if _, err := fsutil.RemoveTempFiles(dir); err != nil {
		t.Fatal(err)
	}
	lock := filepath.Join(dir, OutputLockFile)
	if pid, ok := fsutil.LockHolder(lock); !ok || pid != os.Getpid() {
		t.Fatalf("lock file after two writes and a sweep: holder %d (%v), want this process", pid, ok)
	}
	if stale := fsutil.StaleGenerations(dir, versionPrefix); len(stale) != 0 {
		t.Errorf("stale generations %v", stale)
	}
	_, err = ClaimOutput(Output{Dir: dir})
	if !errors.Is(err, fsutil.ErrLocked) || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), fmt.Sprintf("pid %d", os.Getpid())) {
		t.Fatalf("a second claim: %v, want ErrLocked naming %s and this process", err, dir)
	}
	if err := r.stop(t); err != nil {
		t.Fatal(err)
	}
	claim.Release()
	again, err := ClaimOutput(Output{Dir: dir})
	if err != nil {
		t.Fatalf("a claim once released: %v", err)
	}
	again.Release()
}

// heldSyncs is an fsutil.Syncer that holds every flush until release is closed, as a disk busy
// with other work does, then fails the first failures of them with errFlush; it records what it
// flushed.
type heldSyncs struct {
	started     chan struct{} // closed at the first flush
	startedOnce sync.Once
	release     chan struct{}

	mu       sync.Mutex
	failures int
	flushed  []string
}

var errFlush = errors.New("flush failed: input/output error")

func newHeldSyncs(failures int) *heldSyncs {
	return &heldSyncs{started: make(chan struct{}), release: make(chan struct{}), failures: failures}
}

func (h *heldSyncs) sync(f *os.File) error {
	h.startedOnce.Do(func() { close(h.started) })
	<-h.release
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.failures > 0 {
		h.failures--
		return errFlush
	}
	h.flushed = append(h.flushed, f.Name())
	return f.Sync()
}

func (h *heldSyncs) paths() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.flushed)
}

// TestOutputFlushHoldsOnlyReadiness: while the disk holds the flush of OUTPUT_CERTS, "default"
// and "ROOTCA" are served all the same, and only readiness waits; nothing is visible in
// OUTPUT_CERTS until every file and directory of the generation is flushed. A failed flush is
// reported, counted and retried like any failed write.
func TestOutputFlushHoldsOnlyReadiness(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		failures int
	}{{"flushed", 0}, {"flush fails", 1}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			dir := filepath.Join(t.TempDir(), "out")
			held := newHeldSyncs(tc.failures)
			e.cfg.Output = Output{Dir: dir, RetryInitial: time.Second, RetryMax: time.Minute, Sync: held.sync}
			r := e.start()
			recv(t, held.started, "the first flush of OUTPUT_CERTS")
			s := r.next(t)
			if roots := r.roots.next(t); roots.Bundle == nil {
				t.Fatal("ROOTCA served without a bundle")
			}
			ready(t, r.m, false, "not written yet", dir)
			if _, err := os.Lstat(filepath.Join(dir, dataLink)); !errors.Is(err, fs.ErrNotExist) {
				t.Fatalf("%s visible before its generation was flushed (%v)", dataLink, err)
			}

			close(held.release)
			if tc.failures > 0 {
				ev, n := e.outputRetry()
				if !errors.Is(ev.Err, errFlush) || ev.Version != s.Version || n != 1 {
					t.Fatalf("the failed flush reported as %+v (%d failures), want errFlush for %s", ev, n, s.Version)
				}
				ready(t, r.m, false, "cannot write OUTPUT_CERTS", errFlush.Error())
				if got := e.metric("meshid_agent_output_certs_write_failures_total"); got != 1 {
					t.Errorf("write failure counter %v after one failed flush", got)
				}
				if n := e.errorLogs(); n == 0 {
					t.Error("the failed flush was not logged as an error")
				}
				e.clock.Set(ev.RetryAt)
			}
			e.awaitOutput(s.Version)
			ready(t, r.m, true)
			if leaf, _ := readPair(t, dir); leaf.SerialNumber.Text(16) != s.Version {
				t.Errorf("OUTPUT_CERTS holds serial %s, want %s", leaf.SerialNumber.Text(16), s.Version)
			}
			gen, err := os.Readlink(filepath.Join(dir, dataLink))
			if err != nil {
				t.Fatal(err)
			}
			want := []string{dir, filepath.Join(dir, gen)}
			for _, name := range []string{KeyFile, CertChainFile, RootCertFile} {
				want = append(want, filepath.Join(dir, gen, name))
			}
			for _, path := range want {
				if !slices.Contains(held.paths(), path) {
					t.Errorf("%s was not flushed; flushed: %v", path, held.paths())
				}
			}
		})
	}
}
