package agent_test

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"syscall"
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
	// The port is held on 127.0.0.1 by a socket bound but not listening, so that the probe of
	// 127.0.0.1 is refused whatever else runs: with the port only free there, a parallel test
	// that bound 127.0.0.1 on it made the probe answer 200.
	port := reservePort(t)
	app, err := net.Listen("tcp", fmt.Sprintf("127.0.0.2:%d", port)) // loopback, but not 127.0.0.1
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
	probers := fmt.Sprintf(`{"/app-health/web/livez":{"tcpSocket":{"port":%d}}}`, port)
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

// reservePort binds a TCP socket to 127.0.0.1 on a port the kernel picks, without listening, and
// holds it for the test: a connection to 127.0.0.1 on that port is refused, and no other socket
// can take it.
func reservePort(t *testing.T) int {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	syscall.CloseOnExec(fd) // the agents of the tests start children
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return sa.(*syscall.SockaddrInet4).Port
}
