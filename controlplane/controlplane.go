package controlplane

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller"
	caserver "github.com/meshid/meshid/ca/server"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/discovery"
	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/configerr"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/jwtsvidpb"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/meshcapb"
	"github.com/meshid/meshid/internal/version"
)

// shutdownGrace bounds how long in-flight RPCs may run after the context ends.
const shutdownGrace = 5 * time.Second

// Bounds of the gRPC port that its transport enforces (STYLE habit 13), beside the discovery
// server's own. None is reached by a real client: a CSR is about a kilobyte, a discovery request
// Envoy's node (a few kB) and some names; Envoy and Istio's agent open one ADS stream per
// connection, and a CA client a few calls at a time.
const (
	// maxRequestSize bounds one message from a client: a discovery request carries a node of
	// at most discovery.MaxNodeSize and the names it subscribes to.
	maxRequestSize = 4 << 20
	// maxHeaderListSize bounds a call's headers (gRPC's default is 16 MiB): a token is a
	// kilobyte or two.
	maxHeaderListSize = 64 << 10
	// maxStreamsPerConnection is told to the client through HTTP/2, which holds further calls
	// back until one ends.
	maxStreamsPerConnection = 100
	// keepaliveMinTime is the shortest interval between a client's pings before the server
	// sends it away. Istio's clients ping every 30 s or so, with no call open too: gRPC's default
	// policy (5 min, not without a call) would send them away.
	keepaliveMinTime = 5 * time.Second
)

// grpcTransport are the gRPC port's transport bounds. The largest message sent is the largest
// discovery answer, which the discovery server keeps every answer within.
func grpcTransport(cfg Config) admission.Transport {
	return admission.Transport{
		MaxStreamsPerConnection: maxStreamsPerConnection,
		MaxRecvMsgSize:          maxRequestSize,
		MaxSendMsgSize:          discovery.MaxAnswerSize,
		MaxHeaderListSize:       maxHeaderListSize,
		KeepaliveMinTime:        keepaliveMinTime,
		MaxConnectionAge:        cfg.MaxConnectionAge,
		MaxConnectionAgeGrace:   cfg.MaxConnectionAgeGrace,
	}
}

// ControlPlane is a running `meshid ca`. New builds it in stages, each from the finished parts
// of the ones before: the listeners, the stores, the key material and its authority, the
// authenticators, the controllers, the servers. No part is filled in after it is made.
type ControlPlane struct {
	log       *slog.Logger
	clock     clock.Clock
	lis       listeners
	stores    stores
	authority *ca.Authority
	keys      *ca.KeyManager
	issuers   []*token.Issuer // JWT_RULE's, each refreshing its keys in Run
	work      controllers
	discovery *discovery.Server
	newGRPC   func() *grpc.Server // builds grpc in Run: its stream workers are goroutines
	grpc      *grpc.Server
	monitor   *http.Server     // nil without a monitoring address
	upstream  *caclient.Client // nil without an upstream CA
	ready     *atomic.Bool
	readyCh   chan struct{} // closed once Run serves
}

// New opens the listeners, so that the bound addresses are known before Run, then loads or
// creates the CA's key material and builds the servers. What it asks of the network (an upstream
// CA's first certificate, on Kubernetes the cacerts and JWT-SVID key Secrets) is bounded by the
// start timeouts and ends with ctx: a start cut short (SIGTERM) returns ctx's error at once. It
// starts no goroutines; call Run, or Close if Run will not be called.
func New(ctx context.Context, cfg Config) (_ *ControlPlane, err error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	// Bind first: a port in use fails the start before anything is written to the state dir.
	lis, err := listenAll(cfg)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			lis.close()
		}
	}()
	registry := prometheus.NewRegistry()
	registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	st, err := newStores(cfg, registry)
	if err != nil {
		return nil, err
	}
	authority, keys, upstream, err := newAuthority(ctx, cfg, st, registry)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil && upstream != nil {
			_ = upstream.Close()
		}
	}()
	issuers, err := newIssuers(cfg, registry)
	if err != nil {
		return nil, err
	}
	authenticators, err := newAuthenticators(cfg, st.kube, authority, issuers, registry)
	if err != nil {
		return nil, err
	}
	work, err := newControllers(cfg, st, authority, registry)
	if err != nil {
		return nil, err
	}
	jwtSigner, err := newJWTSVIDSigner(ctx, cfg, st)
	if err != nil {
		return nil, err
	}
	newGRPC, disco, err := newServers(cfg, st, authority, jwtSigner, authenticators, work.targeting, registry)
	if err != nil {
		return nil, err
	}
	ready := new(atomic.Bool)
	return &ControlPlane{
		log: cfg.Logger, clock: cfg.Clock, lis: lis, stores: st, authority: authority, keys: keys, issuers: issuers, work: work,
		discovery: disco, newGRPC: newGRPC, monitor: newMonitor(lis.monitoring, registry, authority, ready), upstream: upstream,
		ready: ready, readyCh: make(chan struct{}),
	}, nil
}

// check refuses a configuration that cannot work: its values (Validate), the directories it
// names, and a state dir that is not ours alone. The last comes before anything is read from the
// state dir or written to it, the embedded CA's socket included: keys another user could have
// put there are never used.
func (c *Config) check() error {
	if err := c.Validate(); err != nil {
		return err
	}
	if err := c.checkGivenPaths(); err != nil {
		return err
	}
	if err := ca.CheckStateDir(c.StateDir); err != nil {
		return fmt.Errorf("the CA's state dir: %w", err)
	}
	return nil
}

// withDefaults fills in what New takes from the rest of the configuration: a logger that
// discards, the real clock, the self-signed CA's organisation.
func (c Config) withDefaults() Config {
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	c.Clock = clock.OrReal(c.Clock)
	if c.SelfSigned.Org == "" {
		c.SelfSigned.Org = c.TrustDomain
	}
	if c.Upstream.StartTimeout <= 0 {
		c.Upstream.StartTimeout = DefaultUpstreamStartTimeout
	}
	return c
}

// listeners are the control plane's open listeners.
type listeners struct {
	grpc net.Listener
	// grpcSocket is the socket of a unix:// address, removed once the server has stopped.
	grpcSocket *fsutil.Socket
	monitoring net.Listener // nil without a monitoring address
}

// listenAll opens the gRPC and monitoring listeners.
func listenAll(cfg Config) (listeners, error) {
	var l listeners
	var err error
	if l.grpc, l.grpcSocket, err = fsutil.ListenAddr(cfg.GRPCAddr, cfg.Logger); err != nil {
		return listeners{}, fmt.Errorf("listen for gRPC on %s: %w", cfg.GRPCAddr, err)
	}
	if cfg.MonitoringAddr != "" {
		if l.monitoring, err = net.Listen("tcp", cfg.MonitoringAddr); err != nil {
			l.close()
			return listeners{}, fmt.Errorf("listen for monitoring on %s: %w", cfg.MonitoringAddr, err)
		}
	}
	return l, nil
}

func (l listeners) close() {
	if l.grpcSocket != nil {
		l.grpcSocket.Close()
	} else {
		_ = l.grpc.Close()
	}
	if l.monitoring != nil {
		_ = l.monitoring.Close()
	}
}

// stores are what the control plane reads: the namespaces and service accounts (local
// manifests, or the Kubernetes API), and the discovery configuration. They are built before the
// key material, so that a wrong --manifests or --xds-config fails the start with nothing written
// to the state dir.
type stores struct {
	manifests *controller.Manifests // nil without --manifests
	kube      *onKubernetes         // nil off Kubernetes
	xds       *discovery.Config     // empty without --xds-config
}

func newStores(cfg Config, reg prometheus.Registerer) (stores, error) {
	var st stores
	var err error
	if cfg.Manifests != "" {
		if st.manifests, err = controller.NewManifests(controller.ManifestsConfig{
			Dir: cfg.Manifests, Clock: cfg.Clock, Logger: cfg.Logger.With(logkey.Component, "manifests"),
		}); err != nil {
			return stores{}, &configerr.FieldError{Field: "Manifests", Err: err}
		}
		if err := controller.RegisterManifestProblems(reg, st.manifests); err != nil {
			return stores{}, err
		}
	}
	if cfg.XDSConfig != "" {
		if st.xds, err = discovery.LoadConfig(cfg.XDSConfig); err != nil {
			return stores{}, err
		}
	} else {
		// Envoy gets an empty configuration rather than Unimplemented at every stream, which it
		// would retry for ever with no listener up; said once here, not per stream.
		st.xds = discovery.EmptyConfig()
		cfg.logNoXDSConfig()
	}
	if cfg.Kubernetes.Enabled() {
		if st.kube, err = newOnKubernetes(cfg, reg); err != nil {
			return stores{}, err
		}
	}
	return st, nil
}

// namespaces is the store of namespaces and service accounts, or nil without one: a nil
// interface, not a nil *Manifests, since no store knows no namespace.
func (s stores) namespaces() controller.Store {
	switch {
	case s.manifests != nil:
		return s.manifests
	case s.kube != nil:
		return s.kube.store
	}
	return nil
}

// nodeAuthorizer is what checks, on Kubernetes, that a node agent asks for a workload of its
// node; nil elsewhere (a nil interface: no pods to check).
func (s stores) nodeAuthorizer() caserver.NodeAuthorizer {
	if s.kube != nil && s.kube.nodePods != nil {
		return s.kube.nodePods
	}
	return nil
}

// newAuthority loads or creates the CA's key material (on Kubernetes, from the cacerts Secret
// unless the mounted files hold a complete bundle; with an upstream CA, from the state dir or the
// upstream) and returns the authority that signs with it, the key manager that keeps it current,
// and the client of the upstream CA (nil without one), which the caller closes.
func newAuthority(ctx context.Context, cfg Config, st stores, reg prometheus.Registerer) (_ *ca.Authority, _ *ca.KeyManager, _ *caclient.Client, err error) {
	var (
		initial       *ca.Bundle
		initialOrigin ca.Origin
		upstream      *ca.Upstream
		client        *caclient.Client
	)
	defer func() {
		if err != nil && client != nil {
			_ = client.Close()
		}
	}()
	switch {
	case cfg.Upstream.Enabled():
		if client, upstream, err = newUpstream(cfg, reg); err != nil {
			return nil, nil, nil, err
		}
		ctx, cancel := context.WithTimeout(ctx, cfg.Upstream.StartTimeout)
		initial, initialOrigin, err = upstream.Load(ctx)
		cancel()
		if err != nil {
			return nil, nil, nil, fmt.Errorf("load CA key material: %w", err)
		}
	case st.kube != nil:
		if initial, initialOrigin, err = st.kube.initialBundle(ctx, cfg.CACertsDir, cfg.Clock.Now()); err != nil {
			return nil, nil, nil, fmt.Errorf("load CA key material: %w", err)
		}
	}
	authority := ca.New(ca.Config{Clock: cfg.Clock, DefaultTTL: cfg.WorkloadCertTTL, MaxTTL: cfg.MaxWorkloadCertTTL,
		CACertIdentities: cfg.caCertIdentities()}, nil)
	keys, err := ca.NewKeyManager(ca.KeyManagerConfig{
		Authority:             authority,
		CACertsDir:            cfg.CACertsDir,
		StateDir:              cfg.StateDir,
		SelfSigned:            cfg.SelfSigned,
		RootCheckInterval:     cfg.RootCheckInterval,
		RootRotationThreshold: cfg.RootRotationThreshold,
		TrustBundleOverlap:    cfg.TrustBundleOverlap,
		Debounce:              cfg.CACertsDebounce,
		Clock:                 cfg.Clock,
		Logger:                cfg.Logger.With(logkey.Component, "ca"),
		Registerer:            reg,
		OnEvent:               cfg.OnKeyEvent,
		Initial:               initial,
		InitialOrigin:         initialOrigin,
		Upstream:              upstream,
	})
	if err != nil {
		return nil, nil, nil, fmt.Errorf("load CA key material: %w", err)
	}
	bundle := authority.Bundle()
	cfg.Logger.Info("CA key material loaded",
		logkey.Source, string(keys.Origin()),
		logkey.Subject, bundle.SigningCert().Subject.String(),
		logkey.NotAfter, bundle.NotAfter(),
		logkey.Root, bundle.Root().Subject.String(),
		logkey.TrustedRoots, len(bundle.Roots()),
		logkey.Path, ca.RootCertPath(cfg.StateDir))
	if err := ca.RegisterMetrics(reg, authority); err != nil {
		return nil, nil, nil, err
	}
	return authority, keys, client, nil
}

// newUpstream returns the client of the upstream CA and what obtains and renews the signing
// certificate through it. The client reads the token at every request: it rotates.
func newUpstream(cfg Config, reg prometheus.Registerer) (*caclient.Client, *ca.Upstream, error) {
	log := cfg.Logger.With(logkey.Component, "upstream-ca")
	client, err := caclient.New(caclient.Config{
		Address:      cfg.Upstream.Address,
		RootCertFile: cfg.Upstream.RootCertFile,
		TokenPath:    cfg.Upstream.TokenPath,
		Clock:        cfg.Clock,
		Logger:       log,
	})
	if err != nil {
		return nil, nil, err
	}
	upstream, err := ca.NewUpstream(ca.UpstreamConfig{
		Signer:       client,
		Address:      cfg.Upstream.Address,
		RootCertFile: cfg.Upstream.RootCertFile,
		StateDir:     cfg.StateDir,
		TTL:          cfg.Upstream.RequestedTTL,
		KeyAlgorithm: cfg.SelfSigned.KeyAlgorithm,
		RSAKeySize:   cfg.SelfSigned.RSAKeySize,
		Clock:        cfg.Clock,
		Logger:       log,
		Registerer:   reg,
	})
	if err != nil {
		_ = client.Close()
		return nil, nil, err
	}
	return client, upstream, nil
}

// controllers are what works over the stores: namespace targeting, the service-account secret
// controller, and on Kubernetes what the elected replica runs besides it.
type controllers struct {
	targeting *controller.Targeting
	leader    *leaderWork          // nil off Kubernetes
	secrets   *controller.Secrets  // nil without a store of service accounts
	probe     *fsutil.LivenessFile // nil without a liveness probe path
}

func newControllers(cfg Config, st stores, authority *ca.Authority, reg prometheus.Registerer) (controllers, error) {
	store := st.namespaces()
	var namespaces controller.NamespaceStore // a nil Store must stay a nil interface
	if store != nil {
		namespaces = store
	}
	c := controllers{targeting: controller.NewTargeting(controller.TargetingConfig{
		Store:            namespaces,
		CANamespace:      cfg.CANamespace,
		EnabledByDefault: cfg.EnableNamespacesByDefault,
		Logger:           cfg.Logger.With(logkey.Component, "targeting"),
	})}
	var err error
	if st.kube != nil {
		if c.leader, err = st.kube.newLeaderWork(cfg, c.targeting, authority, reg); err != nil {
			return controllers{}, err
		}
	}
	if store == nil {
		return c, nil
	}
	// The secret controller keeps its secrets as Kubernetes Secrets, or in directories under the
	// state dir.
	var secretStore controller.SecretStore
	if c.leader != nil {
		secretStore = c.leader.secretStore
	} else {
		secretStore = controller.NewFileSecrets(ca.SecretsDir(cfg.StateDir))
	}
	if c.secrets, err = newSecrets(cfg, store, secretStore, c.targeting, authority, reg); err != nil {
		return controllers{}, err
	}
	if cfg.Secrets.LivenessProbePath != "" {
		c.probe = &fsutil.LivenessFile{Path: cfg.Secrets.LivenessProbePath, Interval: cfg.Secrets.LivenessProbeInterval,
			Healthy: c.secrets.Healthy, Clock: cfg.Clock, Logger: cfg.Logger.With(logkey.Component, "liveness-probe")}
	}
	return c, nil
}

// newServers builds what answers on the gRPC port: the CA protocol and the discovery server
// (serving --xds-config, else an empty configuration), which authorizes its callers as the CA
// does. The gRPC server itself is made by the returned function, in Run.
func newServers(cfg Config, st stores, authority *ca.Authority, jwtSigner *ca.JWTSVIDSigner, authenticators []caserver.Authenticator,
	targeting *controller.Targeting, reg prometheus.Registerer) (func() *grpc.Server, *discovery.Server, error) {
	metrics, err := caserver.NewMetrics(reg)
	if err != nil {
		return nil, nil, err
	}
	serving := caserver.NewServingCertificate(authority, cfg.GRPCHostIdentities, cfg.Clock)
	caServer := caserver.New(caserver.Config{
		Signer:         authority,
		Authenticators: authenticators,
		Targeting:      targeting,
		Metrics:        metrics,
		Logger:         cfg.Logger.With(logkey.Component, "ca-server"),
		Clock:          cfg.Clock,

		TrustedNodeAccounts: cfg.nodeAccounts(),
		Nodes:               st.nodeAuthorizer(),
	})
	disco, err := discovery.NewServer(discovery.ServerConfig{
		ConfigPath:              cfg.XDSConfig,
		Initial:                 st.xds,
		Authorizer:              credentialNamespace{caServer},
		MaxStreams:              cfg.XDSMaxStreams,
		MaxStreamsPerCredential: cfg.XDSMaxStreamsPerCredential,
		Clock:                   cfg.Clock,
		Logger:                  cfg.Logger.With(logkey.Component, "discovery"),
		Registerer:              reg,
	})
	if err != nil {
		return nil, nil, err
	}
	if len(cfg.TrustedNodeAccounts) > 0 {
		// Said once: off Kubernetes nothing narrows what a trusted node account may ask for.
		cfg.Logger.Info("trusted node accounts may ask for other identities", logkey.ServiceAccounts, cfg.TrustedNodeAccounts,
			logkey.NodeCheck, st.nodeAuthorizer() != nil)
	}
	cfg.Logger.Info("CA serving certificate hosts", logkey.Hosts, serving.Hosts(), logkey.TrustDomain, cfg.TrustDomain)
	transport := grpcTransport(cfg)
	return func() *grpc.Server {
		opts := append(caserver.GRPCServerOptions(), transport.ServerOptions()...)
		grpcServer := grpc.NewServer(append(opts, grpc.Creds(credentials.NewTLS(&tls.Config{
			MinVersion:     tls.VersionTLS12,
			GetCertificate: serving.GetCertificate,
			// Client certificates are verified per call by the mTLS authenticator, against the
			// trust bundle in service then; callers with only a token present none.
			ClientAuth: tls.RequestClientCert,
		})))...)
		pb.RegisterIstioCertificateServiceServer(grpcServer, caServer)
		// The Mesh CA protocol (agents with CA_PROVIDER=GoogleCA), on the same pipeline.
		meshcapb.RegisterMeshCertificateServiceServer(grpcServer, caServer.MeshCA())
		// JWT-SVIDs (the agents' Workload API), on the same pipeline.
		jwtsvidpb.RegisterJWTSVIDServiceServer(grpcServer, caServer.JWTSVID(jwtSigner))
		disco.Register(grpcServer)
		return grpcServer
	}, disco, nil
}

// newJWTSVIDSigner loads the JWT-SVID key, or creates it at the first start: on Kubernetes in a
// Secret that every replica shares, elsewhere in the state dir.
func newJWTSVIDSigner(ctx context.Context, cfg Config, st stores) (*ca.JWTSVIDSigner, error) {
	if st.kube != nil {
		return st.kube.jwtSVIDSigner(ctx, cfg)
	}
	signer, created, err := ca.LoadOrCreateJWTSVIDSigner(cfg.StateDir, cfg.TrustDomain, cfg.JWTSVIDTTL)
	if err != nil {
		return nil, err
	}
	logJWTSVIDKey(cfg, signer, created, logkey.Path, ca.JWTSVIDKeyPath(cfg.StateDir))
	return signer, nil
}

// logJWTSVIDKey says where the JWT-SVID key came from and its kid; never the key.
func logJWTSVIDKey(cfg Config, signer *ca.JWTSVIDSigner, created bool, whereKey, where string) {
	msg := "JWT-SVID signing key loaded"
	if created {
		msg = "JWT-SVID signing key created"
	}
	cfg.Logger.Info(msg, whereKey, where, logkey.KeyID, signer.KeyID(cfg.Clock.Now()), logkey.Duration, signer.TTL())
}

// newMonitor returns the monitoring server, or nil without its listener.
func newMonitor(lis net.Listener, registry *prometheus.Registry, authority *ca.Authority, ready *atomic.Bool) *http.Server {
	if lis == nil {
		return nil
	}
	return &http.Server{Handler: monitoringHandler(registry, authority, ready), ReadHeaderTimeout: 10 * time.Second}
}

func newSecrets(cfg Config, store controller.Store, secrets controller.SecretStore, targeting *controller.Targeting, authority *ca.Authority,
	reg prometheus.Registerer) (*controller.Secrets, error) {
	var dns map[string][]string
	if cfg.Secrets.AppendDNSNames {
		var err error
		if dns, err = controller.DNSNames(cfg.CANamespace, cfg.Secrets.CustomDNSNames); err != nil {
			return nil, &configerr.FieldError{Field: "Secrets.CustomDNSNames", Err: err}
		}
	}
	return controller.NewSecrets(controller.SecretsConfig{
		Store:            store,
		Targeting:        targeting,
		Signer:           authority,
		Secrets:          secrets,
		TrustDomain:      cfg.TrustDomain,
		Namespace:        cfg.Secrets.ListenedNamespace,
		CertTTL:          cfg.WorkloadCertTTL,
		GracePeriodRatio: cfg.Secrets.GracePeriodRatio,
		MinGracePeriod:   cfg.Secrets.MinGracePeriod,
		DNSNames:         dns,
		ResyncInterval:   cfg.Secrets.ResyncInterval,
		Clock:            cfg.Clock,
		Logger:           cfg.Logger.With(logkey.Component, "secrets"),
		Registerer:       reg,
		OnEvent:          cfg.Secrets.OnEvent,
	})
}

// newAuthenticators returns how callers prove who they are, in the order tried: a JWT of an
// external issuer (JWT_RULE), a JWT checked offline (with --jwt-keys, or off Kubernetes the state dir's own token key), a JWT checked by the
// API server's TokenReview (on Kubernetes), a client certificate this CA issued.
func newAuthenticators(cfg Config, k *onKubernetes, authority *ca.Authority, issuers []*token.Issuer, reg prometheus.Registerer) ([]caserver.Authenticator, error) {
	var authenticators []caserver.Authenticator
	if len(issuers) > 0 {
		authenticators = append(authenticators, caserver.NewIssuerAuthenticator(issuerVerifiers(issuers), cfg.TrustDomain))
	}
	if cfg.JWTKeysFile != "" || k == nil {
		keys, err := token.TrustedKeys(cfg.JWTKeysFile, ca.TokenKeyPath(cfg.StateDir), cfg.Logger)
		if err != nil {
			return nil, err
		}
		verifier, err := token.NewVerifier(token.VerifierConfig{Keys: keys, Audience: cfg.JWTAudience, Issuer: cfg.JWTIssuer, Now: cfg.Clock.Now})
		if err != nil {
			return nil, err
		}
		authenticators = append(authenticators, caserver.NewJWTAuthenticator(verifier, cfg.TrustDomain))
	}
	if k != nil {
		reviews, err := k.tokenReviews(cfg, reg)
		if err != nil {
			return nil, err
		}
		authenticators = append(authenticators, reviews)
	}
	return append(authenticators, caserver.NewMTLSAuthenticator(authority, cfg.TrustDomain, cfg.Clock)), nil
}

// GRPCAddr returns the address the CA protocol is served on: HOST:PORT, or unix:///path.
func (c *ControlPlane) GRPCAddr() string {
	if c.lis.grpc.Addr().Network() == "unix" {
		return fsutil.UnixScheme + c.lis.grpc.Addr().String()
	}
	return c.lis.grpc.Addr().String()
}

// MonitoringAddr returns the monitoring server's address, or "" when it is disabled.
func (c *ControlPlane) MonitoringAddr() string {
	if c.lis.monitoring == nil {
		return ""
	}
	return c.lis.monitoring.Addr().String()
}

// Close releases the listeners (and the upstream CA's connection) of a control plane that will
// not Run.
func (c *ControlPlane) Close() {
	c.lis.close()
	c.closeUpstream()
}

func (c *ControlPlane) closeUpstream() {
	if c.upstream != nil {
		_ = c.upstream.Close()
	}
}

// Ready is closed once Run serves and watches the plugged-in CA files.
func (c *ControlPlane) Ready() <-chan struct{} { return c.readyCh }

// Authority returns the CA core.
func (c *ControlPlane) Authority() *ca.Authority { return c.authority }

// Namespaces returns the store namespace targeting reads, or nil without one.
func (c *ControlPlane) Namespaces() controller.Store { return c.stores.namespaces() }

// credentialNamespace gives the discovery server the namespace of a caller's credential, as
// the CA authorizes it for a certificate: authenticated, and its namespace served by this
// instance.
type credentialNamespace struct{ ca *caserver.Server }

func (c credentialNamespace) Authorize(ctx context.Context) (discovery.Caller, error) {
	caller, err := c.ca.Authorize(ctx)
	if err != nil {
		return discovery.Caller{}, err
	}
	return discovery.Caller{Identity: caller.Identity, Method: caller.Method, Credential: caller.Credential}, nil
}

func (c credentialNamespace) Serves(ctx context.Context, caller discovery.Caller) error {
	return c.ca.Serves(ctx, caserver.Caller{Identity: caller.Identity, Method: caller.Method, Credential: caller.Credential})
}

// Run serves until ctx ends, then stops the servers, giving in-flight requests a short grace.
func (c *ControlPlane) Run(ctx context.Context) error {
	c.grpc = c.newGRPC()
	g, ctx := errgroup.WithContext(ctx)
	if c.stores.manifests != nil {
		g.Go(func() error { return c.stores.manifests.Run(ctx) })
	}
	g.Go(func() error { return c.keys.Run(ctx) })
	for _, iss := range c.issuers {
		g.Go(func() error { return iss.Run(ctx) })
	}
	g.Go(func() error { return c.discovery.Run(ctx) })
	if c.stores.kube != nil {
		c.stores.kube.run(ctx, g, c.keys, c.work.leader, c.work.secrets)
	} else if c.work.secrets != nil {
		g.Go(func() error { return c.work.secrets.Run(ctx) })
	}
	if c.work.probe != nil {
		g.Go(func() error { return c.work.probe.Run(ctx) })
	}
	g.Go(func() error {
		err := c.grpc.Serve(c.lis.grpc)
		// The stop below may run before Serve begins (a stop as soon as Ready, say, since Ready
		// does not wait for Serve): Serve then returns ErrServerStopped at once. Only our stop
		// stops the server, and only once ctx has ended; that is a clean stop.
		if err == nil || errors.Is(err, grpc.ErrServerStopped) && ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("serve gRPC: %w", err)
	})
	if c.monitor != nil {
		g.Go(func() error {
			if err := c.monitor.Serve(c.lis.monitoring); err != nil && !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("serve monitoring: %w", err)
			}
			return nil
		})
	}
	readyDecided := make(chan struct{})
	g.Go(func() error {
		<-ctx.Done()
		<-readyDecided // so that readiness cannot be raised after it is lowered here
		c.ready.Store(false)
		c.stop(ctx)
		return nil
	})
	g.Go(func() error {
		defer close(readyDecided)
		select {
		case <-c.keys.Ready(): // the cacerts files are watched: a change from now on is seen
		case <-ctx.Done():
			return nil
		}
		if c.stores.kube != nil {
			// Targeting answers only from a complete view of the namespaces, node
			// authorization from one of the pods.
			select {
			case <-c.stores.kube.store.Synced():
			case <-ctx.Done():
				return nil
			}
			if np := c.stores.kube.nodePods; np != nil {
				select {
				case <-np.Synced():
				case <-ctx.Done():
					return nil
				}
			}
		}
		if ctx.Err() != nil { // both at once: stopping wins
			return nil
		}
		c.ready.Store(true)
		close(c.readyCh)
		return nil
	})
	c.log.Info("CA started", logkey.Address, c.GRPCAddr(), logkey.MonitoringAddress, c.MonitoringAddr(), logkey.Version, version.Version())
	err := g.Wait()
	c.closeUpstream()
	if c.lis.grpcSocket != nil {
		c.lis.grpcSocket.Remove() // the server has closed its listener
	}
	c.log.Info("CA stopped")
	return err
}

// stop stops the servers once ctx has ended, giving in-flight requests shutdownGrace on the
// injected clock.
func (c *ControlPlane) stop(ctx context.Context) {
	stopped := make(chan struct{})
	go func() {
		c.grpc.GracefulStop()
		close(stopped)
	}()
	timer := c.clock.NewTimer(shutdownGrace)
	defer timer.Stop()
	select {
	case <-stopped:
	case <-timer.C():
		c.grpc.Stop()
		<-stopped
	}
	if c.monitor != nil {
		ctx, cancel := c.graceContext(ctx)
		defer cancel()
		_ = c.monitor.Shutdown(ctx)
	}
}

// graceContext returns a context, not done with ctx, that ends shutdownGrace from now on the
// control plane's clock.
func (c *ControlPlane) graceContext(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	timer := c.clock.NewTimer(shutdownGrace)
	go func() {
		defer timer.Stop()
		select {
		case <-timer.C():
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}

func monitoringHandler(registry *prometheus.Registry, authority *ca.Authority, ready *atomic.Bool) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{Registry: registry}))
	mux.HandleFunc("GET /version", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = fmt.Fprintln(w, version.String())
	})
	mux.HandleFunc("GET /debug/ca", func(w http.ResponseWriter, _ *http.Request) {
		b := authority.Bundle()
		if b == nil {
			http.Error(w, "not ready: no key material", http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(describeBundle(b))
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /healthz/ready", func(w http.ResponseWriter, _ *http.Request) {
		if !ready.Load() || authority.Bundle() == nil {
			http.Error(w, "not ready: the CA is not serving", http.StatusServiceUnavailable)
			return
		}
		_, _ = fmt.Fprintln(w, "ready")
	})
	return mux
}

// bundleStatus is what /debug/ca shows of the key material in service: certificates only, which
// every caller of the CA receives anyway.
type bundleStatus struct {
	Source  string       `json:"source"`
	Signing certStatus   `json:"signing_cert"`
	Chain   []certStatus `json:"chain"` // signing certificate first, root last
	Roots   []certStatus `json:"trusted_roots"`
	// NotAfter is the earliest expiry along the chain: no certificate is issued past it.
	NotAfter time.Time `json:"not_after"`
}

type certStatus struct {
	Subject   string    `json:"subject"`
	Issuer    string    `json:"issuer"`
	Serial    string    `json:"serial"`
	NotBefore time.Time `json:"not_before"`
	NotAfter  time.Time `json:"not_after"`
}

func describeBundle(b *ca.Bundle) bundleStatus {
	describe := func(c *x509.Certificate) certStatus {
		return certStatus{Subject: c.Subject.String(), Issuer: c.Issuer.String(), Serial: c.SerialNumber.Text(16), NotBefore: c.NotBefore, NotAfter: c.NotAfter}
	}
	s := bundleStatus{Source: string(b.Source()), Signing: describe(b.SigningCert()), NotAfter: b.NotAfter()}
	for _, c := range b.Chain() {
		s.Chain = append(s.Chain, describe(c))
	}
	for _, c := range b.Roots() {
		s.Roots = append(s.Roots, describe(c))
	}
	return s
}
