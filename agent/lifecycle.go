package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshid/meshid/agent/envoy"
	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/secretmanager"
)

// DefaultBootstrapPath is where the agent writes the bootstrap of the Envoy it starts, relative to
// RootDir, as Istio's agent does.
const DefaultBootstrapPath = "etc/istio/proxy/envoy-rev.json"

// AdminAddressFile is where, next to its bootstrap, the Envoy whose admin listens on a port of
// the kernel's choosing (Envoy.AdminPort 0) writes its admin's address.
const AdminAddressFile = "envoy-admin-address"

// readyTimeout bounds the readiness check's question to Envoy's admin.
const readyTimeout = time.Second

// lifecycle is Envoy's life in the agent and the agent's end: the supervisor of the Envoy it runs
// (nil when Envoy runs elsewhere), the moment Envoy may start, and /quitquitquit.
type lifecycle struct {
	envoy *envoy.Supervisor
	// inService is closed once the workload certificate is (Envoy may start then).
	inService     chan struct{}
	markInService func()
	stopWatching  func()
	// quit is closed by /quitquitquit.
	quit     chan struct{}
	quitOnce sync.Once

	log      *slog.Logger
	logs     *admission.LogLimiter
	refusals *prometheus.CounterVec
}

func newLifecycle(clk clock.Clock, log *slog.Logger, reg prometheus.Registerer) (*lifecycle, error) {
	l := &lifecycle{
		inService: make(chan struct{}),
		quit:      make(chan struct{}),
		log:       log,
		logs:      admission.NewLogLimiter(clk),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "quit_refusals_total",
			Help: "POST /quitquitquit refused, by reason (peer: not from loopback; host: a Host header that does not name loopback).",
		}, []string{"reason"}),
	}
	l.markInService = sync.OnceFunc(func() { close(l.inService) })
	if err := reg.Register(l.refusals); err != nil {
		return nil, fmt.Errorf("register the status server's metrics: %w", err)
	}
	return l, nil
}

// watchInService closes inService once secrets holds a workload certificate; with no secrets
// (another server serves SDS) at once.
func (l *lifecycle) watchInService(secrets *secretmanager.Manager) error {
	if secrets == nil {
		l.markInService()
		return nil
	}
	cancel, err := secrets.Subscribe(secretmanager.WorkloadCertName, func(s *secretmanager.Secret, _ error) {
		if s != nil {
			l.markInService()
		}
	})
	if err != nil {
		return err
	}
	l.stopWatching = cancel
	return nil
}

// quitHandler ends the agent, and Envoy with it, at once and with status 0, as Istio's agent's
// /quitquitquit does for a Job's sidecar; only from loopback, and only for a Host that names it (a
// web page can make a browser POST to 127.0.0.1 through a name it rebinds there).
func (l *lifecycle) quitHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		reason := ""
		switch {
		case !loopbackPeer(r.RemoteAddr):
			reason = "peer"
		case !loopbackHost(r.Host):
			reason = "host"
		}
		if reason != "" {
			l.refusals.WithLabelValues(reason).Inc()
			if ok, dropped := l.logs.Allow(reason); ok {
				attrs := []any{logkey.Peer, r.RemoteAddr, logkey.Host, logkey.Untrusted(r.Host), logkey.Reason, reason}
				if dropped > 0 {
					attrs = append(attrs, logkey.Dropped, dropped)
				}
				l.log.Warn("/quitquitquit refused: only a request from loopback, for localhost, may end the agent", attrs...)
			}
			http.Error(w, "/quitquitquit is answered from loopback only", http.StatusForbidden)
			return
		}
		l.log.Info("/quitquitquit: ending Envoy and the agent", logkey.Peer, r.RemoteAddr)
		// The whole answer goes out before the agent starts closing its servers, which cuts
		// the connections it still has.
		const answer = "OK\n"
		w.Header().Set("Content-Length", strconv.Itoa(len(answer)))
		_, _ = io.WriteString(w, answer)
		if f, ok := w.(http.Flusher); ok {
			f.Flush()
		}
		l.quitOnce.Do(func() {
			close(l.quit)
			if l.envoy != nil {
				l.envoy.Quit()
			}
		})
	})
}

func loopbackPeer(remoteAddr string) bool {
	host, _, err := net.SplitHostPort(remoteAddr)
	return err == nil && isLoopback(host)
}

// newEnvoy writes Envoy's bootstrap and makes the supervisor that will run it.
func newEnvoy(cfg Config, clk clock.Clock, log *slog.Logger) (*envoy.Supervisor, error) {
	opts, err := writeBootstrap(cfg, log)
	if err != nil {
		return nil, err
	}
	e := cfg.Envoy
	admin := envoy.NewAdmin(cfg.envoyAdminAddr(), e.PrometheusPort)
	if opts.AdminAddressPath != "" {
		admin = envoy.NewAdminAt(opts.AdminAddressPath)
	}
	return envoy.NewSupervisor(envoy.SupervisorConfig{
		Options: opts,
		Drain: envoy.DrainConfig{Minimum: e.MinimumDrainDuration, Termination: e.TerminationDrainDuration,
			ExitOnZeroActiveConnections: e.ExitOnZeroActiveConnections},
		Admin:   admin,
		Signals: e.Signals,
		Stdout:  e.Stdout,
		Stderr:  e.Stderr,
		Clock:   clk,
		Logger:  log,
	})
}

// writeBootstrap writes Envoy's bootstrap and returns Envoy's command line: the override goes on
// it (--config-yaml) when this binary cannot merge it into the file.
func writeBootstrap(cfg Config, log *slog.Logger) (envoy.Options, error) {
	bootstrap, err := Bootstrap(context.Background(), cfg)
	if err != nil {
		return envoy.Options{}, err
	}
	path := cfg.bootstrapPath()
	// Atomic but not flushed: it is written again at every start before Envoy starts, and a flush
	// would put the disk's latency on the path to Envoy's first certificate. No secret in it:
	// Envoy reads it.
	if err := fsutil.Syncer(fsutil.NoSync).WriteFileAtomic(path, bootstrap.Bootstrap, fsutil.PublicFileMode); err != nil {
		return envoy.Options{}, &FieldError{Field: "Envoy.BootstrapPath", Err: err}
	}
	log.Info("wrote Envoy's bootstrap", logkey.Path, path)
	if len(bootstrap.Override) > 0 {
		log.Info("Envoy merges the bootstrap override itself (--config-yaml): this binary leaves Envoy's types out",
			logkey.Path, cfg.Envoy.BootstrapOverride)
	}
	e := cfg.Envoy
	opts := envoy.Options{Path: e.Path, BootstrapPath: path, ConfigYAML: string(bootstrap.Override),
		LogLevel: e.LogLevel, ComponentLogLevel: e.ComponentLogLevel, Concurrency: e.Concurrency, DrainDuration: e.DrainDuration}
	if e.AdminPort == 0 {
		// The kernel chooses the admin's port; Envoy says which in this file, which an earlier
		// Envoy's must not stand for.
		opts.AdminAddressPath = filepath.Join(filepath.Dir(path), AdminAddressFile)
		if err := os.Remove(opts.AdminAddressPath); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return envoy.Options{}, &FieldError{Field: "Envoy.BootstrapPath", Err: err}
		}
	}
	return opts, nil
}

func (c *Config) bootstrapPath() string {
	if c.Envoy.BootstrapPath != "" {
		return c.Envoy.BootstrapPath
	}
	return c.path(DefaultBootstrapPath)
}

func (c *Config) envoyAdminAddr() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(c.Envoy.AdminPort))
}

// unmet lists why the agent is not ready, every condition that fails: Envoy reaching the agent
// (its sockets' paths), Envoy's certificate (held, and written to OUTPUT_CERTS when asked, or
// another SDS server answering), Envoy's configuration through the xDS proxy, Envoy itself when
// the agent runs it (LIVE), and not shutting down.
func (a *Agent) unmet(ctx context.Context) []string {
	var why []string
	if a.shuttingDown.Load() {
		why = append(why, "the agent is shutting down")
	}
	if a.xds != nil {
		if err := a.xds.SocketProblem(); err != nil {
			why = append(why, err.Error())
		}
		if err := a.xds.ConfigProblem(a.life.envoy != nil); err != nil {
			why = append(why, err.Error())
		}
	}
	if a.source == SourceExternalSDS {
		if !fsutil.SocketServing(a.socketPath) {
			why = append(why, "the external SDS socket "+a.socketPath+" does not accept connections")
		}
	} else {
		if err := a.sds.SocketProblem(); err != nil {
			why = append(why, err.Error())
		}
		// A node agent has no certificate of its own: it is ready once it serves, and can
		// identify its callers.
		if a.node != nil {
			if err := a.node.Problem(); err != nil {
				why = append(why, err.Error())
			}
		}
		if a.secrets != nil {
			if ok, reason := a.secrets.Ready(); !ok {
				why = append(why, reason)
			}
		}
	}
	if a.life.envoy != nil {
		ctx, cancel := context.WithTimeout(ctx, readyTimeout)
		defer cancel()
		if err := a.life.envoy.Problem(ctx); err != nil {
			why = append(why, err.Error())
		}
	}
	return why
}

func (a *Agent) readyHandler(w http.ResponseWriter, r *http.Request) {
	if why := a.unmet(r.Context()); len(why) > 0 {
		http.Error(w, "not ready: "+strings.Join(why, "; "), http.StatusServiceUnavailable)
		return
	}
	_, _ = fmt.Fprintln(w, "ready")
}
