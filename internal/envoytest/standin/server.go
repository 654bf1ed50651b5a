package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sort"
	"sync"
	"time"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	secretv3 "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/anypb"
)

// The types whose versions /config_dump shows.
const (
	typeCluster  = resource.ClusterType
	typeListener = resource.ListenerType
	typeRoute    = resource.RouteType
	typeEndpoint = resource.EndpointType
)

// version is what the stand-in says it is, in Envoy's shape (hash/version/status/build/TLS).
const version = "0000000000000000000000000000000000000000/1.36.0-meshid-standin/Clean/RELEASE/BoringSSL"

// server is the stand-in Envoy: its init state, its xDS configuration and secrets, its listeners
// and its stats.
type server struct {
	log     *slog.Logger
	opts    *options
	boot    *bootstrapv3.Bootstrap
	node    *corev3.Node
	stats   *stats
	started time.Time

	// quit is closed by /quitquitquit.
	quit     chan struct{}
	quitOnce sync.Once

	wg sync.WaitGroup

	mu  sync.Mutex
	ctx context.Context // the run's, for the SDS streams started as references appear
	// stopped is set once Run is shutting down: nothing binds, accepts or subscribes after it, so
	// that the wait for every goroutine ends.
	stopped      bool
	adsConnected bool
	initDone     bool
	healthFailed bool
	draining     bool
	cdsAcked     bool
	ldsAcked     bool
	clusters     map[string]*clusterv3.Cluster
	listenerCfg  map[string]*listenerv3.Listener
	routes       map[string]*routev3.RouteConfiguration
	endpoints    map[string]*endpointv3.ClusterLoadAssignment
	edsNames     []string
	rdsNames     []string
	staticRefs   map[sdsRef]struct{}
	clusterRefs  map[sdsRef]struct{}
	listenerRefs map[sdsRef]struct{}
	secrets      map[sdsRef]*tlsv3.Secret
	// versions are the versions accepted, by type; secretVersions by secret.
	versions       map[string]string
	secretVersions map[sdsRef]string
	sdsStreams     map[sdsRef]context.CancelFunc
	conns          map[string]*grpc.ClientConn
	listeners      map[string]*boundListener
	drained        map[string]bool
	heldConns      map[net.Conn]struct{}
}

func newServer(log *slog.Logger, o *options, b *bootstrapv3.Bootstrap) *server {
	s := &server{
		log:            log,
		opts:           o,
		boot:           b,
		node:           node(b, o),
		stats:          newStats(),
		started:        time.Now(),
		quit:           make(chan struct{}),
		clusters:       map[string]*clusterv3.Cluster{},
		listenerCfg:    map[string]*listenerv3.Listener{},
		routes:         map[string]*routev3.RouteConfiguration{},
		endpoints:      map[string]*endpointv3.ClusterLoadAssignment{},
		staticRefs:     map[sdsRef]struct{}{},
		clusterRefs:    map[sdsRef]struct{}{},
		listenerRefs:   map[sdsRef]struct{}{},
		secrets:        map[sdsRef]*tlsv3.Secret{},
		versions:       map[string]string{},
		secretVersions: map[sdsRef]string{},
		sdsStreams:     map[sdsRef]context.CancelFunc{},
		conns:          map[string]*grpc.ClientConn{},
		listeners:      map[string]*boundListener{},
		drained:        map[string]bool{},
		heldConns:      map[net.Conn]struct{}{},
	}
	s.stats.declare(false,
		"cluster_manager.cds.update_attempt", "cluster_manager.cds.update_success", "cluster_manager.cds.update_rejected",
		"listener_manager.lds.update_attempt", "listener_manager.lds.update_success", "listener_manager.lds.update_rejected",
		"http.admin.downstream_cx_total", "standin.admin_refused")
	s.stats.declare(true,
		"server.state", "server.live", "server.total_connections", "server.concurrency",
		"cluster_manager.active_clusters", "listener_manager.total_listeners_active", "http.admin.downstream_cx_active")
	s.stats.set("server.concurrency", int64(o.concurrency))
	s.stats.set("server.state", int64(adminv3.ServerInfo_PRE_INITIALIZING))
	return s
}

// Run serves until ctx ends or /quitquitquit is asked; an error is a failure to start.
func (s *server) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s.mu.Lock()
	s.ctx = ctx
	s.mu.Unlock()

	admin, err := s.startAdmin()
	if err != nil {
		return err
	}
	if err := s.startStatic(); err != nil {
		_ = admin.Close()
		return err
	}
	if ads := s.boot.GetDynamicResources().GetAdsConfig(); ads != nil {
		target, err := apiTarget(s.boot, ads)
		if err != nil {
			_ = admin.Close()
			return err
		}
		c := &xdsClient{
			log:           s.log.With(keyTarget, target),
			node:          s.node,
			nodeFirstOnly: ads.GetSetNodeOnFirstMessageOnly(),
			open: func(ctx context.Context) (xdsStream, error) {
				conn, err := s.conn(target)
				if err != nil {
					return nil, err
				}
				return discoveryv3.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
			},
			sub:       adsSubscriber{s},
			connected: s.adsUp,
		}
		if isDelta(ads) {
			c.openDelta = func(ctx context.Context) (deltaStream, error) {
				conn, err := s.conn(target)
				if err != nil {
					return nil, err
				}
				return discoveryv3.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx)
			}
		}
		s.wg.Go(func() { c.run(ctx) })
	} else {
		s.mu.Lock()
		s.adsConnected, s.cdsAcked, s.ldsAcked = true, true, true
		s.updateStateLocked()
		s.mu.Unlock()
	}

	select {
	case <-ctx.Done():
	case <-s.quit:
	}
	// Shutdown lets a /quitquitquit answer reach its client before the process ends.
	shutdownCtx, done := context.WithTimeout(context.Background(), 5*time.Second)
	defer done()
	_ = admin.Shutdown(shutdownCtx)
	cancel()
	s.mu.Lock()
	s.stopped = true
	for _, l := range s.listeners {
		_ = l.ln.Close()
	}
	for c := range s.heldConns {
		_ = c.Close()
	}
	for _, c := range s.conns {
		_ = c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

func (s *server) startAdmin() (*http.Server, error) {
	addr := s.boot.GetAdmin().GetAddress()
	network, address := "", ""
	switch {
	case addr.GetPipe() != nil:
		network, address = "unix", addr.GetPipe().GetPath()
	case addr.GetSocketAddress() != nil:
		network, address = "tcp", hostPort(addr.GetSocketAddress())
	default:
		// Envoy runs without an admin when the bootstrap has none.
		return &http.Server{ReadHeaderTimeout: time.Second}, nil
	}
	ln, err := net.Listen(network, address)
	if err != nil {
		return nil, fmt.Errorf("cannot bind the admin address %s: %w", address, err)
	}
	s.log.Info("admin address", keyAddress, ln.Addr().String())
	if p := s.opts.adminAddressPath; p != "" {
		// Written whole then renamed, so that whoever polls for it never reads half an address.
		tmp := p + ".tmp"
		err := os.WriteFile(tmp, []byte(ln.Addr().String()), 0o600)
		if err == nil {
			err = os.Rename(tmp, p)
		}
		if err != nil {
			_ = ln.Close()
			return nil, fmt.Errorf("admin address path: %w", err)
		}
	}
	srv := &http.Server{
		Handler:           s.adminHandler(),
		ReadHeaderTimeout: 10 * time.Second,
		ConnState: func(_ net.Conn, st http.ConnState) {
			switch st {
			case http.StateNew:
				s.stats.inc("http.admin.downstream_cx_total")
				s.stats.gaugeAdd("http.admin.downstream_cx_active", 1)
			case http.StateClosed, http.StateHijacked:
				s.stats.gaugeAdd("http.admin.downstream_cx_active", -1)
			}
		},
	}
	s.wg.Go(func() { _ = srv.Serve(ln) })
	return srv, nil
}

// startStatic takes the bootstrap's static clusters' and listeners' secret references.
func (s *server) startStatic() error {
	refs := newSecretRefs(s.boot)
	for _, c := range s.boot.GetStaticResources().GetClusters() {
		if err := refs.cluster(c); err != nil {
			return err
		}
	}
	for _, l := range s.boot.GetStaticResources().GetListeners() {
		if err := refs.listener(l); err != nil {
			return err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.staticRefs = refs.refs
	s.reconcileSecretsLocked()
	return nil
}

func (s *server) conn(target string) (*grpc.ClientConn, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if c, ok := s.conns[target]; ok {
		return c, nil
	}
	c, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("gRPC client for %s: %w", target, err)
	}
	s.conns[target] = c
	return c, nil
}

func (s *server) adsUp() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.adsConnected = true
	s.updateStateLocked()
}

// updateStateLocked moves the init state on: LIVE once CDS and LDS were accepted and every
// secret they name has come, as Envoy's init manager waits for its targets.
func (s *server) updateStateLocked() {
	if !s.initDone && s.adsConnected && s.cdsAcked && s.ldsAcked && s.secretsReadyLocked() {
		s.initDone = true
		s.log.Info("all dependencies initialized. starting workers")
		// Set only now, so that /stats?usedonly lists it only once LIVE, as Istio's agent reads it.
		s.stats.set("listener_manager.workers_started", 1)
	}
	st := s.stateLocked()
	s.stats.set("server.state", int64(st))
	live := int64(0)
	if st == adminv3.ServerInfo_LIVE {
		live = 1
	}
	s.stats.set("server.live", live)
}

func (s *server) stateLocked() adminv3.ServerInfo_State {
	switch {
	case !s.adsConnected && !s.initDone:
		return adminv3.ServerInfo_PRE_INITIALIZING
	case !s.initDone:
		return adminv3.ServerInfo_INITIALIZING
	case s.healthFailed || s.draining:
		return adminv3.ServerInfo_DRAINING
	}
	return adminv3.ServerInfo_LIVE
}

func (s *server) state() adminv3.ServerInfo_State {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stateLocked()
}

func (s *server) allRefsLocked() map[sdsRef]struct{} {
	all := map[sdsRef]struct{}{}
	for _, m := range []map[sdsRef]struct{}{s.staticRefs, s.clusterRefs, s.listenerRefs} {
		for r := range m {
			all[r] = struct{}{}
		}
	}
	return all
}

func (s *server) secretsReadyLocked() bool {
	for r := range s.allRefsLocked() {
		if _, ok := s.secrets[r]; !ok && r.source != sourceStatic {
			return false
		}
	}
	return true
}

// reconcileSecretsLocked opens an SDS stream for each secret newly named over gRPC and ends those
// no longer named, forgetting their secrets, as Envoy drops an SDS subscription with its last user.
func (s *server) reconcileSecretsLocked() {
	all := s.allRefsLocked()
	for r, cancel := range s.sdsStreams {
		if _, ok := all[r]; !ok {
			cancel()
			delete(s.sdsStreams, r)
		}
	}
	for r := range s.secrets {
		if _, ok := all[r]; !ok {
			delete(s.secrets, r)
			delete(s.secretVersions, r)
		}
	}
	for r := range all {
		if r.source == sourceADS || r.source == sourceStatic {
			continue
		}
		if _, ok := s.sdsStreams[r]; ok || s.ctx == nil || s.stopped {
			continue
		}
		ctx, cancel := context.WithCancel(s.ctx)
		s.sdsStreams[r] = cancel
		c := &xdsClient{
			log:           s.log.With(keyTarget, r.source, keyName, r.name),
			node:          s.node,
			nodeFirstOnly: r.nodeFirst,
			open: func(ctx context.Context) (xdsStream, error) {
				conn, err := s.conn(r.source)
				if err != nil {
					return nil, err
				}
				return secretv3.NewSecretDiscoveryServiceClient(conn).StreamSecrets(ctx)
			},
			sub: &sdsSubscriber{s: s, ref: r},
		}
		if r.delta {
			c.openDelta = func(ctx context.Context) (deltaStream, error) {
				conn, err := s.conn(r.source)
				if err != nil {
					return nil, err
				}
				return secretv3.NewSecretDiscoveryServiceClient(conn).DeltaSecrets(ctx)
			}
		}
		s.stats.declare(false, "sds."+r.name+".update_success", "sds."+r.name+".update_rejected")
		s.wg.Go(func() { c.run(ctx) })
	}
}

// sdsSubscriber is one secret's SDS stream, one name per stream as Envoy's SdsApi has it.
type sdsSubscriber struct {
	s   *server
	ref sdsRef
}

func (u *sdsSubscriber) wanted() []want {
	return []want{{typeURL: resource.SecretType, names: []string{u.ref.name}}}
}

func (u *sdsSubscriber) apply(resp *discoveryv3.DiscoveryResponse) error {
	secret, err := u.decode(resp)
	if err != nil {
		return err
	}
	u.s.mu.Lock()
	defer u.s.mu.Unlock()
	if _, ok := u.s.sdsStreams[u.ref]; !ok {
		return nil // no longer named: the stream is ending
	}
	u.s.secrets[u.ref] = secret
	u.s.secretVersions[u.ref] = resp.GetVersionInfo()
	u.s.log.Info("secret received", keyName, u.ref.name, keyVersion, resp.GetVersionInfo())
	u.s.updateStateLocked()
	return nil
}

func (u *sdsSubscriber) done(_ string, err error) {
	if err != nil {
		u.s.stats.inc("sds." + u.ref.name + ".update_rejected")
		return
	}
	u.s.stats.inc("sds." + u.ref.name + ".update_success")
}

func (u *sdsSubscriber) check(typeURL string, a *anypb.Any) error {
	if typeURL != resource.SecretType {
		return fmt.Errorf("unexpected type %s on an SDS stream", typeURL)
	}
	secret := &tlsv3.Secret{}
	if err := unmarshalValid(a, secret); err != nil {
		return err
	}
	if secret.GetName() != u.ref.name {
		return fmt.Errorf("unexpected SDS secret (expecting %s): %s", u.ref.name, secret.GetName())
	}
	return nil
}

func (u *sdsSubscriber) decode(resp *discoveryv3.DiscoveryResponse) (*tlsv3.Secret, error) {
	if resp.GetTypeUrl() != resource.SecretType {
		return nil, fmt.Errorf("unexpected type %s on an SDS stream", resp.GetTypeUrl())
	}
	switch n := len(resp.GetResources()); n {
	case 0:
		return nil, fmt.Errorf("missing SDS resources for %s", u.ref.name)
	case 1:
	default:
		return nil, fmt.Errorf("unexpected SDS secrets length: %d", n)
	}
	secret := &tlsv3.Secret{}
	if err := unmarshalValid(resp.GetResources()[0], secret); err != nil {
		return nil, fmt.Errorf("secret %s: %w", u.ref.name, err)
	}
	if secret.GetName() != u.ref.name {
		return nil, fmt.Errorf("unexpected SDS secret (expecting %s): %s", u.ref.name, secret.GetName())
	}
	return secret, nil
}

// adsSubscriber is the ADS stream: CDS and LDS by wildcard, then the endpoints, routes and
// secrets (with an ads config source) that they name.
type adsSubscriber struct{ s *server }

func (a adsSubscriber) wanted() []want {
	a.s.mu.Lock()
	defer a.s.mu.Unlock()
	w := []want{{typeURL: resource.ClusterType}, {typeURL: resource.ListenerType}}
	if len(a.s.edsNames) > 0 {
		w = append(w, want{typeURL: resource.EndpointType, names: a.s.edsNames})
	}
	if len(a.s.rdsNames) > 0 {
		w = append(w, want{typeURL: resource.RouteType, names: a.s.rdsNames})
	}
	var secrets []string
	for r := range a.s.allRefsLocked() {
		if r.source == sourceADS {
			secrets = append(secrets, r.name)
		}
	}
	if len(secrets) > 0 {
		sort.Strings(secrets)
		w = append(w, want{typeURL: resource.SecretType, names: secrets})
	}
	return w
}

// done counts CDS's and LDS's updates under Envoy's names.
func (a adsSubscriber) done(typeURL string, err error) {
	prefix := ""
	switch typeURL {
	case resource.ClusterType:
		prefix = "cluster_manager.cds."
	case resource.ListenerType:
		prefix = "listener_manager.lds."
	default:
		return
	}
	a.s.stats.inc(prefix + "update_attempt")
	if err != nil {
		a.s.stats.inc(prefix + "update_rejected")
		return
	}
	a.s.stats.inc(prefix + "update_success")
}

func (a adsSubscriber) check(typeURL string, r *anypb.Any) error {
	if r.GetTypeUrl() != typeURL {
		return fmt.Errorf("resource of type %s in a %s response", r.GetTypeUrl(), typeURL)
	}
	refs := newSecretRefs(a.s.boot)
	switch typeURL {
	case resource.ClusterType:
		c := &clusterv3.Cluster{}
		if err := unmarshalValid(r, c); err != nil {
			return err
		}
		return refs.cluster(c)
	case resource.ListenerType:
		l := &listenerv3.Listener{}
		if err := unmarshalValid(r, l); err != nil {
			return err
		}
		if err := refs.listener(l); err != nil {
			return err
		}
		_, err := routeNames(l)
		return err
	case resource.RouteType:
		return unmarshalValid(r, &routev3.RouteConfiguration{})
	case resource.EndpointType:
		return unmarshalValid(r, &endpointv3.ClusterLoadAssignment{})
	case resource.SecretType:
		return unmarshalValid(r, &tlsv3.Secret{})
	}
	return fmt.Errorf("unexpected type %s on the ADS stream", typeURL)
}

func (a adsSubscriber) apply(resp *discoveryv3.DiscoveryResponse) error {
	s := a.s
	switch resp.GetTypeUrl() {
	case resource.ClusterType:
		return s.applyClusters(resp)
	case resource.ListenerType:
		return s.applyListeners(resp)
	case resource.RouteType:
		routes := map[string]*routev3.RouteConfiguration{}
		if err := decodeAll(resp, routes, func() *routev3.RouteConfiguration { return &routev3.RouteConfiguration{} }); err != nil {
			return err
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		for n, r := range routes {
			s.routes[n] = r
		}
		s.versions[typeRoute] = resp.GetVersionInfo()
		return nil
	case resource.EndpointType:
		eps := map[string]loadAssignment{}
		if err := decodeAll(resp, eps, func() loadAssignment { return loadAssignment{&endpointv3.ClusterLoadAssignment{}} }); err != nil {
			return err
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		for n, e := range eps {
			s.endpoints[n] = e.ClusterLoadAssignment
		}
		s.versions[typeEndpoint] = resp.GetVersionInfo()
		return nil
	case resource.SecretType:
		secrets := map[string]*tlsv3.Secret{}
		if err := decodeAll(resp, secrets, func() *tlsv3.Secret { return &tlsv3.Secret{} }); err != nil {
			return err
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		for n, sec := range secrets {
			s.secrets[sdsRef{name: n, source: sourceADS}] = sec
			s.secretVersions[sdsRef{name: n, source: sourceADS}] = resp.GetVersionInfo()
		}
		s.updateStateLocked()
		return nil
	}
	return fmt.Errorf("unexpected type %s on the ADS stream", resp.GetTypeUrl())
}

// named is a resource with a name, as most of Envoy's top-level xDS resources are.
type named interface {
	validMessage
	GetName() string
}

// loadAssignment names a ClusterLoadAssignment by its cluster.
type loadAssignment struct {
	*endpointv3.ClusterLoadAssignment
}

func (l loadAssignment) GetName() string { return l.GetClusterName() }

// decodeAll decodes and checks each resource of a response; one that fails rejects the whole
// response, as a NACK of a state-of-the-world update does.
func decodeAll[T named](resp *discoveryv3.DiscoveryResponse, into map[string]T, newT func() T) error {
	var errs []error
	for _, a := range resp.GetResources() {
		if a.GetTypeUrl() != resp.GetTypeUrl() {
			errs = append(errs, fmt.Errorf("resource of type %s in a %s response", a.GetTypeUrl(), resp.GetTypeUrl()))
			continue
		}
		m := newT()
		if err := unmarshalValid(a, m); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", m.GetName(), err))
			continue
		}
		if _, dup := into[m.GetName()]; dup {
			errs = append(errs, fmt.Errorf("duplicate resource name %q", m.GetName()))
			continue
		}
		into[m.GetName()] = m
	}
	return errors.Join(errs...)
}

func (s *server) applyClusters(resp *discoveryv3.DiscoveryResponse) error {
	clusters := map[string]*clusterv3.Cluster{}
	if err := decodeAll(resp, clusters, func() *clusterv3.Cluster { return &clusterv3.Cluster{} }); err != nil {
		return err
	}
	refs := newSecretRefs(s.boot)
	var eds []string
	for _, c := range clusters {
		if err := refs.cluster(c); err != nil {
			return err
		}
		if n := edsName(c); n != "" {
			eds = append(eds, n)
		}
	}
	sort.Strings(eds)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.clusters = clusters
	s.versions[typeCluster] = resp.GetVersionInfo()
	s.clusterRefs = refs.refs
	s.edsNames = eds
	s.cdsAcked = true
	s.stats.set("cluster_manager.active_clusters", int64(len(s.boot.GetStaticResources().GetClusters())+len(clusters)))
	s.reconcileSecretsLocked()
	s.updateStateLocked()
	s.log.Info("cds: add/update clusters", "count", len(clusters), keyVersion, resp.GetVersionInfo())
	return nil
}

func (s *server) applyListeners(resp *discoveryv3.DiscoveryResponse) error {
	listeners := map[string]*listenerv3.Listener{}
	if err := decodeAll(resp, listeners, func() *listenerv3.Listener { return &listenerv3.Listener{} }); err != nil {
		return err
	}
	refs := newSecretRefs(s.boot)
	var rds []string
	for _, l := range listeners {
		if err := refs.listener(l); err != nil {
			return err
		}
		names, err := routeNames(l)
		if err != nil {
			return err
		}
		rds = append(rds, names...)
	}
	sort.Strings(rds)
	s.mu.Lock()
	defer s.mu.Unlock()
	bindErr := s.bindLocked(listeners)
	s.listenerCfg = listeners
	s.listenerRefs = refs.refs
	s.rdsNames = rds
	if bindErr != nil {
		// Envoy keeps the listeners it could add and rejects the update for the others.
		s.reconcileSecretsLocked()
		return bindErr
	}
	s.ldsAcked = true
	s.versions[typeListener] = resp.GetVersionInfo()
	s.reconcileSecretsLocked()
	s.updateStateLocked()
	s.log.Info("lds: add/update listeners", "count", len(listeners), keyVersion, resp.GetVersionInfo())
	return nil
}

func (s *server) quitquitquit() {
	s.quitOnce.Do(func() { close(s.quit) })
}
