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

// Probes go to the workload's address (INSTANCE_IP), as Istio's agent sends them: an application
// that listens on the pod IP alone is probed there, not on 127.0.0.1.
func TestApplicationProbesGoToTheInstanceIP(t *testing.T) {
	t.Parallel()
	app, err := net.Listen("tcp", "127.0.0.2:0") // loopback, but not 127.0.0.1
	if err != nil {
		t.Skipf("no 127.0.0.2 to stand for a pod IP here: %v", err)
	}
	t.Cleanup(func() { _ = app.Close() })
	go func() {
		for {
			c, err := app.Accept()
			if err != nil {
				return
			}
			_ = c.Close()
		}
	}()
	_, port, err := net.SplitHostPort(app.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	probers := fmt.Sprintf(`{"/app-health/web/livez":{"tcpSocket":{"port":%s}}}`, port)
	for _, tc := range []struct {
		instanceIP string
		want       int
	}{{"127.0.0.2", http.StatusOK}, {"", http.StatusInternalServerError}} {
		cfg := testConfig(t, newFakeClock(), nil, nil)
		cfg.Servers.AppProbers, cfg.Identity.InstanceIP = probers, tc.instanceIP
		a := newAgent(t, cfg)
		runAgent(t, a)
		if code, body := httpGet(t, "http://"+a.StatusAddr()+"/app-health/web/livez"); code != tc.want {
			t.Errorf("INSTANCE_IP %q: GET /app-health/web/livez = %d %q, want %d", tc.instanceIP, code, body, tc.want)
		}
	}
}
