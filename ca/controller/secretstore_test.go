package controller_test

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"testing/synctest"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshid/meshid/ca/controller"
)

// lineLog keeps the log lines, one record each, and shows them in the test's output.
type lineLog struct {
	t     *testing.T
	mu    sync.Mutex
	lines []string
}

func (l *lineLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	l.lines = append(l.lines, string(p))
	l.mu.Unlock()
	l.t.Log(string(p))
	return len(p), nil
}

// count is how many lines hold every one of words.
func (l *lineLog) count(words ...string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, line := range l.lines {
		all := true
		for _, w := range words {
			all = all && strings.Contains(line, w)
		}
		if all {
			n++
		}
	}
	return n
}

// fakeSecret writes, in dir, a directory that looks like one of ours: the marker and a
// certificate chain that is not one.
func fakeSecret(t *testing.T, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(dir, controller.SecretMarkerFile), []byte("type: "+controller.SecretType+"\n"), 0o644)
	write(t, filepath.Join(dir, "cert-chain.pem"), []byte("theirs"), 0o644)
}

// assertUntouched checks that a fake secret is as fakeSecret left it.
func assertUntouched(t *testing.T, dir string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatalf("%s: %v", dir, err)
	}
	if len(entries) != 2 {
		t.Errorf("%s holds %d entries, want the 2 it was given", dir, len(entries))
	}
	if data, err := os.ReadFile(filepath.Join(dir, "cert-chain.pem")); err != nil || string(data) != "theirs" {
		t.Errorf("%s/cert-chain.pem: %q, %v", dir, data, err)
	}
}

// A link in the secrets tree, for a namespace or for a secret, is never followed: nothing is
// read, written or removed through it. The secret is refused, logged once with the path and
// counted, and not retried before the next resync.
func TestSecretsNeverFollowALinkInTheSecretsTree(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		listened string
		link     func(h *secretsHarness, target string) string // makes the link, returns it
	}{
		{"namespace link", "", func(h *secretsHarness, target string) string {
			return symlink(h.t, target, filepath.Join(h.dir, "prod"))
		}},
		{"namespace link, listened namespace", "prod", func(h *secretsHarness, target string) string {
			return symlink(h.t, target, filepath.Join(h.dir, "prod"))
		}},
		{"secret link", "", func(h *secretsHarness, target string) string {
			return symlink(h.t, filepath.Join(target, "istio.web"), h.secretDir("prod", "web"))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				log := &lineLog{t: t}
				reg := prometheus.NewRegistry()
				h := newSecretsHarness(t, func(c *controller.SecretsConfig) {
					c.Namespace, c.Registerer, c.Logger = tc.listened, reg, slog.New(slog.NewTextHandler(log, nil))
				})
				target := t.TempDir()
				fakeSecret(t, filepath.Join(target, "istio.web"))  // wanted: would be re-issued through the link
				fakeSecret(t, filepath.Join(target, "istio.gone")) // not wanted: would be removed through the link
				if err := os.MkdirAll(filepath.Join(h.dir, "prod"), 0o700); err != nil {
					t.Fatal(err)
				}
				if tc.name != "secret link" {
					if err := os.Remove(filepath.Join(h.dir, "prod")); err != nil {
						t.Fatal(err)
					}
				}
				link := tc.link(h, target)
				h.store.update(func() { h.store.accounts["prod"] = []string{"web"} })
				h.run()
				ev := h.await("prod", "web", controller.SecretRefused)
				if ev.Err == nil || !strings.Contains(ev.Err.Error(), link) {
					t.Errorf("refusal %v, want one naming %s", ev.Err, link)
				}
				for range 2 { // two resyncs: looked at again, not logged or counted again
					h.advance(controller.DefaultResyncInterval)
					h.await("prod", "web", controller.SecretRefused)
				}
				for _, name := range []string{"istio.web", "istio.gone"} {
					assertUntouched(t, filepath.Join(target, name))
				}
				if got, err := os.Readlink(link); err != nil || !strings.HasPrefix(got, target) {
					t.Errorf("the link was changed: %q, %v", got, err)
				}
				if n := log.count("refused", link); n != 1 {
					t.Errorf("%d log lines about the refusal of %s, want 1", n, link)
				}
				if n := log.count("cannot reconcile"); n != 0 {
					t.Errorf("%d failed reconciles logged, want none: a refusal is not retried", n)
				}
				if n := counterValue(t, reg, "meshid_ca_secret_reconcile_errors_total"); n != 1 {
					t.Errorf("%v refusals counted, want 1", n)
				}
			})
		})
	}
}

func symlink(t *testing.T, target, link string) string {
	t.Helper()
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	return link
}

// counterValue reads a registered counter.
func counterValue(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == name && len(f.GetMetric()) == 1 {
			return f.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("no counter %s", name)
	return 0
}

// longName is a valid service-account name of the longest length Kubernetes takes: 253 bytes,
// so that istio.<sa> would be longer than a file name may be (255 bytes).
func longName() string {
	label := strings.Repeat("a", 63)
	return label + "." + label + "." + label + "." + strings.Repeat("b", 61)
}

// A service account with a valid 253-byte name gets its secret under a shortened directory name
// that fits a file name: stable, told apart from every other name, and recognized as that
// service account's (by its marker) after a restart and when the account goes.
func TestSecretsForALongServiceAccountName(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		long := longName()
		other := long[:len(long)-1] + "c" // the same length, the same first 252 bytes
		log := &lineLog{t: t}
		h := newSecretsHarness(t, func(c *controller.SecretsConfig) { c.Logger = slog.New(slog.NewTextHandler(log, nil)) })
		h.store.update(func() { h.store.accounts["prod"] = []string{"web", long, other} })
		h.run()
		h.await("prod", long, controller.SecretCreated)
		h.await("prod", other, controller.SecretCreated)
		h.await("prod", "web", controller.SecretCreated)

		entries, err := os.ReadDir(filepath.Join(h.dir, "prod"))
		if err != nil {
			t.Fatal(err)
		}
		dirs := map[string]string{} // service account → directory
		for _, e := range entries {
			if e.Name() == "istio.web" {
				continue
			}
			if len(e.Name()) > 255 || !strings.HasPrefix(e.Name(), "istio.") {
				t.Errorf("secret directory %q (%d bytes): want istio.… of at most 255 bytes", e.Name(), len(e.Name()))
			}
			marker, err := os.ReadFile(filepath.Join(h.dir, "prod", e.Name(), controller.SecretMarkerFile))
			if err != nil {
				t.Fatal(err)
			}
			for _, sa := range []string{long, other} {
				if strings.Contains(string(marker), "/sa/"+sa+"\n") {
					dirs[sa] = filepath.Join(h.dir, "prod", e.Name())
				}
			}
		}
		if len(dirs) != 2 || dirs[long] == dirs[other] {
			t.Fatalf("directories %v, want one for each long name, told apart", dirs)
		}
		for sa, dir := range dirs {
			h.leafIn(dir, "prod", sa)
		}

		// A resync, and a second controller on the same directory (a restart): recognized, kept.
		h.advance(controller.DefaultResyncInterval)
		h.await("prod", long, controller.SecretUnchanged)
		again := newSecretsHarness(t, func(c *controller.SecretsConfig) {
			c.Secrets, c.Signer = controller.NewFileSecrets(h.dir), h.auth
		})
		again.store.update(func() { again.store.accounts["prod"] = []string{"web", long, other} })
		again.run()
		again.await("prod", long, controller.SecretUnchanged)
		again.await("prod", other, controller.SecretUnchanged)

		// The account goes: its secret is found by its marker and removed, the other one kept.
		h.store.update(func() { h.store.accounts["prod"] = []string{"web", other} })
		h.await("prod", long, controller.SecretDeleted)
		assertGone(t, dirs[long])
		h.leafIn(dirs[other], "prod", other)
		if n := log.count("level=WARN"); n != 0 {
			t.Errorf("%d warnings, want none", n)
		}
		if n := log.count("level=ERROR"); n != 0 {
			t.Errorf("%d errors, want none", n)
		}
	})
}
