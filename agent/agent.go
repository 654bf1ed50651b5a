package agent

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"

	"github.com/meshid/meshid/agent/appprobe"
	"github.com/meshid/meshid/agent/promstats"
	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/configerr"
	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/gcemetadata"
	"github.com/meshid/meshid/internal/istio"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/tokenexchange"
	upstreamcreds "github.com/meshid/meshid/internal/upstream"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/secretmanager"
	"github.com/meshid/meshid/workloadapi"
	"github.com/meshid/meshid/xdsproxy"
)

// Files of the embedded control plane in its state dir.
const (
	embeddedSocket = "ca.sock"
	embeddedLock   = "agent.lock" // held by the agent that runs the embedded CA
)

// Source names where the agent's certificates come from, as chosen at start-up.
type Source string

// The decision flow's outcomes, in the order they are tried.
const (
	SourceExternalSDS Source = "external-sds" // another agent serves the socket: do not serve it
	SourceFiles       Source = "files"        // mounted credential files, served and watched
	SourceCA          Source = "ca"           // a CA, through the CA client
	SourceEmbeddedCA  Source = "embedded-ca"  // the control plane run in-process, as a CA
)

// Agent is a running meshid agent.
type Agent struct {
	log        *slog.Logger
	source     Source
	socketPath string
	embedded   ControlPlane           // embedded mode
	unlocks    []func()               // release the embedded state dir and OUTPUT_CERTS
	ca         *caclient.Client       // CA modes
	secrets    *secretmanager.Manager // nil with an external SDS server, and in node mode
	// fileWatch is the one inotify instance of every secret manager the agent makes: a node
	// agent makes one per identity, and the kernel allows a user 128 by default.
	fileWatch *filewatch.Hub
	// node serves node mode: a secret manager per caller's identity.
	node      Node
	sds       *sds.Server      // nil with an external SDS server
	xds       *xdsproxy.Proxy  // nil with PROXY_XDS_VIA_AGENT=false
	xdsConn   *grpc.ClientConn // the xDS proxy's upstream
	status    *http.Server
	statusLis net.Listener
	debug     *http.Server
	debugLis  net.Listener
	// xdsDebug serves /debug/<type> on xdsDebugSocket, next to the XDS socket.
	xdsDebug       *http.Server
	xdsDebugSocket *fsutil.Socket
	// life is Envoy's supervision, when the agent runs Envoy, and /quitquitquit.
	life *lifecycle
	// shuttingDown fails readiness from the moment Run's context ends.
	shuttingDown atomic.Bool
}

// New runs the decision flow (a live external SDS socket, else credential files, else a CA —
// an embedded one when no CA is given), builds the components it needs and opens their
// listeners. It starts no goroutines; call Run.
func New(cfg Config) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := cfg.checkGivenPaths(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	clk := clock.OrReal(cfg.Clock)
	registry := prometheus.NewRegistry()
	registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	a := &Agent{log: log, socketPath: filepath.Join(cfg.socketDir(), sds.SocketName),
		fileWatch: filewatch.NewHub(filewatch.HubConfig{Logger: log.With(logkey.Component, "filewatch")})}
	if err := a.build(cfg, clk, log, registry); err != nil {
		a.close()
		return nil, err
	}
	return a, nil
}

// build makes the agent's parts in order, each from finished ones: the source decision, the
// secrets (and, from a CA, the CA client and the embedded control plane), the SDS server, the
// xDS proxy, the status and debug servers. A part is assigned once it is complete, so that
// close releases what a failure leaves.
func (a *Agent) build(cfg Config, clk clock.Clock, log *slog.Logger, registry *prometheus.Registry) (err error) {
	var reason string
	if a.source, reason, err = decide(&cfg, a.socketPath); err != nil {
		return err
	}
	log.Info("SDS source chosen", logkey.Source, string(a.source), logkey.Reason, reason)
	if cfg.CA.Provider == CAProviderGoogleCA && a.source != SourceCA && a.source != SourceEmbeddedCA {
		// The source decision flow wins over the provider, as in Istio: said once, not refused.
		log.Info("CA provider unused: no CA is asked for certificates", logkey.CAProvider, cfg.CA.Provider, logkey.Source, string(a.source))
	}
	fetched, err := fetchedToken(cfg, clk, log)
	if err != nil {
		return err
	}

	if a.source != SourceExternalSDS {
		sdsCfg := sds.Config{
			SocketPath:    a.socketPath,
			SocketMode:    cfg.SDS.SocketMode,
			DrainDuration: cfg.SDS.DrainDuration,
			Clock:         clk,
			Logger:        log.With(logkey.Component, "sds"),
			Registerer:    registry,

			MaxStreams:              cfg.SDS.MaxStreams,
			MaxStreamsPerConnection: cfg.SDS.MaxStreamsPerConnection,
			SocketClock:             cfg.SocketClock,
			OnSocket:                onSocket(cfg, a.socketPath),
		}
		var api workloadapi.Config
		if cfg.NodeMode() {
			if err := a.buildNode(cfg, fetched, clk, log, registry); err != nil {
				return err
			}
			sdsCfg.Secrets, sdsCfg.Resolve, sdsCfg.Credentials = a.node, a.node.Resolve, a.node.Credentials
			sdsCfg.StreamInterceptor = a.node.StreamInterceptor
			api = workloadapi.Config{Secrets: a.node, Identify: a.node.Identify, JWT: a.node}
		} else {
			if err := a.buildSecrets(cfg, fetched, clk, log, registry); err != nil {
				return err
			}
			sdsCfg.Secrets = a.secrets
			api = workloadapi.Config{Secrets: a.secrets}
			if a.ca != nil {
				// The CA signs the JWT-SVIDs; without one (mounted files) the JWT methods say so.
				api.JWT = jwtIssuer{a.ca}
			}
		}
		if a.sds, err = sds.New(sdsCfg); err != nil {
			return err
		}
		if err := a.buildWorkloadAPI(cfg, api, clk, log, registry); err != nil {
			return err
		}
	} else if cfg.SDS.WorkloadAPI {
		log.Info("Workload API not served: another server answers on the SDS socket", logkey.Socket, a.socketPath)
	}
	if cfg.XDS.Proxy {
		var held func() *tls.Certificate
		if a.secrets != nil {
			held = a.secrets.TLSCertificate
		}
		if a.xds, a.xdsConn, err = newXDSProxy(cfg, a.embedded, fetched, held, clk, log, registry); err != nil {
			return err
		}
	}
	if a.life, err = newLifecycle(clk, log.With(logkey.Component, "lifecycle"), registry); err != nil {
		return err
	}
	if cfg.Envoy.Path != "" {
		if err := a.life.watchInService(a.secrets); err != nil {
			return err
		}
		if a.life.envoy, err = newEnvoy(cfg, clk, log.With(logkey.Component, "envoy")); err != nil {
			return err
		}
	}
	return a.buildServers(cfg, clk, log, registry)
}

// buildWorkloadAPI registers the SPIFFE Workload API of api (its secrets, callers and JWT
// issuer) on the SDS server: the same socket and bounds.
func (a *Agent) buildWorkloadAPI(cfg Config, api workloadapi.Config, clk clock.Clock, log *slog.Logger, registry *prometheus.Registry) error {
	if !cfg.SDS.WorkloadAPI {
		log.Info("Workload API not served (--workload-api=false)")
		return nil
	}
	api.Clock, api.Logger, api.Registerer = clk, log.With(logkey.Component, "workloadapi"), registry
	server, err := workloadapi.New(api)
	if err != nil {
		return err
	}
	server.Register(a.sds)
	return nil
}

// jwtIssuer gives the Workload API JWT-SVIDs and their bundle from the CA, through the client
// that signs the agent's certificates, with its credentials.
type jwtIssuer struct{ ca *caclient.Client }

func (j jwtIssuer) MintJWTSVID(ctx context.Context, audience []string) (workloadapi.JWTSVID, error) {
	svid, err := j.ca.MintJWTSVID(ctx, audience, 0) // the CA's lifetime
	return workloadapi.JWTSVID(svid), err
}

func (j jwtIssuer) FetchJWTBundle(ctx context.Context) (workloadapi.JWTBundle, error) {
	b, err := j.ca.FetchJWTBundle(ctx)
	return workloadapi.JWTBundle(b), err
}

// buildServers opens the status server, and the debug servers asked for.
func (a *Agent) buildServers(cfg Config, clk clock.Clock, log *slog.Logger, registry *prometheus.Registry) (err error) {
	probers, err := appprobe.Parse(cfg.Servers.AppProbers)
	if err != nil {
		return &FieldError{Field: "Servers.AppProbers", Err: err}
	}
	appProbes, err := appprobe.New(appprobe.Config{Probers: probers, Host: cfg.Identity.InstanceIP, Registerer: registry, Clock: clk,
		Logger: log.With(logkey.Component, "app-probes")})
	if err != nil {
		return err
	}
	// Envoy's metrics are merged when the agent runs Envoy, and so knows its admin.
	var envoyAdmin func() (string, error)
	if a.life.envoy != nil {
		envoyAdmin = a.life.envoy.Admin().Addr
	}
	stats, err := newPromStats(cfg, envoyAdmin, clk, log, registry)
	if err != nil {
		return err
	}
	if a.statusLis, err = net.Listen("tcp", cfg.Servers.StatusAddr); err != nil {
		return fmt.Errorf("listen for status on %s: %w", cfg.Servers.StatusAddr, err)
	}
	a.status = &http.Server{Handler: a.statusHandler(registry, appProbes, stats), ReadHeaderTimeout: 10 * time.Second}
	debug, err := newDebugBoundary(clk, log.With(logkey.Component, "debug"), registry)
	if err != nil {
		return err
	}
	if cfg.XDS.ProxyDebug && a.xds != nil {
		// Whoever may open the XDS socket may read the configuration: the debug socket sits next
		// to it, with its mode.
		if a.xdsDebugSocket, err = fsutil.ListenSocket(cfg.xdsDebugSocket(), xdsproxy.DefaultSocketMode, log.With(logkey.Component, "debug")); err != nil {
			return &FieldError{Field: "XDS.DebugSocket", Err: err}
		}
		a.xdsDebug = &http.Server{Handler: a.xdsDebugHandler(), ConnContext: admission.ConnContext, ReadHeaderTimeout: 10 * time.Second}
	}
	if cfg.Servers.DebugAddr != "" {
		if a.debugLis, err = net.Listen("tcp", cfg.Servers.DebugAddr); err != nil {
			return fmt.Errorf("listen for debug on %s: %w", cfg.Servers.DebugAddr, err)
		}
		a.debug = &http.Server{
			Handler:           debug.loopbackOnly(a.debugHandler(clk, cfg)),
			ConnContext:       admission.ConnContext,
			ReadHeaderTimeout: 10 * time.Second,
		}
	}
	return nil
}

// onSocket tells cfg.OnSocket, when set, about the socket at path.
func onSocket(cfg Config, path string) func(error) {
	if cfg.OnSocket == nil {
		return nil
	}
	return func(err error) { cfg.OnSocket(path, err) }
}

// ErrNoCA is the refusal of an agent that found no credentials and has neither a CA address nor
// an embedded control plane to turn to.
var ErrNoCA = errors.New("this binary carries no CA to run in-process (`meshid agent` does)")

// ErrConfigRefused marks what New refuses because of how the agent was configured, found
// against the machine rather than in the values (which Validate checks): a path given
// explicitly that does not exist or does not hold what it should, a credentials dir with some
// of its files. Like a bad flag, it is the caller's mistake, and no retry will fix it.
var ErrConfigRefused = errors.New("the agent's configuration cannot work on this machine")

// refused is an error that wraps ErrConfigRefused without adding its text to the message.
type refused struct{ error }

func (r refused) Unwrap() []error { return []error{r.error, ErrConfigRefused} }

// checkGivenPaths refuses a path given explicitly that cannot be what it names, each problem
// wrapping ErrConfigRefused: a credentials dir or a PROV_CERT that does not exist (a typo would
// silently turn the agent to a CA, and so to another identity), a CA or xDS root file that does
// not exist or holds no PEM certificate, as a token exchange root file (the agent would look
// healthy while every request or Envoy stream fails). Defaults may be absent: they are where Kubernetes mounts what it has.
func (c *Config) checkGivenPaths() error {
	var errs []error
	add := func(field, path string, err error) {
		if err != nil {
			errs = append(errs, refused{configerr.Errorf(field, "{"+field+"} %s %w", path, err)})
		}
	}
	const onlyDefault = "only the default may be absent"
	if c.SDS.CredentialsDir != "" {
		add("SDS.CredentialsDir", c.SDS.CredentialsDir, fsutil.CheckDir(c.SDS.CredentialsDir, onlyDefault))
	}
	// Istio's VMs use the pair they keep in OUTPUT_CERTS as PROV_CERT: the agent makes that dir.
	if c.CA.ProvCert != "" && (c.Output.Dir == "" || filepath.Clean(c.CA.ProvCert) != filepath.Clean(c.Output.Dir)) {
		add("CA.ProvCert", c.CA.ProvCert, fsutil.CheckDir(c.CA.ProvCert, "it may be absent only when it is {Output.Dir} too, which the agent creates"))
	}
	if c.CA.RootCert != "" {
		add("CA.RootCert", c.CA.RootCert, caclient.CheckRootFile(c.CA.RootCert, onlyDefault))
	}
	if c.XDS.RootCert != "" {
		add("XDS.RootCert", c.XDS.RootCert, caclient.CheckRootFile(c.XDS.RootCert, onlyDefault))
	}
	if c.CA.TokenExchangeRootCert != "" {
		add("CA.TokenExchangeRootCert", c.CA.TokenExchangeRootCert, caclient.CheckRootFile(c.CA.TokenExchangeRootCert, "it has no default: the system roots serve without it"))
	}
	return errors.Join(errs...)
}

// decide applies the source decision flow and says why it chose as it did. A credentials dir
// holding some of the three files but not all is refused: it is a mistake, not a reason to fall
// back to a CA.
func decide(cfg *Config, socketPath string) (Source, string, error) {
	if _, err := os.Lstat(socketPath); err == nil && fsutil.SocketServing(socketPath) {
		return SourceExternalSDS, "another server answers on " + socketPath, nil
	}
	if cfg.SDS.FileMountedCerts {
		return SourceFiles, "FILE_MOUNTED_CERTS is set: serving " + cfg.path(DefaultMountedCerts), nil
	}
	dir := cfg.credentialsDir()
	switch present, missing := secretmanager.CredentialFiles(dir); {
	case cfg.NodeMode():
		// The credentials dir is one workload's: a node agent's callers each have their own.
	case len(missing) == 0:
		return SourceFiles, "credential files found in " + dir, nil
	case len(present) > 0:
		return "", "", refused{configerr.Errorf("SDS.CredentialsDir", "{SDS.CredentialsDir} %s holds %s but not %s: give all three files or none",
			dir, strings.Join(present, ", "), strings.Join(missing, ", "))}
	}
	if cfg.embedded() {
		if cfg.CA.Embed == nil {
			return "", "", configerr.Errorf("CA.Address", "no credential files in %s and no {CA.Address}: %w", dir, ErrNoCA)
		}
		return SourceEmbeddedCA, "no CA address given: running the control plane in-process under " + cfg.path(DefaultEmbeddedDir), nil
	}
	return SourceCA, "no credential files in " + dir + ": using the CA at " + cfg.CA.Address, nil
}

// buildSecrets makes the secret manager: over the credential files, or over a CA through the CA
// client (the embedded control plane started first when it is the CA). OUTPUT_CERTS is claimed
// before anything reads it: a second agent on it would overwrite this one's key pair.
func (a *Agent) buildSecrets(cfg Config, fetched tokenFunc, clk clock.Clock, log *slog.Logger, registry *prometheus.Registry) error {
	output := secretmanager.Output{Dir: cfg.Output.Dir, GroupRead: cfg.Output.GroupRead, KeyGroupRead: cfg.Output.KeyGroupRead, Sync: cfg.Output.Sync}
	if output.Dir != "" {
		claim, err := secretmanager.ClaimOutput(output)
		if err != nil {
			return err
		}
		a.unlocks = append(a.unlocks, claim.Release)
		output.Claim = claim
	}
	smCfg := secretmanager.Config{
		FileResourceDirs: cfg.fileResourceDirs(),
		Output:           output,
		FileWatch:        a.fileWatch,
		Clock:            clk,
		Logger:           log.With(logkey.Component, "secretmanager"),
		Registerer:       registry,
		OnEvent:          cfg.OnEvent,
	}
	if a.source == SourceFiles {
		smCfg.Workload = mountedFiles(cfg)
		var err error
		a.secrets, err = secretmanager.New(smCfg)
		return err
	}

	id, err := cfg.SPIFFEID()
	if err != nil {
		return err
	}
	// The CA client presents the certificate the secret manager holds, so that renewals go on
	// after a provisioned token expires; the manager signs through the CA client. The client is
	// built first, and reaches the manager through held once it exists, before anything runs.
	held := new(heldCertificate)
	up, err := a.buildCAClient(cfg, fetched, id, held.orProvisioned(provisioned(cfg, clk, log)), clk, log, registry)
	if err != nil {
		return err
	}
	smCfg.Workload = &secretmanager.Rotation{
		Signer:           a.ca,
		Identity:         id,
		KeyAlgorithm:     cfg.Certificate.KeyAlgorithm,
		RSAKeySize:       cfg.Certificate.RSAKeySize,
		TTL:              cfg.Certificate.TTL,
		GraceRatio:       cfg.Certificate.GraceRatio,
		GraceRatioJitter: cfg.Certificate.GraceRatioJitter,
		RootCertFile:     up.rootCertFile,
	}
	if a.secrets, err = secretmanager.New(smCfg); err != nil {
		return err
	}
	held.manager.Store(a.secrets)
	return nil
}

// buildNode makes node mode through cfg.SDS.Node, with the CA client of the agent's own
// identity (the node account; the embedded control plane trusts it).
func (a *Agent) buildNode(cfg Config, fetched tokenFunc, clk clock.Clock, log *slog.Logger, registry *prometheus.Registry) error {
	self, err := cfg.SPIFFEID()
	if err != nil {
		return err
	}
	// No certificate is presented: the CA signs another identity only for a token's bearer.
	up, err := a.buildCAClient(cfg, fetched, self, func() *tls.Certificate { return nil }, clk, log, registry)
	if err != nil {
		return err
	}
	a.node, err = cfg.SDS.Node(NodeConfig{RulesFile: cfg.SDS.WorkloadAttestation, Pods: cfg.SDS.AttestPods, TrustDomain: cfg.Identity.TrustDomain,
		Self: self, Certificate: cfg.Certificate, CA: a.ca, RootCertFile: up.rootCertFile, FileWatch: a.fileWatch, OnEvent: cfg.OnEvent,
		Clock: clk, Logger: log, Registerer: registry})
	return err
}

// buildCAClient makes the CA client of the agent's identity id, starting the embedded control
// plane first when it is the CA; it returns where the client finds the CA.
func (a *Agent) buildCAClient(cfg Config, fetched tokenFunc, id pki.SPIFFEID, clientCert func() *tls.Certificate, clk clock.Clock, log *slog.Logger,
	registry *prometheus.Registry) (upstream, error) {
	up := upstream{address: cfg.CA.Address, rootCertFile: cfg.caRootCert(), tokenPath: cfg.CA.TokenPath}
	if fetched != nil {
		up.tokenPath, up.token = "", fetched
	}
	if a.source == SourceEmbeddedCA {
		e, unlock, err := embed(cfg, id, clk, log)
		if err != nil {
			return upstream{}, err
		}
		a.unlocks = append(a.unlocks, unlock)
		a.embedded = e
		up = upstream{address: e.GRPCAddr(), rootCertFile: e.RootCertFile(), token: e.Token}
	}
	provider := cfg.CA.Provider
	if provider == "" {
		provider = CAProviderCitadel
	}
	log.Info("CA source", logkey.CAAddress, up.address, logkey.CAProvider, provider, logkey.CARoot, describePath(up.rootCertFile, "the system roots"), logkey.Identity, id.String())
	var err error
	a.ca, err = caclient.New(caclient.Config{
		Address:           up.address,
		Provider:          provider,
		Location:          cfg.caLocation(),
		RootCertFile:      up.rootCertFile,
		ServerName:        cfg.CA.ServerName,
		TokenPath:         up.tokenPath,
		Token:             up.token,
		ClientCertificate: clientCert,
		ClusterID:         cfg.CA.ClusterID,
		Clock:             clk,
		Logger:            log.With(logkey.Component, "caclient"),
		Registerer:        registry,
	})
	return up, err
}

// upstream is where the CA client finds the CA, how it verifies it, and how it gets its token.
type upstream struct {
	address, rootCertFile, tokenPath string
	token                            tokenFunc // instead of tokenPath
}

// tokenFunc gives the token of one call to the control plane.
type tokenFunc = func(context.Context) (string, error)

// fetchedToken is the token of CA.CredentialFetcherType when it is not the token file, exchanged
// at CA.TokenExchangeURL when that is set (nil when neither applies, and the CA client and the
// xDS proxy read the token file themselves): one source, whose cached token both share.
func fetchedToken(cfg Config, clk clock.Clock, log *slog.Logger) (tokenFunc, error) {
	var tok tokenFunc
	if cfg.CA.CredentialFetcherType == CredentialFetcherGCE {
		f, err := gcemetadata.New(gcemetadata.Config{Host: cfg.CA.MetadataHost, Audience: cfg.CA.CredentialIdentityProvider, Clock: clk})
		if err != nil {
			return nil, configerr.Errorf("CA.CredentialFetcherType", "{CA.CredentialFetcherType} %s: %w", CredentialFetcherGCE, err)
		}
		log.Info("the token comes from the GCE metadata server", logkey.Address, describePath(cfg.CA.MetadataHost, gcemetadata.DefaultHost),
			logkey.Audience, cfg.CA.CredentialIdentityProvider)
		tok = f.Token
	}
	if cfg.CA.TokenExchangeURL == "" {
		return tok, nil
	}
	if tok == nil {
		tok = upstreamcreds.FileToken(cfg.CA.TokenPath, fsutil.NewBoundedReads(nil, fsutil.DefaultReadBound, 0))
	}
	var roots *x509.CertPool // nil: the system roots
	if path := cfg.CA.TokenExchangeRootCert; path != "" {
		pemData, err := os.ReadFile(path)
		if err != nil {
			return nil, &FieldError{Field: "CA.TokenExchangeRootCert", Value: path, Err: err}
		}
		roots = x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pemData) {
			return nil, &FieldError{Field: "CA.TokenExchangeRootCert", Value: path, Err: errors.New("holds no PEM certificate")}
		}
	}
	audience := cfg.CA.TokenExchangeAudience
	if audience == "" {
		audience = DefaultTokenExchangeAudience
	}
	x, err := tokenexchange.New(tokenexchange.Config{URL: cfg.CA.TokenExchangeURL, Subject: tok, Audience: audience, RootCAs: roots, Clock: clk})
	if err != nil {
		return nil, &FieldError{Field: "CA.TokenExchangeURL", Value: cfg.CA.TokenExchangeURL, Err: err}
	}
	log.Info("the token is exchanged for the CA's", logkey.Address, cfg.CA.TokenExchangeURL, logkey.Audience, audience)
	return x.Token, nil
}

// heldCertificate is the certificate the secret manager holds, as the CA client presents it.
// The manager and the client each need the other built first; the manager is stored here once
// both exist, before anything runs, and until then nothing is held.
type heldCertificate struct {
	manager atomic.Pointer[secretmanager.Manager]
}

// orProvisioned returns the certificate held, or else provisioned's (PROV_CERT, the operator's
// provisioned pair).
func (h *heldCertificate) orProvisioned(provisioned func() *tls.Certificate) func() *tls.Certificate {
	return func() *tls.Certificate {
		if m := h.manager.Load(); m != nil {
			if cert := m.TLSCertificate(); cert != nil {
				return cert
			}
		}
		return provisioned()
	}
}

// provisioned returns PROV_CERT's key pair, read as the CA client asks for it; nil without one.
func provisioned(cfg Config, clk clock.Clock, log *slog.Logger) func() *tls.Certificate {
	if cfg.CA.ProvCert == "" {
		return func() *tls.Certificate { return nil }
	}
	return caclient.ProvisionedCertificate(cfg.CA.ProvCert, clk, log.With(logkey.Component, "caclient"))
}

// mountedFiles are the credential files served: FILE_MOUNTED_CERTS's, or the credentials dir's.
func mountedFiles(cfg Config) *secretmanager.MountedFiles {
	if cfg.SDS.FileMountedCerts {
		return secretmanager.MountedFilesIn(cfg.path(DefaultMountedCerts))
	}
	return secretmanager.MountedFilesIn(cfg.credentialsDir())
}

// embed starts the control plane in-process through the hook cmd/meshid supplies, serving on a
// private Unix socket in the embedded state dir, which this agent locks for its life (unlock
// releases it); the CA client reaches it with tokens minted from its own key: the embedded
// pipeline is the production pipeline.
func embed(cfg Config, id pki.SPIFFEID, clk clock.Clock, log *slog.Logger) (_ ControlPlane, unlock func(), err error) {
	stateDir := cfg.path(DefaultEmbeddedDir)
	socket := filepath.Join(stateDir, embeddedSocket)
	if err := fsutil.CheckSocketPath(socket); err != nil {
		return nil, nil, configerr.Errorf("RootDir", "the embedded CA's socket under {RootDir}: %w", err)
	}
	// Made private, or found ours alone, before the lock goes in: another user who could write
	// in it could have put their own CA key and token key there.
	if err := fsutil.EnsureOwnedDir(stateDir, fsutil.PrivateDirMode); err != nil {
		return nil, nil, fmt.Errorf("the embedded CA's state dir: %w", err)
	}
	lock := filepath.Join(stateDir, embeddedLock)
	unlock, err = fsutil.TryLockPID(lock)
	if errors.Is(err, fsutil.ErrLocked) {
		holder := "another agent"
		if pid, ok := fsutil.LockHolder(lock); ok {
			holder += " (pid " + strconv.Itoa(pid) + ")"
		}
		return nil, nil, configerr.Errorf("RootDir", "%s runs the embedded CA in %s (%w): give each agent its own {RootDir}", holder, stateDir, fsutil.ErrLocked)
	}
	if err != nil {
		return nil, nil, err
	}
	e, err := cfg.CA.Embed(EmbedConfig{
		StateDir:    stateDir,
		SocketPath:  socket,
		TrustDomain: cfg.Identity.TrustDomain,
		Identity:    id,
		NodeAgent:   cfg.NodeMode(),
		Clock:       clk,
		Logger:      log.With(logkey.Component, "embedded-ca"),
	})
	if err != nil {
		unlock()
		return nil, nil, fmt.Errorf("embedded control plane: %w", err)
	}
	return e, unlock, nil
}

func describePath(p, ifEmpty string) string {
	if p == "" {
		return ifEmpty
	}
	return p
}

// caRootCert finds the CA root in Istio's order: CA_ROOT_CA, PROV_CERT/root-cert.pem, then the
// mounted istio-ca-root-cert config map; "" (the system roots) when none exists.
func (c *Config) caRootCert() string {
	if c.CA.RootCert != "" {
		return c.CA.RootCert
	}
	for _, candidate := range []string{provRoot(c.CA.ProvCert), c.path(DefaultCARootCert)} {
		if candidate == "" {
			continue
		}
		if _, err := os.Stat(candidate); err == nil {
			return candidate
		}
	}
	return ""
}

func provRoot(provCert string) string {
	if provCert == "" {
		return ""
	}
	return filepath.Join(provCert, istio.RootCertFile)
}

// newXDSProxy builds the proxy of Envoy's xDS: to the discovery address, else the CA's (meshid
// ca serves both), else the embedded control plane (nil when there is none); authenticated as
// the CA client is, with the token read per stream and the workload certificate held (held, nil
// when the agent holds none), so that a VM whose token expired keeps its configuration. It
// returns nil, and no connection, when there is nothing to proxy to.
func newXDSProxy(cfg Config, embedded ControlPlane, fetched tokenFunc, held func() *tls.Certificate, clk clock.Clock, log *slog.Logger,
	registry *prometheus.Registry) (*xdsproxy.Proxy, *grpc.ClientConn, error) {
	up := caclient.UpstreamConfig{
		Address: cfg.XDS.DiscoveryAddress, ServerName: cfg.CA.ServerName, TokenPath: cfg.CA.TokenPath, ClusterID: cfg.CA.ClusterID, Clock: clk,
		RootCertFile: cfg.XDS.RootCert, ClientCertificate: held,
	}
	if fetched != nil {
		up.TokenPath, up.Token = "", fetched
	}
	switch {
	case up.Address != "":
	case embedded != nil:
		up.Address, up.TokenPath, up.Token = embedded.GRPCAddr(), "", embedded.Token
		if up.RootCertFile == "" {
			up.RootCertFile = embedded.RootCertFile()
		}
	default:
		up.Address = cfg.CA.Address
	}
	if up.Address == "" {
		// Credential files and no control plane named: nothing to proxy to.
		log.Info("no discovery server to proxy Envoy's xDS to (neither a discovery address nor a CA address is given): the xDS proxy is off")
		return nil, nil, nil
	}
	if up.RootCertFile == "" {
		up.RootCertFile = cfg.caRootCert()
	}
	id, err := cfg.SPIFFEID()
	if err != nil {
		return nil, nil, err
	}
	conn, err := caclient.DialUpstream(up)
	if err != nil {
		return nil, nil, err
	}
	proxy, err := xdsproxy.New(xdsproxy.Config{
		Socket:   cfg.xdsSocket(),
		Upstream: conn,
		// Istio's form of a sidecar's node ID; the discovery server picks the configuration by
		// the credential, not by this.
		Node:                    &corev3.Node{Id: fmt.Sprintf("sidecar~127.0.0.1~%s.%s~%s.svc.cluster.local", id.ServiceAccount, id.Namespace, id.Namespace)},
		MaxStreams:              cfg.XDS.MaxStreams,
		MaxStreamsPerConnection: cfg.XDS.MaxStreamsPerConnection,
		Clock:                   clk,
		Logger:                  log.With(logkey.Component, "xds-proxy"),
		Registerer:              registry,
		SocketClock:             cfg.SocketClock,
		OnSocket:                onSocket(cfg, cfg.xdsSocket()),
	})
	if err != nil {
		_ = conn.Close()
		return nil, nil, err
	}
	log.Info("xDS proxy", logkey.Socket, cfg.xdsSocket(), logkey.Address, up.Address, logkey.CARoot, describePath(up.RootCertFile, "the system roots"))
	return proxy, conn, nil
}

// Source returns where the certificates come from.
func (a *Agent) Source() Source { return a.source }

// SocketPath returns the SDS socket's path.
func (a *Agent) SocketPath() string { return a.socketPath }

// StatusAddr returns the status server's address.
func (a *Agent) StatusAddr() string { return a.statusLis.Addr().String() }

// DebugAddr returns the debug server's address, or "" when it is off.
func (a *Agent) DebugAddr() string {
	if a.debugLis == nil {
		return ""
	}
	return a.debugLis.Addr().String()
}

// XDSDebugSocket returns the path of the Unix socket serving /debug/<type>, or "" when there is
// none.
func (a *Agent) XDSDebugSocket() string {
	if a.xdsDebugSocket == nil {
		return ""
	}
	return a.xdsDebugSocket.Path()
}

// Secrets returns the secret manager; nil when an external server serves SDS.
func (a *Agent) Secrets() *secretmanager.Manager { return a.secrets }

// Run runs the agent until ctx ends, then stops: when it runs Envoy, it fails readiness at once,
// drains Envoy and stops it, and its servers go on until Envoy has exited; then the SDS server
// stops accepting and ends its streams after the drain duration. OUTPUT_CERTS are left as they
// are. When it runs Envoy, Envoy's exit ends the agent too, with Envoy's status (an
// *envoy.ExitError unless 0); /quitquitquit ends both at once.
func (a *Agent) Run(ctx context.Context) error {
	defer a.release()
	// The servers outlive ctx while Envoy drains: Envoy needs its certificates and configuration
	// until it has exited.
	serveCtx, stopServing := context.WithCancel(context.WithoutCancel(ctx))
	defer stopServing()
	stopOnShutdown := context.AfterFunc(ctx, func() {
		a.shuttingDown.Store(true)
		if a.life.envoy == nil {
			stopServing()
		}
	})
	defer stopOnShutdown()
	g, gctx := errgroup.WithContext(serveCtx)
	if a.life.envoy != nil {
		g.Go(func() error {
			defer stopServing()
			return a.life.envoy.Run(gctx, a.life.inService, ctx.Done())
		})
	}
	if a.embedded != nil {
		g.Go(func() error { return a.embedded.Run(gctx) })
	}
	g.Go(func() error { return a.fileWatch.Run(gctx) })
	if a.secrets != nil {
		g.Go(func() error { return a.secrets.Run(gctx) })
	}
	if a.node != nil {
		g.Go(func() error { return a.node.Run(gctx) })
	}
	if a.sds != nil {
		g.Go(func() error { return a.sds.Run(gctx) })
	}
	if a.xds != nil {
		g.Go(func() error { return a.xds.Run(gctx) })
	}
	var xdsDebugLis net.Listener
	if a.xdsDebugSocket != nil {
		xdsDebugLis = a.xdsDebugSocket.Listener()
		defer a.xdsDebugSocket.Remove()
	}
	var servers []*http.Server
	for _, srv := range []struct {
		server *http.Server
		lis    net.Listener
		name   string
	}{{a.status, a.statusLis, "status"}, {a.debug, a.debugLis, "debug"}, {a.xdsDebug, xdsDebugLis, "xDS debug"}} {
		if srv.server == nil {
			continue
		}
		servers = append(servers, srv.server)
		g.Go(func() error {
			if err := srv.server.Serve(srv.lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("serve %s: %w", srv.name, err)
			}
			return nil
		})
	}
	// One goroutine closes them all: an idle sidecar pays a stack for each goroutine. Without
	// Envoy it also takes /quitquitquit, which the supervisor takes otherwise.
	quit := a.life.quit
	if a.life.envoy != nil {
		quit = nil
	}
	g.Go(func() error {
		select {
		case <-gctx.Done():
		case <-quit:
			a.shuttingDown.Store(true)
			stopServing()
		}
		var errs []error
		for _, srv := range servers {
			errs = append(errs, srv.Close())
		}
		return errors.Join(errs...)
	})
	a.log.Info("agent started", logkey.Source, string(a.source), logkey.SDSSocket, a.socketPath, logkey.StatusAddress, a.StatusAddr(),
		logkey.DebugAddress, a.DebugAddr(), logkey.XDSDebugSocket, a.XDSDebugSocket())
	err := g.Wait()
	a.log.Info("agent stopped")
	return err
}

// release lets go of what outlives the servers: the CA and xDS connections and the embedded
// state dir.
func (a *Agent) release() {
	if a.life != nil && a.life.stopWatching != nil {
		a.life.stopWatching()
	}
	if a.ca != nil {
		_ = a.ca.Close()
	}
	if a.xdsConn != nil {
		_ = a.xdsConn.Close()
	}
	for i := len(a.unlocks) - 1; i >= 0; i-- {
		a.unlocks[i]()
	}
	a.unlocks = nil
}

// close releases what build opened, for an agent that will not Run.
func (a *Agent) close() {
	for _, l := range []net.Listener{a.statusLis, a.debugLis} {
		if l != nil {
			_ = l.Close()
		}
	}
	if a.sds != nil {
		a.sds.Close()
	}
	if a.xds != nil {
		a.xds.Close()
	}
	if a.xdsDebugSocket != nil {
		a.xdsDebugSocket.Close()
	}
	if a.embedded != nil {
		a.embedded.Close()
	}
	a.release()
}

// newPromStats returns the handler of /stats/prometheus: the agent's registry, Envoy's admin at
// envoyAdmin (nil for none) and the application of ISTIO_PROMETHEUS_ANNOTATIONS on INSTANCE_IP.
func newPromStats(cfg Config, envoyAdmin func() (string, error), clk clock.Clock, log *slog.Logger, registry *prometheus.Registry) (http.Handler, error) {
	stats, err := promstats.New(promstats.Config{
		Agent:           registry,
		EnvoyAdminAddr:  envoyAdmin,
		Application:     cfg.Servers.PrometheusAnnotations,
		ApplicationHost: cfg.Identity.InstanceIP,
		Clock:           clk,
		Logger:          log.With(logkey.Component, "stats"),
		Registerer:      registry,
	})
	if err != nil {
		return nil, err
	}
	return stats, nil
}

func (a *Agent) statusHandler(registry *prometheus.Registry, appProbes, stats http.Handler) http.Handler {
	mux := http.NewServeMux()
	// The kubelet's probes of the workload's containers, as Istio's injector rewrites them.
	mux.Handle("GET /app-health/", appProbes)
	mux.Handle("GET /metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{Registry: registry}))
	// One page of the agent's, Envoy's and the application's metrics, as Istio's agent serves it.
	mux.Handle("GET /stats/prometheus", stats)
	mux.HandleFunc("GET /healthz/ready", a.readyHandler)
	mux.Handle("POST /quitquitquit", a.life.quitHandler())
	return mux
}
