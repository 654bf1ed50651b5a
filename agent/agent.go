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

	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/secretmanager"
)

// Agent is a running meshid agent.
type Agent struct {
	log       *slog.Logger
	secrets   *secretmanager.Manager
	status    *http.Server
	statusLis net.Listener
}

// New builds the agent's components from cfg and opens the status listener. It starts no
// goroutines; call Run.
func New(cfg Config) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	clk := clock.OrReal(cfg.Clock)
	id, err := cfg.Identity()
	if err != nil {
		return nil, err
	}
	registry := prometheus.NewRegistry()
	registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	rootCert := cfg.caRootCert()
	log.Info("CA source",
		"ca_address", cfg.CAAddress,
		"ca_root", describePath(rootCert, "the system roots"),
		"token", cfg.TokenPath,
		"identity", id.String())

	ca, err := caclient.New(caclient.Config{
		Address:      cfg.CAAddress,
		RootCertFile: rootCert,
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
	})
	if err != nil {
		return nil, err
	}
	secrets, err := secretmanager.New(secretmanager.Config{
		Signer:           ca,
		Identity:         id,
		KeyAlgorithm:     cfg.KeyAlgorithm,
		RSAKeySize:       cfg.RSAKeySize,
		TTL:              cfg.SecretTTL,
		GraceRatio:       cfg.GraceRatio,
		GraceRatioJitter: cfg.GraceRatioJitter,
		OutputDir:        cfg.OutputCerts,
		RootCertFile:     rootCert,
		Clock:            clk,
		Logger:           log.With(logkey.Component, "secretmanager"),
		Registerer:       registry,
	})
	if err != nil {
		return nil, err
	}

	a := &Agent{log: log, secrets: secrets}
	a.statusLis, err = net.Listen("tcp", cfg.StatusAddr)
	if err != nil {
		return nil, fmt.Errorf("listen for status on %s: %w", cfg.StatusAddr, err)
	}
	a.status = &http.Server{Handler: a.statusHandler(registry), ReadHeaderTimeout: 10 * time.Second}
	return a, nil
}

// caRootCert finds the CA root in Istio's order: CA_ROOT_CA, PROV_CERT/root-cert.pem, then the
// mounted istio-ca-root-cert config map; "" (the system roots) when none exists.
func (c *Config) caRootCert() string {
	if c.CARootCert != "" {
		return c.CARootCert
	}
	for _, candidate := range []string{
		provRoot(c.ProvCert),
		filepath.Join(rootDirOrSlash(c.RootDir), DefaultCARootCert),
	} {
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

func describePath(p, ifEmpty string) string {
	if p == "" {
		return ifEmpty
	}
	return p
}

// StatusAddr returns the status server's address.
func (a *Agent) StatusAddr() string { return a.statusLis.Addr().String() }

// Secrets returns the secret manager.
func (a *Agent) Secrets() *secretmanager.Manager { return a.secrets }

// Run runs the agent until ctx ends. It then stops at once, leaving OUTPUT_CERTS as they are.
func (a *Agent) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return a.secrets.Run(ctx) })
	g.Go(func() error {
		if err := a.status.Serve(a.statusLis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("serve status: %w", err)
		}
		return nil
	})
	g.Go(func() error {
		<-ctx.Done()
		return a.status.Close()
	})
	a.log.Info("agent started", "status_address", a.StatusAddr())
	err := g.Wait()
	a.log.Info("agent stopped")
	return err
}

func (a *Agent) statusHandler(registry *prometheus.Registry) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{Registry: registry}))
	mux.HandleFunc("GET /healthz/ready", func(w http.ResponseWriter, _ *http.Request) {
		if !a.secrets.Ready() {
			http.Error(w, "not ready: no valid workload certificate", http.StatusServiceUnavailable)
			return
		}
		_, _ = fmt.Fprintln(w, "ready")
	})
	return mux
}
