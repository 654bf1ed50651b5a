package secretmanager

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"math/big"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// keyPair is a leaf (valid at the fake clock's time unless a test says otherwise) with its key,
// as the files hold them.
type keyPair struct {
	leaf     *x509.Certificate
	chainPEM []byte // leaf, then the issuing CA
	keyPEM   []byte
}

// newKeyPair issues a workload leaf from ca, valid from notBefore to notAfter (fake clock times:
// testutil's IssueWorkload counts from the real clock).
func newKeyPair(t *testing.T, ca *testutil.CA, notBefore, notAfter time.Time) keyPair {
	t.Helper()
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		t.Fatal(err)
	}
	leaf := ca.Issue(t, &x509.Certificate{
		SerialNumber:          serial,
		URIs:                  []*url.URL{testID.URL()},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
	}, key.Public())
	return keyPair{leaf: leaf, chainPEM: testutil.CertPEM(leaf, ca.Cert), keyPEM: testutil.KeyPEM(t, key)}
}

// validPair is valid for a day around t0.
func validPair(t *testing.T, ca *testutil.CA) keyPair {
	t.Helper()
	return newKeyPair(t, ca, t0.Add(-time.Hour), t0.Add(24*time.Hour))
}

// files are the three credential files with kp and roots in them.
func (kp keyPair) files(roots []byte) map[string][]byte {
	return map[string][]byte{CertChainFile: kp.chainPEM, KeyFile: kp.keyPEM, RootCertFile: roots}
}

// hashVersion is the version a secret read from files must carry: a hash of the file contents,
// computed here independently of the manager.
func hashVersion(parts ...[]byte) string {
	h := sha256.New()
	for _, p := range parts {
		h.Write(p)
	}
	return hex.EncodeToString(h.Sum(nil)[:8])
}

// checkPair fails unless s is a usable key pair: its key matches its leaf, both as parsed and as
// the PEM that would be sent to Envoy.
func checkPair(t *testing.T, s *Secret) {
	t.Helper()
	kp := s.KeyPair
	if kp == nil || len(kp.Chain) == 0 || kp.Key == nil || !pki.KeyMatchesCertificate(kp.Key, kp.Leaf()) {
		t.Fatalf("%s version %s: no key pair, or the key does not match the leaf", s.Name, s.Version)
	}
	chain, err := pki.ParseCertificates(kp.ChainPEM)
	if err != nil {
		t.Fatalf("%s version %s: ChainPEM: %v", s.Name, s.Version, err)
	}
	key, err := pki.ParsePrivateKey(kp.KeyPEM)
	if err != nil {
		t.Fatalf("%s version %s: KeyPEM: %v", s.Name, s.Version, err)
	}
	if !pki.KeyMatchesCertificate(key, chain[0]) {
		t.Fatalf("%s version %s: KeyPEM does not match the leaf of ChainPEM (serial %s)", s.Name, s.Version, chain[0].SerialNumber.Text(16))
	}
}

// checkServes fails unless s holds exactly kp, read from files.
func checkServes(t *testing.T, s *Secret, name string, kp keyPair) {
	t.Helper()
	checkPair(t, s)
	if s.Name != name || s.Source != SourceFiles || s.Bundle != nil {
		t.Fatalf("got %s from %q, want %s from files", s.Name, s.Source, name)
	}
	if !s.KeyPair.Leaf().Equal(kp.leaf) {
		t.Fatalf("%s serves serial %s, want %s", name, s.KeyPair.Leaf().SerialNumber.Text(16), kp.leaf.SerialNumber.Text(16))
	}
	if want := hashVersion(kp.chainPEM, kp.keyPEM); s.Version != want {
		t.Fatalf("%s version %q, want the content hash %q", name, s.Version, want)
	}
	if string(s.KeyPair.ChainPEM) != string(kp.chainPEM) || string(s.KeyPair.KeyPEM) != string(kp.keyPEM) {
		t.Fatalf("%s does not carry the files' PEM as written", name)
	}
	if !s.NotAfter().Equal(kp.leaf.NotAfter) {
		t.Fatalf("%s expires %s, want the leaf's NotAfter %s", name, s.NotAfter(), kp.leaf.NotAfter)
	}
}

// checkRoots fails unless s is the trust bundle roots, read from files holding rootsPEM.
func checkRoots(t *testing.T, s *Secret, name string, rootsPEM []byte, roots ...*x509.Certificate) {
	t.Helper()
	if s.Name != name || s.Source != SourceFiles || s.KeyPair != nil || s.Bundle == nil {
		t.Fatalf("got %s from %q (with a key pair: %v), want the roots %s from files", s.Name, s.Source, s.KeyPair != nil, name)
	}
	if !sameCerts(s.Bundle.Roots, roots) {
		t.Fatalf("%s holds %s, want %s", name, names(s.Bundle.Roots), names(roots))
	}
	if parsed, err := pki.ParseCertificates(s.Bundle.PEM); err != nil || !sameCerts(parsed, roots) {
		t.Fatalf("%s: the bundle's PEM does not hold its roots (err %v)", name, err)
	}
	if want := hashVersion(rootsPEM); s.Version != want {
		t.Fatalf("%s version %q, want the content hash %q", name, s.Version, want)
	}
}

// newVolume mounts files in dir the kubelet's way.
func newVolume(t *testing.T, dir string, files map[string][]byte) *testutil.SecretVolume {
	t.Helper()
	v := testutil.NewSecretVolume(t, dir)
	v.Update(files)
	return v
}

// fileModeEnv is an env in file mode: the workload files in a Kubernetes volume holding kp and
// ca's root.
func fileModeEnv(t *testing.T, ca *testutil.CA, kp keyPair) (*env, *testutil.SecretVolume) {
	t.Helper()
	e := newEnv(t)
	vol := newVolume(t, filepath.Join(t.TempDir(), "certs"), kp.files(testutil.CertPEM(ca.Cert)))
	e.rot = nil
	e.cfg.Workload = &MountedFiles{CertChain: vol.Path(CertChainFile), Key: vol.Path(KeyFile), Root: vol.Path(RootCertFile)}
	return e, vol
}

// driveSecret drives the clock until sub is told of a secret, and returns it; errors on the way
// (files appearing one by one) are skipped.
func driveSecret(t *testing.T, e *env, sub *subscription) *Secret {
	t.Helper()
	for {
		if u := drive(t, e.clock, sub.ch); u.s != nil {
			return u.s
		}
	}
}

func TestFileModeServesAtOnce(t *testing.T) {
	t.Parallel()
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "files root"})
	kp := validPair(t, ca)
	e, _ := fileModeEnv(t, ca, kp)
	m := e.newManager()
	ready(t, m, false, "no workload certificate yet")
	r := e.run(m)

	// No clock moves: the files are read as Run starts, not after a debounce or a timer.
	s := r.next(t)
	checkServes(t, s, WorkloadCertName, kp)
	roots := r.roots.next(t)
	rootsPEM := testutil.CertPEM(ca.Cert)
	checkRoots(t, roots, RootCertName, rootsPEM, ca.Cert)
	ready(t, m, true)
	if got := e.certValid(); got != 1 {
		t.Errorf("meshid_agent_cert_valid = %v with a valid pair in the files", got)
	}
	if got := current(t, m, WorkloadCertName); got.s != s {
		t.Errorf("a new subscriber to default is told %s, want version %s", got, s.Version)
	}
	if got := current(t, m, RootCertName); got.s != roots {
		t.Errorf("a new subscriber to ROOTCA is told %s, want version %s", got, roots.Version)
	}
	var snap []string
	for _, st := range m.Snapshot() {
		snap = append(snap, fmt.Sprintf("%s@%s@%s valid=%v error=%q", st.Name, st.Secret.Source, st.Secret.Version, st.Valid, st.Error))
	}
	want := []string{
		fmt.Sprintf("%s@files@%s valid=true error=\"\"", RootCertName, roots.Version),
		fmt.Sprintf("%s@files@%s valid=true error=\"\"", WorkloadCertName, s.Version),
	}
	if !slices.Equal(snap, want) {
		t.Errorf("Snapshot = %q, want %q (sorted by name)", snap, want)
	}
}

// TestFileModeDataSwaps rotates the mounted pair 100 times. Every fourth rotation is linked in
// two steps (cert-chain.pem or key.pem straight to the new generation, then ..data), so that for
// one debounce the visible cert and key are from different generations: the manager must sit
// that out on the last good pair (istio#59912 broke after the second rotation).
func TestFileModeDataSwaps(t *testing.T) {
	t.Parallel()
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "files root"})
	rootsPEM := testutil.CertPEM(ca.Cert)
	kp := validPair(t, ca)
	e, vol := fileModeEnv(t, ca, kp)
	r := e.start()
	last := r.next(t)
	checkServes(t, last, WorkloadCertName, kp)
	r.roots.next(t)

	const swaps, splitEvery = 100, 4
	splits := 0
	for i := range swaps {
		kp = validPair(t, ca)
		gen := vol.Stage(kp.files(rootsPEM))
		if i%splitEvery == 1 {
			splits++
			first := CertChainFile // then the key, with ..data
			if i%(2*splitEvery) == splitEvery+1 {
				first = KeyFile
			}
			vol.Link(first, filepath.Join(gen, first))
			e.reread("the half-linked pair is refused", func() bool {
				return strings.Contains(status(t, r.m, WorkloadCertName).Error, "does not match")
			})
			if st := status(t, r.m, WorkloadCertName); !st.Valid || st.Secret.Version != last.Version {
				t.Fatalf("swap %d, half linked: Snapshot %+v, want the last good version %s valid", i, st, last.Version)
			}
			r.workload.none(t, fmt.Sprintf("swap %d, while cert and key were from different generations", i))
			if got := current(t, r.m, WorkloadCertName); got.s != last {
				t.Fatalf("swap %d, half linked: a new subscriber is told %s, want the last good version %s", i, got, last.Version)
			}
			ready(t, r.m, true)
		}
		vol.Swap(gen)
		u := drive(t, e.clock, r.workload.ch)
		if u.s == nil {
			t.Fatalf("swap %d: told %v", i, u)
		}
		checkPair(t, u.s)
		if want := hashVersion(kp.chainPEM, kp.keyPEM); u.s.Version != want {
			t.Fatalf("swap %d: announced version %s (serial %s), want %s (serial %s), the pair just written",
				i, u.s.Version, u.s.KeyPair.Leaf().SerialNumber.Text(16), want, kp.leaf.SerialNumber.Text(16))
		}
		last = u.s
	}
	checkServes(t, last, WorkloadCertName, kp)
	if st := status(t, r.m, WorkloadCertName); !st.Valid || st.Secret != last || st.Error != "" {
		t.Fatalf("after %d swaps Snapshot = %+v, want the last written version %s and no error", swaps, st, last.Version)
	}
	// A half-linked swap may be looked at more than once, but nothing else was ever refused.
	refused := e.logs.matching(func(rec logRecord) bool {
		return rec.level >= slog.LevelWarn && rec.attrs[logkey.Secret] == WorkloadCertName
	})
	for _, rec := range refused {
		if !strings.Contains(rec.attrs[logkey.Error], "does not match") {
			t.Errorf("refused files that were not half linked: %q %v", rec.msg, rec.attrs)
		}
	}
	if len(refused) < splits {
		t.Errorf("%d warnings about unusable files, want one for each of the %d half-linked swaps", len(refused), splits)
	}
	r.roots.none(t, "root-cert.pem never changed")
}

func TestFileModeInvalidPairs(t *testing.T) {
	t.Parallel()
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "files root"})
	rootsPEM := testutil.CertPEM(ca.Cert)
	other := validPair(t, ca)
	badPairs := []struct {
		name string
		make func(t *testing.T) keyPair
		want string // in the error subscribers, Ready and Snapshot give
	}{
		{"garbage key", func(t *testing.T) keyPair {
			kp := validPair(t, ca)
			kp.keyPEM = []byte("-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n")
			return kp
		}, "parse PRIVATE KEY"},
		{"expired certificate", func(t *testing.T) keyPair {
			return newKeyPair(t, ca, t0.Add(-48*time.Hour), t0.Add(-time.Hour))
		}, "valid from"},
		{"certificate not yet valid", func(t *testing.T) keyPair {
			return newKeyPair(t, ca, t0.Add(time.Hour), t0.Add(48*time.Hour))
		}, "valid from"},
		{"key of another certificate", func(t *testing.T) keyPair {
			kp := validPair(t, ca)
			kp.keyPEM = other.keyPEM
			return kp
		}, "does not match"},
		{"empty certificate chain", func(t *testing.T) keyPair {
			kp := validPair(t, ca)
			kp.chainPEM = nil
			return kp
		}, "no PEM data"},
	}

	t.Run("becomes invalid", func(t *testing.T) {
		t.Parallel()
		good := validPair(t, ca)
		e, vol := fileModeEnv(t, ca, good)
		r := e.start()
		served := r.next(t)
		checkServes(t, served, WorkloadCertName, good)
		r.roots.next(t)
		previous := ""
		for _, bad := range badPairs {
			vol.Update(bad.make(t).files(rootsPEM))
			e.reread(bad.name+" is refused", func() bool {
				st := status(t, r.m, WorkloadCertName)
				return st.Error != previous && strings.Contains(st.Error, bad.want)
			})
			st := status(t, r.m, WorkloadCertName)
			previous = st.Error
			if !st.Valid || st.Secret != served {
				t.Fatalf("%s: Snapshot %+v, want the last good pair, valid", bad.name, st)
			}
			r.workload.none(t, bad.name)
			if got := current(t, r.m, WorkloadCertName); got.s != served {
				t.Fatalf("%s: a new subscriber is told %s, want the last good pair", bad.name, got)
			}
			ready(t, r.m, true)
		}
		// The same good pair again: nothing to tell subscribers, and nothing wrong any more.
		vol.Update(good.files(rootsPEM))
		e.reread("the good pair is read again", func() bool { return status(t, r.m, WorkloadCertName).Error == "" })
		if st := status(t, r.m, WorkloadCertName); !st.Valid || st.Secret != served {
			t.Fatalf("Snapshot %+v, want the good pair", st)
		}
		r.workload.none(t, "the same pair was mounted again")
		// A new good pair is taken at once.
		next := validPair(t, ca)
		vol.Update(next.files(rootsPEM))
		checkServes(t, driveSecret(t, e, r.workload), WorkloadCertName, next)
		if n := e.errorLogs(); n != 0 {
			t.Errorf("%d errors logged while a valid pair was held", n)
		}
	})

	for _, bad := range badPairs {
		t.Run("invalid from the start/"+bad.name, func(t *testing.T) {
			t.Parallel()
			e, vol := fileModeEnv(t, ca, bad.make(t))
			r := e.start()
			if err := r.workload.nextErr(t); !strings.Contains(err.Error(), bad.want) {
				t.Fatalf("subscribers told %v, want the problem %q", err, bad.want)
			}
			ready(t, r.m, false, bad.want)
			if got := e.certValid(); got != 0 {
				t.Errorf("meshid_agent_cert_valid = %v without a valid pair", got)
			}
			if n := e.errorLogs(); n != 1 {
				t.Errorf("%d errors logged, want 1", n)
			}
			// ROOTCA is its own file, and fine.
			checkRoots(t, r.roots.next(t), RootCertName, rootsPEM, ca.Cert)

			// Subscribers get the pair once it is fixed.
			good := validPair(t, ca)
			vol.Update(good.files(rootsPEM))
			checkServes(t, driveSecret(t, e, r.workload), WorkloadCertName, good)
			ready(t, r.m, true)
			if got := e.certValid(); got != 1 {
				t.Errorf("meshid_agent_cert_valid = %v with a valid pair", got)
			}
		})
	}
}

func TestFileResourceNames(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	base := t.TempDir()
	allowed, outside := filepath.Join(base, "allowed"), filepath.Join(base, "outside")
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "resource root"})
	kp := validPair(t, ca)
	otherRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "other root"})
	rootsPEM := testutil.CertPEM(ca.Cert, otherRoot.Cert)
	for _, dir := range []string{allowed, outside} {
		testutil.WriteFiles(t, dir, map[string][]byte{"cert.pem": kp.chainPEM, "key.pem": kp.keyPEM, "roots.pem": rootsPEM})
	}
	for name, target := range map[string]string{
		"cert-out.pem":  filepath.Join(outside, "cert.pem"),
		"key-out.pem":   filepath.Join(outside, "key.pem"),
		"roots-out.pem": filepath.Join(outside, "roots.pem"),
		"roots-in.pem":  "roots.pem", // a link that stays inside is fine
	} {
		if err := os.Symlink(target, filepath.Join(allowed, name)); err != nil {
			t.Fatal(err)
		}
	}
	e.cfg.FileResourceDirs = []string{allowed}
	r := e.start()
	s := r.next(t)
	e.idle(s.RenewAt)
	in := func(name string) string { return filepath.Join(allowed, name) }
	out := func(name string) string { return filepath.Join(outside, name) }

	t.Run("served", func(t *testing.T) {
		certName := FileCertPrefix + in("cert.pem") + "~" + in("key.pem")
		checkServes(t, subscribe(t, r.m, certName).next(t), certName, kp)
		for _, path := range []string{in("roots.pem"), in("roots-in.pem")} {
			rootName := FileRootPrefix + path
			checkRoots(t, subscribe(t, r.m, rootName).next(t), rootName, rootsPEM, ca.Cert, otherRoot.Cert)
		}
	})

	for _, tc := range []struct {
		name, secret string
		want         error
	}{
		{"cert outside", FileCertPrefix + out("cert.pem") + "~" + in("key.pem"), ErrForbiddenPath},
		{"key outside", FileCertPrefix + in("cert.pem") + "~" + out("key.pem"), ErrForbiddenPath},
		{"roots outside", FileRootPrefix + out("roots.pem"), ErrForbiddenPath},
		{"sibling sharing the prefix", FileRootPrefix + allowed + "-evil/roots.pem", ErrForbiddenPath},
		{"system file", FileRootPrefix + "/etc/ssl/certs/ca-certificates.crt", ErrForbiddenPath},
		{"relative", FileRootPrefix + "allowed/roots.pem", ErrForbiddenPath},
		{"relative cert", FileCertPrefix + "cert.pem~" + in("key.pem"), ErrForbiddenPath},
		{"dot-dot out", FileRootPrefix + allowed + "/../outside/roots.pem", ErrForbiddenPath},
		{"dot-dot back in", FileRootPrefix + allowed + "/../allowed/roots.pem", ErrForbiddenPath},
		{"dot element", FileRootPrefix + allowed + "/./roots.pem", ErrForbiddenPath},
		{"the allowed dir itself", FileRootPrefix + allowed, ErrForbiddenPath},
		{"the allowed dir with a slash", FileRootPrefix + allowed + "/", ErrForbiddenPath},
		{"symlinked cert leading outside", FileCertPrefix + in("cert-out.pem") + "~" + in("key.pem"), ErrForbiddenPath},
		{"symlinked key leading outside", FileCertPrefix + in("cert.pem") + "~" + in("key-out.pem"), ErrForbiddenPath},
		{"symlinked roots leading outside", FileRootPrefix + in("roots-out.pem"), ErrForbiddenPath},
		{"no tilde", FileCertPrefix + in("cert.pem"), ErrUnknownSecret},
		{"empty cert", FileCertPrefix + "~" + in("key.pem"), ErrUnknownSecret},
		{"empty key", FileCertPrefix + in("cert.pem") + "~", ErrUnknownSecret},
		{"only a tilde", FileCertPrefix + "~", ErrUnknownSecret},
		{"empty roots", FileRootPrefix, ErrUnknownSecret},
		{"unknown prefix", "file-key:" + in("key.pem"), ErrUnknownSecret},
		{"no prefix", in("roots.pem"), ErrUnknownSecret},
		{"prefix in upper case", "FILE-ROOT:" + in("roots.pem"), ErrUnknownSecret},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cancel, err := r.m.Subscribe(tc.secret, func(s *Secret, err error) {
				t.Errorf("a refused subscriber to %s was told (%v, %v)", tc.secret, s, err)
			})
			if !errors.Is(err, tc.want) || cancel != nil {
				t.Fatalf("Subscribe(%s) = %v, want %v and no cancel", tc.secret, err, tc.want)
			}
			for _, st := range r.m.Snapshot() {
				if st.Name == tc.secret {
					t.Errorf("the refused %s is in the Snapshot", tc.secret)
				}
			}
		})
	}

	t.Run("file appears later", func(t *testing.T) {
		later := kp
		name := FileCertPrefix + in("later-cert.pem") + "~" + in("later-key.pem")
		sub := subscribe(t, r.m, name) // accepted before its files exist
		// The first read (after the watch is set) found nothing, and says so.
		if err := sub.nextErr(t); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("told %v, want the files missing", err)
		}
		// An operator writes them by atomic renames, the key first.
		writeFileAtomic(t, in("later-key.pem"), later.keyPEM)
		writeFileAtomic(t, in("later-cert.pem"), later.chainPEM)
		checkServes(t, driveSecret(t, e, sub), name, later)
	})
}

// TestFileResourceInMissingDirectory: a file resource whose directory does not exist yet (not
// even its parent, for the roots) is served once the directory and the files appear.
func TestFileResourceInMissingDirectory(t *testing.T) {
	t.Parallel()
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "resource root"})
	kp := validPair(t, ca)
	rootsPEM := testutil.CertPEM(ca.Cert)
	for _, tc := range []struct {
		name  string
		sub   string // the missing directories under the allowed one
		files map[string][]byte
		// resource names the resource in dir; check checks what it serves.
		resource func(dir string) string
		check    func(t *testing.T, s *Secret, name string)
	}{
		{"key pair, its directory missing", "tls", map[string][]byte{"tls.crt": kp.chainPEM, "tls.key": kp.keyPEM},
			func(dir string) string {
				return FileCertPrefix + filepath.Join(dir, "tls.crt") + "~" + filepath.Join(dir, "tls.key")
			},
			func(t *testing.T, s *Secret, name string) { checkServes(t, s, name, kp) }},
		{"roots, two directories missing", filepath.Join("mesh", "ca"), map[string][]byte{"ca.crt": rootsPEM},
			func(dir string) string { return FileRootPrefix + filepath.Join(dir, "ca.crt") },
			func(t *testing.T, s *Secret, name string) { checkRoots(t, s, name, rootsPEM, ca.Cert) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			allowed := t.TempDir()
			e.cfg.FileResourceDirs = []string{allowed}
			r := e.start()
			s := r.next(t)
			e.idle(s.RenewAt)

			dir := filepath.Join(allowed, tc.sub)
			name := tc.resource(dir)
			sub := subscribe(t, r.m, name)
			if err := sub.nextErr(t); !errors.Is(err, fs.ErrNotExist) {
				t.Fatalf("told %v, want the files missing", err)
			}
			if st := status(t, r.m, name); st.Valid || st.Secret != nil || !strings.Contains(st.Error, "no such file") {
				t.Fatalf("Snapshot %+v, want nothing valid and the files missing", st)
			}

			if err := os.MkdirAll(dir, 0o750); err != nil {
				t.Fatal(err)
			}
			for file, data := range tc.files {
				writeFileAtomic(t, filepath.Join(dir, file), data)
			}
			got := driveSecret(t, e, sub)
			tc.check(t, got, name)
			if st := status(t, r.m, name); !st.Valid || st.Secret != got || st.Error != "" {
				t.Fatalf("Snapshot %+v, want the secret served", st)
			}
		})
	}
}

// TestReadersAnswerWhileAFileReadBlocks: a file resource that is a FIFO nobody writes holds up
// nothing; Ready, Snapshot, TLSCertificate and Subscribe answer throughout.
func TestReadersAnswerWhileAFileReadBlocks(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dir := t.TempDir()
	e.cfg.FileResourceDirs = []string{dir}
	fifo := filepath.Join(dir, "cert.pem")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "resource root"})
	kp := validPair(t, ca)
	testutil.WriteFiles(t, dir, map[string][]byte{"key.pem": kp.keyPEM, "roots.pem": testutil.CertPEM(ca.Cert)})
	r := e.start()
	s := r.next(t)
	e.idle(s.RenewAt)

	name := FileCertPrefix + fifo + "~" + filepath.Join(dir, "key.pem")
	sub := subscribe(t, r.m, name)

	// readersAnswer fails unless Ready, Snapshot, TLSCertificate and Subscribe answer. Real time
	// bounds only a failure: a reader that waits for the blocked read never answers.
	readersAnswer := func(when string) {
		t.Helper()
		answered := make(chan struct{})
		go func() {
			defer close(answered)
			if ok, why := r.m.Ready(); !ok {
				t.Errorf("%s: Ready = (false, %q) with a valid certificate", when, why)
			}
			var listed []string
			for _, st := range r.m.Snapshot() {
				listed = append(listed, st.Name)
				if st.Name == name && (st.Valid || st.Secret != nil) {
					t.Errorf("%s: Snapshot shows %s %+v before it was read", when, name, st)
				}
			}
			if !slices.Contains(listed, name) || !slices.Contains(listed, WorkloadCertName) {
				t.Errorf("%s: Snapshot lists %q, want %s and default", when, listed, name)
			}
			if c := r.m.TLSCertificate(); c == nil {
				t.Errorf("%s: no TLSCertificate with a valid certificate", when)
			}
			if got := current(t, r.m, WorkloadCertName); got.s != s {
				t.Errorf("%s: a new subscriber to default is told %s", when, got)
			}
			if _, err := r.m.Subscribe(FileRootPrefix+filepath.Join(dir, "roots.pem"), func(*Secret, error) {}); err != nil {
				t.Errorf("%s: Subscribe while a file read blocks: %v", when, err)
			}
		}()
		select {
		case <-answered:
		case <-time.After(waitLimit):
			t.Fatalf("%s: Ready, Snapshot, TLSCertificate or Subscribe waited for a blocked file read", when)
		}
	}
	// The FIFO is refused as it is opened, without waiting for a writer (a FIFO with no writer
	// used to hold the loader's read for good).
	readersAnswer("while the FIFO is asked for")
	if err := sub.nextErr(t); !strings.Contains(err.Error(), "not a regular file") {
		t.Fatalf("told %v, want the FIFO refused as not a regular file", err)
	}
	readersAnswer("once the FIFO is refused")
}

// subscribeWhileOthersSubscribe subscribes to names at once while other streams keep subscribing
// to default and ROOTCA (which must come from source), and returns the subscriptions. SDS
// subscribes from every stream's goroutine; the race detector checks that the manager's index of
// file secrets, which grows as names are first asked for, is guarded.
func subscribeWhileOthersSubscribe(t *testing.T, m *Manager, source Source, names ...string) map[string]*subscription {
	t.Helper()
	const streams = 4
	stop, asked, running := make(chan struct{}), make(chan error, streams), make(chan struct{}, streams)
	for range streams {
		go func() {
			var failed error
			for i := 0; ; i++ {
				if i == 1 {
					running <- struct{}{} // it has gone round: it keeps going while names are added
				}
				select {
				case <-stop:
					asked <- failed
					return
				default:
				}
				for _, name := range []string{WorkloadCertName, RootCertName} {
					var (
						mu  sync.Mutex
						got update
					)
					cancel, err := m.Subscribe(name, func(s *Secret, err error) {
						mu.Lock()
						defer mu.Unlock()
						if got.s == nil && got.err == nil {
							got = update{s, err}
						}
					})
					switch {
					case failed != nil:
					case err != nil:
						failed = fmt.Errorf("Subscribe(%s) while file resources were added: %w", name, err)
					}
					if cancel != nil {
						cancel()
					}
					mu.Lock()
					switch {
					case failed != nil:
					case got.s == nil:
						failed = fmt.Errorf("Subscribe(%s) while file resources were added was told %v", name, got)
					case got.s.Source != source:
						failed = fmt.Errorf("Subscribe(%s) while file resources were added was given a secret from %q, want %s", name, got.s.Source, source)
					}
					mu.Unlock()
				}
			}
		}()
	}
	for range streams {
		recv(t, running, "the other streams to start")
	}
	type result struct {
		sub *subscription
		err error
	}
	results := make(chan result, len(names))
	for _, name := range names {
		go func() {
			sub, err := trySubscribe(t, m, name)
			results <- result{sub, err}
		}()
	}
	got := map[string]*subscription{}
	var failed error
	for range names {
		res := recv(t, results, "Subscribe")
		if res.err != nil && failed == nil {
			failed = res.err
		} else if res.err == nil {
			got[res.sub.name] = res.sub
		}
	}
	close(stop)
	for range streams {
		if err := recv(t, asked, "the other streams to stop"); err != nil && failed == nil {
			failed = err
		}
	}
	if failed != nil {
		t.Fatal(failed)
	}
	return got
}

// TestFileResourceInCAMode serves file resources next to the CA's certificate: requested at run
// time, watched, listed in Snapshot.
func TestFileResourceInCAMode(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dir := t.TempDir()
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "resource root"})
	kp := validPair(t, ca)
	rootsPEM := testutil.CertPEM(ca.Cert)
	testutil.WriteFiles(t, dir, map[string][]byte{"tls.crt": kp.chainPEM, "tls.key": kp.keyPEM, "ca.crt": rootsPEM})
	e.cfg.FileResourceDirs = []string{dir}
	certName := FileCertPrefix + filepath.Join(dir, "tls.crt") + "~" + filepath.Join(dir, "tls.key")
	rootName := FileRootPrefix + filepath.Join(dir, "ca.crt")
	r := e.start()
	workload := r.next(t)
	e.idle(workload.RenewAt)

	subs := subscribeWhileOthersSubscribe(t, r.m, SourceCA, certName, rootName)
	if got := current(t, r.m, WorkloadCertName); got.s != workload {
		t.Errorf("default = %s, want the CA's %s", got, workload.Version)
	}
	checkServes(t, subs[certName].next(t), certName, kp)
	checkRoots(t, subs[rootName].next(t), rootName, rootsPEM, ca.Cert)

	// An operator replaces the pair by atomic renames, key first, and rewrites the roots in place.
	next := validPair(t, ca)
	otherRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "other root"})
	nextRootsPEM := testutil.CertPEM(ca.Cert, otherRoot.Cert)
	writeFileAtomic(t, filepath.Join(dir, "tls.key"), next.keyPEM)
	writeFileAtomic(t, filepath.Join(dir, "tls.crt"), next.chainPEM)
	if err := os.WriteFile(filepath.Join(dir, "ca.crt"), nextRootsPEM, 0o644); err != nil {
		t.Fatal(err)
	}
	newPair := driveSecret(t, e, subs[certName])
	checkServes(t, newPair, certName, next)
	var newRoots *Secret
	for newRoots == nil || newRoots.Version != hashVersion(nextRootsPEM) {
		newRoots = driveSecret(t, e, subs[rootName]) // a read may catch the file half rewritten
	}
	checkRoots(t, newRoots, rootName, nextRootsPEM, ca.Cert, otherRoot.Cert)
	if got := current(t, r.m, certName); got.s != newPair {
		t.Errorf("a new subscriber to %s is told %s, want the new version %s", certName, got, newPair.Version)
	}

	roots := current(t, r.m, RootCertName).s
	var snap []string
	for _, st := range r.m.Snapshot() {
		snap = append(snap, st.Name+"@"+st.Secret.Version)
	}
	want := []string{
		RootCertName + "@" + roots.Version,
		WorkloadCertName + "@" + workload.Version,
		certName + "@" + newPair.Version,
		rootName + "@" + newRoots.Version,
	}
	slices.Sort(want)
	if !slices.Equal(snap, want) {
		t.Errorf("Snapshot = %q, want %q (sorted by name)", snap, want)
	}
	if e.signer.Calls() != 1 {
		t.Errorf("Sign called %d times, want 1 (file resources are not the CA's)", e.signer.Calls())
	}
}

// TestFileResourcesShareADataSwap serves a key pair and a trust bundle from one Kubernetes
// volume (in file mode, next to the workload files in their own): each ..data swap reaches both.
func TestFileResourcesShareADataSwap(t *testing.T) {
	t.Parallel()
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "files root"})
	e, _ := fileModeEnv(t, ca, validPair(t, ca))
	kp := validPair(t, ca)
	rootsPEM := testutil.CertPEM(ca.Cert)
	res := newVolume(t, filepath.Join(t.TempDir(), "mounted"), map[string][]byte{"tls.crt": kp.chainPEM, "tls.key": kp.keyPEM, "ca.crt": rootsPEM})
	e.cfg.FileResourceDirs = []string{res.Dir}
	certName := FileCertPrefix + res.Path("tls.crt") + "~" + res.Path("tls.key")
	rootName := FileRootPrefix + res.Path("ca.crt")
	r := e.start()
	r.next(t)
	r.roots.next(t)

	subs := subscribeWhileOthersSubscribe(t, r.m, SourceFiles, certName, rootName)
	checkServes(t, subs[certName].next(t), certName, kp)
	checkRoots(t, subs[rootName].next(t), rootName, rootsPEM, ca.Cert)

	for i := range 3 {
		kp = validPair(t, ca)
		rootsPEM = testutil.CertPEM(ca.Cert, testutil.NewRootCA(t, testutil.CAOptions{CommonName: fmt.Sprint("extra root ", i)}).Cert)
		res.Update(map[string][]byte{"tls.crt": kp.chainPEM, "tls.key": kp.keyPEM, "ca.crt": rootsPEM})
		checkServes(t, driveSecret(t, e, subs[certName]), certName, kp)
		rootsNow, err := pki.ParseCertificates(rootsPEM)
		if err != nil {
			t.Fatal(err)
		}
		checkRoots(t, driveSecret(t, e, subs[rootName]), rootName, rootsPEM, rootsNow...)
		subs[certName].none(t, fmt.Sprintf("swap %d", i))
		subs[rootName].none(t, fmt.Sprintf("swap %d", i))
	}
	// The workload files were not touched: nothing for default or ROOTCA.
	r.roots.none(t, "swaps in another volume")
	r.workload.none(t, "swaps in another volume")
}

// Each file secret is watched while subscribed to, so their number is bounded, even when many
// clients ask at once.
func TestFileSecretsAreBounded(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	m, err := New(Config{Workload: &MountedFiles{CertChain: filepath.Join(dir, "c"), Key: filepath.Join(dir, "k"), Root: filepath.Join(dir, "r")},
		FileResourceDirs: []string{dir}})
	if err != nil {
		t.Fatal(err)
	}
	const asks = MaxFileSecrets + 64
	var (
		wg       sync.WaitGroup
		accepted atomic.Int32
		start    = make(chan struct{})
		first    = make(chan string, asks)
	)
	for i := range asks {
		wg.Go(func() {
			name := FileRootPrefix + filepath.Join(dir, fmt.Sprintf("root-%d.pem", i))
			<-start
			_, err := m.Subscribe(name, func(*Secret, error) {})
			switch {
			case err == nil:
				accepted.Add(1)
				first <- name
			case !errors.Is(err, ErrTooManyFiles):
				t.Errorf("Subscribe(%s) = %v, want nil or ErrTooManyFiles", name, err)
			}
		})
	}
	close(start)
	wg.Wait()
	if n := m.files.count(); n != MaxFileSecrets {
		t.Fatalf("%d file secrets watched (%d accepted), want the bound %d", n, accepted.Load(), MaxFileSecrets)
	}
	known := <-first
	if _, err := m.Subscribe(known, func(*Secret, error) {}); err != nil {
		t.Fatalf("a known file secret refused at the bound: %v", err)
	}
	if _, err := m.Subscribe(FileRootPrefix+filepath.Join(dir, "one-more.pem"), func(*Secret, error) {}); !errors.Is(err, ErrTooManyFiles) {
		t.Fatalf("a file secret past the bound: %v, want ErrTooManyFiles", err)
	}
}

// A path resolved into a ..data generation that the kubelet removes before the open (it swaps
// ..data first) is resolved again and read from the new generation, rather than reported as
// missing: that transient error was a warning about files that were fine.
func TestReadFileResolvesAgainWhenTheGenerationIsRemoved(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	vol := testutil.NewSecretVolume(t, dir)
	vol.Update(map[string][]byte{CertChainFile: []byte("old")})
	next := vol.Stage(map[string][]byte{CertChainFile: []byte("new")})
	path := vol.Path(CertChainFile)
	resolutions := 0
	resolve := func(p string) (string, error) {
		resolved, err := filepath.EvalSymlinks(p)
		if resolutions++; resolutions == 1 {
			vol.Swap(next) // between this resolution and the open
		}
		return resolved, err
	}
	got, err := readFileResolved(path, []string{dir}, resolve)
	if err != nil || string(got) != "new" || resolutions != 2 {
		t.Fatalf("read %q, %v after %d resolutions; want the new generation's file after 2", got, err, resolutions)
	}

	// The generation is removed while its links are followed: resolved again, it is the new one.
	resolutions = 0
	got, err = readFileResolved(path, []string{dir}, func(p string) (string, error) {
		resolutions++
		if resolutions == 1 {
			return "", &fs.PathError{Op: "lstat", Path: filepath.Join(dir, "..gone"), Err: fs.ErrNotExist}
		}
		return filepath.EvalSymlinks(p)
	})
	if err != nil || string(got) != "new" || resolutions != 2 {
		t.Fatalf("read %q, %v after %d resolutions; want the new generation's file after 2", got, err, resolutions)
	}

	// A file that is really gone stays an error, after a bounded number of tries.
	resolutions = 0
	if _, err := readFileResolved(filepath.Join(dir, "..data", "gone"), nil, func(p string) (string, error) {
		resolutions++
		return filepath.Join(dir, "nowhere"), nil
	}); !errors.Is(err, fs.ErrNotExist) || resolutions != resolveAttempts {
		t.Fatalf("a missing file: %v after %d resolutions, want ErrNotExist after %d", err, resolutions, resolveAttempts)
	}
}

// The credential files of a directory are named as they are present or missing.
func TestCredentialFiles(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, KeyFile), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	present, missing := CredentialFiles(dir)
	if !slices.Equal(present, []string{KeyFile}) || !slices.Equal(missing, []string{CertChainFile, RootCertFile}) {
		t.Fatalf("CredentialFiles = %v, %v", present, missing)
	}
	if f := MountedFilesIn(dir); f.Key != filepath.Join(dir, KeyFile) || f.CertChain != filepath.Join(dir, CertChainFile) || f.Root != filepath.Join(dir, RootCertFile) {
		t.Fatalf("MountedFilesIn = %+v", f)
	}
}

// Managers sharing one file watcher hub (a node agent's, one manager per identity) each read
// the CA root file again when it changes.
func TestManagersShareAFileWatcher(t *testing.T) {
	t.Parallel()
	hub := filewatch.NewHub(filewatch.HubConfig{})
	ctx, cancel := context.WithCancel(t.Context())
	hubDone := make(chan error, 1)
	go func() { hubDone <- hub.Run(ctx) }()
	first, second := newEnv(t), newEnv(t)
	first.trustSignerRoot(t)
	second.signer.useCA(first.signer)
	second.rot.RootCertFile = first.rot.RootCertFile
	var runs []*run
	for _, e := range []*env{first, second} {
		e.cfg.FileWatch = hub
		r := e.start()
		r.next(t)
		runs = append(runs, r)
	}
	extra := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "next root"})
	writeFileAtomic(t, first.rot.RootCertFile, testutil.CertPEM(first.signer.rootCert(), extra.Cert))
	for i, e := range []*env{first, second} {
		e.reread("ROOTCA holds the new root", func() bool {
			got := current(t, runs[i].m, RootCertName).s
			return got != nil && slices.ContainsFunc(got.Bundle.Roots, extra.Cert.Equal)
		})
	}
	for _, r := range runs {
		if err := r.stop(t); err != nil {
			t.Fatal(err)
		}
	}
	cancel()
	if err := <-hubDone; err != nil {
		t.Fatal(err)
	}
}
