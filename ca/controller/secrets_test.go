package controller_test

import (
	"context"
	"crypto/x509"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

const trustDomain = "cluster.local"

// saStore is a Store over maps whose changes close Changed, as a real store's do.
type saStore struct {
	mu         sync.Mutex
	namespaces map[string]map[string]string
	accounts   map[string][]string // namespace → names
	changed    chan struct{}
}

func newSAStore() *saStore {
	return &saStore{namespaces: map[string]map[string]string{}, accounts: map[string][]string{}, changed: make(chan struct{})}
}

func (s *saStore) NamespaceLabels(_ context.Context, ns string) (map[string]string, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	l, ok := s.namespaces[ns]
	return l, ok, nil
}

func (s *saStore) Namespaces(context.Context) ([]controller.Namespace, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []controller.Namespace
	for n, l := range s.namespaces {
		out = append(out, controller.Namespace{Name: n, Labels: l})
	}
	return out, nil
}

func (s *saStore) ServiceAccounts(_ context.Context, ns string) ([]controller.ServiceAccount, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []controller.ServiceAccount
	for n, names := range s.accounts {
		if ns != "" && n != ns {
			continue
		}
		for _, name := range names {
			out = append(out, controller.ServiceAccount{Namespace: n, Name: name})
		}
	}
	return out, nil
}

func (s *saStore) Changed() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.changed
}

func (s *saStore) update(f func()) {
	s.mu.Lock()
	f()
	close(s.changed)
	s.changed = make(chan struct{})
	s.mu.Unlock()
}

// secretsHarness runs the controller on the real clock inside the test's synctest bubble, where
// time moves only when every goroutine of the bubble waits: so an advance never comes before the
// controller has done what the time so far asks of it.
type secretsHarness struct {
	t      *testing.T
	store  *saStore
	auth   *ca.Authority
	dir    string
	events chan controller.SecretEvent
	seen   []controller.SecretEvent // read by await, not yet matched
	cfg    controller.SecretsConfig
}

// newSecretsHarness must be called inside a synctest bubble.
func newSecretsHarness(t *testing.T, mutate func(*controller.SecretsConfig)) *secretsHarness {
	t.Helper()
	now := time.Now()
	h := &secretsHarness{t: t, store: newSAStore(), dir: filepath.Join(t.TempDir(), "secrets"),
		events: make(chan controller.SecretEvent, 4096)}
	h.auth = ca.New(ca.Config{DefaultTTL: 24 * time.Hour}, newBundle(t, now))
	h.cfg = controller.SecretsConfig{
		Store:     h.store,
		Targeting: controller.NewTargeting(controller.TargetingConfig{Store: h.store, CANamespace: caNamespace, EnabledByDefault: true}),
		Signer:    h.auth, Secrets: controller.NewFileSecrets(h.dir), TrustDomain: trustDomain,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, nil)), OnEvent: func(ev controller.SecretEvent) { h.events <- ev },
	}
	if mutate != nil {
		mutate(&h.cfg)
	}
	return h
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) { w.t.Log(string(p)); return len(p), nil }

func newBundle(t *testing.T, now time.Time) *ca.Bundle {
	t.Helper()
	b, err := ca.CreateSelfSigned(t.TempDir(), ca.SelfSignedConfig{KeyAlgorithm: pki.ECDSA, Org: "test", TTL: 365 * 24 * time.Hour}, now)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func (h *secretsHarness) run() {
	h.t.Helper()
	s, err := controller.NewSecrets(h.cfg)
	if err != nil {
		h.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(h.t.Context())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	h.t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			h.t.Errorf("Run: %v", err)
		}
	})
}

// await reads events until one for ns/sa of kind comes. Its bound is on the bubble's clock, which
// moves only when nothing else can happen: a missing event fails the test at once.
func (h *secretsHarness) await(ns, sa string, kind controller.SecretEventKind) controller.SecretEvent {
	h.t.Helper()
	match := func(ev controller.SecretEvent) bool {
		return ev.Namespace == ns && ev.ServiceAccount == sa && ev.Kind == kind
	}
	if i := slices.IndexFunc(h.seen, match); i >= 0 {
		ev := h.seen[i]
		h.seen = slices.Delete(h.seen, i, i+1)
		return ev
	}
	giveUp := time.NewTimer(30 * time.Second)
	defer giveUp.Stop()
	for {
		select {
		case ev := <-h.events:
			if ev.Kind == controller.SecretFailed {
				h.t.Logf("failed reconcile of %s/%s: %v", ev.Namespace, ev.ServiceAccount, ev.Err)
			}
			if match(ev) {
				return ev
			}
			h.seen = append(h.seen, ev)
		case <-giveUp.C:
			h.t.Fatalf("no %s event for %s/%s", kind, ns, sa)
		}
	}
}

// advance lets d pass on the bubble's clock; the controller acts at each moment due on the way.
func (h *secretsHarness) advance(d time.Duration) {
	h.t.Helper()
	time.Sleep(d)
}

func (h *secretsHarness) secretDir(ns, sa string) string {
	return filepath.Join(h.dir, ns, "istio."+sa)
}

// leaf reads and checks a secret as an agent would: a key matching the leaf, the identity, a
// chain to the roots in root-cert.pem.
func (h *secretsHarness) leaf(ns, sa string) *x509.Certificate {
	h.t.Helper()
	return h.leafIn(h.secretDir(ns, sa), ns, sa)
}

// leafIn is leaf for the secret in dir.
func (h *secretsHarness) leafIn(dir, ns, sa string) *x509.Certificate {
	h.t.Helper()
	read := func(name string) []byte {
		data, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			h.t.Fatal(err)
		}
		return data
	}
	key, err := pki.ParsePrivateKey(read("key.pem"))
	if err != nil {
		h.t.Fatal(err)
	}
	chain, err := pki.ParseCertificates(read("cert-chain.pem"))
	if err != nil {
		h.t.Fatal(err)
	}
	roots, err := pki.ParseCertificates(read("root-cert.pem"))
	if err != nil {
		h.t.Fatal(err)
	}
	id := "spiffe://" + trustDomain + "/ns/" + ns + "/sa/" + sa
	if err := pki.CheckKeyPair(chain, key, id, time.Now()); err != nil {
		h.t.Fatalf("%s: %v", dir, err)
	}
	pool := x509.NewCertPool()
	for _, r := range roots {
		pool.AddCert(r)
	}
	if _, err := chain[0].Verify(x509.VerifyOptions{Roots: pool, CurrentTime: time.Now()}); err != nil {
		h.t.Fatalf("%s: the leaf does not verify under root-cert.pem: %v", dir, err)
	}
	if info, err := os.Stat(filepath.Join(dir, "key.pem")); err != nil || info.Mode().Perm() != 0o600 {
		h.t.Fatalf("key.pem mode: %v, %v; want 0600", info, err)
	}
	if link, err := os.Readlink(filepath.Join(dir, "key.pem")); err != nil || link != filepath.Join("..data", "key.pem") {
		h.t.Errorf("key.pem is not a link through ..data: %q, %v", link, err)
	}
	return chain[0]
}

func assertGone(t *testing.T, path string) {
	t.Helper()
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s still exists (%v)", path, err)
	}
}

func TestSecretsCreatedForServedNamespacesOnly(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		h := newSecretsHarness(t, nil)
		h.store.update(func() {
			h.store.namespaces["prod"] = map[string]string{}
			h.store.namespaces["off"] = map[string]string{controller.LabelOverride: "false"}
			h.store.namespaces["other-ca"] = map[string]string{controller.LabelEnv: "elsewhere"}
			h.store.accounts["prod"] = []string{"web", "db"}
			h.store.accounts["off"] = []string{"web"}
			h.store.accounts["other-ca"] = []string{"web"}
			h.store.accounts["unknown"] = []string{"default"} // no Namespace object: unlabelled, served by default
		})
		h.run()
		for _, k := range [][2]string{{"prod", "web"}, {"prod", "db"}, {"unknown", "default"}} {
			h.await(k[0], k[1], controller.SecretCreated)
			h.leaf(k[0], k[1])
		}
		h.await("off", "web", controller.SecretAbsent)
		h.await("other-ca", "web", controller.SecretAbsent)
		assertGone(t, filepath.Join(h.dir, "off"))
		assertGone(t, filepath.Join(h.dir, "other-ca"))
	})
}

func TestSecretsListenedNamespace(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		h := newSecretsHarness(t, func(c *controller.SecretsConfig) { c.Namespace = "prod" })
		h.store.update(func() {
			h.store.accounts["prod"] = []string{"web"}
			h.store.accounts["dev"] = []string{"web"}
		})
		h.run()
		h.await("prod", "web", controller.SecretCreated)
		h.advance(time.Minute) // a resync: still nothing for dev
		h.await("prod", "web", controller.SecretUnchanged)
		assertGone(t, filepath.Join(h.dir, "dev"))
	})
}

func TestSecretsRefreshedAtTheGracePoint(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		h := newSecretsHarness(t, func(c *controller.SecretsConfig) {
			c.GracePeriodRatio, c.MinGracePeriod, c.ResyncInterval = 0.25, 10*time.Minute, 24*time.Hour
		})
		h.store.update(func() { h.store.accounts["prod"] = []string{"web"} })
		h.run()
		h.await("prod", "web", controller.SecretCreated)
		first := h.leaf("prod", "web")
		lifetime := first.NotAfter.Sub(first.NotBefore)
		refreshAt := first.NotAfter.Add(-lifetime / 4)

		h.advance(time.Until(refreshAt) - time.Second)
		h.advance(time.Second)
		ev := h.await("prod", "web", controller.SecretRefreshed)
		second := h.leaf("prod", "web")
		if second.SerialNumber.Cmp(first.SerialNumber) == 0 {
			t.Fatal("the certificate was not re-issued")
		}
		if !time.Now().Equal(refreshAt) {
			t.Errorf("refreshed at %s, want the grace point %s (%s)", time.Now(), refreshAt, ev.Reason)
		}
	})
}

func TestSecretsMinGracePeriodWins(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		h := newSecretsHarness(t, func(c *controller.SecretsConfig) {
			c.GracePeriodRatio, c.MinGracePeriod, c.ResyncInterval = 0.1, 20*time.Hour, 48*time.Hour
		})
		h.store.update(func() { h.store.accounts["prod"] = []string{"web"} })
		h.run()
		h.await("prod", "web", controller.SecretCreated)
		first := h.leaf("prod", "web")
		want := first.NotAfter.Add(-20 * time.Hour)
		h.advance(time.Until(want))
		h.await("prod", "web", controller.SecretRefreshed)
		if !time.Now().Equal(want) {
			t.Errorf("refreshed at %s, want %s", time.Now(), want)
		}
	})
}

func TestSecretsReissuedOnRootChange(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		h := newSecretsHarness(t, nil)
		h.store.update(func() { h.store.accounts["prod"] = []string{"web"} })
		h.run()
		h.await("prod", "web", controller.SecretCreated)

		next := newBundle(t, time.Now())
		h.auth.SetBundle(next)
		h.await("prod", "web", controller.SecretRefreshed)
		leaf := h.leaf("prod", "web")
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: next.RootPool(), CurrentTime: time.Now()}); err != nil {
			t.Errorf("the re-issued leaf does not verify under the new root: %v", err)
		}
	})
}

func TestSecretsRemoved(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		h := newSecretsHarness(t, nil)
		h.store.update(func() {
			h.store.namespaces["prod"] = map[string]string{}
			h.store.accounts["prod"] = []string{"web", "db"}
		})
		h.run()
		h.await("prod", "web", controller.SecretCreated)
		h.await("prod", "db", controller.SecretCreated)

		h.store.update(func() { h.store.accounts["prod"] = []string{"db"} })
		h.await("prod", "web", controller.SecretDeleted)
		assertGone(t, h.secretDir("prod", "web"))
		h.leaf("prod", "db")

		h.store.update(func() { h.store.namespaces["prod"] = map[string]string{controller.LabelEnv: "another-ca"} })
		h.await("prod", "db", controller.SecretDeleted)
		assertGone(t, filepath.Join(h.dir, "prod"))
	})
}

func TestSecretsRecreatedWhenTamperedWith(t *testing.T) {
	t.Parallel()
	otherKey, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	otherKeyPEM, err := pki.EncodePrivateKey(otherKey)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		tamper func(h *secretsHarness, dir string)
	}{
		{"deleted", func(_ *secretsHarness, dir string) {
			if err := os.RemoveAll(dir); err != nil {
				t.Fatal(err)
			}
		}},
		{"garbage chain", func(_ *secretsHarness, dir string) {
			write(t, filepath.Join(dir, "cert-chain.pem"), []byte("garbage"), 0o644)
		}},
		{"mismatched key", func(_ *secretsHarness, dir string) { write(t, filepath.Join(dir, "key.pem"), otherKeyPEM, 0o600) }},
		{"key readable by others", func(_ *secretsHarness, dir string) {
			if err := os.Chmod(filepath.Join(dir, "key.pem"), 0o644); err != nil {
				t.Fatal(err)
			}
		}},
		{"other identity", func(h *secretsHarness, dir string) {
			// A valid pair from our own CA, for another service account.
			other := h.secretDir("prod", "db")
			for _, f := range []string{"key.pem", "cert-chain.pem"} {
				data, err := os.ReadFile(filepath.Join(other, f))
				if err != nil {
					t.Fatal(err)
				}
				write(t, filepath.Join(dir, f), data, 0o600)
			}
		}},
		{"not under our roots", func(h *secretsHarness, dir string) {
			foreign := testutil.NewRootCA(t, testutil.CAOptions{})
			cert, key := foreign.IssueWorkload(t, "spiffe://"+trustDomain+"/ns/prod/sa/web", 24*time.Hour)
			write(t, filepath.Join(dir, "key.pem"), testutil.KeyPEM(t, key), 0o600)
			write(t, filepath.Join(dir, "cert-chain.pem"), testutil.CertPEM(cert, foreign.Cert), 0o644)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				h := newSecretsHarness(t, nil)
				h.store.update(func() { h.store.accounts["prod"] = []string{"web", "db"} })
				h.run()
				h.await("prod", "web", controller.SecretCreated)
				h.await("prod", "db", controller.SecretCreated)
				dir := h.secretDir("prod", "web")
				tc.tamper(h, dir)
				h.advance(controller.DefaultResyncInterval)
				kind := controller.SecretRefreshed
				if tc.name == "deleted" {
					kind = controller.SecretCreated
				}
				h.await("prod", "web", kind)
				h.leaf("prod", "web")
			})
		})
	}
}

// write replaces the file a name links to, as a careless editor would.
func write(t *testing.T, path string, data []byte, mode os.FileMode) {
	t.Helper()
	if err := os.WriteFile(path, data, mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
}

func TestSecretsLeaveForeignDirectoriesAlone(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		h := newSecretsHarness(t, nil)
		mine := h.secretDir("prod", "web")             // wanted, but made by someone else
		stray := h.secretDir("prod", "gone")           // not wanted, made by someone else
		invalid := h.secretDir("Not_A_Namespace", "x") // not a name we would ever write
		for _, dir := range []string{mine, stray, invalid} {
			if err := os.MkdirAll(dir, 0o700); err != nil {
				t.Fatal(err)
			}
			write(t, filepath.Join(dir, "cert-chain.pem"), []byte("theirs"), 0o644)
		}
		h.store.update(func() { h.store.accounts["prod"] = []string{"web"} })
		h.run()
		h.await("prod", "web", controller.SecretForeign)
		h.await("prod", "gone", controller.SecretForeign)
		h.await("Not_A_Namespace", "x", controller.SecretForeign)
		for _, dir := range []string{mine, stray, invalid} {
			data, err := os.ReadFile(filepath.Join(dir, "cert-chain.pem"))
			if err != nil || string(data) != "theirs" {
				t.Errorf("%s was touched: %q, %v", dir, data, err)
			}
			if _, err := os.Lstat(filepath.Join(dir, controller.SecretMarkerFile)); err == nil {
				t.Errorf("%s was marked as ours", dir)
			}
		}
	})
}

func TestSecretsCustomDNSNames(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		dns, err := controller.DNSNames(caNamespace, "pilot-sa.istio-system:istio-pilot.istio-system,pilot-sa.istio-system:pilot.example.com")
		if err != nil {
			t.Fatal(err)
		}
		h := newSecretsHarness(t, func(c *controller.SecretsConfig) { c.DNSNames = dns })
		h.store.update(func() {
			h.store.accounts[caNamespace] = []string{"pilot-sa", "istio-sidecar-injector-service-account"}
			h.store.accounts["prod"] = []string{"pilot-sa"}
		})
		h.run()
		for _, tc := range []struct {
			ns, sa string
			want   []string
		}{
			{caNamespace, "pilot-sa", []string{"istio-pilot.istio-system", "pilot.example.com"}},
			{caNamespace, "istio-sidecar-injector-service-account", []string{"istio-sidecar-injector.istio-system.svc", "istio-sidecar-injector.istio-system"}},
			{"prod", "pilot-sa", nil},
		} {
			h.await(tc.ns, tc.sa, controller.SecretCreated)
			if got := h.leaf(tc.ns, tc.sa).DNSNames; !slices.Equal(got, tc.want) {
				t.Errorf("%s/%s: DNS SANs %q, want %q", tc.ns, tc.sa, got, tc.want)
			}
		}
	})
}

func TestDNSNamesRefusesMalformedEntries(t *testing.T) {
	t.Parallel()
	for _, in := range []string{"no-colon", "sa:dns", "sa.ns:", ":dns", "sa.ns:bad name", "sa.ns:a:b"} {
		if _, err := controller.DNSNames(caNamespace, in); err == nil {
			t.Errorf("DNSNames(%q) accepted it", in)
		}
	}
}

func TestSecretsRemoveUnfinishedGenerations(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		h := newSecretsHarness(t, nil)
		h.store.update(func() { h.store.accounts["prod"] = []string{"web"} })
		h.run()
		h.await("prod", "web", controller.SecretCreated)
		unfinished := filepath.Join(h.secretDir("prod", "web"), "..meshid_killed")
		if err := os.Mkdir(unfinished, 0o700); err != nil {
			t.Fatal(err)
		}
		h.advance(controller.DefaultResyncInterval)
		h.await("prod", "web", controller.SecretUnchanged)
		assertGone(t, unfinished)
		h.leaf("prod", "web")
	})
}
