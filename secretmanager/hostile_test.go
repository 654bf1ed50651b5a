package secretmanager

// Attacks by a local client that can write in an allowed directory and ask for any file resource.

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/testutil"
)

// fileRefusals is meshid_agent_file_secret_refusals_total{reason}.
func (e *env) fileRefusals(reason string) float64 {
	e.t.Helper()
	mfs, err := e.reg.Gather()
	if err != nil {
		e.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "meshid_agent_file_secret_refusals_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" && l.GetValue() == reason {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// refusalLogs are the records that say a file secret was refused, for name and reason.
func (e *env) refusalLogs(name, reason string) []logRecord {
	return e.logs.matching(func(rec logRecord) bool {
		return rec.msg == "file secret refused" && rec.attrs["secret"] == name && rec.attrs["reason"] == reason
	})
}

// embeddedCA is the embedded control plane's state dir under a root dir, outside every allowed
// dir, holding its CA key; its certificate is valid at t0.
type embeddedCA struct {
	ca               *testutil.CA
	certPEM, keyPEM  []byte
	keyPath, dirPath string
}

func newEmbeddedCA(t *testing.T) embeddedCA {
	t.Helper()
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "embedded CA", NotBefore: t0.Add(-time.Hour)})
	e := embeddedCA{ca: ca, certPEM: testutil.CertPEM(ca.Cert), keyPEM: testutil.KeyPEM(t, ca.Key)}
	e.dirPath = filepath.Join(t.TempDir(), "var", "lib", "meshid")
	testutil.WriteFiles(t, e.dirPath, map[string][]byte{"ca-key.pem": e.keyPEM, "root-cert.pem": e.certPEM})
	e.keyPath = filepath.Join(e.dirPath, "ca-key.pem")
	return e
}

// servesKey fails if any update of sub served key.
func servesKey(t *testing.T, sub *subscription, keyPEM []byte, what string) {
	t.Helper()
	for _, u := range sub.seen() {
		if u.s != nil && u.s.KeyPair != nil && string(u.s.KeyPair.KeyPEM) == string(keyPEM) {
			t.Fatalf("%s: served %s (serial %s) with the embedded CA's key", what, sub.name, u.s.KeyPair.Leaf().SerialNumber.Text(16))
		}
	}
}

// Attack: key disclosure through a check-then-open race. The client makes the chain a FIFO, so
// that the agent's read of it waits for a writer after the paths were checked; it then swaps the
// key for a symlink to the embedded CA's key and writes the CA's certificate into the FIFO: the
// pair (CA certificate, CA key) matched, and the CA key was served. The files are now opened once
// and judged by what was opened: the FIFO is refused without waiting, and the link leads outside.
func TestFileResourceRaceCannotServeCAKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	embedded := newEmbeddedCA(t)
	allowed := t.TempDir()
	e.cfg.FileResourceDirs = []string{allowed}
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "resource root"})
	testutil.WriteFiles(t, allowed, map[string][]byte{"key.pem": validPair(t, ca).keyPEM})
	chain, key := filepath.Join(allowed, "cert.pem"), filepath.Join(allowed, "key.pem")
	if err := syscall.Mkfifo(chain, 0o600); err != nil {
		t.Fatal(err)
	}
	r := e.start()
	s := r.next(t)
	e.idle(s.RenewAt)

	name := FileCertPrefix + chain + "~" + key
	sub := subscribe(t, r.m, name)
	opened := make(chan *os.File, 1)
	go func() {
		// Returns once the agent opens the FIFO to read it.
		if w, err := os.OpenFile(chain, os.O_WRONLY, 0); err == nil {
			opened <- w
		}
	}()
	t.Cleanup(func() {
		// Release the writer if the agent never opened the FIFO.
		if f, err := os.OpenFile(chain, os.O_RDONLY|syscall.O_NONBLOCK, 0); err == nil {
			_ = f.Close()
		}
	})

	var first update
	select {
	case w := <-opened:
		// The agent holds the FIFO open: the attacker swaps the key and feeds the chain.
		if err := os.Remove(key); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(embedded.keyPath, key); err != nil {
			t.Fatal(err)
		}
		_, _ = w.Write(embedded.certPEM) // fails once the agent has closed it
		_ = w.Close()
		first = recv(t, sub.ch, "the first read of "+name)
	case first = <-sub.ch:
	case <-time.After(waitLimit):
		t.Fatal("the agent neither refused the FIFO nor opened it")
	}
	servesKey(t, sub, embedded.keyPEM, "the FIFO race")
	if first.err == nil || !strings.Contains(first.err.Error(), "not a regular file") {
		t.Fatalf("the FIFO chain: told %v, want it refused as not a regular file", first)
	}

	// The attacker tries again with the CA's certificate as a plain file and the key a link to
	// the CA key: the key opened is outside the allowed dir, whatever the path said.
	if _, err := os.Lstat(key); err == nil {
		if err := os.Remove(key); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(embedded.keyPath, key); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(chain); err != nil {
		t.Fatal(err)
	}
	writeFileAtomic(t, chain, embedded.certPEM)
	for {
		u := drive(t, e.clock, sub.ch)
		servesKey(t, sub, embedded.keyPEM, "the chain a file, the key a link")
		if errors.Is(u.err, ErrForbiddenPath) {
			break
		}
	}
}

// Attacks that point a file resource at what the agent must not serve, each refused on the file
// opened (not on the path asked for), logged once with the resource and the reason, and counted.
func TestFileResourceRefusesUnsafeFiles(t *testing.T) {
	t.Parallel()
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "resource root"})
	caAsLeaf := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "a CA as a leaf", NotBefore: t0.Add(-time.Hour)})
	// A valid chain followed by junk that PEM parsing skips: served whole before files were bounded.
	pad := []byte("\n" + strings.Repeat("x", maxTestFileSize) + "\n")
	for _, tc := range []struct {
		name string
		// setup writes the files into allowed (outside is another dir) after the subscription when
		// late, and returns the resource name.
		setup  func(t *testing.T, allowed, outside string) string
		late   bool
		reason string // counted
		want   string // in the error subscribers are told
	}{
		{
			name: "the key a symlink made later to a key outside",
			setup: func(t *testing.T, allowed, outside string) string {
				kp := validPair(t, ca)
				testutil.WriteFiles(t, allowed, map[string][]byte{"cert.pem": kp.chainPEM})
				testutil.WriteFiles(t, outside, map[string][]byte{"key.pem": kp.keyPEM})
				return FileCertPrefix + filepath.Join(allowed, "cert.pem") + "~" + filepath.Join(allowed, "key.pem")
			},
			late:   true,
			reason: "forbidden_path", want: ErrForbiddenPath.Error(),
		},
		{
			name: "the chain a FIFO",
			setup: func(t *testing.T, allowed, _ string) string {
				testutil.WriteFiles(t, allowed, map[string][]byte{"key.pem": validPair(t, ca).keyPEM})
				if err := syscall.Mkfifo(filepath.Join(allowed, "cert.pem"), 0o600); err != nil {
					t.Fatal(err)
				}
				return FileCertPrefix + filepath.Join(allowed, "cert.pem") + "~" + filepath.Join(allowed, "key.pem")
			},
			reason: "not_regular_file", want: "not a regular file",
		},
		{
			name: "the roots a FIFO",
			setup: func(t *testing.T, allowed, _ string) string {
				if err := syscall.Mkfifo(filepath.Join(allowed, "roots.pem"), 0o600); err != nil {
					t.Fatal(err)
				}
				return FileRootPrefix + filepath.Join(allowed, "roots.pem")
			},
			reason: "not_regular_file", want: "not a regular file",
		},
		{
			name: "the key a directory",
			setup: func(t *testing.T, allowed, _ string) string {
				testutil.WriteFiles(t, allowed, map[string][]byte{"cert.pem": validPair(t, ca).chainPEM})
				if err := os.Mkdir(filepath.Join(allowed, "key.pem"), 0o700); err != nil {
					t.Fatal(err)
				}
				return FileCertPrefix + filepath.Join(allowed, "cert.pem") + "~" + filepath.Join(allowed, "key.pem")
			},
			reason: "not_regular_file", want: "not a regular file",
		},
		{
			name: "a CA certificate as the leaf, with its key",
			setup: func(t *testing.T, allowed, _ string) string {
				testutil.WriteFiles(t, allowed, map[string][]byte{"cert.pem": testutil.CertPEM(caAsLeaf.Cert), "key.pem": testutil.KeyPEM(t, caAsLeaf.Key)})
				return FileCertPrefix + filepath.Join(allowed, "cert.pem") + "~" + filepath.Join(allowed, "key.pem")
			},
			reason: "ca_certificate", want: "is a CA certificate",
		},
		{
			name: "an oversized chain",
			setup: func(t *testing.T, allowed, _ string) string {
				kp := validPair(t, ca)
				testutil.WriteFiles(t, allowed, map[string][]byte{"cert.pem": append(kp.chainPEM, pad...), "key.pem": kp.keyPEM})
				return FileCertPrefix + filepath.Join(allowed, "cert.pem") + "~" + filepath.Join(allowed, "key.pem")
			},
			reason: "too_large", want: "larger than",
		},
		{
			name: "oversized roots",
			setup: func(t *testing.T, allowed, _ string) string {
				testutil.WriteFiles(t, allowed, map[string][]byte{"roots.pem": append(testutil.CertPEM(ca.Cert), pad...)})
				return FileRootPrefix + filepath.Join(allowed, "roots.pem")
			},
			reason: "too_large", want: "larger than",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			allowed, outside := t.TempDir(), t.TempDir()
			e.cfg.FileResourceDirs = []string{allowed}
			r := e.start()
			s := r.next(t)
			e.idle(s.RenewAt)
			name := tc.setup(t, allowed, outside)
			sub := subscribe(t, r.m, name)
			var got update
			if tc.late {
				// The key is not there when first read; then it appears as a link leading outside.
				if err := sub.nextErr(t); !errors.Is(err, fs.ErrNotExist) {
					t.Fatalf("told %v, want the key missing", err)
				}
				if err := os.Symlink(filepath.Join(outside, "key.pem"), filepath.Join(allowed, "key.pem")); err != nil {
					t.Fatal(err)
				}
				got = drive(t, e.clock, sub.ch)
			} else {
				got = recv(t, sub.ch, "the first read of "+name)
			}
			if got.err == nil || !strings.Contains(got.err.Error(), tc.want) {
				t.Fatalf("told %v, want a refusal saying %q", got, tc.want)
			}
			if st := status(t, r.m, name); st.Valid || st.Secret != nil {
				t.Errorf("Snapshot %+v, want nothing served", st)
			}
			if n := e.fileRefusals(tc.reason); n != 1 {
				t.Errorf("meshid_agent_file_secret_refusals_total{reason=%q} = %v, want 1", tc.reason, n)
			}
			if logs := e.refusalLogs(name, tc.reason); len(logs) != 1 {
				t.Errorf("%d refusal logs for %s with reason %s, want 1", len(logs), name, tc.reason)
			}
		})
	}
}

// maxTestFileSize is more than any file of a file resource may hold.
const maxTestFileSize = 1<<20 + 1

// Attack: a FIFO in an allowed dir wedges the agent. Opening it for reading waited for a writer
// on the file loader's goroutine, so that the CA root file (ROOTCA) and every other file resource
// were never read again. It is refused at open now, and the rest goes on.
func TestFIFOFileResourceStallsNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "resource root"})
	rootFile := filepath.Join(t.TempDir(), "root-cert.pem")
	testutil.WriteFiles(t, filepath.Dir(rootFile), map[string][]byte{"root-cert.pem": testutil.CertPEM(e.signer.rootCert())})
	e.rot.RootCertFile = rootFile
	allowed := t.TempDir()
	e.cfg.FileResourceDirs = []string{allowed}
	kp := validPair(t, ca)
	testutil.WriteFiles(t, allowed, map[string][]byte{"tls.crt": kp.chainPEM, "tls.key": kp.keyPEM})
	fifo := filepath.Join(allowed, "fifo.pem")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	r := e.start()
	s := r.next(t)
	e.idle(s.RenewAt)

	fifoSub := subscribe(t, r.m, FileRootPrefix+fifo)
	if err := fifoSub.nextErr(t); !strings.Contains(err.Error(), "not a regular file") {
		t.Fatalf("the FIFO: told %v, want it refused as not a regular file", err)
	}
	// Another file resource is read.
	certName := FileCertPrefix + filepath.Join(allowed, "tls.crt") + "~" + filepath.Join(allowed, "tls.key")
	checkServes(t, subscribe(t, r.m, certName).next(t), certName, kp)
	// The CA root file is read again when it changes: ROOTCA gets the new root.
	extra := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "next root"})
	writeFileAtomic(t, rootFile, testutil.CertPEM(e.signer.rootCert(), extra.Cert))
	e.reread("ROOTCA holds the new root", func() bool {
		got := current(t, r.m, RootCertName).s
		return got != nil && slices.ContainsFunc(got.Bundle.Roots, extra.Cert.Equal)
	})
	// default is renewed, and the agent is ready.
	if ev := e.attempt(s.RenewAt); ev.Kind != EventIssued {
		t.Fatalf("renewal: %+v", ev)
	}
	ready(t, r.m, true)
	if err := r.stop(t); err != nil {
		t.Fatal(err)
	}
}

// Each file secret is watched and kept while someone subscribes to it; once nobody does, it is
// forgotten, so that the bound on file secrets does not turn away later names for the agent's life.
func TestFileSecretsAreReleased(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dir := t.TempDir()
	e.cfg.FileResourceDirs = []string{dir}
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "resource root"})
	kp := validPair(t, ca)
	testutil.WriteFiles(t, dir, map[string][]byte{"tls.crt": kp.chainPEM, "tls.key": kp.keyPEM})
	r := e.start()
	s := r.next(t)
	e.idle(s.RenewAt)

	pairName := FileCertPrefix + filepath.Join(dir, "tls.crt") + "~" + filepath.Join(dir, "tls.key")
	pair := subscribe(t, r.m, pairName)
	checkServes(t, pair.next(t), pairName, kp)
	// The loader waits for the pair's expiry, to report it.
	waitArmed(t, e.clock, kp.leaf.NotAfter)
	// Two streams on one name: one leaving keeps it.
	second := subscribe(t, r.m, pairName)
	second.cancel()
	subs := []*subscription{pair}
	for i := range MaxFileSecrets - 1 {
		subs = append(subs, subscribe(t, r.m, FileRootPrefix+filepath.Join(dir, fmt.Sprintf("root-%d.pem", i))))
	}
	if _, err := trySubscribe(t, r.m, FileRootPrefix+filepath.Join(dir, "one-more.pem")); !errors.Is(err, ErrTooManyFiles) {
		t.Fatalf("a file secret past the bound: %v, want ErrTooManyFiles", err)
	}
	for _, sub := range subs {
		sub.cancel()
		sub.cancel() // idempotent
	}
	// Nothing is kept for them: not in /debug/secrets, no expiry to wait for.
	var kept []string
	for _, st := range r.m.Snapshot() {
		if st.Name != WorkloadCertName && st.Name != RootCertName {
			kept = append(kept, st.Name)
		}
	}
	if len(kept) > 0 {
		t.Errorf("%d file secrets still in the Snapshot after their last subscriber left, such as %s", len(kept), kept[0])
	}
	awaitClock(t, e.clock, "no timer for the forgotten pair's expiry", func() bool {
		return !slices.ContainsFunc(e.clock.Deadlines(), kp.leaf.NotAfter.Equal)
	})
	// New names are taken, up to the bound again, and a name asked for anew is read anew.
	late := subscribe(t, r.m, FileRootPrefix+filepath.Join(dir, "late.pem"))
	if err := late.nextErr(t); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a new name: told %v, want its file missing", err)
	}
	again := subscribe(t, r.m, pairName)
	checkServes(t, again.next(t), pairName, kp)
	for i := range MaxFileSecrets - 2 {
		subscribe(t, r.m, FileRootPrefix+filepath.Join(dir, fmt.Sprintf("new-%d.pem", i)))
	}
	if _, err := trySubscribe(t, r.m, FileRootPrefix+filepath.Join(dir, "past.pem")); !errors.Is(err, ErrTooManyFiles) {
		t.Fatalf("a file secret past the bound: %v, want ErrTooManyFiles", err)
	}
}

// Many clients at once, each asking for a name of its own and leaving: the number of file secrets
// held never passes the bound, and nothing is left once they have all left.
func TestFileSecretsBurstStaysBounded(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dir := t.TempDir()
	e.cfg.FileResourceDirs = []string{dir}
	r := e.start()
	s := r.next(t)
	e.idle(s.RenewAt)

	const clients = 4 * MaxFileSecrets
	var (
		wg       sync.WaitGroup
		start    = make(chan struct{})
		accepted atomic.Int32
		refused  atomic.Int32
		stop     = make(chan struct{})
		sampled  = make(chan int, 1)
	)
	go func() {
		most := 0
		for {
			most = max(most, r.m.files.count())
			select {
			case <-stop:
				sampled <- most
				return
			default:
			}
		}
	}()
	for i := range clients {
		wg.Go(func() {
			<-start
			name := FileRootPrefix + filepath.Join(dir, fmt.Sprintf("root-%d.pem", i))
			cancel, err := r.m.Subscribe(name, func(*Secret, error) {})
			switch {
			case err == nil:
				accepted.Add(1)
				if i%2 == 0 {
					cancel() // some leave at once, the rest once everyone has asked
					return
				}
				<-stop
				cancel()
			case errors.Is(err, ErrTooManyFiles):
				refused.Add(1)
			default:
				t.Errorf("Subscribe(%s) = %v, want nil or ErrTooManyFiles", name, err)
			}
		})
	}
	close(start)
	// Every client has asked once this many have answered; those keeping theirs wait for stop.
	for accepted.Load()+refused.Load() < clients {
		if n := r.m.files.count(); n > MaxFileSecrets {
			t.Fatalf("%d file secrets held, past the bound %d", n, MaxFileSecrets)
		}
	}
	close(stop)
	wg.Wait()
	if most := <-sampled; most > MaxFileSecrets {
		t.Fatalf("%d file secrets held at once, past the bound %d", most, MaxFileSecrets)
	}
	if accepted.Load() < MaxFileSecrets {
		t.Errorf("%d of %d names accepted, want at least the bound %d", accepted.Load(), clients, MaxFileSecrets)
	}
	if n := r.m.files.count(); n != 0 {
		t.Errorf("%d file secrets held after every client left", n)
	}
	if _, err := trySubscribe(t, r.m, FileRootPrefix+filepath.Join(dir, "after.pem")); err != nil {
		t.Errorf("a name after the burst: %v", err)
	}
}

// Attack: a file resource on a filesystem whose reads hang (a FUSE mount in an allowed dir, a
// stuck NFS server). One read held the loader's only goroutine: in file mode the workload's own
// files were never read again, nor any other file resource. Each resource is read on its own now.
func TestHangingFileReadStallsNothing(t *testing.T) {
	t.Parallel()
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "files root"})
	rootsPEM := testutil.CertPEM(ca.Cert)
	e, vol := fileModeEnv(t, ca, validPair(t, ca))
	allowed := t.TempDir()
	e.cfg.FileResourceDirs = []string{allowed}
	kp := validPair(t, ca)
	testutil.WriteFiles(t, allowed, map[string][]byte{"tls.crt": kp.chainPEM, "tls.key": kp.keyPEM, "hung.pem": rootsPEM})
	hungName := FileRootPrefix + filepath.Join(allowed, "hung.pem")
	m := e.newManager()
	entered, release := make(chan struct{}, 1), make(chan struct{})
	m.files.readFiles = func(r *fileResource, now time.Time) (*Secret, error) {
		if r.name == hungName {
			entered <- struct{}{}
			<-release
		}
		return r.read(now)
	}
	r := e.run(m)
	t.Cleanup(func() { close(release) }) // before Run is stopped
	r.next(t)
	r.roots.next(t)

	hung := subscribe(t, r.m, hungName)
	recv(t, entered, "the read that hangs")
	// The workload's own files are read when they change.
	next := validPair(t, ca)
	vol.Update(next.files(rootsPEM))
	checkServes(t, driveSecret(t, e, r.workload), WorkloadCertName, next)
	ready(t, r.m, true)
	// Other file resources are read.
	certName := FileCertPrefix + filepath.Join(allowed, "tls.crt") + "~" + filepath.Join(allowed, "tls.key")
	checkServes(t, subscribe(t, r.m, certName).next(t), certName, kp)
	hung.none(t, "while its read hangs")
	if st := status(t, r.m, hungName); st.Valid || st.Secret != nil {
		t.Fatalf("Snapshot %+v while its read hangs, want nothing yet", st)
	}
}

// A read under way when its file secret is forgotten tells nobody anything, not even a later
// subscriber to the same name, which is read anew.
func TestForgottenReadBringsNothingBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dir := t.TempDir()
	e.cfg.FileResourceDirs = []string{dir}
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "resource root"})
	rootsPEM := testutil.CertPEM(ca.Cert)
	testutil.WriteFiles(t, dir, map[string][]byte{"roots.pem": rootsPEM})
	name := FileRootPrefix + filepath.Join(dir, "roots.pem")
	errStale := errors.New("the read of a forgotten secret")
	m := e.newManager()
	entered, release := make(chan struct{}, 1), make(chan struct{})
	var first atomic.Bool
	m.files.readFiles = func(r *fileResource, now time.Time) (*Secret, error) {
		if r.name == name && first.CompareAndSwap(false, true) {
			entered <- struct{}{}
			<-release
			return nil, errStale
		}
		return r.read(now)
	}
	r := e.run(m)
	s := r.next(t)
	e.idle(s.RenewAt)

	old := subscribe(t, r.m, name)
	recv(t, entered, "the first read")
	old.cancel()
	again := subscribe(t, r.m, name)
	checkRoots(t, again.next(t), name, rootsPEM, ca.Cert)
	close(release)
	if err := r.stop(t); err != nil { // Run returns once the reads under way have ended
		t.Fatal(err)
	}
	for _, u := range append(old.seen(), again.seen()...) {
		if errors.Is(u.err, errStale) {
			t.Errorf("a subscriber was told %v", u.err)
		}
	}
	if evs := e.events.since(0, func(ev Event) bool { return errors.Is(ev.Err, errStale) }); len(evs) != 0 {
		t.Errorf("the forgotten read was reported: %+v", evs)
	}
	if st := status(t, r.m, name); !st.Valid || st.Error != "" {
		t.Errorf("Snapshot %+v, want the roots of the second read", st)
	}
}

// A file system that stops answering (a dead NFS server): the read is given up after the bound,
// on the read clock, and the subscribers are told why; the resource is asked again at once,
// joining the read left hanging instead of starting another, and served once the file system
// answers.
func TestHungFileSystemIsReportedAndRecovers(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit) // only bounds a broken test
	defer cancel()
	e := newEnv(t)
	dir := t.TempDir()
	e.cfg.FileResourceDirs = []string{dir}
	readClock := testutil.NewFakeClock(time.Unix(1_700_000_000, 0))
	e.cfg.ReadClock = readClock
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "resource root"})
	rootsPEM := testutil.CertPEM(ca.Cert)
	testutil.WriteFiles(t, dir, map[string][]byte{"roots.pem": rootsPEM})
	name := FileRootPrefix + filepath.Join(dir, "roots.pem")
	m := e.newManager()
	entered, answer := make(chan struct{}, 1), make(chan struct{})
	var hung atomic.Int32
	m.files.readFiles = func(r *fileResource, now time.Time) (*Secret, error) {
		if r.name == name {
			// The file system hangs on the file until answer, in a read made as readBounded makes it.
			if _, err := r.reads.Read(context.Background(), r.root, r.root, func() ([]byte, error) {
				hung.Add(1)
				entered <- struct{}{}
				<-answer
				return nil, nil
			}); err != nil {
				return nil, err
			}
		}
		return r.read(now)
	}
	r := e.run(m)
	s := r.next(t)
	e.idle(s.RenewAt)

	sub := subscribe(t, r.m, name)
	recv(t, entered, "the read that hangs")
	if err := readClock.WaitForTimers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	readClock.Advance(fsutil.DefaultReadBound)
	if err := sub.nextErr(t); !errors.Is(err, fsutil.ErrNoAnswer) {
		t.Fatalf("told %v, want ErrNoAnswer", err)
	}
	// Asked again at once: the read waits for the one left hanging, and starts none.
	if err := readClock.WaitForTimers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	close(answer)
	checkRoots(t, sub.next(t), name, rootsPEM, ca.Cert)
	if n := hung.Load(); n != 1 {
		t.Fatalf("%d reads of the hung file, want 1", n)
	}
}
