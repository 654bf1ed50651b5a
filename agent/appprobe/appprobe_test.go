package appprobe_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/meshid/meshid/agent/appprobe"
	"github.com/meshid/meshid/internal/testutil"
)

// wait bounds, in real time, how long a test waits for something that should come at once.
const wait = 30 * time.Second

func port(t *testing.T, addr string) int {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func newHandler(t *testing.T, probers string, reg prometheus.Registerer) *appprobe.Handler {
	t.Helper()
	p, err := appprobe.Parse(probers)
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	h, err := appprobe.New(appprobe.Config{Probers: p, Registerer: reg})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return h
}

func get(h http.Handler, path string) int {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	return rec.Code
}

func TestHTTPProbePassesTheStatusAndSendsTheHeaders(t *testing.T) {
	t.Parallel()
	app := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Custom") != "yes" || r.Host != "app.example" {
			http.Error(w, "headers not sent", http.StatusTeapot)
			return
		}
		switch r.URL.Path {
		case "/ok":
			w.WriteHeader(http.StatusOK)
		case "/moved":
			http.Redirect(w, r, "/elsewhere", http.StatusFound)
		default:
			http.Error(w, strings.Repeat("x", 1<<20), http.StatusServiceUnavailable)
		}
	}))
	t.Cleanup(app.Close)
	p := port(t, app.Listener.Addr().String())
	headers := `"httpHeaders":[{"name":"X-Custom","value":"yes"},{"name":"Host","value":"app.example"}]`
	h := newHandler(t, fmt.Sprintf(`{
		"/app-health/web/livez":{"httpGet":{"path":"/ok","port":%d,"scheme":"HTTP",%s},"timeoutSeconds":5},
		"/app-health/web/readyz":{"httpGet":{"path":"/down","port":"%d",%s}},
		"/app-health/web/startupz":{"httpGet":{"path":"/moved","port":%d,%s}}}`, p, headers, p, headers, p, headers), nil)
	for path, want := range map[string]int{
		"/app-health/web/livez":    http.StatusOK,
		"/app-health/web/readyz":   http.StatusServiceUnavailable,
		"/app-health/web/startupz": http.StatusFound,
		"/app-health/other/livez":  http.StatusNotFound,
		"/healthz/ready":           http.StatusNotFound,
	} {
		if got := get(h, path); got != want {
			t.Errorf("GET %s = %d, want %d", path, got, want)
		}
	}
}

func TestTCPProbe(t *testing.T) {
	t.Parallel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lis.Close() })
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_ = closed.Close()
	h := newHandler(t, fmt.Sprintf(`{"/app-health/db/livez":{"tcpSocket":{"port":%d}},"/app-health/db/readyz":{"tcpSocket":{"port":%d}}}`,
		port(t, lis.Addr().String()), port(t, closed.Addr().String())), nil)
	if got := get(h, "/app-health/db/livez"); got != http.StatusOK {
		t.Errorf("listening port: %d, want 200", got)
	}
	if got := get(h, "/app-health/db/readyz"); got != http.StatusInternalServerError {
		t.Errorf("closed port: %d, want 500", got)
	}
}

func TestGRPCProbe(t *testing.T) {
	t.Parallel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	hs := health.NewServer()
	hs.SetServingStatus("up", healthpb.HealthCheckResponse_SERVING)
	hs.SetServingStatus("down", healthpb.HealthCheckResponse_NOT_SERVING)
	healthpb.RegisterHealthServer(srv, hs)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	p := port(t, lis.Addr().String())
	h := newHandler(t, fmt.Sprintf(`{"/app-health/g/livez":{"grpc":{"port":%d,"service":"up"},"timeoutSeconds":10},
		"/app-health/g/readyz":{"grpc":{"port":%d,"service":"down"},"timeoutSeconds":10},
		"/app-health/g/startupz":{"grpc":{"port":%d},"timeoutSeconds":10}}`, p, p, p), nil)
	for path, want := range map[string]int{
		"/app-health/g/livez":    http.StatusOK,
		"/app-health/g/readyz":   http.StatusInternalServerError,
		"/app-health/g/startupz": http.StatusOK, // "": the server as a whole
	} {
		if got := get(h, path); got != want {
			t.Errorf("GET %s = %d, want %d", path, got, want)
		}
	}
}

// blockingApp is an application whose probe path answers only when the probe gives up; entered
// tells that a probe arrived, ended that its request's context ended.
func blockingApp(t *testing.T) (p int, entered, ended chan struct{}) {
	t.Helper()
	entered, ended = make(chan struct{}, 16), make(chan struct{}, 16)
	app := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		entered <- struct{}{}
		<-r.Context().Done()
		ended <- struct{}{}
	}))
	t.Cleanup(app.Close)
	return port(t, app.Listener.Addr().String()), entered, ended
}

func recv(t *testing.T, c <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(wait):
		t.Fatalf("%s: not within %s", what, wait)
	}
}

func TestProbeEndsWithTheRequest(t *testing.T) {
	t.Parallel()
	p, entered, ended := blockingApp(t)
	h := newHandler(t, fmt.Sprintf(`{"/app-health/web/livez":{"httpGet":{"path":"/","port":%d},"timeoutSeconds":60}}`, p), nil)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan int)
	go func() {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequestWithContext(ctx, http.MethodGet, "/app-health/web/livez", nil))
		done <- rec.Code
	}()
	recv(t, entered, "the probe reaching the application")
	cancel()
	recv(t, ended, "the probe's connection closing")
	if code := <-done; code != http.StatusInternalServerError {
		t.Errorf("abandoned probe: %d, want 500", code)
	}
}

func TestTooManyProbesOfAPathAreRefused(t *testing.T) {
	t.Parallel()
	p, entered, _ := blockingApp(t)
	reg := prometheus.NewRegistry()
	probers, err := appprobe.Parse(fmt.Sprintf(`{"/app-health/web/livez":{"httpGet":{"port":%d},"timeoutSeconds":60}}`, p))
	if err != nil {
		t.Fatal(err)
	}
	var logs testutil.SyncBuffer
	h, err := appprobe.New(appprobe.Config{Probers: probers, MaxInFlight: 2, Registerer: reg,
		Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan int, 2)
	for range 2 {
		go func() {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequestWithContext(ctx, http.MethodGet, "/app-health/web/livez", nil))
			done <- rec.Code
		}()
	}
	recv(t, entered, "the first probe")
	recv(t, entered, "the second probe")
	if got := get(h, "/app-health/web/livez"); got != http.StatusServiceUnavailable {
		t.Errorf("third probe at once: %d, want 503", got)
	}
	if n := refusals(t, reg); n != 1 {
		t.Errorf("meshid_agent_app_probe_refusals_total = %v, want 1", n)
	}
	// httptest's requests come from 192.0.2.1:1234.
	if recs := logs.Records(t, "application probe refused: as many probes of this path are running already"); len(recs) != 1 ||
		recs[0]["peer"] != "192.0.2.1:1234" || recs[0]["path"] != "/app-health/web/livez" {
		t.Errorf("refusal logged as %v, want once with the peer and the path", recs)
	}
	cancel()
	<-done
	<-done
}

func refusals(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "meshid_agent_app_probe_refusals_total" {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatal("meshid_agent_app_probe_refusals_total not registered")
	return 0
}

func TestParseRefuses(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, in, want string }{
		{"bad JSON", `{bad`, "not a JSON object"},
		{"not a probe", `{"/app-health/a/livez":3}`, `"/app-health/a/livez": not a probe object`},
		{"path", `{"/healthz":{"tcpSocket":{"port":1}}}`, `"/healthz": want /app-health/<container>/livez`},
		{"path kind", `{"/app-health/a/alive":{"tcpSocket":{"port":1}}}`, `"/app-health/a/alive"`},
		{"unknown kind", `{"/app-health/a/livez":{"exec":{"command":["true"]}}}`, `"/app-health/a/livez": exec: unknown field`},
		{"no kind", `{"/app-health/a/livez":{"timeoutSeconds":1}}`, "want exactly one"},
		{"two kinds", `{"/app-health/a/livez":{"tcpSocket":{"port":1},"grpc":{"port":1}}}`, "want exactly one"},
		{"port range", `{"/app-health/a/livez":{"httpGet":{"port":70000}}}`, "httpGet: 70000 is out of range"},
		{"named port", `{"/app-health/a/livez":{"tcpSocket":{"port":"http"}}}`, "tcpSocket: \"http\" is not a port number"},
		{"no port", `{"/app-health/a/livez":{"grpc":{"service":"x"}}}`, "grpc: port: required"},
		{"unknown field", `{"/app-health/a/livez":{"httpGet":{"port":1,"paht":"/"}}}`, `httpGet: json: unknown field "paht"`},
		{"scheme", `{"/app-health/a/livez":{"httpGet":{"port":1,"scheme":"FTP"}}}`, "httpGet: scheme"},
		{"header", `{"/app-health/a/livez":{"httpGet":{"port":1,"httpHeaders":[{"name":"X","value":"a\r\nB: c"}]}}}`, "httpHeaders[0].value"},
		{"timeout", `{"/app-health/a/livez":{"tcpSocket":{"port":1},"timeoutSeconds":-1}}`, "timeoutSeconds: -1 must not be negative"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := appprobe.Parse(tc.in)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Parse(%s) = %v, want an error containing %q", tc.in, err, tc.want)
			}
		})
	}
}

func TestParseDefaults(t *testing.T) {
	t.Parallel()
	p, err := appprobe.Parse(`{"/app-health/a/livez":{"tcpSocket":{"port":1}},"/app-health/a/readyz":{"tcpSocket":{"port":1},"timeoutSeconds":3}}`)
	if err != nil {
		t.Fatal(err)
	}
	if got := p["/app-health/a/livez"].Timeout; got != appprobe.DefaultTimeout {
		t.Errorf("default timeout %s, want %s", got, appprobe.DefaultTimeout)
	}
	if got := p["/app-health/a/readyz"].Timeout; got != 3*time.Second {
		t.Errorf("timeout %s, want 3s", got)
	}
	if p, err := appprobe.Parse(""); err != nil || p != nil {
		t.Errorf(`Parse("") = %v, %v; want none`, p, err)
	}
}
