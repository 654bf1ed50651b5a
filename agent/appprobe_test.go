package agent_test

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
)

// The status server answers the kubelet's rewritten probes by probing the application.
func TestStatusServerAnswersApplicationProbes(t *testing.T) {
	t.Parallel()
	app := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/healthz" {
			http.Error(w, "down", http.StatusServiceUnavailable)
		}
	}))
	t.Cleanup(app.Close)
	_, port, err := net.SplitHostPort(app.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t, newFakeClock(), nil, nil)
	cfg.Servers.AppProbers = fmt.Sprintf(`{"/app-health/web/livez":{"httpGet":{"path":"/healthz","port":%s}},
		"/app-health/web/readyz":{"httpGet":{"path":"/other","port":%s}},
		"/app-health/web/startupz":{"tcpSocket":{"port":%s}}}`, port, port, port)
	a := newAgent(t, cfg)
	runAgent(t, a)
	base := "http://" + a.StatusAddr()
	for path, want := range map[string]int{
		"/app-health/web/livez":    http.StatusOK,
		"/app-health/web/readyz":   http.StatusServiceUnavailable,
		"/app-health/web/startupz": http.StatusOK,
		"/app-health/db/livez":     http.StatusNotFound,
	} {
		if code, body := httpGet(t, base+path); code != want {
			t.Errorf("GET %s = %d %q, want %d", path, code, body, want)
		}
	}
}
