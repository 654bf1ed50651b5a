package ca_test

import (
	"bytes"
	"context"
	"crypto"
	"crypto/x509"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// keyManager is a KeyManager under test with its authority, fake clock and event stream.
type keyManager struct {
	*ca.KeyManager
	authority *ca.Authority
	clock     *testutil.FakeClock
	events    chan ca.Event
	cfg       ca.KeyManagerConfig
	nextCheck time.Time // when the pending root check is due
}

const checkInterval = time.Hour

// keyManagerConfig is what the tests start from: a fresh state dir, a long-lived self-signed
// root, hourly root checks.
func keyManagerConfig(t *testing.T) ca.KeyManagerConfig {
	t.Helper()
	return ca.KeyManagerConfig{
		StateDir:          filepath.Join(t.TempDir(), "state"),
		SelfSigned:        ca.SelfSignedConfig{KeyAlgorithm: pki.ECDSA, Org: "example.org", TTL: year},
		RootCheckInterval: checkInterval,
	}
}

// newKeyManager builds a KeyManager on cfg with a fake clock at now, a fixed jitter (checks every
// cfg.RootCheckInterval exactly) and its events sent to a channel. It does not run it.
func newKeyManager(t *testing.T, cfg ca.KeyManagerConfig, now time.Time) *keyManager {
	t.Helper()
	clk := testutil.NewFakeClock(now)
	h := &keyManager{
		authority: ca.New(ca.Config{Clock: clk}, nil),
		clock:     clk,
		events:    make(chan ca.Event, 256),
	}
	cfg.Authority = h.authority
	cfg.Clock = clk
	cfg.Jitter = func() float64 { return 0.5 }
	cfg.OnEvent = func(ev ca.Event) { h.events <- ev }
	h.cfg = cfg
	m, err := ca.NewKeyManager(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h.KeyManager = m
	return h
}

// run runs the key manager until the test ends and returns once it watches the cacerts files and
// has done its first root check.
func (h *keyManager) run(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	select {
	case <-h.Ready():
	case err := <-done:
		t.Fatalf("Run ended before it was ready: %v", err)
	}
	h.nextCheck = h.clock.Now().Add(h.cfg.RootCheckInterval)
	h.waitCheck(t)
}

// waitCheck blocks until the root check that arms the timer for h.nextCheck is done. The manager
// arms the timer for its next check (the only timer due that late) once the previous check, events
// included, is over. So once that timer is pending the check's events are in the channel, even
// while the tail of a burst of file events keeps debounce timers coming and going.
func (h *keyManager) waitCheck(t *testing.T) {
	t.Helper()
	if err := h.clock.WaitForDeadline(t.Context(), h.nextCheck); err != nil {
		t.Fatalf("gave up waiting for the root check that arms the next one at %s: %v", h.nextCheck, err)
	}
}

// until lets debounce intervals pass until the manager reports want. Unchanged reloads (the tail
// of a burst of file events) and the kinds in tolerate are skipped; anything else fails the test.
func (h *keyManager) until(t *testing.T, want ca.EventKind, tolerate ...ca.EventKind) ca.Event {
	t.Helper()
	for {
		ev := testutil.Drive(t, h.clock, filewatch.DefaultDebounce, 1, h.events)
		switch {
		case ev.Kind == want:
			return ev
		case ev.Kind == ca.EventUnchanged || containsKind(tolerate, ev.Kind):
			t.Logf("skipped event %s (%v) while waiting for %s", ev.Kind, ev.Err, want)
		default:
			t.Fatalf("got event %s (%v) while waiting for %s", ev.Kind, ev.Err, want)
		}
	}
}

// checkAt moves the clock to at, which must be when the pending root check is due or later, and
// waits until that check is done. It returns the check's events (without unchanged reloads).
func (h *keyManager) checkAt(t *testing.T, at time.Time) []ca.Event {
	t.Helper()
	h.startCheck(t, at)
	h.waitCheck(t)
	return h.drain()
}

// startCheck moves the clock to at to trigger the pending root check; waitCheck waits for it.
func (h *keyManager) startCheck(t *testing.T, at time.Time) {
	t.Helper()
	if at.Before(h.nextCheck) {
		t.Fatalf("check at %s: the next root check is due at %s", at, h.nextCheck)
	}
	h.clock.Set(at)
	h.nextCheck = at.Add(h.cfg.RootCheckInterval)
}

// drain returns the events already reported, unchanged reloads left out.
func (h *keyManager) drain() []ca.Event {
	var out []ca.Event
	for {
		select {
		case ev := <-h.events:
			if ev.Kind != ca.EventUnchanged {
				out = append(out, ev)
			}
		default:
			return out
		}
	}
}

// sign issues a workload certificate with the manager's authority.
func (h *keyManager) sign(t *testing.T) *ca.Issued {
	t.Helper()
	id := testID(t, "default", "web")
	csr, _ := workloadCSR(t, id)
	issued, err := h.authority.SignWorkload(t.Context(), ca.WorkloadRequest{CSR: csr, Identity: id})
	if err != nil {
		t.Fatalf("SignWorkload: %v", err)
	}
	return issued
}

func (h *keyManager) rootFile() string { return filepath.Join(h.cfg.StateDir, ca.RootCertFile) }

func containsKind(kinds []ca.EventKind, k ca.EventKind) bool {
	for _, x := range kinds {
		if x == k {
			return true
		}
	}
	return false
}

func kinds(events []ca.Event) []ca.EventKind {
	var out []ca.EventKind
	for _, ev := range events {
		out = append(out, ev.Kind)
	}
	return out
}

// istioFiles is a plugged-in CA in Istio's cacerts layout: signer signs, under root.
func istioFiles(t *testing.T, signer, root *testutil.CA) map[string][]byte {
	t.Helper()
	return map[string][]byte{
		ca.CACertFile:    testutil.CertPEM(signer.Cert),
		ca.CAKeyFile:     testutil.KeyPEM(t, signer.Key),
		ca.CertChainFile: testutil.CertPEM(signer.Cert, root.Cert),
		ca.RootCertFile:  testutil.CertPEM(root.Cert),
	}
}

// rewriteFiles replaces the files in place, one after the other, as an operator copying new
// files over the old ones does.
func rewriteFiles(t *testing.T, dir string, _ int, files map[string][]byte) {
	t.Helper()
	testutil.WriteFiles(t, dir, files)
}

// mountSecret updates dir the way the kubelet's atomic writer updates a mounted secret (see
// testutil.SecretVolume); version numbers the generation.
func mountSecret(t *testing.T, dir string, version int, files map[string][]byte) {
	t.Helper()
	v := testutil.NewSecretVolume(t, dir)
	gen := fmt.Sprintf("..2026_03_14_15_09_26.%09d", version)
	testutil.WriteFiles(t, filepath.Join(dir, gen), files)
	previous, _ := os.Readlink(filepath.Join(dir, "..data"))
	v.Swap(gen)
	if previous != "" && previous != gen {
		if err := os.RemoveAll(filepath.Join(dir, previous)); err != nil {
			t.Fatal(err)
		}
	}
}

func readBytes(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// requireIssuedBy fails unless the leaf was signed by signer and its chain is signer then root.
func requireIssuedBy(t *testing.T, issued *ca.Issued, signer, root *x509.Certificate, now time.Time) {
	t.Helper()
	if !bytes.Equal(issued.Leaf.RawIssuer, signer.RawSubject) {
		t.Fatalf("leaf issuer %q, want %q", issued.Leaf.Issuer, signer.Subject)
	}
	if err := issued.Leaf.CheckSignatureFrom(signer); err != nil {
		t.Fatalf("leaf not signed by %q: %v", signer.Subject, err)
	}
	chain := issued.Chain()
	if !chain[1].Equal(signer) || !chain[len(chain)-1].Equal(root) {
		t.Fatalf("chain %v, want leaf, %q, ..., %q", names(chain), signer.Subject.CommonName, root.Subject.CommonName)
	}
	verifyPath(t, chain, []*x509.Certificate{root}, now)
}

func TestPluggedInIntermediateReloads(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		write func(t *testing.T, dir string, version int, files map[string][]byte)
	}{
		{"plain rewrite", rewriteFiles},
		// Two swaps: Istio lost its watch on the second one (istio#59912).
		{"kubernetes ..data swap", mountSecret},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			now := baseTime()
			root := testutil.NewRootCA(t, caOpts("root", now, 3*year))
			first := root.NewIntermediate(t, caOpts("intermediate 1", now, year))
			cfg := keyManagerConfig(t)
			cfg.CACertsDir = filepath.Join(t.TempDir(), "cacerts")
			tt.write(t, cfg.CACertsDir, 1, istioFiles(t, first, root))
			h := newKeyManager(t, cfg, now)
			h.run(t)
			requireIssuedBy(t, h.sign(t), first.Cert, root.Cert, h.clock.Now())
			trustBundle := readBytes(t, h.rootFile())

			for version := 2; version <= 3; version++ {
				next := root.NewIntermediate(t, caOpts(fmt.Sprintf("intermediate %d", version), now, year))
				tt.write(t, cfg.CACertsDir, version, istioFiles(t, next, root))
				h.until(t, ca.EventReloaded, ca.EventRejected)

				requireIssuedBy(t, h.sign(t), next.Cert, root.Cert, h.clock.Now())
				if got := h.authority.Bundle().SigningCert(); !got.Equal(next.Cert) {
					t.Fatalf("after swap %d the authority signs with %q", version, got.Subject)
				}
				if got := readBytes(t, h.rootFile()); !bytes.Equal(got, trustBundle) {
					t.Fatalf("after swap %d root-cert.pem changed although the root did not:\n%s", version, got)
				}
				if r := h.authority.Bundle().Retained(); len(r) != 0 {
					t.Fatalf("after swap %d the bundle retains %v; the root did not change", version, names(r))
				}
			}
		})
	}
}

// A key written before its certificate must never leave a request refused or signed by a key
// that does not match the certificate its chain reports.
func TestTornWriteNeverMisSigns(t *testing.T) {
	t.Parallel()
	now := baseTime()
	root := testutil.NewRootCA(t, caOpts("root", now, 3*year))
	oldInt := root.NewIntermediate(t, caOpts("old intermediate", now, year))
	newInt := root.NewIntermediate(t, caOpts("new intermediate", now, year))
	cfg := keyManagerConfig(t)
	cfg.CACertsDir = filepath.Join(t.TempDir(), "cacerts")
	testutil.WriteFiles(t, cfg.CACertsDir, istioFiles(t, oldInt, root))
	h := newKeyManager(t, cfg, now)
	h.run(t)

	const signers = 4
	var (
		wg         sync.WaitGroup
		stop       = make(chan struct{})
		progress   = make(chan struct{}, 1) // a signature completed
		failed     = make(chan struct{})    // a signer gave up
		failOnce   sync.Once
		mu         sync.Mutex
		bySigner   = map[string]int{} // signing certificate's CN → leaves
		stopSigner = sync.OnceFunc(func() { close(stop); wg.Wait() })
	)
	defer stopSigner()
	fail := func(format string, args ...any) {
		t.Errorf(format, args...)
		failOnce.Do(func() { close(failed) })
	}
	id := testID(t, "default", "web")
	for range signers {
		csr, _ := workloadCSR(t, id) // a CSR may be signed any number of times
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				issued, err := h.authority.SignWorkload(context.Background(), ca.WorkloadRequest{CSR: csr, Identity: id})
				if err != nil {
					fail("SignWorkload during the reload: %v", err)
					return
				}
				chain := issued.Chain()
				if err := issued.Leaf.CheckSignatureFrom(chain[1]); err != nil {
					fail("leaf is not signed by %q, the signing certificate of its chain: %v", chain[1].Subject, err)
					return
				}
				if _, err := issued.Leaf.Verify(x509.VerifyOptions{
					Roots: pool(root.Cert), Intermediates: pool(chain[1 : len(chain)-1]...), CurrentTime: h.clock.Now(),
				}); err != nil {
					fail("leaf does not verify against the root: %v", err)
					return
				}
				mu.Lock()
				bySigner[chain[1].Subject.CommonName]++
				mu.Unlock()
				select {
				case progress <- struct{}{}:
				default:
				}
			}
		})
	}
	// waitForSignature returns once a signature that completed after the call began is reported.
	waitForSignature := func() {
		t.Helper()
		select {
		case <-progress:
		default:
		}
		select {
		case <-progress:
		case <-failed:
			t.FailNow()
		}
	}

	waitForSignature()
	// The new key lands first: the files on disk are now the new key next to the old certificate.
	if err := os.WriteFile(filepath.Join(cfg.CACertsDir, ca.CAKeyFile), testutil.KeyPEM(t, newInt.Key), 0o600); err != nil {
		t.Fatal(err)
	}
	ev := h.until(t, ca.EventRejected)
	if ev.Err == nil || !strings.Contains(ev.Err.Error(), "does not match") {
		t.Fatalf("torn bundle rejected with %v, want a key mismatch", ev.Err)
	}
	waitForSignature()
	waitForSignature() // signatures keep coming with the torn files on disk
	requireIssuedBy(t, h.sign(t), oldInt.Cert, root.Cert, h.clock.Now())

	files := istioFiles(t, newInt, root)
	delete(files, ca.CAKeyFile) // already written
	testutil.WriteFiles(t, cfg.CACertsDir, files)
	h.until(t, ca.EventReloaded, ca.EventRejected)
	waitForSignature()
	waitForSignature()

	requireIssuedBy(t, h.sign(t), newInt.Cert, root.Cert, h.clock.Now())
	if got := h.authority.Bundle().SigningCert(); !got.Equal(newInt.Cert) {
		t.Fatalf("settled on %q, want the new intermediate", got.Subject)
	}
	stopSigner()
	if bySigner["old intermediate"] == 0 || bySigner["new intermediate"] == 0 {
		t.Fatalf("leaves by signing certificate %v: want some under each intermediate", bySigner)
	}
}

func counterValue(t *testing.T, reg *prometheus.Registry, name, label, value string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range families {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

func TestInvalidPluggedInFilesAreRejected(t *testing.T) {
	t.Parallel()
	const reloads = "meshid_ca_key_material_reloads_total"
	tests := []struct {
		name    string
		change  func(t *testing.T, dir string, other *testutil.CA)
		wantErr string
	}{
		{
			name: "garbage signing certificate",
			change: func(t *testing.T, dir string, _ *testutil.CA) {
				testutil.WriteFiles(t, dir, map[string][]byte{ca.CACertFile: []byte("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")})
			},
			wantErr: ca.CACertFile,
		},
		{
			// The key of the next intermediate, written before its certificate, which never comes.
			name: "key without its certificate",
			change: func(t *testing.T, dir string, other *testutil.CA) {
				testutil.WriteFiles(t, dir, map[string][]byte{ca.CAKeyFile: testutil.KeyPEM(t, other.Key)})
			},
			wantErr: "does not match",
		},
		{
			name: "key removed",
			change: func(t *testing.T, dir string, _ *testutil.CA) {
				if err := os.Remove(filepath.Join(dir, ca.CAKeyFile)); err != nil {
					t.Fatal(err)
				}
			},
			wantErr: "missing " + ca.CAKeyFile,
		},
		{
			name: "intermediate of another root",
			change: func(t *testing.T, dir string, _ *testutil.CA) {
				stranger := testutil.NewRootCA(t, caOpts("stranger", baseTime(), year)).NewIntermediate(t, caOpts("stranger's intermediate", baseTime(), year))
				testutil.WriteFiles(t, dir, map[string][]byte{
					ca.CACertFile: testutil.CertPEM(stranger.Cert),
					ca.CAKeyFile:  testutil.KeyPEM(t, stranger.Key),
				})
			},
			wantErr: "does not chain",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			now := baseTime()
			root := testutil.NewRootCA(t, caOpts("root", now, 3*year))
			inter := root.NewIntermediate(t, caOpts("intermediate", now, year))
			other := root.NewIntermediate(t, caOpts("next intermediate", now, year))
			reg := prometheus.NewRegistry()
			cfg := keyManagerConfig(t)
			cfg.CACertsDir = filepath.Join(t.TempDir(), "cacerts")
			cfg.Registerer = reg
			testutil.WriteFiles(t, cfg.CACertsDir, istioFiles(t, inter, root))
			h := newKeyManager(t, cfg, now)
			h.run(t)
			serving := h.authority.Bundle()
			trustBundle := readBytes(t, h.rootFile())

			tt.change(t, cfg.CACertsDir, other)
			ev := h.until(t, ca.EventRejected)
			if ev.Err == nil || !strings.Contains(ev.Err.Error(), tt.wantErr) {
				t.Fatalf("rejected with %v, want an error mentioning %q", ev.Err, tt.wantErr)
			}

			if h.authority.Bundle() != serving {
				t.Fatal("the bundle in service changed after a rejected reload")
			}
			requireIssuedBy(t, h.sign(t), inter.Cert, root.Cert, h.clock.Now())
			if got := readBytes(t, h.rootFile()); !bytes.Equal(got, trustBundle) {
				t.Fatal("root-cert.pem changed after a rejected reload")
			}
			// Each rejection reported is counted once; a reload counted before its event is
			// reported is taken from the channel.
			rejected := 1
			got := counterValue(t, reg, reloads, "outcome", "rejected")
			for ; float64(rejected) < got; rejected++ {
				if ev := <-h.events; ev.Kind != ca.EventRejected {
					t.Fatalf("reload counted as rejected reported %s", ev.Kind)
				}
			}
			if got != float64(rejected) {
				t.Fatalf("%s{outcome=\"rejected\"} = %v, want %d", reloads, got, rejected)
			}
			if got := counterValue(t, reg, reloads, "outcome", "reloaded"); got != 0 {
				t.Fatalf("%s{outcome=\"reloaded\"} = %v, want 0", reloads, got)
			}
		})
	}
}

func TestNewRootStaysTrustedForTheOverlap(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		overlap time.Duration
		// pruneAt is when the replaced root must leave the trust bundle.
		pruneAt func(replaced time.Time, oldRoot *x509.Certificate) time.Time
	}{
		{"until the old root expires", 0, func(_ time.Time, oldRoot *x509.Certificate) time.Time { return oldRoot.NotAfter }},
		{"one hour overlap", time.Hour, func(replaced time.Time, _ *x509.Certificate) time.Time { return replaced.Add(time.Hour) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			now := baseTime()
			oldRoot := testutil.NewRootCA(t, caOpts("old root", now, 48*time.Hour))
			oldInt := oldRoot.NewIntermediate(t, caOpts("old intermediate", now, 24*time.Hour))
			newRoot := testutil.NewRootCA(t, caOpts("new root", now, 3*year))
			newInt := newRoot.NewIntermediate(t, caOpts("new intermediate", now, year))
			cfg := keyManagerConfig(t)
			cfg.CACertsDir = filepath.Join(t.TempDir(), "cacerts")
			cfg.TrustBundleOverlap = tt.overlap
			testutil.WriteFiles(t, cfg.CACertsDir, istioFiles(t, oldInt, oldRoot))
			h := newKeyManager(t, cfg, now)
			h.run(t)
			before := h.sign(t)

			testutil.WriteFiles(t, cfg.CACertsDir, istioFiles(t, newInt, newRoot))
			h.until(t, ca.EventReloaded, ca.EventRejected)
			replaced := h.clock.Now()

			requireIssuedBy(t, h.sign(t), newInt.Cert, newRoot.Cert, h.clock.Now())
			both := []*x509.Certificate{newRoot.Cert, oldRoot.Cert}
			if got := h.authority.Bundle().Roots(); !sameCerts(got, both) {
				t.Fatalf("trusted roots %v, want the new root then the old one", names(got))
			}
			if got := readCerts(t, h.rootFile()); !sameCerts(got, both) {
				t.Fatalf("root-cert.pem holds %v, want the new root then the old one", names(got))
			}
			// A workload still holding a leaf under the old root is trusted by clients reading
			// root-cert.pem, and by the CA itself.
			verifyPath(t, before.Chain(), readCerts(t, h.rootFile()), h.clock.Now())
			if _, err := before.Leaf.Verify(x509.VerifyOptions{
				Roots: h.authority.Bundle().RootPool(), Intermediates: pool(oldInt.Cert), CurrentTime: h.clock.Now(),
			}); err != nil {
				t.Fatalf("the CA no longer trusts a leaf under the old root: %v", err)
			}

			due := tt.pruneAt(replaced, oldRoot.Cert)
			last := h.nextCheck
			if due.Add(-time.Second).After(last) {
				last = due.Add(-time.Second)
			}
			if evs := h.checkAt(t, last); len(evs) != 0 {
				t.Fatalf("root check %s before the old root was due to go reported %v", due.Sub(last), kinds(evs))
			}
			if got := readCerts(t, h.rootFile()); !sameCerts(got, both) {
				t.Fatalf("root-cert.pem holds %v %s before the old root was due to go", names(got), due.Sub(last))
			}

			first := h.nextCheck // the first check after it is due
			if first.Before(due) {
				t.Fatalf("test setup: the check at %s is not after %s", first, due)
			}
			if evs := h.checkAt(t, first); len(evs) != 1 || evs[0].Kind != ca.EventPruned {
				t.Fatalf("first root check after the old root was due to go reported %v, want [pruned]", kinds(evs))
			}
			only := []*x509.Certificate{newRoot.Cert}
			if got := readCerts(t, h.rootFile()); !sameCerts(got, only) {
				t.Fatalf("root-cert.pem holds %v after pruning, want only the new root", names(got))
			}
			if got := h.authority.Bundle().Roots(); !sameCerts(got, only) {
				t.Fatalf("trusted roots %v after pruning, want only the new root", names(got))
			}
			requireIssuedBy(t, h.sign(t), newInt.Cert, newRoot.Cert, h.clock.Now())
		})
	}
}

func TestPluggedInCAAppearingTakesOver(t *testing.T) {
	t.Parallel()
	now := baseTime()
	cfg := keyManagerConfig(t)
	// Empty, as Kubernetes mounts an optional secret that does not exist yet.
	cfg.CACertsDir = t.TempDir()
	h := newKeyManager(t, cfg, now)
	if h.Origin() != ca.OriginGenerated {
		t.Fatalf("origin %q, want a new self-signed CA", h.Origin())
	}
	h.run(t)
	selfSigned := h.authority.Bundle().SigningCert()
	selfSignedPEM := readBytes(t, filepath.Join(cfg.StateDir, ca.CACertFile))
	before := h.sign(t)

	// The files appear, as the kubelet fills the volume once the secret is created.
	root := testutil.NewRootCA(t, caOpts("corp root", now, 3*year))
	inter := root.NewIntermediate(t, caOpts("mesh intermediate", now, year))
	mountSecret(t, cfg.CACertsDir, 1, istioFiles(t, inter, root))
	h.until(t, ca.EventReloaded, ca.EventRejected)

	b := h.authority.Bundle()
	if b.Source() != ca.SourcePluggedIn {
		t.Fatalf("source %q after the cacerts dir appeared, want plugged-in", b.Source())
	}
	requireIssuedBy(t, h.sign(t), inter.Cert, root.Cert, h.clock.Now())
	if got, want := readBytes(t, h.rootFile()), append(testutil.CertPEM(root.Cert), selfSignedPEM...); !bytes.Equal(got, want) {
		t.Fatalf("root-cert.pem is not the plugged-in root followed by the self-signed one:\n%s", got)
	}
	if got := b.Retained(); !sameCerts(got, []*x509.Certificate{selfSigned}) {
		t.Fatalf("retained roots %v, want the self-signed root", names(got))
	}
	verifyPath(t, before.Chain(), readCerts(t, h.rootFile()), h.clock.Now())
	trustBundle := readBytes(t, h.rootFile())

	// The files go away again: the plugged-in CA keeps serving, not the self-signed one.
	for _, name := range []string{ca.CACertFile, ca.CAKeyFile, ca.CertChainFile, ca.RootCertFile} {
		if err := os.Remove(filepath.Join(cfg.CACertsDir, name)); err != nil {
			t.Fatal(err)
		}
	}
	ev := h.until(t, ca.EventRejected)
	if !errors.Is(ev.Err, ca.ErrNoPluggedInCA) {
		t.Fatalf("rejected with %v, want ErrNoPluggedInCA", ev.Err)
	}
	if h.authority.Bundle() != b {
		t.Fatal("the bundle in service changed when the cacerts files were removed")
	}
	requireIssuedBy(t, h.sign(t), inter.Cert, root.Cert, h.clock.Now())
	if got := readBytes(t, h.rootFile()); !bytes.Equal(got, trustBundle) {
		t.Fatal("root-cert.pem changed when the cacerts files were removed")
	}
}

func TestSelfSignedRootRotation(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		threshold float64
	}{
		{"threshold 0.2", 0.2},
		{"zero threshold takes the default", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			now := baseTime()
			cfg := keyManagerConfig(t)
			cfg.SelfSigned.TTL = 10 * time.Hour
			cfg.RootRotationThreshold = tt.threshold
			h := newKeyManager(t, cfg, now)
			h.run(t)
			old := h.authority.Bundle().SigningCert()
			keyPEM := readBytes(t, filepath.Join(cfg.StateDir, ca.CAKeyFile))
			before := h.sign(t)

			// 20% of a 10h lifetime: the root is renewed once about 2h or less are left.
			share := tt.threshold
			if share == 0 {
				share = ca.DefaultRootRotationThreshold
			}
			threshold := time.Duration(share * float64(old.NotAfter.Sub(old.NotBefore.Add(ca.Backdate))))
			quiet := 0
			for {
				at := h.nextCheck
				left := old.NotAfter.Sub(at)
				evs := h.checkAt(t, at)
				if left > threshold {
					if len(evs) != 0 {
						t.Fatalf("root check with %s left reported %v, want nothing", left, kinds(evs))
					}
					if got := h.authority.Bundle().SigningCert(); !got.Equal(old) {
						t.Fatalf("root changed with %s left", left)
					}
					quiet++
					continue
				}
				if len(evs) != 1 || evs[0].Kind != ca.EventRotated || evs[0].Err != nil {
					t.Fatalf("root check with %s left reported %v, want [rotated]", left, evs)
				}
				break
			}
			if quiet < 3 {
				t.Fatalf("only %d root checks before the rotation", quiet)
			}

			renewed := h.authority.Bundle().SigningCert()
			switch {
			case renewed.Equal(old):
				t.Fatal("the signing root did not change")
			case !bytes.Equal(renewed.RawSubject, old.RawSubject):
				t.Fatalf("renewed root subject %q, want %q", renewed.Subject, old.Subject)
			case !bytes.Equal(renewed.SubjectKeyId, old.SubjectKeyId):
				t.Fatal("renewed root has another subject key ID")
			case !pki.PublicKeysEqual(renewed.PublicKey, old.PublicKey):
				t.Fatal("renewed root has another key")
			case !renewed.NotAfter.After(old.NotAfter):
				t.Fatalf("renewed root expires at %s, not after the old one (%s)", renewed.NotAfter, old.NotAfter)
			}
			if got := readCerts(t, filepath.Join(cfg.StateDir, ca.CACertFile)); !sameCerts(got, []*x509.Certificate{renewed}) {
				t.Fatal("ca-cert.pem is not the renewed root")
			}
			if got := readBytes(t, filepath.Join(cfg.StateDir, ca.CAKeyFile)); !bytes.Equal(got, keyPEM) {
				t.Fatal("ca-key.pem changed")
			}
			if got := readCerts(t, h.rootFile()); !sameCerts(got, []*x509.Certificate{renewed, old}) {
				t.Fatalf("root-cert.pem holds %d roots, want the renewed root then the old one", len(got))
			}

			after := h.sign(t)
			if chain := after.Chain(); !chain[len(chain)-1].Equal(renewed) {
				t.Fatal("a leaf issued after the rotation does not chain to the renewed root")
			}
			// Same key and subject: each root vouches for the leaves of the other.
			verifyPath(t, []*x509.Certificate{before.Leaf}, []*x509.Certificate{renewed}, h.clock.Now())
			verifyPath(t, []*x509.Certificate{after.Leaf}, []*x509.Certificate{old}, h.clock.Now())
		})
	}
}

// A root's NotBefore is backdated for lagging peers, but the threshold is a share of the lifetime
// the root was issued with: a short-lived root is not due at once, and once renewed it is not due
// again at the next check.
func TestShortLivedSelfSignedRootRotatesOnceWhenDue(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		ttl       time.Duration
		threshold float64 // 0 takes the default
	}{
		{"20s root, default threshold", 20 * time.Second, 0},
		{"1m root, threshold 0.5", time.Minute, 0.5},
		{"10m root, threshold 0.9", 10 * time.Minute, 0.9},
		{"1h root, default threshold", time.Hour, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			now := baseTime()
			cfg := keyManagerConfig(t)
			cfg.SelfSigned.TTL = tt.ttl
			cfg.RootRotationThreshold = tt.threshold
			// 7.5% of the lifetime: no check lands exactly on a threshold of these cases.
			cfg.RootCheckInterval = tt.ttl * 3 / 40
			h := newKeyManager(t, cfg, now)
			h.run(t)
			if evs := h.drain(); len(evs) != 0 {
				t.Fatalf("the start-up check reported %v, want nothing", kinds(evs))
			}
			old := h.authority.Bundle().SigningCert()
			share := tt.threshold
			if share == 0 {
				share = ca.DefaultRootRotationThreshold
			}
			due := old.NotAfter.Add(-time.Duration(share * float64(tt.ttl)))

			for {
				at := h.nextCheck
				evs := h.checkAt(t, at)
				if at.Before(due) {
					if len(evs) != 0 {
						t.Fatalf("root check with %s left reported %v, want nothing (due with %s left)",
							old.NotAfter.Sub(at), kinds(evs), old.NotAfter.Sub(due))
					}
					continue
				}
				if len(evs) != 1 || evs[0].Kind != ca.EventRotated || evs[0].Err != nil {
					t.Fatalf("root check with %s left reported %v, want [rotated]", old.NotAfter.Sub(at), evs)
				}
				break
			}
			renewed := h.authority.Bundle().SigningCert()
			if got := renewed.NotAfter.Sub(h.clock.Now()); got > tt.ttl || got < tt.ttl-time.Second {
				t.Fatalf("renewed root has %s left, want the TTL %s", got, tt.ttl)
			}
			// The renewed root is fresh: the next check leaves it alone.
			if evs := h.checkAt(t, h.nextCheck); len(evs) != 0 {
				t.Fatalf("the check after the rotation reported %v, want nothing", kinds(evs))
			}
			if !h.authority.Bundle().SigningCert().Equal(renewed) {
				t.Fatal("the renewed root was replaced at the next check")
			}
		})
	}
}

// A CA whose root expired while it ran (suspended past the rotation window, or checking less
// often than the window is long) renews it at its next check, as it would at start-up.
func TestSelfSignedRootExpiredWhileRunning(t *testing.T) {
	t.Parallel()
	now := baseTime()
	cfg := keyManagerConfig(t)
	cfg.SelfSigned.TTL = 10 * time.Hour
	h := newKeyManager(t, cfg, now)
	h.run(t)
	old := h.authority.Bundle().SigningCert()

	at := old.NotAfter.Add(time.Hour)
	evs := h.checkAt(t, at)
	if len(evs) != 1 || evs[0].Kind != ca.EventRotated || evs[0].Err != nil {
		t.Fatalf("root check after the root expired reported %v, want [rotated]", evs)
	}
	renewed := h.authority.Bundle().SigningCert()
	if !pki.PublicKeysEqual(renewed.PublicKey, old.PublicKey) || !renewed.NotAfter.Equal(at.Add(cfg.SelfSigned.TTL)) {
		t.Fatalf("renewed root expires at %s, want %s with the same key", renewed.NotAfter, at.Add(cfg.SelfSigned.TTL))
	}
	if got := readCerts(t, filepath.Join(cfg.StateDir, ca.CACertFile)); !sameCerts(got, []*x509.Certificate{renewed}) {
		t.Fatal("ca-cert.pem is not the renewed root")
	}
	if got := readCerts(t, h.rootFile()); !sameCerts(got, []*x509.Certificate{renewed}) {
		t.Fatalf("root-cert.pem holds %v, want only the renewed root (the old one expired)", names(got))
	}
	verifyPath(t, h.sign(t).Chain(), []*x509.Certificate{renewed}, at)
}

func TestReplicasOnOneStateDirRotateOnce(t *testing.T) {
	t.Parallel()
	now := baseTime()
	cfg := keyManagerConfig(t)
	cfg.SelfSigned.TTL = 10 * time.Hour
	cfg.RootRotationThreshold = 0.2
	a := newKeyManager(t, cfg, now)
	b := newKeyManager(t, cfg, now)
	if a.Origin() != ca.OriginGenerated || b.Origin() != ca.OriginPersisted {
		t.Fatalf("origins %q and %q, want the second replica to load the first one's root", a.Origin(), b.Origin())
	}
	old := a.authority.Bundle().SigningCert()
	if !b.authority.Bundle().SigningCert().Equal(old) {
		t.Fatal("the replicas start with different roots")
	}
	a.run(t)
	b.run(t)

	// Both reach the rotation point (2h left) together: their checks race for the state dir.
	at := now.Add(8 * time.Hour)
	a.startCheck(t, at)
	b.startCheck(t, at)
	a.waitCheck(t)
	b.waitCheck(t)
	evA, evB := a.drain(), b.drain()
	rotated, adopted := 0, 0
	for _, ev := range append(evA, evB...) {
		if ev.Err != nil {
			t.Errorf("event %s: %v", ev.Kind, ev.Err)
		}
		switch ev.Kind {
		case ca.EventRotated:
			rotated++
		case ca.EventAdopted:
			adopted++
		}
	}
	if rotated != 1 || adopted != 1 || len(evA) != 1 || len(evB) != 1 {
		t.Fatalf("replicas reported %v and %v, want one rotated and one adopted", kinds(evA), kinds(evB))
	}

	onDisk := readCerts(t, filepath.Join(cfg.StateDir, ca.CACertFile))
	for i, h := range []*keyManager{a, b} {
		got := h.authority.Bundle().SigningCert()
		if !sameCerts(onDisk, []*x509.Certificate{got}) {
			t.Fatalf("replica %d signs with a root other than ca-cert.pem", i)
		}
		if got.Equal(old) {
			t.Fatalf("replica %d still signs with the old root", i)
		}
		if roots := h.authority.Bundle().Roots(); !sameCerts(roots, []*x509.Certificate{got, old}) {
			t.Fatalf("replica %d trusts %d roots, want the renewed root then the old one", i, len(roots))
		}
	}
	if got := readCerts(t, a.rootFile()); !sameCerts(got, []*x509.Certificate{onDisk[0], old}) {
		t.Fatal("root-cert.pem is not the renewed root then the old one")
	}

	// The next checks, one interval later, find nothing to do on either replica.
	at = at.Add(checkInterval)
	a.startCheck(t, at)
	b.startCheck(t, at)
	a.waitCheck(t)
	b.waitCheck(t)
	if evA, evB := a.drain(), b.drain(); len(evA)+len(evB) != 0 {
		t.Fatalf("the check after the rotation reported %v and %v, want nothing", kinds(evA), kinds(evB))
	}
}

func TestExpiredSelfSignedRootAtStartup(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		keyOf   func(t *testing.T, rootKey crypto.Signer) crypto.Signer // the key persisted next to the root
		wantErr string                                                  // empty: renewed
	}{
		{"its key: renewed", func(_ *testing.T, k crypto.Signer) crypto.Signer { return k }, ""},
		{"another key: refused", func(t *testing.T, _ crypto.Signer) crypto.Signer { return newKey(t) }, "does not match"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			now := baseTime()
			key := newKey(t)
			expired, err := ca.NewRootCertificate(key, "example.org", 10*time.Hour, now.Add(-30*time.Hour))
			if err != nil {
				t.Fatal(err)
			}
			cfg := keyManagerConfig(t)
			cfg.SelfSigned.TTL = 10 * time.Hour
			keyPEM := testutil.KeyPEM(t, tt.keyOf(t, key))
			testutil.WriteFiles(t, cfg.StateDir, map[string][]byte{
				ca.CACertFile:   testutil.CertPEM(expired),
				ca.CAKeyFile:    keyPEM,
				ca.RootCertFile: testutil.CertPEM(expired),
			})

			if tt.wantErr != "" {
				_, err := ca.NewKeyManager(ca.KeyManagerConfig{
					Authority: ca.New(ca.Config{}, nil), StateDir: cfg.StateDir, SelfSigned: cfg.SelfSigned, Clock: testutil.NewFakeClock(now),
				})
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("NewKeyManager = %v, want an error mentioning %q", err, tt.wantErr)
				}
				if got := readCerts(t, filepath.Join(cfg.StateDir, ca.CACertFile)); !sameCerts(got, []*x509.Certificate{expired}) {
					t.Fatal("ca-cert.pem was replaced although its key does not match it")
				}
				return
			}

			h := newKeyManager(t, cfg, now)
			if h.Origin() != ca.OriginPersisted {
				t.Fatalf("origin %q, want the persisted self-signed CA", h.Origin())
			}
			renewed := h.authority.Bundle().SigningCert()
			switch {
			case !pki.PublicKeysEqual(renewed.PublicKey, key.Public()):
				t.Fatal("the renewed root has another key")
			case !bytes.Equal(renewed.RawSubject, expired.RawSubject):
				t.Fatalf("renewed root subject %q, want %q", renewed.Subject, expired.Subject)
			case !renewed.NotAfter.Equal(now.Add(cfg.SelfSigned.TTL)):
				t.Fatalf("renewed root expires at %s, want now + TTL = %s", renewed.NotAfter, now.Add(cfg.SelfSigned.TTL))
			}
			if got := readCerts(t, filepath.Join(cfg.StateDir, ca.CACertFile)); !sameCerts(got, []*x509.Certificate{renewed}) {
				t.Fatal("ca-cert.pem is not the renewed root")
			}
			if got := readBytes(t, filepath.Join(cfg.StateDir, ca.CAKeyFile)); !bytes.Equal(got, keyPEM) {
				t.Fatal("ca-key.pem changed")
			}
			if got := readCerts(t, h.rootFile()); !sameCerts(got, []*x509.Certificate{renewed}) {
				t.Fatalf("root-cert.pem holds %v, want only the renewed root (the expired one is no use)", names(got))
			}
			verifyPath(t, h.sign(t).Chain(), []*x509.Certificate{renewed}, now)
		})
	}
}

func TestNewKeyManagerRefusals(t *testing.T) {
	t.Parallel()
	aFile := filepath.Join(t.TempDir(), ca.CACertFile)
	testutil.WriteFiles(t, filepath.Dir(aFile), map[string][]byte{ca.CACertFile: []byte("x")})
	tests := []struct {
		name    string
		modify  func(cfg *ca.KeyManagerConfig)
		wantErr string
	}{
		{"no authority", func(c *ca.KeyManagerConfig) { c.Authority = nil }, "authority"},
		{"threshold above 1", func(c *ca.KeyManagerConfig) { c.RootRotationThreshold = 1.5 }, "threshold"},
		{"threshold of 1", func(c *ca.KeyManagerConfig) { c.RootRotationThreshold = 1 }, "threshold"},
		{"negative threshold", func(c *ca.KeyManagerConfig) { c.RootRotationThreshold = -0.1 }, "threshold"},
		{"NaN threshold", func(c *ca.KeyManagerConfig) { c.RootRotationThreshold = math.NaN() }, "threshold"},
		{"RSA key size out of range", func(c *ca.KeyManagerConfig) {
			c.SelfSigned.KeyAlgorithm, c.SelfSigned.RSAKeySize = pki.RSA, 1024
		}, "RSA key size 1024 out of range"},
		{"negative overlap", func(c *ca.KeyManagerConfig) { c.TrustBundleOverlap = -time.Hour }, "overlap"},
		// A typo must not fall back to a self-signed CA silently.
		{"cacerts dir that does not exist", func(c *ca.KeyManagerConfig) {
			c.CACertsDir = filepath.Join(filepath.Dir(c.StateDir), "cacerts-typo")
		}, "cacerts-typo: file does not exist"},
		{"cacerts dir that is a file", func(c *ca.KeyManagerConfig) { c.CACertsDir = aFile }, "is not a directory"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := keyManagerConfig(t)
			cfg.Authority = ca.New(ca.Config{}, nil)
			cfg.Clock = testutil.NewFakeClock(baseTime())
			tt.modify(&cfg)
			_, err := ca.NewKeyManager(cfg)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("NewKeyManager = %v, want an error mentioning %q", err, tt.wantErr)
			}
			if _, err := os.Stat(cfg.StateDir); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("a refused configuration left a state dir behind (stat: %v)", err)
			}
			if cfg.Authority != nil && cfg.Authority.Bundle() != nil {
				t.Fatal("a refused configuration put a bundle in service")
			}
		})
	}
}

// If the state files vanish while the CA runs, the next rotation puts back the key and the root,
// so that a restart finds a pair instead of refusing to start.
func TestRotationRestoresDeletedStateFiles(t *testing.T) {
	t.Parallel()
	now := baseTime()
	cfg := keyManagerConfig(t)
	cfg.SelfSigned.TTL = 10 * time.Hour
	h := newKeyManager(t, cfg, now)
	h.run(t)
	for _, name := range []string{ca.CACertFile, ca.CAKeyFile} {
		if err := os.Remove(filepath.Join(cfg.StateDir, name)); err != nil {
			t.Fatal(err)
		}
	}
	old := h.authority.Bundle().SigningCert()
	evs := h.checkAt(t, old.NotAfter.Add(-time.Hour))
	if len(evs) != 1 || evs[0].Kind != ca.EventRotated {
		t.Fatalf("check reported %v, want [rotated]", evs)
	}
	restarted, err := ca.LoadSelfSigned(cfg.StateDir, old.NotAfter.Add(-time.Hour))
	if err != nil || restarted == nil {
		t.Fatalf("state dir after rotation: %v", err)
	}
	if !restarted.SigningCert().Equal(h.authority.Bundle().SigningCert()) {
		t.Fatal("the persisted root is not the one in service")
	}
	info, err := os.Stat(filepath.Join(cfg.StateDir, ca.CAKeyFile))
	if err != nil || info.Mode().Perm() != 0o600 {
		t.Fatalf("ca-key.pem: %v, mode %v", err, info)
	}
}

// A SIGKILL between WriteFileAtomic's temporary file and its rename leaves the temporary file
// behind, a copy of a private key included. The next start removes it under the state dir lock.
func TestStartupRemovesLeftoverTempFiles(t *testing.T) {
	t.Parallel()
	cfg := keyManagerConfig(t)
	leftover := filepath.Join(cfg.StateDir, ".ca-key.pem.tmp-123")
	unrelated := filepath.Join(cfg.StateDir, "notes.tmp-123")
	testutil.WriteFiles(t, cfg.StateDir, map[string][]byte{
		filepath.Base(leftover):  testutil.KeyPEM(t, newKey(t)),
		filepath.Base(unrelated): []byte("not ours"),
	})
	h := newKeyManager(t, cfg, baseTime())
	if _, err := os.Lstat(leftover); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("%s survived the start (stat: %v)", leftover, err)
	}
	if _, err := os.Stat(unrelated); err != nil {
		t.Fatalf("a file not named as WriteFileAtomic names its temporary files was touched: %v", err)
	}
	evs := h.drain()
	if len(evs) != 1 || evs[0].Kind != ca.EventTempFileRemoved || evs[0].Path != leftover {
		t.Fatalf("start-up reported %+v, want one %s event for %s", evs, ca.EventTempFileRemoved, leftover)
	}
	if h.Origin() != ca.OriginGenerated {
		t.Fatalf("origin %q, want a new self-signed CA (the leftover is no key pair)", h.Origin())
	}

	// A later start has nothing to remove.
	again := newKeyManager(t, cfg, baseTime())
	if evs := again.drain(); len(evs) != 0 {
		t.Fatalf("the next start reported %v, want nothing", kinds(evs))
	}
}
