package controller_test

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

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
			if n := counterValue(t, reg, "meshid_ca_secret_reconcile_errors_total"); n != 1 {
				t.Errorf("%v refusals counted, want 1", n)
			}
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
