package agent

import (
	"log/slog"
	"net/http"

	"github.com/meshid/meshid/agent/envoy"
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
