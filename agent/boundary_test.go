package agent_test

import (
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/xdsproxy"
)

// Attack: /debug/<type> on the loopback debug port gave any local user the namespace's
// configuration and its other proxies, while the XDS socket's mode refused them. It is served on
// a Unix socket next to the XDS socket, with its mode; on the debug port only when asked.
func TestXDSDebugIsServedToWhoMayOpenTheXDSSocket(t *testing.T) {
	t.Parallel()
	e := newXDSEnv(t)
	for _, tcp := range []bool{false, true} {
		t.Run("xds-debug-tcp="+strconv.FormatBool(tcp), func(t *testing.T) {
			t.Parallel()
			cfg := e.config(t, e.tokenFile(t, "default", "demo"), nil)
			cfg.Output.Dir = filepath.Join(t.TempDir(), "out") // one agent's: the subtests run at once
			cfg.XDS.DebugTCP = tcp
			a := newAgent(t, cfg)
			runAgent(t, a)

			socket := a.XDSDebugSocket()
			if want := filepath.Join(cfg.RootDir, "etc/istio/proxy", agent.XDSDebugSocketName); socket != want {
				t.Fatalf("debug socket %s, want %s", socket, want)
			}
			xds, err := os.Lstat(filepath.Join(cfg.RootDir, agent.DefaultXDSSocket))
			if err != nil {
				t.Fatal(err)
			}
			debug, err := os.Lstat(socket)
			if err != nil {
				t.Fatal(err)
			}
			if debug.Mode().Type() != os.ModeSocket || debug.Mode().Perm() != xds.Mode().Perm() || debug.Mode().Perm() != xdsproxy.DefaultSocketMode {
				t.Fatalf("debug socket %v, want a socket with the XDS socket's mode %v", debug.Mode(), xds.Mode().Perm())
			}
			if code, body := unixGet(t, socket, "/debug/config_dump"); code != http.StatusOK || !strings.Contains(body, `"backend"`) {
				t.Fatalf("/debug/config_dump on the socket: %d %s", code, body)
			}
			if code, body := unixGet(t, socket, "/debug/adsz"); code != http.StatusNotFound {
				t.Fatalf("/debug/adsz on the socket: %d %s, want 404", code, body)
			}
			code, body := httpGet(t, "http://"+a.DebugAddr()+"/debug/config_dump")
			switch {
			case tcp && (code != http.StatusOK || !strings.Contains(body, `"backend"`)):
				t.Fatalf("/debug/config_dump on the debug port, asked for: %d %s", code, body)
			case !tcp && (code != http.StatusNotFound || !strings.Contains(body, socket) || strings.Contains(body, `"backend"`)):
				t.Fatalf("/debug/config_dump on the debug port, not asked for: %d %s, want 404 naming the socket", code, body)
			}
			if code, _ := httpGet(t, "http://"+a.DebugAddr()+"/debug/secrets"); code != http.StatusOK {
				t.Fatalf("/debug/secrets: %d", code)
			}
		})
	}
}

// Attack: a web page can have the browser ask 127.0.0.1 through a name it rebinds there (DNS
// rebinding), and read the answers. The debug server answers only a Host naming loopback; the
// others are refused, counted and logged.
func TestDebugServerRefusesHostsThatAreNotLoopback(t *testing.T) {
	t.Parallel()
	logs := newLogSink(t)
	cfg := testConfig(t, newFakeClock(), logs, nil)
	a := newAgent(t, cfg)
	runAgent(t, a)
	get := func(host string) int {
		t.Helper()
		req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://"+a.DebugAddr()+"/debug/secrets", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Host = host
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	_, port, _ := net.SplitHostPort(a.DebugAddr())
	for _, host := range []string{"localhost:" + port, "LOCALHOST", "127.0.0.1:" + port, "127.0.0.2", "[::1]:" + port} {
		if code := get(host); code != http.StatusOK {
			t.Fatalf("Host %s: %d, want 200", host, code)
		}
	}
	for _, host := range []string{"rebind.example:" + port, "rebind.example", "10.0.0.1:" + port, "localhost.rebind.example"} {
		if code := get(host); code != http.StatusForbidden {
			t.Fatalf("Host %s: %d, want 403", host, code)
		}
	}
	if got := metric(t, a, `meshid_agent_debug_refusals_total{reason="host"}`); got != "4" {
		t.Fatalf("refusals counted %q, want 4", got)
	}
	if logged := logs.records(t, "debug request refused: its Host does not name loopback"); len(logged) != 4 || logged[0]["host"] != "rebind.example:"+port {
		t.Fatalf("the refusals logged as %v", logged)
	}
}

// A server that binds the agent's SDS or XDS socket path after it started (spire-agent, say:
// istio#61343) takes Envoy's new connections. The agent notices within seconds: it is not ready,
// naming the cause and who serves the path now, until the path is its own again.
func TestReadinessFollowsTheSocketPaths(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		socket func(agent.Config, *agent.Agent) string
		metric string
	}{
		{"SDS", func(_ agent.Config, a *agent.Agent) string { return a.SocketPath() }, "meshid_sds_socket_taken_total"},
		{"XDS", func(cfg agent.Config, _ *agent.Agent) string {
			return filepath.Join(cfg.RootDir, agent.DefaultXDSSocket)
		}, "meshid_xds_proxy_socket_taken_total"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			clk := newFakeClock()
			type change struct {
				socket string
				err    error
			}
			changes := make(chan change, 10)
			sockets := newFakeClock()
			cfg := testConfig(t, clk, nil, nil)
			cfg.SocketClock = sockets
			cfg.OnSocket = func(socket string, err error) { changes <- change{socket, err} }
			a := newAgent(t, cfg)
			certs := issued(t, a)
			runAgent(t, a)
			receive(t, certs, "first certificate")
			ready := "http://" + a.StatusAddr() + "/healthz/ready"
			if code, body := httpGet(t, ready); code != http.StatusOK {
				t.Fatalf("/healthz/ready = %d %q", code, body)
			}

			path := tc.socket(cfg, a)
			other, err := net.Listen("unix", path+".new")
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(path+".new", path); err != nil {
				t.Fatal(err)
			}
			if got := testutil.Drive(t, sockets, sds.SocketCheckInterval, 0, changes); got.socket != path || got.err == nil {
				t.Fatalf("the takeover reported as %v", got)
			}
			code, body := httpGet(t, ready)
			if code != http.StatusServiceUnavailable || !strings.Contains(body, path) || !strings.Contains(body, "served by pid="+strconv.Itoa(os.Getpid())) {
				t.Fatalf("/healthz/ready while the path is taken: %d %q, want 503 naming the path and the other server", code, body)
			}
			if got := metric(t, a, tc.metric); got != "1" {
				t.Fatalf("%s = %q, want 1", tc.metric, got)
			}

			_ = other.Close()
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			for got := testutil.Drive(t, sockets, sds.SocketCheckInterval, 0, changes); got.err != nil; got = <-changes {
			}
			if code, body := httpGet(t, ready); code != http.StatusOK {
				t.Fatalf("/healthz/ready once the path is the agent's again: %d %q", code, body)
			}
		})
	}
}
