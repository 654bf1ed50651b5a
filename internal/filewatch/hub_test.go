package filewatch

import (
	"context"
	"errors"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/testutil"
)

// startHub runs a Hub until the test ends.
func startHub(t *testing.T) *Hub {
	t.Helper()
	hub := NewHub(HubConfig{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- hub.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("hub Run: %v", err)
		}
	})
	return hub
}

// startOn runs a Watcher of paths on hub (nil: a hub of its own, as without one), with clk,
// until the test ends.
func startOn(t *testing.T, hub *Hub, clk *testutil.FakeClock, paths ...string) *harness {
	t.Helper()
	h := &harness{clock: clk, changes: make(chan []string, 16)}
	w, err := New(Config{Paths: paths, Clock: clk, Hub: hub})
	if err != nil {
		t.Fatal(err)
	}
	h.watcher = w
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx, func(changed []string) { h.changes <- changed }) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	select {
	case <-w.Ready():
	case err := <-done:
		t.Fatalf("Run ended: %v", err)
	}
	return h
}

// Two Watchers on one hub share its one inotify instance; each is told only of its own paths,
// including a path both watch; a path one removes stays watched for the other.
func TestHubSharedByWatchers(t *testing.T) {
	t.Parallel()
	hub := startHub(t)
	dir, other := t.TempDir(), t.TempDir()
	shared, onlyA, onlyB := filepath.Join(dir, "root-cert.pem"), filepath.Join(dir, "a.pem"), filepath.Join(other, "b.pem")
	// One clock each: each Watcher's debounce is driven on its own.
	a := startOn(t, hub, testutil.NewFakeClock(time.Now()), shared, onlyA)
	b := startOn(t, hub, testutil.NewFakeClock(time.Now()), shared, onlyB)

	hub.mu.Lock()
	fw := hub.fw
	hub.mu.Unlock()
	if fw == nil {
		t.Fatal("the hub has no inotify instance with paths watched")
	}

	// A file only b watches: b is told, a is not (a's next report is of its own file).
	write(t, onlyB, "one")
	b.until(t, onlyB)
	write(t, onlyA, "one")
	for got := a.next(t); !slices.Contains(got, onlyA); got = a.next(t) {
		if slices.Contains(got, onlyB) {
			t.Fatalf("a was told of %v, which only b watches", got)
		}
	}

	// The file both watch: both are told.
	write(t, shared, "one")
	a.until(t, shared)
	b.until(t, shared)

	// a stops watching it: b still is told of it, a is not, and the directory stays watched
	// for a's other file.
	if err := a.watcher.Remove(t.Context(), shared); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(fw.WatchList(), dir) {
		t.Fatalf("the directory %s was unwatched while others need it; watched: %v", dir, fw.WatchList())
	}
	write(t, shared, "two")
	b.until(t, shared)
	write(t, onlyA, "two")
	for got := a.next(t); !slices.Contains(got, onlyA); got = a.next(t) {
		if slices.Contains(got, shared) {
			t.Fatalf("a was told of %v after removing %s", got, shared)
		}
	}

	// b stops watching everything in dir: the directory is still a's.
	if err := b.watcher.Remove(t.Context(), shared); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(fw.WatchList(), dir) {
		t.Fatalf("the directory %s was unwatched while a needs it", dir)
	}
	// a stops too: nobody needs dir, and it is unwatched; other stays b's.
	if err := a.watcher.Remove(t.Context(), onlyA); err != nil {
		t.Fatal(err)
	}
	if list := fw.WatchList(); slices.Contains(list, dir) || !slices.Contains(list, other) {
		t.Fatalf("watched %v: want %s dropped and %s kept", list, dir, other)
	}
}

// A hub makes its inotify instance on the first watch: Watchers with nothing to watch, and a
// Watcher without a hub with nothing to watch, cost none.
func TestNoInotifyWithoutPaths(t *testing.T) {
	t.Parallel()
	hub := startHub(t)
	startOn(t, hub, testutil.NewFakeClock(time.Now()))
	startOn(t, hub, testutil.NewFakeClock(time.Now()))
	hub.mu.Lock()
	made := hub.fw != nil
	hub.mu.Unlock()
	if made {
		t.Fatal("the hub made an inotify instance with nothing to watch")
	}
	// The first path makes it, and is watched.
	file := filepath.Join(t.TempDir(), "token")
	h := startOn(t, hub, testutil.NewFakeClock(time.Now()))
	if err := h.watcher.Add(t.Context(), file); err != nil {
		t.Fatal(err)
	}
	write(t, file, "jwt")
	h.until(t, file)
}

// Once a hub's Run has ended, its Watchers end, and a Watcher started on it is refused with
// ErrHubStopped.
func TestHubStopped(t *testing.T) {
	t.Parallel()
	hub := NewHub(HubConfig{})
	ctx, cancel := context.WithCancel(t.Context())
	hubDone := make(chan error, 1)
	go func() { hubDone <- hub.Run(ctx) }()

	w, err := New(Config{Paths: []string{filepath.Join(t.TempDir(), "f")}, Hub: hub})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- w.Run(t.Context(), func([]string) {}) }()
	<-w.Ready()
	cancel()
	if err := <-hubDone; err != nil {
		t.Fatalf("hub Run: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatalf("a Watcher on a hub that stopped ended with %v, want nil: the hub's owner stops", err)
	}

	late, err := New(Config{Hub: hub})
	if err != nil {
		t.Fatal(err)
	}
	if err := late.Run(t.Context(), func([]string) {}); !errors.Is(err, ErrHubStopped) {
		t.Fatalf("a Watcher started on a stopped hub: Run returned %v, want ErrHubStopped", err)
	}
	if err := hub.Run(t.Context()); err == nil {
		t.Fatal("a hub ran twice")
	}
}
