package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"

	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/secretmanager"
)

const embeddedSocket = "ca.sock"

// embeddedTokenTTL is the life of the token minted for each request to the embedded CA.
const embeddedTokenTTL = 5 * time.Minute

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
	log          *slog.Logger
	source       Source
	socketPath   string
	controlPlane *controlplane.ControlPlane // embedded mode
	secrets      *secretmanager.Manager     // nil with an external SDS server
	sds          *sds.Server                // nil with an external SDS server
	status       *http.Server
	statusLis    net.Listener
	debug        *http.Server
	debugLis     net.Listener
}

// New runs the decision flow (a live external SDS socket, else credential files, else a CA —
// an embedded one when no CA is given), builds the components it needs and opens their
// listeners. It starts no goroutines; call Run.
func New(cfg Config) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	clk := clock.OrReal(cfg.Clock)
	registry := prometheus.NewRegistry()
	registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	a := &Agent{log: log, socketPath: filepath.Join(cfg.socketDir(), sds.SocketName)}
	if err := a.build(cfg, clk, log, registry); err != nil {
		a.close()
		return nil, err
	}
	return a, nil
}

func (a *Agent) build(cfg Config, clk clock.Clock, log *slog.Logger, registry *prometheus.Registry) (err error) {
	var reason string
	a.source, reason = decide(&cfg, a.socketPath)
	log.Info("SDS source chosen", logkey.Source, string(a.source), logkey.Reason, reason)

	if a.source != SourceExternalSDS {
		if a.secrets, err = a.newSecretManager(cfg, clk, log, registry); err != nil {
			return err
		}
		a.sds, err = sds.New(sds.Config{
			SocketPath:    a.socketPath,
			SocketMode:    cfg.SocketMode,
			Secrets:       a.secrets,
			DrainDuration: cfg.DrainDuration,
			Clock:         clk,
			Logger:        log.With(logkey.Component, "sds"),
			Registerer:    registry,
		})
		if err != nil {
			return err
		}
	}
	if a.statusLis, err = net.Listen("tcp", cfg.StatusAddr); err != nil {
		return fmt.Errorf("listen for status on %s: %w", cfg.StatusAddr, err)
	}
	a.status = &http.Server{Handler: a.statusHandler(registry), ReadHeaderTimeout: 10 * time.Second}
	if cfg.DebugAddr != "" {
		if a.debugLis, err = net.Listen("tcp", cfg.DebugAddr); err != nil {
			return fmt.Errorf("listen for debug on %s: %w", cfg.DebugAddr, err)
		}
		a.debug = &http.Server{Handler: a.debugHandler(clk), ReadHeaderTimeout: 10 * time.Second}
	}
	return nil
}

// decide applies the source decision flow and says why it chose as it did.
func decide(cfg *Config, socketPath string) (Source, string) {
	if _, err := os.Lstat(socketPath); err == nil && sds.SocketServing(socketPath) {
		return SourceExternalSDS, "another server answers on " + socketPath
	}
	if cfg.FileMountedCerts {
		return SourceFiles, "FILE_MOUNTED_CERTS is set: serving " + cfg.path(DefaultMountedCerts)
	}
	if dir := cfg.credentialsDir(); credentialFilesPresent(dir) {
		return SourceFiles, "credential files found in " + dir
	}
	if cfg.embedded() {
		return SourceEmbeddedCA, "no CA address given: running the control plane in-process under " + cfg.path(DefaultEmbeddedDir)
	}
	return SourceCA, "no credential files in " + cfg.credentialsDir() + ": using the CA at " + cfg.CAAddress
}

func credentialFilesPresent(dir string) bool {
	for _, name := range []string{secretmanager.CertChainFile, secretmanager.KeyFile, secretmanager.RootCertFile} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			return false
		}
	}
	return true
}

func (a *Agent) newSecretManager(cfg Config, clk clock.Clock, log *slog.Logger, registry *prometheus.Registry) (*secretmanager.Manager, error) {
	smCfg := secretmanager.Config{
		FileResourceDirs: cfg.fileResourceDirs(),
		KeyAlgorithm:     cfg.KeyAlgorithm,
		RSAKeySize:       cfg.RSAKeySize,
		TTL:              cfg.SecretTTL,
		GraceRatio:       cfg.GraceRatio,
		GraceRatioJitter: cfg.GraceRatioJitter,
		OutputDir:        cfg.OutputCerts,
		Clock:            clk,
		Logger:           log.With(logkey.Component, "secretmanager"),
		Registerer:       registry,
	}
	if a.source == SourceFiles {
		dir := cfg.credentialsDir()
		if cfg.FileMountedCerts {
			dir = cfg.path(DefaultMountedCerts)
		}
		smCfg.WorkloadFiles = &secretmanager.FilePaths{
			CertChain: filepath.Join(dir, secretmanager.CertChainFile),
			Key:       filepath.Join(dir, secretmanager.KeyFile),
			Root:      filepath.Join(dir, secretmanager.RootCertFile),
		}
		smCfg.OutputDir = ""
		return secretmanager.New(smCfg)
	}

	id, err := cfg.Identity()
	if err != nil {
		return nil, err
	}
	caCfg := caclient.Config{
		Address:      cfg.CAAddress,
		RootCertFile: cfg.caRootCert(),
		ServerName:   cfg.CAServerName,
		TokenPath:    cfg.TokenPath,
		// A certificate we hold for our own identity authenticates renewals, so that they go on
		// after a provisioned token expires; PROV_CERT is the operator's provisioned pair.
		ClientCertificate: caclient.KeyPairFromDirs(clk,
			caclient.KeyPairDir{Dir: cfg.OutputCerts, SPIFFEID: id.String()},
			caclient.KeyPairDir{Dir: cfg.ProvCert}),
		ClusterID:  cfg.ClusterID,
		Clock:      clk,
		Logger:     log.With(logkey.Component, "caclient"),
		Registerer: registry,
	}
	if a.source == SourceEmbeddedCA {
		if err := a.embed(&caCfg, cfg, id, clk, log); err != nil {
			return nil, err
		}
	}
	log.Info("CA source", logkey.CAAddress, caCfg.Address, logkey.CARoot, describePath(caCfg.RootCertFile, "the system roots"), logkey.Identity, id.String())
	ca, err := caclient.New(caCfg)
	if err != nil {
		return nil, err
	}
	smCfg.Signer = ca
	smCfg.Identity = id
	smCfg.RootCertFile = caCfg.RootCertFile
	return secretmanager.New(smCfg)
}

// embed builds the control plane in-process, serving on a private Unix socket under the root
// dir, and points the CA client at it with tokens minted from its own key: the embedded pipeline
// is the production pipeline.
func (a *Agent) embed(caCfg *caclient.Config, cfg Config, id pki.SPIFFEID, clk clock.Clock, log *slog.Logger) error {
	stateDir := cfg.path(DefaultEmbeddedDir)
	if err := sds.CheckSocketPath(filepath.Join(stateDir, embeddedSocket)); err != nil {
		return fmt.Errorf("the embedded CA's socket under --root-dir: %w", err)
	}
	cpCfg := controlplane.DefaultConfig()
	cpCfg.StateDir = stateDir
	cpCfg.GRPCAddr = "unix://" + filepath.Join(stateDir, embeddedSocket)
	cpCfg.MonitoringAddr = ""
	cpCfg.TrustDomain = cfg.TrustDomain
	cpCfg.Clock = clk
	cpCfg.Logger = log.With(logkey.Component, "embedded-ca")
	cp, err := controlplane.New(cpCfg)
	if err != nil {
		return fmt.Errorf("embedded control plane: %w", err)
	}
	a.controlPlane = cp
	// New has created the token key: read it once, and mint a short-lived token per request.
	minter, err := token.LoadMinter(controlplane.TokenKeyPath(stateDir))
	if err != nil {
		return fmt.Errorf("embedded control plane: %w", err)
	}
	caCfg.Address = cp.GRPCAddr()
	caCfg.RootCertFile = filepath.Join(stateDir, "root-cert.pem")
	caCfg.TokenPath = ""
	caCfg.Token = func(context.Context) (string, error) {
		return minter.Mint(token.MintParams{
			Issuer:         token.DefaultIssuer,
			Audiences:      []string{token.DefaultAudience},
			Namespace:      id.Namespace,
			ServiceAccount: id.ServiceAccount,
			TTL:            embeddedTokenTTL,
			Now:            clk.Now(),
		})
	}
	return nil
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
	if c.CARootCert != "" {
		return c.CARootCert
	}
	for _, candidate := range []string{provRoot(c.ProvCert), c.path(DefaultCARootCert)} {
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
	return filepath.Join(provCert, caclient.RootCertFile)
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

// Secrets returns the secret manager; nil when an external server serves SDS.
func (a *Agent) Secrets() *secretmanager.Manager { return a.secrets }

// Run runs the agent until ctx ends, then stops: the SDS server stops accepting and ends its
// streams after the drain duration; OUTPUT_CERTS are left as they are.
func (a *Agent) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	if a.controlPlane != nil {
		g.Go(func() error { return a.controlPlane.Run(ctx) })
	}
	if a.secrets != nil {
		g.Go(func() error { return a.secrets.Run(ctx) })
		g.Go(func() error { return a.sds.Run(ctx) })
	}
	for _, srv := range []struct {
		server *http.Server
		lis    net.Listener
		name   string
	}{{a.status, a.statusLis, "status"}, {a.debug, a.debugLis, "debug"}} {
		if srv.server == nil {
			continue
		}
		g.Go(func() error {
			if err := srv.server.Serve(srv.lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("serve %s: %w", srv.name, err)
			}
			return nil
		})
		g.Go(func() error {
			<-ctx.Done()
			return srv.server.Close()
		})
	}
	a.log.Info("agent started", logkey.Source, string(a.source), logkey.SDSSocket, a.socketPath, logkey.StatusAddress, a.StatusAddr(), logkey.DebugAddress, a.DebugAddr())
	err := g.Wait()
	a.log.Info("agent stopped")
	return err
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
	if a.controlPlane != nil {
		a.controlPlane.Close()
	}
}

// ready reports whether Envoy can get its certificate: a valid one held, or, when another
// server serves SDS, that server answering on the socket.
func (a *Agent) ready() (bool, string) {
	if a.source == SourceExternalSDS {
		if sds.SocketServing(a.socketPath) {
			return true, ""
		}
		return false, "the external SDS socket " + a.socketPath + " does not accept connections"
	}
	if !a.secrets.Ready() {
		return false, "no valid workload certificate"
	}
	return true, ""
}

func (a *Agent) statusHandler(registry *prometheus.Registry) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{Registry: registry}))
	mux.HandleFunc("GET /healthz/ready", func(w http.ResponseWriter, _ *http.Request) {
		if ok, why := a.ready(); !ok {
			http.Error(w, "not ready: "+why, http.StatusServiceUnavailable)
			return
		}
		_, _ = fmt.Fprintln(w, "ready")
	})
	return mux
}
