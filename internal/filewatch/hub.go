package filewatch

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"sync"

	"github.com/fsnotify/fsnotify"

	"github.com/meshid/meshid/internal/logkey"
)

// ErrHubStopped is what a Hub, and the Watchers on it, answer once its Run has ended.
var ErrHubStopped = errors.New("the shared file watcher has stopped")

// maxQueued bounds the events a Hub holds for one Watcher that has not taken them yet; past it
// the Watcher is told it missed some, and reports all its paths changed, as a kernel queue
// overflow would make it.
const maxQueued = 4096

// HubConfig configures a Hub.
type HubConfig struct {
	Logger *slog.Logger
}

// Hub is one inotify instance shared by many Watchers (Config.Hub): the kernel allows a user
// few (fs.inotify.max_user_instances, 128 by default), and a node agent runs a secret manager
// per identity. Each Watcher keeps its own paths, debounce and onChange; a directory is watched
// once, for as long as any Watcher needs it, and its events go to the Watchers that watch it.
// The inotify instance is made on the first watch, so a Hub nobody asks to watch costs none.
type Hub struct {
	log     *slog.Logger
	started chan struct{} // closed when Run starts
	stopped chan struct{} // closed when Run ends

	mu   sync.Mutex
	fw   *fsnotify.Watcher     // nil until the first watch
	made chan struct{}         // closed when fw is made
	dirs map[string]*dirWatch  // the directories watched, and by whom
	subs map[*subscription]any // every Watcher on the hub
	ran  bool
	done bool
}

// dirWatch is one directory under watch and the subscriptions that need it.
type dirWatch struct {
	subs map[*subscription]struct{}
}

// NewHub returns a Hub; Watchers on it work once its Run runs.
func NewHub(cfg HubConfig) *Hub {
	h := &Hub{log: cfg.Logger, started: make(chan struct{}), stopped: make(chan struct{}), made: make(chan struct{}),
		dirs: map[string]*dirWatch{}, subs: map[*subscription]any{}}
	if h.log == nil {
		h.log = slog.New(slog.DiscardHandler)
	}
	return h
}

// Run routes the events of the watched directories to the Watchers that watch them until ctx
// ends; then the Watchers on it end with ErrHubStopped. It runs once.
func (h *Hub) Run(ctx context.Context) error {
	h.mu.Lock()
	if h.ran {
		h.mu.Unlock()
		return errors.New("a file watcher hub runs once")
	}
	h.ran = true
	h.mu.Unlock()
	close(h.started)
	defer func() {
		h.mu.Lock()
		h.done = true
		if h.fw != nil {
			_ = h.fw.Close()
		}
		h.mu.Unlock()
		close(h.stopped)
	}()
	select {
	case <-ctx.Done():
		return nil
	case <-h.made:
	}
	h.mu.Lock()
	fw := h.fw
	h.mu.Unlock()
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-fw.Events:
			if !ok {
				return errors.New("file watcher closed")
			}
			h.route(ev)
		case err, ok := <-fw.Errors:
			if !ok {
				return errors.New("file watcher closed")
			}
			if errors.Is(err, fsnotify.ErrEventOverflow) {
				h.overflow()
			}
			h.log.Warn("file watch error", logkey.Error, err.Error())
		}
	}
}

// route gives ev to the subscriptions watching its directory, or the directory it names.
func (h *Hub) route(ev fsnotify.Event) {
	name := filepath.Clean(ev.Name)
	h.mu.Lock()
	var to []*subscription
	for _, dir := range []string{filepath.Dir(name), name} {
		if d := h.dirs[dir]; d != nil {
			for s := range d.subs {
				if !slices.Contains(to, s) {
					to = append(to, s)
				}
			}
		}
	}
	h.mu.Unlock()
	for _, s := range to {
		s.push(ev)
	}
}

// overflow tells every subscription it may have missed events: the kernel dropped some.
func (h *Hub) overflow() {
	h.mu.Lock()
	subs := make([]*subscription, 0, len(h.subs))
	for s := range h.subs {
		subs = append(subs, s)
	}
	h.mu.Unlock()
	for _, s := range subs {
		s.lost()
	}
}

// subscribe returns a new Watcher's view of the hub, once Run has started.
func (h *Hub) subscribe(ctx context.Context) (*subscription, error) {
	select {
	case <-h.started:
	case <-h.stopped:
		return nil, ErrHubStopped
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.done {
		return nil, ErrHubStopped
	}
	s := &subscription{hub: h, wake: make(chan struct{}, 1), dirs: map[string]bool{}}
	h.subs[s] = nil
	return s, nil
}

// subscription is one Watcher on a hub: the directories it watches, and the events of those
// that it has not taken yet. The hub never waits for a Watcher: one busy in its onChange must
// not hold up the others' events, so they queue here (bounded by maxQueued).
type subscription struct {
	hub  *Hub
	wake chan struct{}   // buffered: events are queued
	dirs map[string]bool // guarded by hub.mu

	mu       sync.Mutex
	queue    []fsnotify.Event
	overflow bool
}

func (s *subscription) push(ev fsnotify.Event) {
	s.mu.Lock()
	if len(s.queue) < maxQueued {
		s.queue = append(s.queue, ev)
	} else {
		s.overflow = true
	}
	s.mu.Unlock()
	s.poke()
}

func (s *subscription) lost() {
	s.mu.Lock()
	s.overflow = true
	s.mu.Unlock()
	s.poke()
}

func (s *subscription) poke() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// take returns the events queued, and whether some were lost.
func (s *subscription) take() ([]fsnotify.Event, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	evs, lost := s.queue, s.overflow
	s.queue, s.overflow = nil, false
	return evs, lost
}

// add watches dir for s, the inotify instance made on the first watch. A directory the kernel
// stopped watching (removed, then made again) is watched anew.
func (s *subscription) add(dir string) error {
	h := s.hub
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.done {
		return ErrHubStopped
	}
	if h.fw == nil {
		fw, err := fsnotify.NewWatcher()
		if err != nil {
			return fmt.Errorf("start file watcher: %w", err)
		}
		h.fw = fw
		close(h.made)
	}
	d := h.dirs[dir]
	if d == nil || !slices.Contains(h.fw.WatchList(), dir) {
		if err := h.fw.Add(dir); err != nil {
			return fmt.Errorf("watch %s: %w", dir, err)
		}
	}
	if d == nil {
		d = &dirWatch{subs: map[*subscription]struct{}{}}
		h.dirs[dir] = d
	}
	d.subs[s] = struct{}{}
	s.dirs[dir] = true
	return nil
}

// remove stops watching dir for s; the directory stays watched while another Watcher needs it.
func (s *subscription) remove(dir string) {
	h := s.hub
	h.mu.Lock()
	defer h.mu.Unlock()
	s.removeLocked(dir)
}

func (s *subscription) removeLocked(dir string) {
	h := s.hub
	delete(s.dirs, dir)
	d := h.dirs[dir]
	if d == nil {
		return
	}
	delete(d.subs, s)
	if len(d.subs) > 0 {
		return
	}
	delete(h.dirs, dir)
	if h.fw != nil && !h.done {
		// Fails only for a watch the kernel has dropped already, with its directory.
		_ = h.fw.Remove(dir)
	}
}

// watching returns the directories s watches.
func (s *subscription) watching() []string {
	s.hub.mu.Lock()
	defer s.hub.mu.Unlock()
	out := make([]string, 0, len(s.dirs))
	for dir := range s.dirs {
		out = append(out, dir)
	}
	return out
}

// close drops s's watches that no other Watcher needs, and s from the hub.
func (s *subscription) close() {
	h := s.hub
	h.mu.Lock()
	defer h.mu.Unlock()
	for dir := range s.dirs {
		s.removeLocked(dir)
	}
	delete(h.subs, s)
}
