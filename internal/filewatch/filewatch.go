// Package filewatch tells when files or directories change on disk, including Kubernetes'
// atomic "..data" symlink swaps of mounted secrets and config maps, and paths that do not exist
// yet. Bursts of events are debounced into one notification on an injected clock.
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
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/meshid/meshid/internal/clock"
)

// DefaultDebounce is how long a path must stay quiet before a change is reported.
const DefaultDebounce = 100 * time.Millisecond

// Config configures a Watcher.
type Config struct {
	// Paths are the files and directories to watch. Their parent directories must exist.
	Paths    []string
	Debounce time.Duration
	Clock    clock.Clock
	Logger   *slog.Logger
}

// Watcher reports changes to a set of paths.
type Watcher struct {
	paths    []string
	debounce time.Duration
	clock    clock.Clock
	log      *slog.Logger
	ready    chan struct{}
}

// New returns a Watcher; it watches nothing until Run.
func New(cfg Config) (*Watcher, error) {
	if len(cfg.Paths) == 0 {
		return nil, errors.New("filewatch: no paths")
	}
	w := &Watcher{debounce: cfg.Debounce, clock: clock.OrReal(cfg.Clock), log: cfg.Logger, ready: make(chan struct{})}
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

// Run watches until ctx ends, calling onChange (from Run's goroutine) with the watched paths
// that changed, once a burst of changes has been quiet for the debounce interval.
func (w *Watcher) Run(ctx context.Context, onChange func(changed []string)) error {
	fw, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("start file watcher: %w", err)
	}
	defer func() { _ = fw.Close() }()

	// Each path's parent is watched, so that a path created, replaced or swapped by a symlink
	// rename is seen; a directory path is watched itself too, for the files inside it.
	for _, dir := range w.parents() {
		if err := fw.Add(dir); err != nil {
			return fmt.Errorf("watch %s: %w", dir, err)
		}
	}
	for _, p := range w.paths {
		w.watchIfDir(fw, p)
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
		case ev, ok := <-fw.Events:
			if !ok {
				return errors.New("file watcher closed")
			}
			name := filepath.Clean(ev.Name)
			path, relevant := w.match(name)
			if !relevant {
				continue
			}
			if path == name && ev.Has(fsnotify.Create) {
				w.watchIfDir(fw, path) // a watched directory appeared
			}
			if !slices.Contains(pending, path) {
				pending = append(pending, path)
			}
			if timer != nil {
				timer.Stop()
			}
			timer = w.clock.NewTimer(w.debounce)
			timerC = timer.C()
		case err, ok := <-fw.Errors:
			if !ok {
				return errors.New("file watcher closed")
			}
			w.log.Warn("file watch error", "error", err.Error())
		case <-timerC:
			changed := pending
			timer, timerC, pending = nil, nil, nil
			w.log.Debug("files changed", "paths", changed)
			onChange(changed)
		}
	}
}

func (w *Watcher) parents() []string {
	var dirs []string
	for _, p := range w.paths {
		if d := filepath.Dir(p); !slices.Contains(dirs, d) {
			dirs = append(dirs, d)
		}
	}
	return dirs
}

func (w *Watcher) watchIfDir(fw *fsnotify.Watcher, path string) {
	if info, err := os.Stat(path); err == nil && info.IsDir() {
		if err := fw.Add(path); err != nil {
			w.log.Warn("cannot watch directory", "path", path, "error", err.Error())
		}
	}
}

// match maps an event's file name to the watched path it concerns: the path itself, a file
// inside a watched directory, or a Kubernetes "..data" entry next to a watched file.
func (w *Watcher) match(name string) (string, bool) {
	for _, p := range w.paths {
		if name == p || filepath.Dir(name) == p {
			return p, true
		}
		if filepath.Dir(name) == filepath.Dir(p) && strings.HasPrefix(filepath.Base(name), "..") {
			return p, true
		}
	}
	return "", false
}
