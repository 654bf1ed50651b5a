package secretmanager

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/filewatch"
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
	if len(s.Chain) == 0 || s.Key == nil || !pki.KeyMatchesCertificate(s.Key, s.Chain[0]) {
		t.Fatalf("%s version %s: the key does not match the leaf", s.Name, s.Version)
	}
	chain, err := pki.ParseCertificates(s.ChainPEM)
	if err != nil {
		t.Fatalf("%s version %s: ChainPEM: %v", s.Name, s.Version, err)
	}
	key, err := pki.ParsePrivateKey(s.KeyPEM)
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
	if s.Name != name || s.Source != "files" {
		t.Fatalf("got %s from %q, want %s from files", s.Name, s.Source, name)
	}
	if !s.Chain[0].Equal(kp.leaf) {
		t.Fatalf("%s serves serial %s, want %s", name, s.Chain[0].SerialNumber.Text(16), kp.leaf.SerialNumber.Text(16))
	}
	if want := hashVersion(kp.chainPEM, kp.keyPEM); s.Version != want {
		t.Fatalf("%s version %q, want the content hash %q", name, s.Version, want)
	}
	if string(s.ChainPEM) != string(kp.chainPEM) || string(s.KeyPEM) != string(kp.keyPEM) {
		t.Fatalf("%s does not carry the files' PEM as written", name)
	}
	if !s.ExpiresAt.Equal(kp.leaf.NotAfter) {
		t.Fatalf("%s expires %s, want the leaf's NotAfter %s", name, s.ExpiresAt, kp.leaf.NotAfter)
	}
}

// checkRoots fails unless s is the trust bundle roots, read from files holding rootsPEM.
func checkRoots(t *testing.T, s *Secret, name string, rootsPEM []byte, roots ...*x509.Certificate) {
	t.Helper()
	if s.Name != name || s.Source != "files" || s.Chain != nil || s.Key != nil {
		t.Fatalf("got %s from %q (with a key pair: %v), want the roots %s from files", s.Name, s.Source, s.Chain != nil, name)
	}
	if !sameCerts(s.Roots, roots) {
		t.Fatalf("%s holds %s, want %s", name, names(s.Roots), names(roots))
	}
	if parsed, err := pki.ParseCertificates(s.RootsPEM); err != nil || !sameCerts(parsed, roots) {
		t.Fatalf("%s: RootsPEM does not hold Roots (err %v)", name, err)
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

// warning is a warning the manager logged.
type warning struct{ msg, secret, err string }

// logTap passes records on and copies each warning to ch, so that a test can wait until the
// manager has looked at files it must refuse (refusing notifies nobody).
type logTap struct {
	slog.Handler
	ch chan warning
}

func (h logTap) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		w := warning{msg: r.Message}
		r.Attrs(func(a slog.Attr) bool {
			switch a.Key {
			case "secret":
				w.secret = a.Value.String()
			case "error":
				w.err = a.Value.String()
			}
			return true
		})
		select {
		case h.ch <- w:
		default: // a test that waits for it fails by Drive's deadline
		}
	}
	return h.Handler.Handle(ctx, r)
}

func (h logTap) WithAttrs(as []slog.Attr) slog.Handler {
	return logTap{h.Handler.WithAttrs(as), h.ch}
}

func (h logTap) WithGroup(name string) slog.Handler { return logTap{h.Handler.WithGroup(name), h.ch} }

// tapWarnings makes e's manager copy its warnings to the returned channel.
func (e *env) tapWarnings() chan warning {
	ch := make(chan warning, 1024)
	e.cfg.Logger = slog.New(logTap{e.cfg.Logger.Handler(), ch})
	return ch
}

// awaitWarning runs the fake clock (debounce steps, above baseline timers) until the manager
// warns about secret, and returns the warning.
func (e *env) awaitWarning(baseline int, warnings chan warning, secret string) warning {
	e.t.Helper()
	for {
		if w := testutil.Drive(e.t, e.clock, filewatch.DefaultDebounce, baseline, warnings); w.secret == secret {
			return w
		}
	}
}

func drain[T any](ch chan T) {
	for {
		select {
		case <-ch:
		default:
			return
		}
	}
}

// subscribeNames subscribes to m and returns the secrets it announces under names, in order.
func subscribeNames(t *testing.T, m *Manager, names ...string) chan *Secret {
	ch := make(chan *Secret, 256)
	m.Subscribe(func(s *Secret) {
		if !slices.Contains(names, s.Name) {
			return
		}
		select {
		case ch <- s:
		default:
			t.Errorf("subscriber channel full at %s", s.Name)
		}
	})
	return ch
}

// fileModeEnv is an env in file mode: no signer, the workload files in a Kubernetes volume
// holding kp and ca's root.
func fileModeEnv(t *testing.T, ca *testutil.CA, kp keyPair) (*env, *testutil.SecretVolume, chan warning) {
	t.Helper()
	e := newEnv(t)
	vol := newVolume(t, filepath.Join(t.TempDir(), "certs"), kp.files(testutil.CertPEM(ca.Cert)))
	e.cfg.Signer = nil
	e.cfg.WorkloadFiles = &FilePaths{CertChain: vol.Path(CertChainFile), Key: vol.Path(KeyFile), Root: vol.Path(RootCertFile)}
	return e, vol, e.tapWarnings()
}

func TestFileModeServesAtOnce(t *testing.T) {
	t.Parallel()
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "files root"})
	kp := validPair(t, ca)
	e, _, _ := fileModeEnv(t, ca, kp)
	m := e.newManager()
	if m.Ready() {
		t.Fatal("Ready before Run read the files")
	}
	r := e.run(m)

	// No clock moves: the files are read as Run starts, not after a debounce or a timer.
	s := r.next(t)
	checkServes(t, s, WorkloadCertName, kp)
	roots := recv(t, r.roots, "ROOTCA from the files")
	rootsPEM := testutil.CertPEM(ca.Cert)
	checkRoots(t, roots, RootCertName, rootsPEM, ca.Cert)
	if !m.Ready() {
		t.Error("not Ready with a valid pair in the files")
	}
	if got, err := m.GenerateSecret(cancelledCtx(), WorkloadCertName); err != nil || got.Version != s.Version {
		t.Errorf("GenerateSecret(default) = (%v, %v), want version %s", got, err, s.Version)
	}
	if got, err := m.GenerateSecret(cancelledCtx(), RootCertName); err != nil || got.Version != roots.Version {
		t.Errorf("GenerateSecret(ROOTCA) = (%v, %v), want version %s", got, err, roots.Version)
	}
	var snap []string
	for _, s := range m.Snapshot() {
		snap = append(snap, s.Name+"@"+s.Source+"@"+s.Version)
	}
	slices.Sort(snap)
	if want := []string{RootCertName + "@files@" + roots.Version, WorkloadCertName + "@files@" + s.Version}; !slices.Equal(snap, want) {
		t.Errorf("Snapshot = %q, want %q", snap, want)
	}

	files := e.cfg.WorkloadFiles
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"both a signer and files", Config{Signer: e.signer, WorkloadFiles: files, Identity: testID}},
		{"neither", Config{Identity: testID}},
	} {
		t.Run("New refuses "+tc.name, func(t *testing.T) {
			if m, err := New(tc.cfg); err == nil || !strings.Contains(err.Error(), "either a signer or workload files") {
				t.Fatalf("New = (%v, %v), want an error asking for either a signer or workload files", m, err)
			}
		})
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
	e, vol, warnings := fileModeEnv(t, ca, kp)
	r := e.start()
	last := r.next(t)
	checkServes(t, last, WorkloadCertName, kp)
	recv(t, r.roots, "ROOTCA from the files")

	const swaps, splitEvery = 100, 4
	splits := 0
	for i := range swaps {
		kp = validPair(t, ca)
		gen := vol.Stage(kp.files(rootsPEM))
		if i%splitEvery == 1 {
			splits++
			drain(warnings)
			first := CertChainFile // then the key, with ..data
			if i%(2*splitEvery) == splitEvery+1 {
				first = KeyFile
			}
			vol.Link(first, filepath.Join(gen, first))
			w := e.awaitWarning(0, warnings, WorkloadCertName)
			if !strings.Contains(w.msg, "last good") || !strings.Contains(w.err, "does not match") {
				t.Fatalf("swap %d, half linked: warned %q (%s), want the last good pair kept over a key that does not match", i, w.msg, w.err)
			}
			select {
			case s := <-r.workload:
				t.Fatalf("swap %d: announced version %s while cert and key were from different generations", i, s.Version)
			default:
			}
			if got, err := r.m.GenerateSecret(cancelledCtx(), WorkloadCertName); err != nil || got.Version != last.Version {
				t.Fatalf("swap %d, half linked: GenerateSecret = (%v, %v), want the last good version %s", i, got, err, last.Version)
			}
			if !r.m.Ready() {
				t.Fatalf("swap %d, half linked: not Ready while the last good pair is valid", i)
			}
		}
		vol.Swap(gen)
		s := testutil.Drive(t, e.clock, filewatch.DefaultDebounce, 0, r.workload)
		checkPair(t, s)
		if want := hashVersion(kp.chainPEM, kp.keyPEM); s.Version != want {
			t.Fatalf("swap %d: announced version %s (serial %s), want %s (serial %s), the pair just written",
				i, s.Version, s.Chain[0].SerialNumber.Text(16), want, kp.leaf.SerialNumber.Text(16))
		}
		last = s
	}
	checkServes(t, last, WorkloadCertName, kp)
	if got, err := r.m.GenerateSecret(cancelledCtx(), WorkloadCertName); err != nil || got.Version != last.Version {
		t.Fatalf("after %d swaps GenerateSecret = (%v, %v), want the last written version %s", swaps, got, err, last.Version)
	}
	// A half-linked swap may be looked at more than once, but nothing else was ever refused.
	unusable := 0
	for line := range strings.Lines(e.logs.String()) {
		if strings.Contains(line, "files not usable") {
			unusable++
			if !strings.Contains(line, "does not match") {
				t.Errorf("refused files that were not half linked: %s", line)
			}
		}
	}
	if unusable < splits {
		t.Errorf("%d warnings about unusable files, want one for each of the %d half-linked swaps", unusable, splits)
	}
	if len(r.roots) != 0 {
		t.Errorf("ROOTCA announced %d times though root-cert.pem never changed", len(r.roots))
	}
}

func TestFileModeInvalidPairs(t *testing.T) {
	t.Parallel()
	ca := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "files root"})
	rootsPEM := testutil.CertPEM(ca.Cert)
	other := validPair(t, ca)
	badPairs := []struct {
		name string
		make func(t *testing.T) keyPair
		want string // in the warning and in GenerateSecret's error
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
		e, vol, warnings := fileModeEnv(t, ca, good)
		r := e.start()
		served := r.next(t)
		checkServes(t, served, WorkloadCertName, good)
		for _, bad := range badPairs {
			drain(warnings)
			vol.Update(bad.make(t).files(rootsPEM))
			w := e.awaitWarning(0, warnings, WorkloadCertName)
			if !strings.Contains(w.msg, "last good") || !strings.Contains(w.err, bad.want) {
				t.Fatalf("%s: warned %q (%s), want the last good pair kept, saying %q", bad.name, w.msg, w.err, bad.want)
			}
			select {
			case s := <-r.workload:
				t.Fatalf("%s: announced version %s", bad.name, s.Version)
			default:
			}
			got, err := r.m.GenerateSecret(cancelledCtx(), WorkloadCertName)
			if err != nil {
				t.Fatalf("%s: GenerateSecret = %v, want the last good pair", bad.name, err)
			}
			checkServes(t, got, WorkloadCertName, good)
			if !r.m.Ready() {
				t.Fatalf("%s: not Ready while the last good pair is valid", bad.name)
			}
		}
		// A good pair again is taken at once.
		next := validPair(t, ca)
		vol.Update(next.files(rootsPEM))
		checkServes(t, testutil.Drive(t, e.clock, filewatch.DefaultDebounce, 0, r.workload), WorkloadCertName, next)
	})

	for _, bad := range badPairs {
		t.Run("invalid from the start/"+bad.name, func(t *testing.T) {
			t.Parallel()
			e, vol, warnings := fileModeEnv(t, ca, bad.make(t))
			r := e.start()
			w := recv(t, warnings, "a warning about the files")
			if w.secret != WorkloadCertName || !strings.Contains(w.msg, "not usable yet") || !strings.Contains(w.err, bad.want) {
				t.Fatalf("warned %q for %q (%s), want default not usable yet, saying %q", w.msg, w.secret, w.err, bad.want)
			}
			_, err := r.m.GenerateSecret(cancelledCtx(), WorkloadCertName)
			if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), bad.want) {
				t.Fatalf("GenerateSecret = %v, want it cancelled while waiting, naming the problem %q", err, bad.want)
			}
			if r.m.Ready() {
				t.Fatal("Ready without a valid pair")
			}
			// ROOTCA is its own file, and fine.
			recv(t, r.roots, "ROOTCA from the files")
			roots, err := r.m.GenerateSecret(cancelledCtx(), RootCertName)
			if err != nil {
				t.Fatal(err)
			}
			checkRoots(t, roots, RootCertName, rootsPEM, ca.Cert)

			// A waiting GenerateSecret gets the pair once it is fixed.
			result := make(chan *Secret, 1)
			go func() {
				s, err := r.m.GenerateSecret(t.Context(), WorkloadCertName)
				if err != nil {
					t.Error(err)
				}
				result <- s
			}()
			good := validPair(t, ca)
			vol.Update(good.files(rootsPEM))
			checkServes(t, testutil.Drive(t, e.clock, filewatch.DefaultDebounce, 0, result), WorkloadCertName, good)
			checkServes(t, r.next(t), WorkloadCertName, good)
			if !r.m.Ready() {
				t.Fatal("not Ready once the files hold a valid pair")
			}
		})
	}
}

func TestFileResourceNames(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	warnings := e.tapWarnings()
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
	r.next(t)
	e.idle()
	in := func(name string) string { return filepath.Join(allowed, name) }
	out := func(name string) string { return filepath.Join(outside, name) }

	t.Run("served", func(t *testing.T) {
		certName := FileCertPrefix + in("cert.pem") + "~" + in("key.pem")
		if err := r.m.CheckName(certName); err != nil {
			t.Errorf("CheckName(%s) = %v", certName, err)
		}
		s, err := r.m.GenerateSecret(t.Context(), certName)
		if err != nil {
			t.Fatal(err)
		}
		checkServes(t, s, certName, kp)
		for _, path := range []string{in("roots.pem"), in("roots-in.pem")} {
			rootName := FileRootPrefix + path
			if err := r.m.CheckName(rootName); err != nil {
				t.Errorf("CheckName(%s) = %v", rootName, err)
			}
			s, err := r.m.GenerateSecret(t.Context(), rootName)
			if err != nil {
				t.Fatal(err)
			}
			checkRoots(t, s, rootName, rootsPEM, ca.Cert, otherRoot.Cert)
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
			if err := r.m.CheckName(tc.secret); !errors.Is(err, tc.want) {
				t.Errorf("CheckName(%s) = %v, want %v", tc.secret, err, tc.want)
			}
			// Refused before any wait: a cancelled context must not be what ends the call.
			if s, err := r.m.GenerateSecret(cancelledCtx(), tc.secret); !errors.Is(err, tc.want) {
				t.Errorf("GenerateSecret(%s) = (%v, %v), want %v", tc.secret, s, err, tc.want)
			}
		})
	}

	t.Run("file appears later", func(t *testing.T) {
		later := kp
		name := FileCertPrefix + in("later-cert.pem") + "~" + in("later-key.pem")
		if err := r.m.CheckName(name); err != nil {
			t.Fatalf("CheckName(%s) = %v, want it accepted before its files exist", name, err)
		}
		drain(warnings)
		result := make(chan *Secret, 1)
		go func() {
			s, err := r.m.GenerateSecret(t.Context(), name)
			if err != nil {
				t.Error(err)
			}
			result <- s
		}()
		// The first read (after the watch is set) found nothing.
		if w := recv(t, warnings, "a warning about the missing files"); w.secret != name || !strings.Contains(w.msg, "not usable yet") {
			t.Fatalf("warned %q for %q, want %s not usable yet", w.msg, w.secret, name)
		}
		select {
		case s := <-result:
			t.Fatalf("GenerateSecret returned %v before the files existed", s)
		default:
		}
		// An operator writes them by atomic renames, the key first.
		writeFileAtomic(t, in("later-key.pem"), later.keyPEM)
		writeFileAtomic(t, in("later-cert.pem"), later.chainPEM)
		checkServes(t, testutil.Drive(t, e.clock, filewatch.DefaultDebounce, 1, result), name, later)
	})
}

// requestWhileOthersAsk asks for names at once while other streams keep asking for default and
// ROOTCA (which must come from source), and returns what each name got. SDS calls GenerateSecret
// from every stream's goroutine; the race detector checks that the manager's index of file
// secrets, which grows as names are first asked for, is guarded.
func requestWhileOthersAsk(t *testing.T, m *Manager, source string, names ...string) map[string]*Secret {
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
					s, err := m.GenerateSecret(t.Context(), name)
					switch {
					case failed != nil:
					case err != nil:
						failed = fmt.Errorf("GenerateSecret(%s) while file resources were added: %w", name, err)
					case s.Source != source:
						failed = fmt.Errorf("GenerateSecret(%s) while file resources were added came from %q, want %s", name, s.Source, source)
					}
				}
			}
		}()
	}
	for range streams {
		recv(t, running, "the other streams to start")
	}
	type result struct {
		s   *Secret
		err error
	}
	results := make(chan result, len(names))
	for _, name := range names {
		go func() {
			s, err := m.GenerateSecret(t.Context(), name)
			results <- result{s, err}
		}()
	}
	got := map[string]*Secret{}
	var failed error
	for range names {
		res := recv(t, results, "GenerateSecret")
		if res.err != nil && failed == nil {
			failed = res.err
		} else if res.err == nil {
			got[res.s.Name] = res.s
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
	m := e.newManager()
	files := subscribeNames(t, m, certName, rootName)
	r := e.run(m)
	workload := r.next(t)
	e.idle()

	got := requestWhileOthersAsk(t, m, "ca", certName, rootName)
	if s, err := m.GenerateSecret(cancelledCtx(), WorkloadCertName); err != nil || s.Version != workload.Version {
		t.Errorf("default = (%v, %v), want the CA's %s", s, err, workload.Version)
	}
	checkServes(t, got[certName], certName, kp)
	checkRoots(t, got[rootName], rootName, rootsPEM, ca.Cert)
	for range 2 { // their first reads
		recv(t, files, "a file resource's first announcement")
	}

	// An operator replaces the pair by atomic renames, key first, and rewrites the roots in place.
	next := validPair(t, ca)
	otherRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "other root"})
	nextRootsPEM := testutil.CertPEM(ca.Cert, otherRoot.Cert)
	writeFileAtomic(t, filepath.Join(dir, "tls.key"), next.keyPEM)
	writeFileAtomic(t, filepath.Join(dir, "tls.crt"), next.chainPEM)
	if err := os.WriteFile(filepath.Join(dir, "ca.crt"), nextRootsPEM, 0o644); err != nil {
		t.Fatal(err)
	}
	announced := map[string]*Secret{}
	for len(announced) < 2 {
		s := testutil.Drive(t, e.clock, filewatch.DefaultDebounce, 1, files)
		announced[s.Name] = s
	}
	checkServes(t, announced[certName], certName, next)
	checkRoots(t, announced[rootName], rootName, nextRootsPEM, ca.Cert, otherRoot.Cert)
	if s, err := m.GenerateSecret(cancelledCtx(), certName); err != nil || s.Version != announced[certName].Version {
		t.Errorf("GenerateSecret(%s) = (%v, %v), want the new version %s", certName, s, err, announced[certName].Version)
	}

	roots, err := m.GenerateSecret(cancelledCtx(), RootCertName)
	if err != nil {
		t.Fatal(err)
	}
	var snap []string
	for _, s := range m.Snapshot() {
		snap = append(snap, s.Name+"@"+s.Version)
	}
	slices.Sort(snap)
	want := []string{
		RootCertName + "@" + roots.Version,
		WorkloadCertName + "@" + workload.Version,
		certName + "@" + announced[certName].Version,
		rootName + "@" + announced[rootName].Version,
	}
	slices.Sort(want)
	if !slices.Equal(snap, want) {
		t.Errorf("Snapshot = %q, want %q", snap, want)
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
	e, _, _ := fileModeEnv(t, ca, validPair(t, ca))
	kp := validPair(t, ca)
	rootsPEM := testutil.CertPEM(ca.Cert)
	res := newVolume(t, filepath.Join(t.TempDir(), "mounted"), map[string][]byte{"tls.crt": kp.chainPEM, "tls.key": kp.keyPEM, "ca.crt": rootsPEM})
	e.cfg.FileResourceDirs = []string{res.Dir}
	certName := FileCertPrefix + res.Path("tls.crt") + "~" + res.Path("tls.key")
	rootName := FileRootPrefix + res.Path("ca.crt")
	m := e.newManager()
	files := subscribeNames(t, m, certName, rootName)
	r := e.run(m)
	r.next(t)
	recv(t, r.roots, "ROOTCA from the files")

	got := requestWhileOthersAsk(t, m, "files", certName, rootName)
	checkServes(t, got[certName], certName, kp)
	checkRoots(t, got[rootName], rootName, rootsPEM, ca.Cert)
	for range 2 {
		recv(t, files, "a file resource's first announcement")
	}

	for i := range 3 {
		kp = validPair(t, ca)
		rootsPEM = testutil.CertPEM(ca.Cert, testutil.NewRootCA(t, testutil.CAOptions{CommonName: fmt.Sprint("extra root ", i)}).Cert)
		res.Update(map[string][]byte{"tls.crt": kp.chainPEM, "tls.key": kp.keyPEM, "ca.crt": rootsPEM})
		announced := map[string]*Secret{}
		for len(announced) < 2 {
			s := testutil.Drive(t, e.clock, filewatch.DefaultDebounce, 0, files)
			if announced[s.Name] != nil {
				t.Fatalf("swap %d: %s announced twice", i, s.Name)
			}
			announced[s.Name] = s
		}
		checkServes(t, announced[certName], certName, kp)
		rootsNow, err := pki.ParseCertificates(rootsPEM)
		if err != nil {
			t.Fatal(err)
		}
		checkRoots(t, announced[rootName], rootName, rootsPEM, rootsNow...)
	}
	// The workload files were not touched: nothing for default or ROOTCA.
	if len(r.roots) != 0 {
		t.Errorf("ROOTCA announced %d times after swaps in another volume", len(r.roots))
	}
	for len(r.workload) > 0 {
		if s := <-r.workload; s.Name == WorkloadCertName {
			t.Errorf("default announced (version %s) after swaps in another volume", s.Version)
		}
	}
}

// Each file secret is watched for the agent's life, so their number is bounded.
func TestFileSecretsAreBounded(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	m, err := New(Config{WorkloadFiles: &FilePaths{CertChain: filepath.Join(dir, "c"), Key: filepath.Join(dir, "k"), Root: filepath.Join(dir, "r")},
		FileResourceDirs: []string{dir}})
	if err != nil {
		t.Fatal(err)
	}
	m.mu.Lock()
	for i := len(m.files); i < MaxFileSecrets; i++ {
		name := FileRootPrefix + filepath.Join(dir, fmt.Sprintf("root-%d.pem", i))
		m.files[name] = &fileSecret{name: name, root: filepath.Join(dir, fmt.Sprintf("root-%d.pem", i))}
	}
	m.mu.Unlock()
	known := FileRootPrefix + filepath.Join(dir, "root-10.pem")
	if err := m.CheckName(known); err != nil {
		t.Fatalf("a known file secret refused at the bound: %v", err)
	}
	if err := m.CheckName(FileRootPrefix + filepath.Join(dir, "one-more.pem")); !errors.Is(err, ErrTooManyFiles) {
		t.Fatalf("a file secret past the bound: %v, want ErrTooManyFiles", err)
	}
}
