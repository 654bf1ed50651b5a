// Package filewatch tells when files or directories change on disk, including Kubernetes'
// atomic "..data" symlink swaps of mounted secrets and config maps, and paths that do not exist
// yet, even when their directories do not either: the nearest existing ancestor is watched until
// they appear. Bursts of events are debounced into one notification on an injected clock.
package filewatch

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/meshid/meshid/internal/logkey"

	"github.com/fsnotify/fsnotify"

	"github.com/meshid/meshid/internal/clock"
)

// DefaultDebounce is how long a path must stay quiet before a change is reported.
const DefaultDebounce = 100 * time.Millisecond

// Config configures a Watcher.
type Config struct {
	// Paths are the files and directories to watch from the start; Add watches more. They and
	// their directories need not exist yet.
	Paths    []string
	Debounce time.Duration
	Clock    clock.Clock
	Logger   *slog.Logger
	// Hub, when set, is the inotify instance the Watcher shares with others; nil: its own.
	Hub *Hub
}

var errStopped = errors.New("the file watcher has stopped")

// Watcher reports changes to a set of paths.
type Watcher struct {
	debounce time.Duration
	clock    clock.Clock
	log      *slog.Logger
	ready    chan struct{}
	stopped  chan struct{} // closed when Run returns
	requests chan request
	hub      *Hub // nil: Run makes and runs its own

	mu      sync.Mutex
	paths   []string
	running bool
}

// request asks Run to watch path, or with remove to drop the watches no path needs any more.
type request struct {
	path   string
	remove bool
	done   chan error
}

// New returns a Watcher; it watches nothing until Run.
func New(cfg Config) (*Watcher, error) {
	w := &Watcher{debounce: cfg.Debounce, clock: clock.OrReal(cfg.Clock), log: cfg.Logger, ready: make(chan struct{}), stopped: make(chan struct{}), requests: make(chan request), hub: cfg.Hub}
	if w.debounce <= 0 {
		w.debounce = DefaultDebounce
	}
	if w.log == nil {
		w.log = slog.New(slog.DiscardHandler)
	}
	for _, p := range cfg.Paths {
		w.paths = append(w.paths, filepath.Clean(p))
	}
	return w, nil
}

// Ready is closed once every watch is in place: a change made after it is reported.
func (w *Watcher) Ready() <-chan struct{} { return w.ready }

// Add watches path too. When Add returns while Run runs, the watch is in place: a change made
// after it is reported. Adding a watched path again is a no-op.
func (w *Watcher) Add(ctx context.Context, path string) error {
	path = filepath.Clean(path)
	w.mu.Lock()
	if slices.Contains(w.paths, path) {
		w.mu.Unlock()
		return nil
	}
	if !w.running {
		w.paths = append(w.paths, path)
		w.mu.Unlock()
		return nil
	}
	w.mu.Unlock()
	return w.ask(ctx, request{path: path, done: make(chan error, 1)})
}

// Remove stops watching path: a change to it is no longer reported, and the watches that no other
// path needs are dropped. Removing a path not watched is a no-op.
func (w *Watcher) Remove(ctx context.Context, path string) error {
	path = filepath.Clean(path)
	w.mu.Lock()
	if !slices.Contains(w.paths, path) {
		w.mu.Unlock()
		return nil
	}
	w.paths = slices.DeleteFunc(w.paths, func(p string) bool { return p == path })
	running := w.running
	w.mu.Unlock()
	if !running {
		return nil
	}
	return w.ask(ctx, request{path: path, remove: true, done: make(chan error, 1)})
}

// ask has Run carry out req, which owns the fsnotify watcher.
func (w *Watcher) ask(ctx context.Context, req request) error {
	select {
	case w.requests <- req:
	case <-w.stopped:
		return errStopped
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-req.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Run watches until ctx ends, calling onChange (from Run's goroutine) with the watched paths
// that changed, once a burst of changes has been quiet for the debounce interval. On a shared
// Hub it waits for the Hub's Run, and ends when that does; started on a Hub whose Run has ended,
// it returns ErrHubStopped.
func (w *Watcher) Run(ctx context.Context, onChange func(changed []string)) error {
	if w.hub != nil {
		return w.run(ctx, w.hub, onChange)
	}
	// Its own hub, whose inotify instance is made on the first watch: a Watcher with nothing to
	// watch costs none.
	hub := NewHub(HubConfig{Logger: w.log})
	hubCtx, stopHub := context.WithCancel(ctx)
	hubDone := make(chan error, 1)
	go func() { hubDone <- hub.Run(hubCtx) }()
	err := w.run(ctx, hub, onChange)
	stopHub()
	if hubErr := <-hubDone; err == nil {
		err = hubErr
	}
	return err
}

func (w *Watcher) run(ctx context.Context, hub *Hub, onChange func(changed []string)) error {
	sub, err := hub.subscribe(ctx)
	if err != nil {
		close(w.stopped)
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	defer sub.close()

	w.mu.Lock()
	w.running = true
	paths := slices.Clone(w.paths)
	w.mu.Unlock()
	defer func() {
		w.mu.Lock()
		w.running = false
		w.mu.Unlock()
		close(w.stopped)
	}()
	for _, p := range paths {
		if err := w.watch(sub, p); err != nil {
			return err
		}
	}
	close(w.ready)

	var (
		timer   clock.Timer
		timerC  <-chan time.Time
		pending []string
	)
	for {
		select {
		case <-ctx.Done():
			if timer != nil {
				timer.Stop()
			}
			return nil
		case <-hub.stopped:
			// Its owner is stopping, as the Watcher's ctx will be: that is not the Watcher's
			// failure (the hub's Run says if it failed).
			if timer != nil {
				timer.Stop()
			}
			return nil
		case <-sub.wake:
			events, lost := sub.take()
			if lost {
				// Events were dropped: every path may have changed, and a directory on the way
				// to one may have appeared.
				w.mu.Lock()
				all := slices.Clone(w.paths)
				w.mu.Unlock()
				w.log.Warn("file events were lost: reporting every watched path changed", logkey.Paths, all)
				for _, path := range all {
					if err := w.watch(sub, path); err != nil {
						w.log.Warn("cannot watch", logkey.Path, path, logkey.Error, err.Error())
					}
					if !slices.Contains(pending, path) {
						pending = append(pending, path)
					}
				}
			}
			matched := lost
			for _, ev := range events {
				var ok bool
				pending, ok = w.event(sub, ev, pending)
				matched = matched || ok
			}
			if !matched {
				continue
			}
			if timer != nil {
				timer.Stop()
			}
			timer = w.clock.NewTimer(w.debounce)
			timerC = timer.C()
		case req := <-w.requests:
			if req.remove {
				w.unwatch(sub)
				req.done <- nil
				continue
			}
			err := w.watch(sub, req.path)
			if err == nil {
				w.mu.Lock()
				if !slices.Contains(w.paths, req.path) {
					w.paths = append(w.paths, req.path)
				}
				w.mu.Unlock()
			}
			req.done <- err
		case <-timerC:
			// A path removed since its change was seen is not reported: Remove promises it.
			w.mu.Lock()
			changed := slices.DeleteFunc(pending, func(p string) bool { return !slices.Contains(w.paths, p) })
			w.mu.Unlock()
			timer, timerC, pending = nil, nil, nil
			if len(changed) == 0 {
				continue
			}
			w.log.Debug("files changed", logkey.Paths, changed)
			onChange(changed)
		}
	}
}

// event adds to pending the watched paths that ev concerns, watching what it makes watchable;
// it reports whether there were any.
func (w *Watcher) event(sub *subscription, ev fsnotify.Event, pending []string) ([]string, bool) {
	name := filepath.Clean(ev.Name)
	paths := w.match(name)
	for _, path := range paths {
		switch {
		case path == name && ev.Has(fsnotify.Create):
			w.watchIfDir(sub, path) // a watched directory appeared
		case path != name && isAncestor(name, path):
			// A directory on the way to the path appeared or went away: watch the nearest one
			// that exists now.
			if err := w.watch(sub, path); err != nil {
				w.log.Warn("cannot watch", logkey.Path, path, logkey.Error, err.Error())
			}
		}
		if !slices.Contains(pending, path) {
			pending = append(pending, path)
		}
	}
	return pending, len(paths) > 0
}

// watch puts path's parent under watch, so that a path created, replaced or swapped by a symlink
// rename is seen, and a directory path itself, for the files inside it. When the parent does not
// exist, its nearest existing ancestor is watched instead, until the parent appears.
func (w *Watcher) watch(sub *subscription, path string) error {
	dir := filepath.Dir(path)
	anchor := dir
	for {
		if info, err := os.Stat(anchor); err == nil && info.IsDir() {
			break
		}
		up := filepath.Dir(anchor)
		if up == anchor {
			return fmt.Errorf("watch %s: no directory above it exists", path)
		}
		anchor = up
	}
	if err := sub.add(anchor); err != nil {
		return err
	}
	if anchor == dir {
		w.watchIfDir(sub, path)
	}
	return nil
}

// unwatch drops the watches that no watched path needs: a path's own, and those of the
// directories above it (where its nearest existing ancestor is watched).
func (w *Watcher) unwatch(sub *subscription) {
	w.mu.Lock()
	paths := slices.Clone(w.paths)
	w.mu.Unlock()
	for _, watched := range sub.watching() {
		if slices.ContainsFunc(paths, func(p string) bool { return p == watched || isAncestor(watched, p) }) {
			continue
		}
		sub.remove(watched)
	}
}

// isAncestor reports whether dir is a directory above path.
func isAncestor(dir, path string) bool {
	return strings.HasPrefix(path, strings.TrimSuffix(dir, string(filepath.Separator))+string(filepath.Separator)) && dir != path
}

func (w *Watcher) watchIfDir(sub *subscription, path string) {
	if info, err := os.Stat(path); err == nil && info.IsDir() {
		if err := sub.add(path); err != nil {
			w.log.Warn("cannot watch directory", logkey.Path, path, logkey.Error, err.Error())
		}
	}
}

// match maps an event's file name to the watched paths it concerns: the path itself, a watched
// directory it is in, or every watched file next to a Kubernetes "..data" entry.
func (w *Watcher) match(name string) []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for _, p := range w.paths {
		switch {
		case name == p, filepath.Dir(name) == p:
			out = append(out, p)
		case filepath.Dir(name) == filepath.Dir(p) && strings.HasPrefix(filepath.Base(name), ".."):
			out = append(out, p)
		case isAncestor(name, filepath.Dir(p)) || name == filepath.Dir(p):
			out = append(out, p) // a directory on the way to p appeared or went away
		}
	}
	return out
}
