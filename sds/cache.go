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

	"github.com/meshid/meshid/internal/logkey"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/secretmanager"
)

// Secrets is what the SDS server needs of the secret manager.
type Secrets interface {
	// GenerateSecret returns the named secret, waiting until one is available or ctx ends.
	GenerateSecret(ctx context.Context, name string) (*secretmanager.Secret, error)
	// Subscribe registers fn to be told of every new secret.
	Subscribe(fn func(*secretmanager.Secret)) (unsubscribe func())
	// CheckName reports whether a name can be served (ErrUnknownSecret, ErrForbiddenPath).
	CheckName(name string) error
}

// secretCache is go-control-plane's cache.Cache for SDS, built for secrets made on demand and
// pushed per name (STYLE.md habit 9). A watch answers at most once, and only with the subscribed
// names whose current version differs from what the stream was last sent (its returned
// resources), never because of the request's version_info: so a NACK gets no reply, an ACK gets
// none, and a rotation reaches only the streams subscribed to that name.
type secretCache struct {
	secrets Secrets
	clock   clock.Clock
	log     *slog.Logger
	ctx     context.Context // bounds the generation of secrets; set by start

	mu       sync.Mutex
	entries  map[string]*entry
	pending  map[string]bool // generation in flight
	watchers map[string]map[*watch]struct{}
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

func newSecretCache(secrets Secrets, clk clock.Clock, log *slog.Logger) *secretCache {
	return &secretCache{
		secrets:  secrets,
		clock:    clk,
		log:      log,
		ctx:      context.Background(),
		entries:  map[string]*entry{},
		pending:  map[string]bool{},
		watchers: map[string]map[*watch]struct{}{},
	}
}

// start ties the generation of secrets to ctx and follows the secret manager's updates.
func (c *secretCache) start(ctx context.Context) (stop func()) {
	c.mu.Lock()
	c.ctx = ctx
	c.mu.Unlock()
	return c.secrets.Subscribe(c.update)
}

// CreateWatch implements cache.ConfigWatcher for state-of-the-world streams.
func (c *secretCache) CreateWatch(req *cache.Request, sub cache.Subscription, ch chan cache.Response) (func(), error) {
	names, err := c.checkNames(sub.SubscribedResources())
	if err != nil {
		return nil, err
	}
	return c.open(&watch{names: names, known: maps.Clone(sub.ReturnedResources()), sotwReq: req, sotwCh: ch}), nil
}

// CreateDeltaWatch implements cache.ConfigWatcher for delta streams.
func (c *secretCache) CreateDeltaWatch(req *cache.DeltaRequest, sub cache.Subscription, ch chan cache.DeltaResponse) (func(), error) {
	names, err := c.checkNames(sub.SubscribedResources())
	if err != nil {
		return nil, err
	}
	return c.open(&watch{names: names, known: maps.Clone(sub.ReturnedResources()), deltaReq: req, deltaCh: ch}), nil
}

// Fetch implements cache.ConfigFetcher: it waits for each requested secret (until ctx ends).
func (c *secretCache) Fetch(ctx context.Context, req *cache.Request) (cache.Response, error) {
	subscribed := map[string]struct{}{}
	for _, n := range req.GetResourceNames() {
		subscribed[n] = struct{}{}
	}
	names, err := c.checkNames(subscribed)
	if err != nil {
		return nil, err
	}
	var resources []*anypb.Any
	versions := map[string]string{}
	for _, name := range names {
		s, err := c.secrets.GenerateSecret(ctx, name)
		if err != nil {
			return nil, status.Errorf(codes.Unavailable, "secret %s: %s", name, err.Error())
		}
		e, err := toEntry(s, c.clock.Now())
		if err != nil {
			return nil, status.Errorf(codes.Unavailable, "secret %s is not usable: %s", name, err.Error())
		}
		resources = append(resources, e.resource)
		versions[name] = e.version
	}
	return &cache.PassthroughResponse{
		Request:           req,
		DiscoveryResponse: &discovery.DiscoveryResponse{VersionInfo: versionInfo(versions), Resources: resources, TypeUrl: SecretTypeURL},
		ReturnedResources: versions,
	}, nil
}

// checkNames returns the subscribed names, sorted, refusing an unknown name with InvalidArgument
// and a file outside the allowed directories with PermissionDenied.
func (c *secretCache) checkNames(subscribed map[string]struct{}) ([]string, error) {
	names := make([]string, 0, len(subscribed))
	for name := range subscribed {
		if name == "*" { // wildcard: SDS serves named secrets only
			continue
		}
		if err := c.secrets.CheckName(name); err != nil {
			code := codes.InvalidArgument
			switch {
			case errors.Is(err, secretmanager.ErrForbiddenPath):
				code = codes.PermissionDenied
			case errors.Is(err, secretmanager.ErrTooManyFiles):
				code = codes.ResourceExhausted
			}
			return nil, status.Errorf(code, "secret %q: %s", name, err.Error())
		}
		names = append(names, name)
	}
	sort.Strings(names)
	return names, nil
}

// open answers w at once if it can, or indexes it under its names and starts generating the
// secrets that do not exist yet. CreateWatch runs on the stream's goroutine, so it never waits.
func (c *secretCache) open(w *watch) (cancel func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.answerLocked(w) {
		return func() {}
	}
	for _, name := range w.names {
		if c.watchers[name] == nil {
			c.watchers[name] = map[*watch]struct{}{}
		}
		c.watchers[name][w] = struct{}{}
		if c.entries[name] == nil && !c.pending[name] {
			c.pending[name] = true
			go c.generate(c.ctx, name)
		}
	}
	return func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.closeLocked(w)
	}
}

func (c *secretCache) generate(ctx context.Context, name string) {
	s, err := c.secrets.GenerateSecret(ctx, name)
	c.mu.Lock()
	delete(c.pending, name)
	c.mu.Unlock()
	if err != nil {
		if ctx.Err() == nil {
			c.log.Warn("cannot generate secret", logkey.Secret, name, logkey.Error, err.Error())
		}
		return
	}
	c.install(s, true)
}

// update takes a new secret and answers every open watch subscribed to it.
func (c *secretCache) update(s *secretmanager.Secret) { c.install(s, false) }

// install caches s and answers the watches subscribed to it. A generated secret (generated) is
// taken only if no secret of that name came meanwhile: one that came through Subscribe while
// GenerateSecret returned is at least as new.
func (c *secretCache) install(s *secretmanager.Secret, generated bool) {
	e, err := toEntry(s, c.clock.Now())
	if err != nil {
		c.log.Error("not sending an invalid secret; the previous one stays", logkey.Secret, s.Name, logkey.Version, s.Version, logkey.Error, err.Error())
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	old := c.entries[s.Name]
	if generated && old != nil {
		c.log.Debug("generated secret superseded by a newer one", logkey.Secret, s.Name, logkey.Version, s.Version, logkey.Current, old.version)
		return
	}
	if old != nil && old.version == e.version {
		return
	}
	c.entries[s.Name] = e
	for w := range c.watchers[s.Name] {
		c.answerLocked(w)
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
		// A key pair that expired in the cache (its renewal failed) is not sent to a stream
		// that does not have it: it waits for the next one.
		if e := c.entries[name]; e != nil && w.known[name] != e.version && (e.notAfter.IsZero() || now.Before(e.notAfter)) {
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
	for _, name := range w.names {
		delete(c.watchers[name], w)
		if len(c.watchers[name]) == 0 {
			delete(c.watchers, name)
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
