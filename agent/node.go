package agent

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/secretmanager"
	"github.com/meshid/meshid/workloadapi"
)

// Node mode (--workload-attestation): one agent, one socket, many workloads. Each caller is
// attested at the handshake and its "default" and "ROOTCA" resolve to keys naming its identity
// ("default@spiffe://TD/ns/NS/sa/SA"), which an identities registry serves, one secret manager
// per identity.

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

// Resolve is sds.Config.Resolve: every name is the caller's own.
func (n nodeResolver) Resolve(ctx context.Context, requested string) (string, error) {
	id, err := n.identity(ctx)
	if err != nil {
		return "", err
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
type identities struct {
	// newManager makes id's manager, registering its metrics with reg.
	newManager func(id pki.SPIFFEID, reg prometheus.Registerer) (*secretmanager.Manager, error)
	registerer prometheus.Registerer // nil: the managers' metrics are not registered
	clock      clock.Clock
	log        *slog.Logger
	idle       time.Duration
	// swept, when set, is told after each sweep (tests).
	swept func()

	mu      sync.Mutex
	entries map[pki.SPIFFEID]*heldIdentity
	runCtx  context.Context //nolint:containedctx // Run's, for the managers made while it runs
	stopped bool
	running sync.WaitGroup // the managers' Run
}

// heldIdentity is one identity's manager and who uses it.
type heldIdentity struct {
	id      pki.SPIFFEID
	manager *secretmanager.Manager
	users   int       // subscriptions open
	since   time.Time // when users last fell to 0
	stop    context.CancelFunc
	metrics *trackedRegisterer
}

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
	for _, c := range t.collectors {
		t.reg.Unregister(c)
	}
	t.collectors = nil
}

// errNodeAgentStopped refuses a subscription that comes once the agent stops.
var errNodeAgentStopped = errors.New("the node agent is stopping")

func newIdentities(newManager func(pki.SPIFFEID, prometheus.Registerer) (*secretmanager.Manager, error), registerer prometheus.Registerer,
	clk clock.Clock, log *slog.Logger) *identities {
	return &identities{newManager: newManager, registerer: registerer, clock: clk, log: log, idle: IdentityIdleRelease,
		entries: map[pki.SPIFFEID]*heldIdentity{}}
}

// Subscribe is secretmanager.Manager.Subscribe over keys of nodeKey: the named secret of the
// key's identity, its manager made and started on first use.
func (r *identities) Subscribe(key string, fn func(*secretmanager.Secret, error)) (func(), error) {
	name, id, err := parseNodeKey(key)
	if err != nil {
		return nil, err
	}
	h, err := r.acquire(id)
	if err != nil {
		return nil, err
	}
	cancel, err := h.manager.Subscribe(name, fn)
	if err != nil {
		r.release(h)
		return nil, err
	}
	return sync.OnceFunc(func() {
		cancel()
		r.release(h)
	}), nil
}

// acquire returns id's manager, made (and started, once Run runs) on the first ask, counting one
// more user.
func (r *identities) acquire(id pki.SPIFFEID) (*heldIdentity, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.stopped {
		return nil, errNodeAgentStopped
	}
	h := r.entries[id]
	if h == nil {
		var reg prometheus.Registerer
		tracked := &trackedRegisterer{}
		if r.registerer != nil {
			tracked.reg = prometheus.WrapRegistererWith(prometheus.Labels{identityLabel: id.String()}, r.registerer)
			reg = tracked
		}
		m, err := r.newManager(id, reg)
		if err != nil {
			tracked.unregisterAll()
			return nil, fmt.Errorf("identity %s: %w", id, err)
		}
		h = &heldIdentity{id: id, manager: m, metrics: tracked}
		r.entries[id] = h
		r.log.Info("identity asked for: obtaining and renewing its certificate", logkey.Identity, id.String())
		if r.runCtx != nil {
			r.startLocked(h)
		}
	}
	h.users++
	return h, nil
}

// release counts one user of h less.
func (r *identities) release(h *heldIdentity) {
	r.mu.Lock()
	defer r.mu.Unlock()
	h.users--
	if h.users == 0 {
		h.since = r.clock.Now()
	}
}

// startLocked runs h's manager until Run ends or h is released.
func (r *identities) startLocked(h *heldIdentity) {
	ctx, stop := context.WithCancel(r.runCtx)
	h.stop = stop
	r.running.Add(1)
	go func() {
		defer r.running.Done()
		if err := h.manager.Run(ctx); err != nil && ctx.Err() == nil {
			r.log.Error("identity's secret manager stopped; it is made again when next asked for", logkey.Identity, h.id.String(), logkey.Error, err.Error())
			r.mu.Lock()
			if r.entries[h.id] == h {
				delete(r.entries, h.id)
				h.metrics.unregisterAll()
			}
			r.mu.Unlock()
		}
	}()
}

// Run starts the managers of the identities asked for, and those asked for later, and every
// identitySweep releases the ones idle for IdentityIdleRelease, until ctx ends.
func (r *identities) Run(ctx context.Context) error {
	r.mu.Lock()
	r.runCtx = ctx
	for _, h := range r.entries {
		r.startLocked(h)
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
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C():
			r.sweep()
			t = r.clock.NewTimer(identitySweep)
			if r.swept != nil {
				r.swept()
			}
		}
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
		h.stop()
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

// buildNode makes node mode's parts: the attestor of the rules file, the CA client of the
// agent's own identity (the node account; the embedded control plane trusts it), and the
// registry whose managers sign through it for each identity asked for.
func (a *Agent) buildNode(cfg Config, fetched tokenFunc, clk clock.Clock, log *slog.Logger, registry *prometheus.Registry) (nodeResolver, error) {
	var err error
	if a.attestor, err = cfg.SDS.Attest(AttestConfig{RulesFile: cfg.SDS.WorkloadAttestation, Clock: clk,
		Logger: log.With(logkey.Component, "attest"), Registerer: registry}); err != nil {
		return nodeResolver{}, &FieldError{Field: "SDS.WorkloadAttestation", Value: cfg.SDS.WorkloadAttestation, Err: err}
	}
	self, err := cfg.SPIFFEID()
	if err != nil {
		return nodeResolver{}, err
	}
	// No certificate is presented: the CA signs another identity only for a token's bearer.
	up, err := a.buildCAClient(cfg, fetched, self, func() *tls.Certificate { return nil }, clk, log, registry)
	if err != nil {
		return nodeResolver{}, err
	}
	newManager := func(id pki.SPIFFEID, reg prometheus.Registerer) (*secretmanager.Manager, error) {
		signer, err := a.ca.ForIdentity(id)
		if err != nil {
			return nil, err
		}
		return secretmanager.New(secretmanager.Config{
			Workload: &secretmanager.Rotation{
				Signer:           signer,
				Identity:         id,
				KeyAlgorithm:     cfg.Certificate.KeyAlgorithm,
				RSAKeySize:       cfg.Certificate.RSAKeySize,
				TTL:              cfg.Certificate.TTL,
				GraceRatio:       cfg.Certificate.GraceRatio,
				GraceRatioJitter: cfg.Certificate.GraceRatioJitter,
				RootCertFile:     up.rootCertFile,
			},
			FileWatch:  a.fileWatch,
			Clock:      clk,
			Logger:     log.With(logkey.Component, "secretmanager", logkey.Identity, id.String()),
			OnEvent:    cfg.OnEvent,
			Registerer: reg,
		})
	}
	a.identities = newIdentities(newManager, registry, clk, log.With(logkey.Component, "identities"))
	resolver := nodeResolver{trustDomain: cfg.Identity.TrustDomain, identify: func(ctx context.Context) (string, string, error) {
		return a.attestor.Caller(ctx)
	}}
	if a.nodeStreams, err = newNodeStreams(resolver.lookup, log.With(logkey.Component, "node-streams"), registry); err != nil {
		return nodeResolver{}, err
	}
	resolver.streams = a.nodeStreams
	log.Info("node mode: each caller on the socket gets the identity its rule gives", logkey.Path, cfg.SDS.WorkloadAttestation,
		logkey.Identity, self.String())
	return resolver, nil
}

// nodeJWTIssuer asks the CA for JWT-SVIDs of each caller's identity, as a trusted node account
// (impersonated_identity), and for the bundle.
type nodeJWTIssuer struct {
	ca       *caclient.Client
	resolver nodeResolver
}

func (j nodeJWTIssuer) MintJWTSVID(ctx context.Context, audience []string) (workloadapi.JWTSVID, error) {
	id, err := j.resolver.identity(ctx)
	if err != nil {
		// The Workload API identified the caller a moment ago: its rule has just gone.
		return workloadapi.JWTSVID{}, status.Error(codes.PermissionDenied, err.Error())
	}
	signer, err := j.ca.ForIdentity(id)
	if err != nil {
		return workloadapi.JWTSVID{}, err
	}
	svid, err := signer.MintJWTSVID(ctx, audience, 0) // the CA's lifetime
	return workloadapi.JWTSVID(svid), err
}

func (j nodeJWTIssuer) FetchJWTBundle(ctx context.Context) (workloadapi.JWTBundle, error) {
	return jwtIssuer{j.ca}.FetchJWTBundle(ctx)
}
