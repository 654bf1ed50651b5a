package controlplane

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strings"
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
	"github.com/meshid/meshid/discovery"
	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
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

// ControlPlane is a running `meshid ca`.
type ControlPlane struct {
	log       *slog.Logger
	clock     clock.Clock
	authority *ca.Authority
	keys      *ca.KeyManager
	grpc      *grpc.Server
	newGRPC   func() *grpc.Server // builds grpc in Run: its stream workers are goroutines
	grpcLis   net.Listener
	// grpcSocket is the socket of a unix:// address, removed once the server has stopped.
	grpcSocket *fsutil.Socket
	monitor    *http.Server
	monLis     net.Listener
	manifests  *controller.Manifests // nil without --manifests
	kube       *onKubernetes         // nil off Kubernetes
	discovery  *discovery.Server     // nil without --xds-config
	secrets    *controller.Secrets   // nil without a store of service accounts
	probe      *livenessProbe        // nil without a liveness probe path
	ready      atomic.Bool
	readyCh    chan struct{} // closed once Run serves
}

// New opens the listeners, so that the bound addresses are known before Run, then loads or
// creates the CA's key material and builds the servers. It starts no goroutines; call Run, or
// Close if Run will not be called.
func New(cfg Config) (_ *ControlPlane, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := cfg.checkGivenPaths(); err != nil {
		return nil, err
	}
	// Before anything is read from the state dir or written to it, the embedded CA's socket
	// included: keys another user could have put there are never used.
	if err := CheckStateDir(cfg.StateDir); err != nil {
		return nil, fmt.Errorf("the CA's state dir: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	clk := clock.OrReal(cfg.Clock)
	if cfg.SelfSigned.Org == "" {
		cfg.SelfSigned.Org = cfg.TrustDomain
	}

	// Bind first: a port in use fails the start before anything is written to the state dir.
	cp := &ControlPlane{log: log, clock: clk, readyCh: make(chan struct{})}
	if cp.grpcLis, cp.grpcSocket, err = listen(cfg.GRPCAddr, log); err != nil {
		return nil, fmt.Errorf("listen for gRPC on %s: %w", cfg.GRPCAddr, err)
	}
	defer func() {
		if err != nil {
			cp.Close()
		}
	}()
	if cfg.MonitoringAddr != "" {
		if cp.monLis, err = net.Listen("tcp", cfg.MonitoringAddr); err != nil {
			return nil, fmt.Errorf("listen for monitoring on %s: %w", cfg.MonitoringAddr, err)
		}
	}

	registry := prometheus.NewRegistry()
	registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	// Before the key material: a wrong --manifests fails the start before the state dir is written.
	var store controller.Store // nil, not a nil *Manifests: no store knows no namespace
	if cfg.Manifests != "" {
		if cp.manifests, err = controller.NewManifests(controller.ManifestsConfig{
			Dir: cfg.Manifests, Clock: clk, Logger: log.With(logkey.Component, "manifests"),
		}); err != nil {
			return nil, fmt.Errorf("--manifests: %w", err)
		}
		store = cp.manifests
		registerManifestProblems(registry, cp.manifests)
	}
	// Before the key material too: a bad --xds-config fails the start with nothing written.
	discoveryAuth := &credentialNamespace{}
	if cfg.XDSConfig != "" {
		if cp.discovery, err = discovery.NewServer(discovery.ServerConfig{
			ConfigPath:              cfg.XDSConfig,
			Authorizer:              discoveryAuth,
			MaxStreams:              cfg.XDSMaxStreams,
			MaxStreamsPerCredential: cfg.XDSMaxStreamsPerCredential,
			Clock:                   clk,
			Logger:                  log.With(logkey.Component, "discovery"),
			Registerer:              registry,
		}); err != nil {
			return nil, err
		}
	}
	var (
		initial       *ca.Bundle
		initialOrigin ca.Origin
	)
	if cfg.Kubernetes.Enabled() {
		if cp.kube, err = newOnKubernetes(cfg, clk, log, registry); err != nil {
			return nil, err
		}
		store = cp.kube.store
		if initial, initialOrigin, err = cp.kube.initialBundle(cfg.CACertsDir, clk.Now()); err != nil {
			return nil, fmt.Errorf("load CA key material: %w", err)
		}
	}

	authority := ca.New(ca.Config{Clock: clk, DefaultTTL: cfg.WorkloadCertTTL, MaxTTL: cfg.MaxWorkloadCertTTL}, nil)
	keys, err := ca.NewKeyManager(ca.KeyManagerConfig{
		Authority:             authority,
		CACertsDir:            cfg.CACertsDir,
		StateDir:              cfg.StateDir,
		SelfSigned:            cfg.SelfSigned,
		RootCheckInterval:     cfg.RootCheckInterval,
		RootRotationThreshold: cfg.RootRotationThreshold,
		TrustBundleOverlap:    cfg.TrustBundleOverlap,
		Debounce:              cfg.CACertsDebounce,
		Clock:                 clk,
		Logger:                log.With(logkey.Component, "ca"),
		Registerer:            registry,
		OnEvent:               cfg.OnKeyEvent,
		Initial:               initial,
		InitialOrigin:         initialOrigin,
	})
	if err != nil {
		return nil, fmt.Errorf("load CA key material: %w", err)
	}
	bundle := authority.Bundle()
	log.Info("CA key material loaded",
		logkey.Source, string(keys.Origin()),
		logkey.Subject, bundle.SigningCert().Subject.String(),
		logkey.NotAfter, bundle.NotAfter(),
		logkey.Root, bundle.Root().Subject.String(),
		logkey.TrustedRoots, len(bundle.Roots()),
		logkey.Path, RootCertPath(cfg.StateDir))

	authenticators, err := newAuthenticators(cfg, cp.kube, authority, clk, log, registry)
	if err != nil {
		return nil, err
	}

	if err := ca.RegisterMetrics(registry, authority); err != nil {
		return nil, err
	}
	metrics, err := caserver.NewMetrics(registry)
	if err != nil {
		return nil, err
	}

	var namespaces controller.NamespaceStore // a nil Store must stay a nil interface
	if store != nil {
		namespaces = store
	}
	targeting := controller.NewTargeting(controller.TargetingConfig{
		Store:            namespaces,
		CANamespace:      cfg.CANamespace,
		EnabledByDefault: cfg.EnableNamespacesByDefault,
		Logger:           log.With(logkey.Component, "targeting"),
	})
	if cp.kube != nil {
		if err := cp.kube.newLeaderWork(cfg, targeting, authority, log, registry); err != nil {
			return nil, err
		}
	}
	if store != nil {
		if cp.secrets, err = newSecrets(cfg, store, cp.secretStore(cfg), targeting, authority, clk, log, registry); err != nil {
			return nil, err
		}
		if cp.kube != nil {
			cp.kube.secrets = cp.secrets
		}
		if cfg.Secrets.LivenessProbePath != "" {
			cp.probe = &livenessProbe{path: cfg.Secrets.LivenessProbePath, interval: cfg.Secrets.LivenessProbeInterval,
				healthy: cp.secrets.Healthy, clock: clk, log: log.With(logkey.Component, "liveness-probe")}
		}
	}

	serving := caserver.NewServingCertificate(authority, cfg.GRPCHostIdentities, clk)
	caServer := caserver.New(caserver.Config{
		Signer:         authority,
		Authenticators: authenticators,
		Targeting:      targeting,
		Metrics:        metrics,
		Logger:         log.With(logkey.Component, "ca-server"),
		Clock:          clk,
	})
	if cp.discovery != nil {
		discoveryAuth.ca = caServer
	}
	transport := grpcTransport(cfg)
	cp.newGRPC = func() *grpc.Server {
		opts := append(caserver.GRPCServerOptions(), transport.ServerOptions()...)
		grpcServer := grpc.NewServer(append(opts, grpc.Creds(credentials.NewTLS(&tls.Config{
			MinVersion:     tls.VersionTLS12,
			GetCertificate: serving.GetCertificate,
			// Client certificates are verified per call by the mTLS authenticator, against the
			// trust bundle in service then; callers with only a token present none.
			ClientAuth: tls.RequestClientCert,
		})))...)
		pb.RegisterIstioCertificateServiceServer(grpcServer, caServer)
		if cp.discovery != nil {
			cp.discovery.Register(grpcServer)
		}
		return grpcServer
	}

	cp.authority, cp.keys = authority, keys
	if cp.monLis != nil {
		cp.monitor = &http.Server{Handler: cp.monitoringHandler(registry), ReadHeaderTimeout: 10 * time.Second}
	}
	log.Info("CA serving certificate hosts", logkey.Hosts, serving.Hosts(), logkey.TrustDomain, cfg.TrustDomain)
	return cp, nil
}

func newSecrets(cfg Config, store controller.Store, secrets controller.SecretStore, targeting *controller.Targeting, authority *ca.Authority,
	clk clock.Clock, log *slog.Logger, reg prometheus.Registerer) (*controller.Secrets, error) {
	var dns map[string][]string
	if cfg.Secrets.AppendDNSNames {
		var err error
		if dns, err = controller.DNSNames(cfg.CANamespace, cfg.Secrets.CustomDNSNames); err != nil {
			return nil, fmt.Errorf("--custom-dns-names: %w", err)
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
		Clock:            clk,
		Logger:           log.With(logkey.Component, "secrets"),
		Registerer:       reg,
		OnEvent:          cfg.Secrets.OnEvent,
	})
}

// newAuthenticators returns how callers prove who they are, in the order tried: a JWT checked
// offline (with --jwt-keys, or off Kubernetes the state dir's own token key), a JWT checked by the
// API server's TokenReview (on Kubernetes), a client certificate this CA issued.
func newAuthenticators(cfg Config, k *onKubernetes, authority *ca.Authority, clk clock.Clock, log *slog.Logger,
	reg prometheus.Registerer) ([]caserver.Authenticator, error) {
	var authenticators []caserver.Authenticator
	if cfg.JWTKeysFile != "" || k == nil {
		verifier, err := newTokenVerifier(cfg, clk, log)
		if err != nil {
			return nil, err
		}
		authenticators = append(authenticators, caserver.NewJWTAuthenticator(verifier, cfg.TrustDomain))
	}
	if k != nil {
		reviews, err := k.tokenReviews(cfg, clk, reg)
		if err != nil {
			return nil, err
		}
		authenticators = append(authenticators, reviews)
	}
	return append(authenticators, caserver.NewMTLSAuthenticator(authority, cfg.TrustDomain, clk)), nil
}

func newTokenVerifier(cfg Config, clk clock.Clock, log *slog.Logger) (*token.Verifier, error) {
	var keys *token.KeySet
	if cfg.JWTKeysFile != "" {
		ks, err := token.LoadKeySet(cfg.JWTKeysFile)
		if err != nil {
			return nil, err
		}
		keys = ks
		log.Info("trusting token issuer keys", logkey.Path, cfg.JWTKeysFile, logkey.Keys, ks.Len())
	} else {
		path := TokenKeyPath(cfg.StateDir)
		key, created, err := token.LoadOrCreateKey(path)
		if err != nil {
			return nil, err
		}
		kid, err := pki.KeyID(key.Public())
		if err != nil {
			return nil, err
		}
		if keys, err = token.NewKeySet(key.Public()); err != nil {
			return nil, err
		}
		log.Info("trusting the local token signing key", logkey.Path, path, logkey.KeyID, kid, logkey.Created, created)
	}
	return token.NewVerifier(token.VerifierConfig{
		Keys:     keys,
		Audience: cfg.JWTAudience,
		Issuer:   cfg.JWTIssuer,
		Now:      clk.Now,
	})
}

// listen opens a TCP address, or for "unix:///path" a private Unix socket through the servers'
// one socket listener (a stale socket file replaced, a live one refused, the file removed at the
// end only while it is still ours), in a directory created private when missing.
func listen(addr string, log *slog.Logger) (net.Listener, *fsutil.Socket, error) {
	path, ok := strings.CutPrefix(addr, unixScheme)
	if !ok {
		lis, err := net.Listen("tcp", addr)
		return lis, nil, err
	}
	// The embedding agent puts the socket in the state dir, which a first start has not made yet.
	if err := fsutil.EnsureDir(filepath.Dir(path), fsutil.PrivateDirMode); err != nil {
		return nil, nil, err
	}
	// The directory is the CA's own state dir: one that others may write in is a mistake, not
	// a Kubernetes emptyDir to serve with a warning.
	if err := fsutil.CheckSocketDir(filepath.Dir(path)); err != nil {
		return nil, nil, err
	}
	socket, err := fsutil.ListenSocket(path, fsutil.PrivateFileMode, log)
	if err != nil {
		return nil, nil, err
	}
	return socket.Listener(), socket, nil
}

// GRPCAddr returns the address the CA protocol is served on: HOST:PORT, or unix:///path.
func (c *ControlPlane) GRPCAddr() string {
	if c.grpcLis.Addr().Network() == "unix" {
		return unixScheme + c.grpcLis.Addr().String()
	}
	return c.grpcLis.Addr().String()
}

// MonitoringAddr returns the monitoring server's address, or "" when it is disabled.
func (c *ControlPlane) MonitoringAddr() string {
	if c.monLis == nil {
		return ""
	}
	return c.monLis.Addr().String()
}

// Close releases the listeners of a control plane that will not Run.
func (c *ControlPlane) Close() {
	if c.grpcSocket != nil {
		c.grpcSocket.Close()
	} else {
		_ = c.grpcLis.Close()
	}
	if c.monLis != nil {
		_ = c.monLis.Close()
	}
}

// Ready is closed once Run serves and watches the plugged-in CA files.
func (c *ControlPlane) Ready() <-chan struct{} { return c.readyCh }

// Authority returns the CA core.
func (c *ControlPlane) Authority() *ca.Authority { return c.authority }

// Namespaces returns the store namespace targeting reads, or nil without one.
func (c *ControlPlane) Namespaces() controller.Store {
	switch {
	case c.manifests != nil:
		return c.manifests
	case c.kube != nil:
		return c.kube.store
	}
	return nil
}

// credentialNamespace gives the discovery server the namespace of a caller's credential, as
// the CA authorizes it for a certificate: authenticated, and its namespace served by this
// instance. ca is set once the CA server exists, before anything is served.
type credentialNamespace struct{ ca *caserver.Server }

func (c *credentialNamespace) Authorize(ctx context.Context) (discovery.Caller, error) {
	caller, err := c.ca.Authorize(ctx)
	if err != nil {
		return discovery.Caller{}, err
	}
	return discovery.Caller{Identity: caller.Identity, Method: caller.Method, Credential: caller.Credential}, nil
}

func (c *credentialNamespace) Serves(ctx context.Context, caller discovery.Caller) error {
	return c.ca.Serves(ctx, caserver.Caller{Identity: caller.Identity, Method: caller.Method, Credential: caller.Credential})
}

// secretStore is where the secret controller keeps its secrets: Kubernetes Secrets, or
// directories under the state dir.
func (c *ControlPlane) secretStore(cfg Config) controller.SecretStore {
	if c.kube != nil {
		return c.kube.secretStore
	}
	return controller.NewFileSecrets(SecretsDir(cfg.StateDir))
}

// Run serves until ctx ends, then stops the servers, giving in-flight requests a short grace.
func (c *ControlPlane) Run(ctx context.Context) error {
	c.grpc = c.newGRPC()
	g, ctx := errgroup.WithContext(ctx)
	if c.manifests != nil {
		g.Go(func() error { return c.manifests.Run(ctx) })
	}
	g.Go(func() error { return c.keys.Run(ctx) })
	if c.discovery != nil {
		g.Go(func() error { return c.discovery.Run(ctx) })
	}
	if c.kube != nil {
		c.kube.run(ctx, g, c.keys, c.secrets)
	} else if c.secrets != nil {
		g.Go(func() error { return c.secrets.Run(ctx) })
	}
	if c.probe != nil {
		g.Go(func() error { return c.probe.run(ctx) })
	}
	g.Go(func() error {
		err := c.grpc.Serve(c.grpcLis)
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
			if err := c.monitor.Serve(c.monLis); err != nil && !errors.Is(err, http.ErrServerClosed) {
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
		if c.kube != nil {
			// Targeting answers only from a complete view of the namespaces.
			select {
			case <-c.kube.store.Synced():
			case <-ctx.Done():
				return nil
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
	if c.grpcSocket != nil {
		c.grpcSocket.Remove() // the server has closed its listener
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

func (c *ControlPlane) monitoringHandler(registry *prometheus.Registry) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{Registry: registry}))
	mux.HandleFunc("GET /version", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = fmt.Fprintln(w, version.String())
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /healthz/ready", func(w http.ResponseWriter, _ *http.Request) {
		if !c.ready.Load() || c.authority.Bundle() == nil {
			http.Error(w, "not ready: the CA is not serving", http.StatusServiceUnavailable)
			return
		}
		_, _ = fmt.Fprintln(w, "ready")
	})
	return mux
}

// CheckStateDir refuses (fsutil.ErrNotOwned) a state dir that is not ours alone: one that
// another user owns or can write in, a CA key or token key in it that is a link, another user's
// or open to others, or a secrets tree reached through a link. Whoever could write there could
// have put their own keys there, and the CA would sign what they ask. A missing state dir
// passes: the CA makes it private, and checks it again once made.
func CheckStateDir(stateDir string) error {
	if err := fsutil.CheckOwnedDir(stateDir); err != nil {
		return err
	}
	for _, name := range []string{ca.CAKeyFile, ca.TokenKeyFile} {
		if err := fsutil.CheckKeyFile(filepath.Join(stateDir, name)); err != nil {
			return err
		}
	}
	return fsutil.CheckOwnedSubdir(SecretsDir(stateDir))
}

// TokenKeyPath is where the control plane whose state dir is stateDir keeps its local token
// signing key: what `meshid token` and an embedding agent mint with (see token.LoadMinter).
func TokenKeyPath(stateDir string) string {
	return filepath.Join(stateDir, ca.TokenKeyFile)
}

// RootCertPath is the trust bundle of the control plane whose state dir is stateDir: every root
// it trusts, what verifies it.
func RootCertPath(stateDir string) string {
	return filepath.Join(stateDir, ca.RootCertFile)
}

// registerManifestProblems exports what the last load of --manifests skipped, by kind: an
// operator alerts on it rather than reading logs for a typo that leaves a namespace unlabelled.
func registerManifestProblems(reg prometheus.Registerer, m *controller.Manifests) {
	for kind, count := range map[string]func(controller.ManifestProblems) int{
		"file":      func(p controller.ManifestProblems) int { return p.Files },
		"object":    func(p controller.ManifestProblems) int { return p.Objects },
		"duplicate": func(p controller.ManifestProblems) int { return p.Duplicates },
	} {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        "meshid_ca_manifest_problems",
			Help:        "What the last load of --manifests skipped: unreadable files, objects that could not be used, objects defined twice.",
			ConstLabels: prometheus.Labels{"kind": kind},
		}, func() float64 { return float64(count(m.Problems())) }))
	}
}
