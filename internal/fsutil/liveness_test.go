package fsutil_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/testutil"
)

// The liveness file is touched, on the clock, only while the controller is healthy.
func TestLivenessProbeTouchesWhileHealthy(t *testing.T) {
	t.Parallel()
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clk := testutil.NewFakeClock(start)
	var healthy atomic.Bool
	healthy.Store(true)
	path := filepath.Join(t.TempDir(), "alive")
	p := &fsutil.LivenessFile{Path: path, Interval: time.Minute, Healthy: healthy.Load, Clock: clk, Logger: slog.New(slog.DiscardHandler)}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	modTime := func() time.Time {
		t.Helper()
		info, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		return info.ModTime().UTC()
	}
	step := func() {
		t.Helper()
		if err := clk.WaitForTimers(t.Context(), 1); err != nil {
			t.Fatal(err)
		}
		clk.Advance(time.Minute)
		// The probe touches, then arms its next timer: wait for that before looking.
		if err := clk.WaitForTimers(t.Context(), 1); err != nil {
			t.Fatal(err)
		}
	}
	if err := clk.WaitForTimers(t.Context(), 1); err != nil {
		t.Fatal(err)
	}
	if got := modTime(); !got.Equal(start) {
		t.Fatalf("first touch at %s, want %s", got, start)
	}
	step()
	if got := modTime(); !got.Equal(start.Add(time.Minute)) {
		t.Fatalf("touch at %s, want %s", got, start.Add(time.Minute))
	}
	healthy.Store(false)
	step()
	step()
	if got := modTime(); !got.Equal(start.Add(time.Minute)) {
		t.Fatalf("touched at %s while unhealthy", got)
	}
}
