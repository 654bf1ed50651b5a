// Package nodemode is the agent's node mode (--workload-attestation): one agent, one socket,
// many workloads. Each caller is attested at the handshake and its "default" and "ROOTCA"
// resolve to keys naming its identity ("default@spiffe://TD/ns/NS/sa/SA"), which an identities
// registry serves, one secret manager per identity. The agent reaches it through
// agent.Config.SDS.Node, which only cmd/meshid sets, so that meshid-agent links none of it.
package nodemode

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/secretmanager"
	"github.com/meshid/meshid/workloadapi"
)

// IdentityIdleRelease is how long a node agent keeps renewing an identity no stream or call asks
// for before it lets it go; identitySweep is how often it looks.
const (
	IdentityIdleRelease = 10 * time.Minute
	identitySweep       = 30 * time.Second
)

// nodeKey is the key of the secret name (default, ROOTCA) of identity id.
func nodeKey(name string, id pki.SPIFFEID) string { return name + "@" + id.String() }

// parseNodeKey splits a key of nodeKey; anything else is an unknown secret.
func parseNodeKey(key string) (string, pki.SPIFFEID, error) {
	name, raw, ok := strings.Cut(key, "@")
	if !ok || (name != secretmanager.WorkloadCertName && name != secretmanager.RootCertName) {
		return "", pki.SPIFFEID{}, fmt.Errorf("%w: a node agent serves only %s and %s", secretmanager.ErrUnknownSecret,
			secretmanager.WorkloadCertName, secretmanager.RootCertName)
	}
	id, err := pki.ParseSPIFFEID(raw)
	if err != nil {
		return "", pki.SPIFFEID{}, fmt.Errorf("%w: %w", secretmanager.ErrUnknownSecret, err)
	}
	return name, id, nil
}

// identify gives the caller of a call its identity (the attestor's); refusals are its errors.
type identify func(ctx context.Context) (namespace, serviceAccount string, err error)

// nodeResolver turns the names a caller asks for into its identity's keys.
type nodeResolver struct {
	trustDomain string
	identify    identify
	// streams, when set, is told the identity each stream is given.
	streams *nodeStreams
	// failure, when set, says why an identity's secret manager has failed (nil: it has not).
	failure func(pki.SPIFFEID) error
}

// identity is the SPIFFE ID of the caller of ctx, noted as its stream's when ctx is a stream's.
func (n nodeResolver) identity(ctx context.Context) (pki.SPIFFEID, error) {
	if n.streams == nil {
		return n.lookup(ctx)
	}
	generation := n.streams.generationNow()
	id, err := n.lookup(ctx)
	if err == nil {
		n.streams.note(ctx, id, generation)
	}
	return id, err
}

// lookup is the SPIFFE ID the rules give the caller of ctx now.
func (n nodeResolver) lookup(ctx context.Context) (pki.SPIFFEID, error) {
	ns, sa, err := n.identify(ctx)
	if err != nil {
		return pki.SPIFFEID{}, err
	}
	id, err := pki.NewSPIFFEID(n.trustDomain, ns, sa)
	if err != nil {
		return pki.SPIFFEID{}, fmt.Errorf("the rule's identity: %w", err)
	}
	return id, nil
}

// Resolve is sds.Config.Resolve: every name is the caller's own. An SDS stream of an identity
// whose secret manager has failed is ended: nothing would come on it (a fetch is answered with
// the failure by the secret cache).
func (n nodeResolver) Resolve(ctx context.Context, requested string) (string, error) {
	id, err := n.identity(ctx)
	if err != nil {
		return "", err
	}
	if n.failure != nil && n.streams != nil {
		if why := n.failure(id); why != nil {
			n.streams.endStreamFailed(ctx, id, why)
		}
	}
	return nodeKey(requested, id), nil
}

// Names is workloadapi.Config.Identify: the caller's key pair and bundle.
func (n nodeResolver) Names(ctx context.Context) (workloadapi.Names, error) {
	id, err := n.identity(ctx)
	if err != nil {
		return workloadapi.Names{}, err
	}
	return workloadapi.Names{KeyPair: nodeKey(secretmanager.WorkloadCertName, id), Bundle: nodeKey(secretmanager.RootCertName, id)}, nil
}

// identities holds a secret manager per workload identity a caller asked for: made on the first
// ask, run under Run (so renewed proactively like a sidecar's), and released once no stream or
// call has asked for it for idle. Each manager's metrics are registered with its identity as the
// label "identity", and unregistered when it is released, so that the series come and go with
// the identities.
//
// A manager that cannot be made, or whose Run fails, is dropped: its subscribers are told why
// (nil and the failure), so that no caller waits on it for nothing, and the identity's SDS
// streams are ended with Unavailable (failed, when set). It is made again once its backoff has
// passed, when asked for or, while someone still subscribes, by Run; the subscriptions still open
// then follow the new manager.
type identities struct {
	// newManager makes id's manager, registering its metrics with reg.
	newManager func(id pki.SPIFFEID, reg prometheus.Registerer) (*secretmanager.Manager, error)
	registerer prometheus.Registerer // nil: the managers' metrics are not registered
	clock      clock.Clock
	log        *slog.Logger
	idle       time.Duration
	failures   *prometheus.CounterVec
	// swept, when set, is told after each sweep (tests).
	swept func()
	// failed, when set, is told of each identity whose manager failed, with why.
	failed func(id pki.SPIFFEID, why error)

	wake chan struct{} // buffered: a failure to schedule a retry of

	mu      sync.Mutex
	entries map[pki.SPIFFEID]*heldIdentity
	runCtx  context.Context //nolint:containedctx // Run's, for the managers made while it runs
	stopped bool
	running sync.WaitGroup // the managers' Run
}

// heldIdentity is one identity's manager and who uses it.
type heldIdentity struct {
	id      pki.SPIFFEID
	manager *secretmanager.Manager // nil after a failure, until made again
	users   int                    // subscriptions open
	since   time.Time              // when users last fell to 0
	stop    context.CancelFunc     // nil while the manager does not run
	metrics *trackedRegisterer
	subs    map[*nodeSubscription]struct{}
	// generation counts the managers made and failures, so that a subscription follows the
	// latest of them whatever order they reach it in.
	generation uint64

	// failure is why the manager failed, while it is nil; the next attempt waits until retryAt.
	failure error
	retryAt time.Time
	retries *backoff.ExponentialBackOff
	madeAt  time.Time
}

// nodeSubscription is one subscription to a name of an identity: it follows the identity's
// manager of the moment, and is told of its failure.
type nodeSubscription struct {
	name string
	fn   func(*secretmanager.Secret, error)

	mu         sync.Mutex // serializes attach and close, and so every call of fn made here
	generation uint64
	cancel     func() // of the manager's subscription; nil when there is none
	closed     bool
}

// attach makes s follow m, or, with m nil, tells it of failure; unless it follows a later
// generation already. It returns m's refusal.
func (s *nodeSubscription) attach(m *secretmanager.Manager, generation uint64, failure error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || generation <= s.generation {
		return nil
	}
	s.generation = generation
	if s.cancel != nil {
		s.cancel()
		s.cancel = nil
	}
	if m == nil {
		s.fn(nil, failure)
		return nil
	}
	cancel, err := m.Subscribe(s.name, s.fn)
	if err != nil {
		return err
	}
	s.cancel = cancel
	return nil
}

func (s *nodeSubscription) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	if s.cancel != nil {
		s.cancel()
		s.cancel = nil
	}
}

// rebinding is what a change of an identity's manager tells its open subscriptions, once the
// registry's lock is released: the manager's Subscribe calls them.
type rebinding struct {
	subs       []*nodeSubscription
	manager    *secretmanager.Manager
	generation uint64
	failure    error
	failedNow  bool // the manager has just failed: its streams are to be ended
}

func (b rebinding) apply() {
	for _, s := range b.subs {
		// A refusal here is of a name the manager accepted before: none is refused later.
		_ = s.attach(b.manager, b.generation, b.failure)
	}
}

// Why an identity's manager failed, as counted.
const (
	managerFailedStart = "start" // it could not be made
	managerFailedRun   = "run"   // its Run ended with an error
)

// The retries of a failed identity's manager: soon after a passing failure, seldom after a
// lasting one.
const (
	identityRetryInitial = time.Second
	identityRetryMax     = 5 * time.Minute
)

// errIdentityFailed is the cause of what a failed identity's callers are told.
var errIdentityFailed = errors.New("the identity's secret manager failed")

// identityLabel labels a node agent's per-identity series with the identity's SPIFFE ID.
const identityLabel = "identity"

// trackedRegisterer registers with a registerer and remembers what, so that it can all be
// unregistered when the identity whose metrics they are is released.
type trackedRegisterer struct {
	reg        prometheus.Registerer
	collectors []prometheus.Collector
}

func (t *trackedRegisterer) Register(c prometheus.Collector) error {
	if err := t.reg.Register(c); err != nil {
		return err
	}
	t.collectors = append(t.collectors, c)
	return nil
}

func (t *trackedRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := t.Register(c); err != nil {
			panic(err)
		}
	}
}

func (t *trackedRegisterer) Unregister(c prometheus.Collector) bool {
	t.collectors = slices.DeleteFunc(t.collectors, func(held prometheus.Collector) bool { return held == c })
	return t.reg.Unregister(c)
}

// unregisterAll removes every series registered through t.
func (t *trackedRegisterer) unregisterAll() {
	if t == nil {
		return
	}
	for _, c := range t.collectors {
		t.reg.Unregister(c)
	}
	t.collectors = nil
}

// errNodeAgentStopped refuses a subscription that comes once the agent stops.
var errNodeAgentStopped = errors.New("the node agent is stopping")

func newIdentities(newManager func(pki.SPIFFEID, prometheus.Registerer) (*secretmanager.Manager, error), registerer prometheus.Registerer,
	clk clock.Clock, log *slog.Logger) (*identities, error) {
	r := &identities{newManager: newManager, registerer: registerer, clock: clk, log: log, idle: IdentityIdleRelease,
		wake: make(chan struct{}, 1), entries: map[pki.SPIFFEID]*heldIdentity{},
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "identity_manager_failures_total",
			Help: "Secret managers of a node agent's identities that failed, by stage: start (could not be made), run (stopped with an error).",
		}, []string{"stage"})}
	if registerer != nil {
		if err := registerer.Register(r.failures); err != nil {
			return nil, fmt.Errorf("register identity metrics: %w", err)
		}
	}
	return r, nil
}

// Subscribe is secretmanager.Manager.Subscribe over keys of nodeKey: the named secret of the
// key's identity, its manager made and started on first use. While the identity's manager has
// failed, fn is told why at once.
func (r *identities) Subscribe(key string, fn func(*secretmanager.Secret, error)) (func(), error) {
	name, id, err := parseNodeKey(key)
	if err != nil {
		return nil, err
	}
	sub := &nodeSubscription{name: name, fn: fn}
	h, b, err := r.acquire(id, sub)
	if err != nil {
		return nil, err
	}
	b.apply()
	r.notifyFailed(id, b)
	if err := sub.attach(b.manager, b.generation, b.failure); err != nil {
		r.release(h, sub)
		return nil, err
	}
	return sync.OnceFunc(func() {
		sub.close()
		r.release(h, sub)
	}), nil
}

// acquire returns id's entry, with sub among its subscriptions, counting one more user. The
// manager is made (and started, once Run runs) on the first ask, and again on an ask once the
// backoff of its failure has passed. What the subscriptions are to be told, sub's included, is
// returned to be applied once the lock is released.
func (r *identities) acquire(id pki.SPIFFEID, sub *nodeSubscription) (*heldIdentity, rebinding, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.stopped {
		return nil, rebinding{}, errNodeAgentStopped
	}
	h := r.entries[id]
	var b rebinding
	switch {
	case h == nil:
		h = &heldIdentity{id: id, subs: map[*nodeSubscription]struct{}{}}
		r.entries[id] = h
		r.log.Info("identity asked for: obtaining and renewing its certificate", logkey.Identity, id.String())
		b = r.makeLocked(h)
	case h.manager == nil && !r.clock.Now().Before(h.retryAt):
		b = r.makeLocked(h)
	default:
		b = rebinding{manager: h.manager, generation: h.generation, failure: h.failure}
	}
	h.subs[sub] = struct{}{}
	h.users++
	return h, b, nil
}

// makeLocked makes h's manager, started when Run runs, or records why it could not be made.
// It returns what h's subscriptions are to be told.
func (r *identities) makeLocked(h *heldIdentity) rebinding {
	tracked := &trackedRegisterer{}
	var reg prometheus.Registerer
	if r.registerer != nil {
		tracked.reg = prometheus.WrapRegistererWith(prometheus.Labels{identityLabel: h.id.String()}, r.registerer)
		reg = tracked
	}
	m, err := r.newManager(h.id, reg)
	if err != nil {
		tracked.unregisterAll()
		return r.failLocked(h, managerFailedStart, err)
	}
	h.manager, h.metrics, h.failure, h.madeAt = m, tracked, nil, r.clock.Now()
	h.generation++
	if r.runCtx != nil {
		r.startLocked(h)
	}
	return rebinding{subs: slices.Collect(maps.Keys(h.subs)), manager: m, generation: h.generation}
}

// failLocked drops h's manager, which failed at stage with err, and schedules the next attempt
// after a backoff; logged once and counted. It returns what h's subscriptions are to be told.
func (r *identities) failLocked(h *heldIdentity, stage string, err error) rebinding {
	if h.stop != nil {
		h.stop()
		h.stop = nil
	}
	h.metrics.unregisterAll()
	now := r.clock.Now()
	if h.retries == nil || (stage == managerFailedRun && now.Sub(h.madeAt) > identityRetryMax) {
		// A first failure, or a manager's that ran a long while: retried soon.
		h.retries = backoff.NewExponentialBackOff(backoff.WithInitialInterval(identityRetryInitial), backoff.WithMaxInterval(identityRetryMax),
			backoff.WithMaxElapsedTime(0), backoff.WithClockProvider(r.clock))
	}
	h.manager, h.metrics = nil, nil
	h.retryAt = now.Add(h.retries.NextBackOff())
	h.failure = fmt.Errorf("%w: identity %s: %w; tried again at %s", errIdentityFailed, h.id, err, h.retryAt.UTC().Format(time.RFC3339))
	h.generation++
	r.failures.WithLabelValues(stage).Inc()
	r.log.Error("identity's secret manager failed: its callers are told, and it is made again after a backoff", logkey.Identity, h.id.String(),
		logkey.Reason, stage, logkey.Error, err.Error(), logkey.RetryAt, h.retryAt)
	select {
	case r.wake <- struct{}{}:
	default:
	}
	return rebinding{subs: slices.Collect(maps.Keys(h.subs)), generation: h.generation, failure: h.failure, failedNow: true}
}

// notifyFailed tells failed of the failure that b carries, if it has just happened.
func (r *identities) notifyFailed(id pki.SPIFFEID, b rebinding) {
	if b.failedNow && r.failed != nil {
		r.failed(id, b.failure)
	}
}

// release counts one user of h less.
func (r *identities) release(h *heldIdentity, sub *nodeSubscription) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(h.subs, sub)
	h.users--
	if h.users == 0 {
		h.since = r.clock.Now()
	}
}

// failure is why id's manager has failed, or nil when it has not.
func (r *identities) failure(id pki.SPIFFEID) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if h := r.entries[id]; h != nil && h.manager == nil {
		return h.failure
	}
	return nil
}

// startLocked runs h's manager until Run ends or h is released.
func (r *identities) startLocked(h *heldIdentity) {
	ctx, stop := context.WithCancel(r.runCtx)
	h.stop = stop
	m := h.manager
	r.running.Add(1)
	go func() {
		defer r.running.Done()
		err := m.Run(ctx)
		if err == nil || ctx.Err() != nil {
			return
		}
		r.mu.Lock()
		if r.entries[h.id] != h || h.manager != m {
			r.mu.Unlock()
			return
		}
		b := r.failLocked(h, managerFailedRun, err)
		r.mu.Unlock()
		b.apply()
		r.notifyFailed(h.id, b)
	}()
}

// Run starts the managers of the identities asked for, and those asked for later; every
// identitySweep it releases the ones idle for IdentityIdleRelease, and once a failed manager's
// backoff has passed it makes it again for those who still subscribe, until ctx ends.
func (r *identities) Run(ctx context.Context) error {
	r.mu.Lock()
	r.runCtx = ctx
	for _, h := range r.entries {
		if h.manager != nil {
			r.startLocked(h)
		}
	}
	r.mu.Unlock()
	defer r.running.Wait()
	defer func() {
		r.mu.Lock()
		r.stopped = true
		r.mu.Unlock()
	}()
	t := r.clock.NewTimer(identitySweep)
	for {
		var (
			retry  clock.Timer
			retryC <-chan time.Time
		)
		if at := r.nextRetry(); !at.IsZero() {
			retry = r.clock.NewTimer(at.Sub(r.clock.Now()))
			retryC = retry.C()
		}
		select {
		case <-ctx.Done():
			t.Stop()
			if retry != nil {
				retry.Stop()
			}
			return nil
		case <-t.C():
			r.sweep()
			t = r.clock.NewTimer(identitySweep)
			if r.swept != nil {
				r.swept()
			}
		case <-r.wake:
		case <-retryC:
			r.retry()
		}
		if retry != nil {
			retry.Stop()
		}
	}
}

// nextRetry is when the earliest failed manager someone subscribes to is to be made again; zero
// when there is none.
func (r *identities) nextRetry() time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	var next time.Time
	for _, h := range r.entries {
		if h.manager == nil && h.users > 0 && (next.IsZero() || h.retryAt.Before(next)) {
			next = h.retryAt
		}
	}
	return next
}

// retry makes again the failed managers whose backoff has passed and that someone subscribes to.
func (r *identities) retry() {
	r.mu.Lock()
	now := r.clock.Now()
	var changes []rebinding
	var ids []pki.SPIFFEID
	for id, h := range r.entries {
		if h.manager == nil && h.users > 0 && !now.Before(h.retryAt) {
			r.log.Info("identity's secret manager made again after its failure", logkey.Identity, id.String())
			changes = append(changes, r.makeLocked(h))
			ids = append(ids, id)
		}
	}
	r.mu.Unlock()
	for i, b := range changes {
		b.apply()
		r.notifyFailed(ids[i], b)
	}
}

// sweep releases the identities no one has asked for since idle ago.
func (r *identities) sweep() {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.clock.Now()
	for id, h := range r.entries {
		if h.users > 0 || now.Sub(h.since) < r.idle {
			continue
		}
		delete(r.entries, id)
		if h.stop != nil {
			h.stop()
		}
		h.metrics.unregisterAll()
		r.log.Info("identity released: no caller has asked for it", logkey.Identity, id.String(), logkey.Duration, r.idle)
	}
}

// held returns the identities held now, sorted.
func (r *identities) held() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]string, 0, len(r.entries))
	for id := range maps.Keys(r.entries) {
		out = append(out, id.String())
	}
	slices.Sort(out)
	return out
}

// New returns the agent's hook (agent.Config.SDS.Node) that makes node mode with the attestor
// attest makes.
func New(attest agent.AttestFunc) agent.NodeFunc {
	return func(c agent.NodeConfig) (agent.Node, error) {
		n, err := newNode(attest, c)
		if err != nil {
			return nil, err // not a nil *Node in a non-nil agent.Node
		}
		return n, nil
	}
}

// Node is node mode's parts: the attestor of the rules file, the registry whose managers sign
// through the CA for each identity asked for, and the streams served, each for one identity.
type Node struct {
	attestor   agent.Attestor
	identities *identities
	streams    *nodeStreams
	resolver   nodeResolver
	ca         agent.NodeCA
}

var _ agent.Node = (*Node)(nil)

func newNode(attest agent.AttestFunc, c agent.NodeConfig) (*Node, error) {
	log := c.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	clk := clock.OrReal(c.Clock)
	n := &Node{ca: c.CA}
	var err error
	if n.attestor, err = attest(agent.AttestConfig{RulesFile: c.RulesFile, Pods: c.Pods, Clock: clk,
		Logger: log.With(logkey.Component, "attest"), Registerer: c.Registerer}); err != nil {
		if c.RulesFile == "" {
			return nil, &agent.FieldError{Field: "SDS.AttestPods.Enabled", Err: err}
		}
		return nil, &agent.FieldError{Field: "SDS.WorkloadAttestation", Value: c.RulesFile, Err: err}
	}
	newManager := func(id pki.SPIFFEID, reg prometheus.Registerer) (*secretmanager.Manager, error) {
		signer, err := c.CA.ForIdentity(id)
		if err != nil {
			return nil, err
		}
		return secretmanager.New(secretmanager.Config{
			Workload: &secretmanager.Rotation{
				Signer:           signer,
				Identity:         id,
				KeyAlgorithm:     c.Certificate.KeyAlgorithm,
				RSAKeySize:       c.Certificate.RSAKeySize,
				TTL:              c.Certificate.TTL,
				GraceRatio:       c.Certificate.GraceRatio,
				GraceRatioJitter: c.Certificate.GraceRatioJitter,
				RootCertFile:     c.RootCertFile,
			},
			FileWatch:  c.FileWatch,
			Clock:      clk,
			Logger:     log.With(logkey.Component, "secretmanager", logkey.Identity, id.String()),
			OnEvent:    c.OnEvent,
			Registerer: reg,
		})
	}
	if n.identities, err = newIdentities(newManager, c.Registerer, clk, log.With(logkey.Component, "identities")); err != nil {
		return nil, err
	}
	n.resolver = nodeResolver{trustDomain: c.TrustDomain, identify: n.attestor.Caller}
	if n.streams, err = newNodeStreams(n.resolver.lookup, log.With(logkey.Component, "node-streams"), c.Registerer); err != nil {
		return nil, err
	}
	n.resolver.streams, n.resolver.failure = n.streams, n.identities.failure
	n.identities.failed = n.streams.endFailed
	log.Info("node mode: each caller on the socket gets the identity its rule, or its pod on this node, gives", logkey.Path, c.RulesFile,
		logkey.Node, c.Pods.NodeName, logkey.Identity, c.Self.String())
	return n, nil
}

// Subscribe is the secrets of SDS and the Workload API: those of the caller's identity.
func (n *Node) Subscribe(key string, fn func(*secretmanager.Secret, error)) (func(), error) {
	return n.identities.Subscribe(key, fn)
}

// Resolve is sds.Config.Resolve: every name is the caller's own.
func (n *Node) Resolve(ctx context.Context, requested string) (string, error) {
	return n.resolver.Resolve(ctx, requested)
}

// Identify is workloadapi.Config.Identify: the caller's key pair and bundle.
func (n *Node) Identify(ctx context.Context) (workloadapi.Names, error) { return n.resolver.Names(ctx) }

// Credentials are the socket's transport credentials: the attestor's, around connCredentials,
// around the server's own (inner, its admission).
func (n *Node) Credentials(inner credentials.TransportCredentials) credentials.TransportCredentials {
	return nodeCredentials(n.attestor)(inner)
}

// StreamInterceptor is the socket's stream interceptor (nodeStreams.intercept).
func (n *Node) StreamInterceptor(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	return n.streams.intercept(srv, ss, info, handler)
}

// Run runs the identities' managers, the attestor, and the check of the open streams after each
// load of the rules, until ctx ends or one fails.
func (n *Node) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return n.identities.Run(ctx) })
	g.Go(func() error { return n.attestor.Run(ctx) })
	g.Go(func() error { return n.streams.Run(ctx, n.attestor.Loaded) })
	return g.Wait()
}

// Problem says why callers cannot be identified yet, when the attestor says so (the node's pods
// not listed); nil when they can.
func (n *Node) Problem() error {
	if p, ok := n.attestor.(interface{ Problem() error }); ok {
		return p.Problem()
	}
	return nil
}

// Held returns the identities held now, sorted.
func (n *Node) Held() []string { return n.identities.held() }

// RetryAt is when the failed secret manager of identity id is made again; zero when it has not
// failed.
func (n *Node) RetryAt(id pki.SPIFFEID) time.Time {
	r := n.identities
	r.mu.Lock()
	defer r.mu.Unlock()
	if h := r.entries[id]; h != nil && h.manager == nil {
		return h.retryAt
	}
	return time.Time{}
}

// MintJWTSVID asks the CA for a JWT-SVID of the caller's identity, as a trusted node account
// (impersonated_identity).
func (n *Node) MintJWTSVID(ctx context.Context, audience []string) (workloadapi.JWTSVID, error) {
	id, err := n.resolver.identity(ctx)
	if err != nil {
		// The Workload API identified the caller a moment ago: its rule has just gone.
		return workloadapi.JWTSVID{}, status.Error(codes.PermissionDenied, err.Error())
	}
	signer, err := n.ca.ForIdentity(id)
	if err != nil {
		return workloadapi.JWTSVID{}, err
	}
	svid, err := signer.MintJWTSVID(ctx, audience, 0) // the CA's lifetime
	return workloadapi.JWTSVID(svid), err
}

// FetchJWTBundle is the CA's JWT bundle.
func (n *Node) FetchJWTBundle(ctx context.Context) (workloadapi.JWTBundle, error) {
	b, err := n.ca.FetchJWTBundle(ctx)
	return workloadapi.JWTBundle(b), err
}
