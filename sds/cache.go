package sds

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
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

// secretCache is go-control-plane's cache.Cache for SDS, built for secrets made on demand and
// pushed per name (STYLE.md habit 9). It subscribes once to each name asked for and keeps what
// the secret manager last said of it. A watch answers at most once, and only with the subscribed
// names whose current version differs from what the stream was last sent (its returned
// resources), never because of the request's version_info: so a NACK gets no reply, an ACK gets
// none, and a rotation reaches only the streams subscribed to that name.
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
}

// idleRelease is how long a name no stream watches keeps its subscription: a stream has no watch
// between a response and its next request, which Envoy sends at once; a name idle longer is
// released, so that what hostile or departed clients asked for is not held for the agent's life.
const idleRelease = time.Minute

// entry is what the secret manager last said of one name, as Envoy receives it.
type entry struct {
	// The secret to send, marshaled once and shared by every stream; nil when there is none.
	resource *anypb.Any
	version  string
	notAfter time.Time // a key pair's expiry; zero for a trust bundle
	// err says why there is no secret to send; nil while none is known yet.
	err     error
	known   chan struct{} // closed once a secret or an error has come
	watches map[*watch]struct{}
	// pins counts the requests between subscribing to the name and opening their watch (or the
	// end of a fetch): a pinned name is never released.
	pins      int
	idleSince time.Time // when the last watch or pin went; zero while in use
}

// watch is one open SotW or delta watch.
type watch struct {
	names    []string
	known    map[string]string // name → version the stream was last sent
	sotwReq  *discovery.DiscoveryRequest
	sotwCh   chan cache.Response
	deltaReq *discovery.DeltaDiscoveryRequest
	deltaCh  chan cache.DeltaResponse
	done     bool // answered or cancelled: it never sends again
}

var _ cache.Cache = (*secretCache)(nil)

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
	if e.pins == 0 && len(e.watches) == 0 && e.idleSince.IsZero() {
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
		if e.pins > 0 || len(e.watches) > 0 || e.idleSince.IsZero() || now.Sub(e.idleSince) < idleRelease {
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
	cancels := slices.Collect(maps.Values(c.cancels))
	clear(c.cancels)
	c.mu.Unlock()
	for _, cancel := range cancels {
		cancel()
	}
}

// subscribeAll subscribes to each name and returns them sorted, without the wildcard (SDS serves
// named secrets only).
// Each name is pinned until the caller unpins it.
func (c *secretCache) subscribeAll(subscribed map[string]struct{}) ([]string, error) {
	names := make([]string, 0, len(subscribed))
	for name := range subscribed {
		if name == "*" {
			continue
		}
		if err := c.subscribe(name); err != nil {
			c.unpin(names)
			return nil, refusalStatus(name, err)
		}
		names = append(names, name)
	}
	sort.Strings(names)
	return names, nil
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

// CreateWatch implements cache.ConfigWatcher for state-of-the-world streams.
func (c *secretCache) CreateWatch(req *cache.Request, sub cache.Subscription, ch chan cache.Response) (func(), error) {
	names, err := c.subscribeAll(sub.SubscribedResources())
	if err != nil {
		return nil, err
	}
	defer c.unpin(names)
	return c.open(&watch{names: names, known: maps.Clone(sub.ReturnedResources()), sotwReq: req, sotwCh: ch}), nil
}

// CreateDeltaWatch implements cache.ConfigWatcher for delta streams.
func (c *secretCache) CreateDeltaWatch(req *cache.DeltaRequest, sub cache.Subscription, ch chan cache.DeltaResponse) (func(), error) {
	names, err := c.subscribeAll(sub.SubscribedResources())
	if err != nil {
		return nil, err
	}
	defer c.unpin(names)
	return c.open(&watch{names: names, known: maps.Clone(sub.ReturnedResources()), deltaReq: req, deltaCh: ch}), nil
}

// Fetch implements cache.ConfigFetcher: it answers with each requested secret as soon as the
// secret manager has said what it has, or with Unavailable and the reason when it has none.
func (c *secretCache) Fetch(ctx context.Context, req *cache.Request) (cache.Response, error) {
	subscribed := map[string]struct{}{}
	for _, n := range req.GetResourceNames() {
		subscribed[n] = struct{}{}
	}
	names, err := c.subscribeAll(subscribed)
	if err != nil {
		return nil, err
	}
	defer c.unpin(names)
	var resources []*anypb.Any
	versions := map[string]string{}
	for _, name := range names {
		c.mu.Lock()
		e := c.entryLocked(name)
		c.mu.Unlock()
		select {
		case <-e.known:
		case <-ctx.Done():
			return nil, status.Errorf(codes.DeadlineExceeded, "secret %q: nothing known of it yet", name)
		}
		c.mu.Lock()
		resource, version, notAfter, why := e.resource, e.version, e.notAfter, e.err
		c.mu.Unlock()
		if resource == nil || (!notAfter.IsZero() && !c.clock.Now().Before(notAfter)) {
			if why == nil {
				why = secretmanager.ErrExpired
			}
			return nil, status.Errorf(codes.Unavailable, "secret %q: %s", name, why.Error())
		}
		resources = append(resources, resource)
		versions[name] = version
	}
	return &cache.PassthroughResponse{
		Request:           req,
		DiscoveryResponse: &discovery.DiscoveryResponse{VersionInfo: versionInfo(versions), Resources: resources, TypeUrl: SecretTypeURL},
		ReturnedResources: versions,
	}, nil
}

func (c *secretCache) entryLocked(name string) *entry {
	e := c.entries[name]
	if e == nil {
		e = &entry{known: make(chan struct{}), watches: map[*watch]struct{}{}}
		c.entries[name] = e
	}
	return e
}

// update takes what the secret manager says of name and answers every open watch it concerns.
func (c *secretCache) update(name string, s *secretmanager.Secret, why error) {
	var (
		resource *anypb.Any
		notAfter time.Time
	)
	if s != nil {
		var err error
		if resource, notAfter, err = toResource(s, c.clock.Now()); err != nil {
			// Nothing invalid is ever sent: the streams keep what they have.
			c.log.Error("not sending an invalid secret", logkey.Secret, name, logkey.Version, s.Version, logkey.Error, err.Error())
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
		e.resource, e.version, e.notAfter, e.err = nil, "", time.Time{}, why
		return
	}
	if e.resource != nil && e.version == s.Version {
		return
	}
	e.resource, e.version, e.notAfter, e.err = resource, s.Version, notAfter, nil
	for w := range e.watches {
		c.answerLocked(w)
	}
}

// open answers w at once if it can, or indexes it under its names until a secret it waits for
// comes. CreateWatch runs on the stream's goroutine, so it never waits.
func (c *secretCache) open(w *watch) (cancel func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.answerLocked(w) {
		return func() {}
	}
	for _, name := range w.names {
		e := c.entryLocked(name)
		e.watches[w] = struct{}{}
		e.idleSince = time.Time{}
	}
	return func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.closeLocked(w)
	}
}

// answerLocked sends w the subscribed secrets whose version differs from what its stream knows,
// if there are any; it reports whether it did.
func (c *secretCache) answerLocked(w *watch) bool {
	if w.done {
		return false
	}
	var changed []string
	now := c.clock.Now()
	for _, name := range w.names {
		// A key pair that expired in the cache is not sent to a stream that does not have it.
		if e := c.entries[name]; e != nil && e.resource != nil && w.known[name] != e.version && (e.notAfter.IsZero() || now.Before(e.notAfter)) {
			changed = append(changed, name)
		}
	}
	if len(changed) == 0 {
		return false
	}
	// What the stream will know after this response: only what it still subscribes to.
	returned := make(map[string]string, len(w.names))
	for _, name := range w.names {
		if v, ok := w.known[name]; ok {
			returned[name] = v
		}
	}
	sent := make(map[string]string, len(changed))
	for _, name := range changed {
		returned[name] = c.entries[name].version
		sent[name] = c.entries[name].version
	}
	// One response per stream: the server writes the stream's nonce into it.
	if w.sotwCh != nil {
		resources := make([]*anypb.Any, 0, len(changed))
		for _, name := range changed {
			resources = append(resources, c.entries[name].resource)
		}
		w.sotwCh <- &cache.PassthroughResponse{ // buffered for this one response
			Request:           w.sotwReq,
			DiscoveryResponse: &discovery.DiscoveryResponse{VersionInfo: versionInfo(sent), Resources: resources, TypeUrl: SecretTypeURL},
			ReturnedResources: returned,
		}
	} else {
		resources := make([]*discovery.Resource, 0, len(changed))
		for _, name := range changed {
			resources = append(resources, &discovery.Resource{Name: name, Version: sent[name], Resource: c.entries[name].resource})
		}
		w.deltaCh <- &cache.DeltaPassthroughResponse{ // the server buffers one per type
			DeltaRequest:           w.deltaReq,
			NextVersionMap:         returned,
			DeltaDiscoveryResponse: &discovery.DeltaDiscoveryResponse{SystemVersionInfo: versionInfo(sent), Resources: resources, TypeUrl: SecretTypeURL},
		}
	}
	c.closeLocked(w)
	return true
}

// closeLocked marks w done and drops it from the index; calling it again is harmless.
func (c *secretCache) closeLocked(w *watch) {
	if w.done {
		return
	}
	w.done = true
	now := c.clock.Now()
	for _, name := range w.names {
		if e := c.entries[name]; e != nil {
			delete(e.watches, w)
			e.markIdle(now)
		}
	}
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
