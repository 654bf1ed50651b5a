package sds

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/secretmanager"
)

// Secrets is what the SDS server needs of the secret manager: one subscription per name, told of
// the name's state now and at every change after.
type Secrets interface {
	// Subscribe calls fn with the named secret's state, at once if it is known and at every
	// change after: the secret to serve, or nil and why there is none. It refuses a name it cannot
	// serve (secretmanager.ErrUnknownSecret, ErrForbiddenPath, ErrTooManyFiles).
	Subscribe(name string, fn func(*secretmanager.Secret, error)) (cancel func(), err error)
}

// secretCache follows the secrets the streams ask for (STYLE.md habit 9): it subscribes once to
// each name and keeps what the secret manager last said of it, marshaled once for every stream.
// A change of a name's version notifies the streams subscribed to it, and only them; a stream
// sends what its client does not have yet, never because of the request's version_info: so a
// NACK gets no reply, an ACK gets none, and a rotation reaches only the streams that asked for it.
type secretCache struct {
	secrets Secrets
	clock   clock.Clock
	log     *slog.Logger

	// subscribeMu makes first uses of names subscribe one at a time; taken before mu, never
	// inside it.
	subscribeMu sync.Mutex

	mu      sync.Mutex
	entries map[string]*entry
	cancels map[string]func() // the subscription of each name, ended by close or release
	// subscribing is the name being subscribed to, whose first state comes before its cancel.
	subscribing string
	closed      bool
	// stopping is closed, read without the lock.
	stopping atomic.Bool
}

// idleRelease is how long a name no stream subscribes to keeps its subscription, so that what
// hostile or departed clients asked for is not held for the agent's life.
const idleRelease = time.Minute

// entry is what the secret manager last said of one name, as Envoy receives it.
type entry struct {
	// served is the secret to send, nil when there is none. It is read without the cache's lock,
	// so that a rotation's thousands of streams do not queue on it.
	served atomic.Pointer[servedSecret]
	// err says why there is no secret to send; nil while none is known yet.
	err      error
	known    chan struct{} // closed once a secret or an error has come
	watchers map[*watcher]struct{}
	// pins counts the requests between subscribing to the name and indexing their stream under
	// it (or the end of a fetch): a pinned name is never released.
	pins      int
	idleSince time.Time // when the last watcher or pin went; zero while in use
}

// servedSecret is a secret as every stream is sent it, marshaled once, and its responses' bodies
// encoded once (encoded.go).
type servedSecret struct {
	resource *anypb.Any
	version  string
	notAfter time.Time // a key pair's expiry; zero for a trust bundle
	bodies
}

// validAt reports whether a stream that does not have it may be sent it: an expired key pair is
// not.
func (s *servedSecret) validAt(now time.Time) bool {
	return s.notAfter.IsZero() || now.Before(s.notAfter)
}

// unresolved is fetch's error for a name its caller was given no key for.
type unresolved struct{ error }

func (u unresolved) Unwrap() error { return u.error }

// errClosed answers a request that comes while the server stops.
var errClosed = status.Error(codes.Unavailable, "the SDS server is stopping")

func newSecretCache(secrets Secrets, clk clock.Clock, log *slog.Logger) *secretCache {
	return &secretCache{
		secrets: secrets,
		clock:   clk,
		log:     log,
		entries: map[string]*entry{},
		cancels: map[string]func(){},
	}
}

// subscribe makes sure the cache follows name, subscribing on its first use, and pins it until
// unpin; it returns the secret manager's refusal. The manager tells the current state through
// update before Subscribe returns, so c.mu is not held across the call; subscribeMu is, so that
// two first uses at once make one subscription: the second waits and finds it made.
func (c *secretCache) subscribe(name string) error {
	if done, err := c.pinIfSubscribed(name); done {
		return err
	}
	c.subscribeMu.Lock()
	defer c.subscribeMu.Unlock()
	if done, err := c.pinIfSubscribed(name); done {
		return err
	}
	c.releaseIdle()
	c.mu.Lock()
	c.subscribing = name
	c.mu.Unlock()
	cancel, err := c.secrets.Subscribe(name, func(s *secretmanager.Secret, err error) { c.update(name, s, err) })
	c.mu.Lock()
	c.subscribing = "" // and followed from now on, in the same breath: no call falls between
	closed := c.closed
	if err == nil && !closed {
		c.cancels[name] = cancel
		c.entryLocked(name).pins++
	}
	c.mu.Unlock()
	if err != nil {
		return err
	}
	if closed {
		cancel()
		return errClosed
	}
	return nil
}

// pinIfSubscribed reports whether subscribe has nothing more to do for name: it is followed
// already (and is now pinned), or the cache is closed (errClosed).
func (c *secretCache) pinIfSubscribed(name string) (bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return true, errClosed
	}
	if _, ok := c.cancels[name]; !ok {
		return false, nil
	}
	c.entryLocked(name).pins++
	return true, nil
}

// unpin ends the pins subscribe took on names.
func (c *secretCache) unpin(names []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.clock.Now()
	for _, name := range names {
		if e := c.entries[name]; e != nil && e.pins > 0 {
			e.pins--
			e.markIdle(now)
		}
	}
}

func (e *entry) markIdle(now time.Time) {
	if e.pins == 0 && len(e.watchers) == 0 && e.idleSince.IsZero() {
		e.idleSince = now
	}
}

// releaseIdle ends the subscriptions of the names no stream has watched for idleRelease. It runs
// before each new subscription, under subscribeMu, so that the names held stay those in use.
func (c *secretCache) releaseIdle() {
	c.mu.Lock()
	now := c.clock.Now()
	var released []func()
	for name, e := range c.entries {
		if e.pins > 0 || len(e.watchers) > 0 || e.idleSince.IsZero() || now.Sub(e.idleSince) < idleRelease {
			continue
		}
		if cancel, ok := c.cancels[name]; ok {
			released = append(released, cancel)
			delete(c.cancels, name)
		}
		delete(c.entries, name)
		c.log.Debug("released a secret no stream watches", logkey.Secret, logkey.Untrusted(name))
	}
	c.mu.Unlock()
	for _, cancel := range released {
		cancel()
	}
}

// close ends every subscription; later requests are refused.
func (c *secretCache) close() {
	c.mu.Lock()
	c.closed = true
	c.stopping.Store(true)
	cancels := slices.Collect(maps.Values(c.cancels))
	clear(c.cancels)
	c.mu.Unlock()
	for _, cancel := range cancels {
		cancel()
	}
}

// refusalStatus maps the secret manager's refusal of a name to the status Envoy gets.
func refusalStatus(name string, err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Errorf(refusalCode(err), "secret %q: %s", name, err.Error())
}

func refusalCode(err error) codes.Code {
	switch {
	case errors.Is(err, secretmanager.ErrForbiddenPath):
		return codes.PermissionDenied
	case errors.Is(err, secretmanager.ErrTooManyFiles):
		return codes.ResourceExhausted
	case errors.Is(err, secretmanager.ErrUnknownSecret):
		return codes.InvalidArgument
	default:
		return status.Code(err)
	}
}

func (c *secretCache) entryLocked(name string) *entry {
	e := c.entries[name]
	if e == nil {
		e = &entry{known: make(chan struct{}), watchers: map[*watcher]struct{}{}}
		c.entries[name] = e
	}
	return e
}

// update takes what the secret manager says of name and notifies the streams subscribed to it.
func (c *secretCache) update(name string, s *secretmanager.Secret, why error) {
	var (
		resource *anypb.Any
		notAfter time.Time
		sotw     []byte
	)
	if s != nil {
		var err error
		resource, notAfter, err = toResource(s, c.clock.Now())
		if err == nil {
			sotw, err = encodeSotW(resource, s.Version)
		}
		if err != nil {
			// Nothing invalid is ever sent: the streams keep what they have.
			c.log.Error("not sending an invalid secret", logkey.Secret, logkey.Untrusted(name), logkey.Version, s.Version, logkey.Error, err.Error())
			s, why = nil, fmt.Errorf("the secret manager gave an unusable secret: %w", err)
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, followed := c.cancels[name]; !followed && c.subscribing != name {
		return // a late call for a released name
	}
	e := c.entryLocked(name)
	select {
	case <-e.known:
	default:
		close(e.known)
	}
	if s == nil {
		// Streams that have a secret keep it; new ones wait for the next.
		e.served.Store(nil)
		e.err = why
		return
	}
	if cur := e.served.Load(); cur != nil && cur.version == s.Version {
		return
	}
	e.served.Store(&servedSecret{resource: resource, version: s.Version, notAfter: notAfter, bodies: bodies{sotw: sotw}})
	e.err = nil
	for w := range e.watchers {
		w.notify()
	}
}

// watch indexes w under names, and under no other: a change of one of them notifies it. It
// returns the names' entries, which stay while w is indexed under them.
func (c *secretCache) watch(w *watcher, names []string) []*entry {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.clock.Now()
	for _, name := range w.indexed {
		if e := c.entries[name]; e != nil && !slices.Contains(names, name) {
			delete(e.watchers, w)
			e.markIdle(now)
		}
	}
	entries := make([]*entry, len(names))
	for i, name := range names {
		e := c.entryLocked(name)
		e.watchers[w] = struct{}{}
		e.idleSince = time.Time{}
		entries[i] = e
	}
	w.indexed = slices.Clone(names)
	return entries
}

// unwatch takes w out of the index: its stream has ended.
func (c *secretCache) unwatch(w *watcher) {
	c.watch(w, nil)
}

// subscriptions counts the streams subscribed to each name.
func (c *secretCache) subscriptions() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	counts := map[string]int{}
	for name, e := range c.entries {
		if n := len(e.watchers); n > 0 {
			counts[name] = n
		}
	}
	return counts
}

// fetch answers with each named secret as soon as the secret manager has said what it has, or
// with Unavailable and the reason when it has none. A name the manager refuses is returned with
// its refusal.
//
// resolve gives each name's key; a name it refuses is returned with an unresolved error.
func (c *secretCache) fetch(ctx context.Context, requested []string, resolve func(string) (string, error)) (resp *discovery.DiscoveryResponse, refused string, err error) {
	var names, keys []string
	defer func() { c.unpin(keys) }()
	for _, name := range requested {
		if name == "*" || slices.Contains(names, name) {
			continue
		}
		key, err := resolve(name)
		if err != nil {
			return nil, name, unresolved{err}
		}
		if err := c.subscribe(key); err != nil {
			return nil, name, err
		}
		names = append(names, name)
		keys = append(keys, key)
	}
	order := make([]int, len(names))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return strings.Compare(names[a], names[b]) })
	resources := make([]*anypb.Any, 0, len(names))
	versions := make(map[string]string, len(names))
	for _, i := range order {
		name := names[i]
		c.mu.Lock()
		e := c.entryLocked(keys[i])
		c.mu.Unlock()
		select {
		case <-e.known:
		case <-ctx.Done():
			return nil, "", status.Errorf(status.FromContextError(ctx.Err()).Code(), "secret %q: nothing known of it yet", name)
		}
		c.mu.Lock()
		served, why := e.served.Load(), e.err
		c.mu.Unlock()
		if served == nil || !served.validAt(c.clock.Now()) {
			if why == nil {
				why = secretmanager.ErrExpired
			}
			return nil, "", status.Errorf(codes.Unavailable, "secret %q: %s", name, why.Error())
		}
		resources = append(resources, served.resource)
		versions[name] = served.version
	}
	return &discovery.DiscoveryResponse{VersionInfo: versionInfo(versions), Resources: resources, TypeUrl: SecretTypeURL}, "", nil
}

// versionInfo names a response's content: the version of its one secret, or name=version pairs.
func versionInfo(versions map[string]string) string {
	if len(versions) == 1 {
		for _, v := range versions {
			return v
		}
	}
	parts := make([]string, 0, len(versions))
	for _, name := range slices.Sorted(maps.Keys(versions)) {
		parts = append(parts, fmt.Sprintf("%s=%s", name, versions[name]))
	}
	return strings.Join(parts, ",")
}
