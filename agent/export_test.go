package agent

import (
	"log/slog"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshid/meshid/agent/envoy"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/secretmanager"
)

// CARootCert exposes the CA root lookup to the tests.
func CARootCert(c Config) string { return c.caRootCert() }

// QuitHandler exposes /quitquitquit's handler, for requests from peers a test cannot be.
func (a *Agent) QuitHandler() http.Handler { return a.life.quitHandler() }

// EnvoyPID is the pid of the Envoy the agent runs, 0 when none runs.
func (a *Agent) EnvoyPID() int {
	if a.life.envoy == nil {
		return 0
	}
	return a.life.envoy.PID()
}

// WriteBootstrap exposes what the agent that runs Envoy writes and passes it.
func WriteBootstrap(c Config) (envoy.Options, error) {
	return writeBootstrap(c, slog.New(slog.DiscardHandler))
}

// EnvoyAdmin is the address of the admin of the Envoy the agent runs, once known.
func (a *Agent) EnvoyAdmin() (string, error) { return a.life.envoy.Admin().Addr() }

// FailNodeManagers makes a node agent's secret managers fail to start while fail returns an
// error for their identity; call it before Run.
func (a *Agent) FailNodeManagers(fail func(id pki.SPIFFEID) error) {
	next := a.identities.newManager
	a.identities.newManager = func(id pki.SPIFFEID, reg prometheus.Registerer) (*secretmanager.Manager, error) {
		if err := fail(id); err != nil {
			return nil, err
		}
		return next(id, reg)
	}
}

// IdentityRetryAt is when the failed manager of a node agent's identity id is made again; zero
// when it has not failed.
func (a *Agent) IdentityRetryAt(id pki.SPIFFEID) time.Time {
	a.identities.mu.Lock()
	defer a.identities.mu.Unlock()
	if h := a.identities.entries[id]; h != nil && h.manager == nil {
		return h.retryAt
	}
	return time.Time{}
}
