package ca_test

import (
	"crypto/x509"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/testutil"
)

// replacedRoot is a state dir whose plugged-in CA moved from an old root to a new one.
type replacedRoot struct {
	cfg              ca.KeyManagerConfig
	oldRoot, newRoot *x509.Certificate
	replaced         time.Time
}

// replaceRoot runs a key manager on an old plugged-in CA and replaces its files with a new one,
// under overlap; it returns once the running key manager has reloaded them.
func replaceRoot(t *testing.T, overlap time.Duration) replacedRoot {
	t.Helper()
	now := baseTime()
	oldRoot := testutil.NewRootCA(t, caOpts("old root", now, 3*year))
	oldInt := oldRoot.NewIntermediate(t, caOpts("old intermediate", now, year))
	newRoot := testutil.NewRootCA(t, caOpts("new root", now, 3*year))
	newInt := newRoot.NewIntermediate(t, caOpts("new intermediate", now, year))
	cfg := keyManagerConfig(t)
	cfg.CACertsDir = filepath.Join(t.TempDir(), "cacerts")
	cfg.TrustBundleOverlap = overlap
	testutil.WriteFiles(t, cfg.CACertsDir, istioFiles(t, oldInt, oldRoot))
	h := newKeyManager(t, cfg, now)
	h.run(t)
	testutil.WriteFiles(t, cfg.CACertsDir, istioFiles(t, newInt, newRoot))
	h.until(t, ca.EventReloaded, ca.EventRejected)
	return replacedRoot{cfg: cfg, oldRoot: oldRoot.Cert, newRoot: newRoot.Cert, replaced: h.clock.Now()}
}

// Attack: each start counted --trust-bundle-overlap afresh from then, so that a CA restarted
// more often than the overlap (a crash loop, a daily rollout) trusted a replaced root for ever.
// The replacement time is kept in the state dir, and a restart counts from it.
func TestRestartKeepsTheOverlapClock(t *testing.T) {
	t.Parallel()
	r := replaceRoot(t, time.Hour)
	both := []*x509.Certificate{r.newRoot, r.oldRoot}
	only := []*x509.Certificate{r.newRoot}
	for _, step := range []struct {
		after time.Duration // restart this long after the replacement
		want  []*x509.Certificate
	}{
		{20 * time.Minute, both},
		{59 * time.Minute, both},
		{time.Hour, only},
		{3 * time.Hour, only},
	} {
		h := newKeyManager(t, r.cfg, r.replaced.Add(step.after))
		if got := h.authority.Bundle().Roots(); !sameCerts(got, step.want) {
			t.Fatalf("restarted %s after the replacement (overlap 1h): trusted roots %v, want %v", step.after, names(got), names(step.want))
		}
		if got := readCerts(t, h.rootFile()); !sameCerts(got, step.want) {
			t.Fatalf("restarted %s after the replacement (overlap 1h): root-cert.pem holds %v, want %v", step.after, names(got), names(step.want))
		}
	}
}

// A retained root stops anchoring trust at the end of its overlap, checked per call: the key
// manager's next check, which drops it from the pool, may come an interval later.
func TestRetainedRootCheckedPerCall(t *testing.T) {
	t.Parallel()
	r := replaceRoot(t, time.Hour)
	h := newKeyManager(t, r.cfg, r.replaced.Add(30*time.Minute))
	b := h.authority.Bundle()
	if err := b.CheckRoot(r.oldRoot, r.replaced.Add(59*time.Minute)); err != nil {
		t.Fatalf("old root refused within its overlap: %v", err)
	}
	if err := b.CheckRoot(r.newRoot, r.replaced.Add(3*time.Hour)); err != nil {
		t.Fatalf("the root in service refused: %v", err)
	}
	err := b.CheckRoot(r.oldRoot, r.replaced.Add(time.Hour))
	if !errors.Is(err, ca.ErrRootRetired) || !strings.Contains(err.Error(), "old root") {
		t.Fatalf("old root at the end of its overlap: %v, want ErrRootRetired naming it", err)
	}
}

// A replaced root whose replacement time a start cannot know (a state dir of an older meshid, or
// a removed or damaged record): under an overlap it is trusted no longer, since counting the
// overlap from now could trust it longer than configured; without an overlap the time does not
// matter and it stays until it expires. Either way the start says so and writes a sound record.
func TestUnknownReplacementTime(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name    string
		overlap time.Duration
		record  []byte // nil: removed
		kept    bool
	}{
		{"no record, overlap", time.Hour, nil, false},
		{"damaged record, overlap", time.Hour, []byte("meshid retired roots v1\nnot a line\n"), false},
		{"no record, no overlap", 0, nil, true},
		{"damaged record, no overlap", 0, []byte("garbage"), true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			r := replaceRoot(t, tt.overlap)
			path := filepath.Join(r.cfg.StateDir, ca.RetiredRootsFile)
			if tt.record == nil {
				if err := os.Remove(path); err != nil {
					t.Fatal(err)
				}
			} else {
				testutil.WriteFiles(t, r.cfg.StateDir, map[string][]byte{ca.RetiredRootsFile: tt.record})
			}
			logs := &testutil.SyncBuffer{}
			cfg := r.cfg
			cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
			h := newKeyManager(t, cfg, r.replaced.Add(time.Minute))

			want := []*x509.Certificate{r.newRoot}
			if tt.kept {
				want = append(want, r.oldRoot)
			}
			if got := h.authority.Bundle().Roots(); !sameCerts(got, want) {
				t.Fatalf("trusted roots %v, want %v", names(got), names(want))
			}
			if got := readCerts(t, h.rootFile()); !sameCerts(got, want) {
				t.Fatalf("root-cert.pem holds %v, want %v", names(got), names(want))
			}
			if !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), ca.RetiredRootsFile) {
				t.Fatalf("the start did not warn about the record:\n%s", logs)
			}
			if !tt.kept && !strings.Contains(logs.String(), "could trust it longer than configured") {
				t.Fatalf("the start did not say why the old root left:\n%s", logs)
			}
			// The record is sound again: the next start reads it without a warning.
			logs2 := &testutil.SyncBuffer{}
			cfg.Logger = slog.New(slog.NewTextHandler(logs2, nil))
			again := newKeyManager(t, cfg, r.replaced.Add(2*time.Minute))
			if strings.Contains(logs2.String(), "level=WARN") {
				t.Fatalf("the next start warned:\n%s", logs2)
			}
			if got := again.authority.Bundle().Roots(); !sameCerts(got, want) {
				t.Fatalf("after the next start: trusted roots %v, want %v", names(got), names(want))
			}
		})
	}
}

// A CA stopped while its plugged-in files are replaced retires the old root when it starts: the
// record says the old root anchored it until then.
func TestReplacedWhileStoppedCountsFromTheStart(t *testing.T) {
	t.Parallel()
	now := baseTime()
	oldRoot := testutil.NewRootCA(t, caOpts("old root", now, 3*year))
	oldInt := oldRoot.NewIntermediate(t, caOpts("old intermediate", now, year))
	newRoot := testutil.NewRootCA(t, caOpts("new root", now, 3*year))
	newInt := newRoot.NewIntermediate(t, caOpts("new intermediate", now, year))
	cfg := keyManagerConfig(t)
	cfg.CACertsDir = filepath.Join(t.TempDir(), "cacerts")
	cfg.TrustBundleOverlap = time.Hour
	testutil.WriteFiles(t, cfg.CACertsDir, istioFiles(t, oldInt, oldRoot))
	newKeyManager(t, cfg, now)

	testutil.WriteFiles(t, cfg.CACertsDir, istioFiles(t, newInt, newRoot))
	started := now.Add(5 * time.Hour)
	h := newKeyManager(t, cfg, started)
	if got := h.authority.Bundle().Roots(); !sameCerts(got, []*x509.Certificate{newRoot.Cert, oldRoot.Cert}) {
		t.Fatalf("trusted roots %v, want the new root then the old one", names(got))
	}
	b := h.authority.Bundle()
	if err := b.CheckRoot(oldRoot.Cert, started.Add(59*time.Minute)); err != nil {
		t.Fatalf("old root refused within the overlap counted from the start: %v", err)
	}
	if err := b.CheckRoot(oldRoot.Cert, started.Add(time.Hour)); !errors.Is(err, ca.ErrRootRetired) {
		t.Fatalf("old root at the end of the overlap counted from the start: %v, want ErrRootRetired", err)
	}
}
