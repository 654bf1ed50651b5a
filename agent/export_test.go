package agent

import "net/http"

// CARootCert exposes the CA root lookup to the tests.
func CARootCert(c Config) string { return c.caRootCert() }

// QuitHandler exposes /quitquitquit's handler, for requests from peers a test cannot be.
func (a *Agent) QuitHandler() http.Handler { return a.life.quitHandler() }
