package promstats_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/meshid/meshid/agent/promstats"
	"github.com/meshid/meshid/internal/testutil"
)

// wait bounds, in real time, how long a test waits for something that should come at once.
const wait = 30 * time.Second

const envoyPage = `# TYPE envoy_cluster_upstream_cx_total counter
envoy_cluster_upstream_cx_total{envoy_cluster_name="inbound|8080||"} 5
envoy_cluster_upstream_cx_total{envoy_cluster_name="outbound|80||db"} 7
# TYPE envoy_server_live gauge
envoy_server_live 1
# TYPE envoy_cluster_upstream_rq_time histogram
envoy_cluster_upstream_rq_time_bucket{le="0.5"} 1
envoy_cluster_upstream_rq_time_bucket{le="+Inf"} 3
envoy_cluster_upstream_rq_time_sum 12.5
envoy_cluster_upstream_rq_time_count 3
`

const appPage = `# HELP app_orders_total Orders taken.
# TYPE app_orders_total counter
app_orders_total{kind="book"} 42
`

// agentRegistry is the agent's own metrics: one counter at 3.
func agentRegistry(t *testing.T) *prometheus.Registry {
	t.Helper()
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "meshid_agent_test_total", Help: "A counter of the agent's."})
	c.Add(3)
	reg.MustRegister(c)
	return reg
}

// page serves body as a text-format page at path, and 404 elsewhere; it insists on being asked
// for the text format.
func page(t *testing.T, path, body string) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.RequestURI() != path {
			http.NotFound(w, r)
			return
		}
		if !strings.HasPrefix(r.Header.Get("Accept"), "text/plain") {
			http.Error(w, "ask for text", http.StatusNotAcceptable)
			return
		}
		w.Header().Set("Content-Type", string(expfmt.FmtText))
		_, _ = io.WriteString(w, body)
	}))
	t.Cleanup(srv.Close)
	return srv
}

func addr(srv *httptest.Server) string { return srv.Listener.Addr().String() }

func port(t *testing.T, hostPort string) string {
	t.Helper()
	_, p, err := net.SplitHostPort(hostPort)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// closedPort returns a loopback address nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a := lis.Addr().String()
	_ = lis.Close()
	return a
}

func annotations(port, path string) string {
	return fmt.Sprintf(`{"scrape":"true","path":%q,"port":%q}`, path, port)
}

func newHandler(t *testing.T, cfg promstats.Config) *promstats.Handler {
	t.Helper()
	if cfg.Agent == nil {
		cfg.Agent = agentRegistry(t)
	}
	h, err := promstats.New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return h
}

// scrape serves one GET /stats/prometheus and parses the page with Prometheus' own parser.
func scrape(t *testing.T, h http.Handler) (int, map[string]*dto.MetricFamily) {
	t.Helper()
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodGet, "/stats/prometheus", nil)
	req.RemoteAddr = "10.0.0.9:4242"
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusOK {
		return rec.Code, nil
	}
	if ct := rec.Header().Get("Content-Type"); ct != string(expfmt.FmtText) {
		t.Errorf("Content-Type %q, want %q", ct, expfmt.FmtText)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	families, err := p.TextToMetricFamilies(strings.NewReader(rec.Body.String()))
	if err != nil {
		t.Fatalf("the merged page does not parse: %v\n%s", err, rec.Body.String())
	}
	return rec.Code, families
}

// value returns the value of the family's only series, or of its first.
func value(t *testing.T, families map[string]*dto.MetricFamily, name string) float64 {
	t.Helper()
	mf, ok := families[name]
	if !ok {
		t.Fatalf("no family %s in the page", name)
	}
	m := mf.GetMetric()[0]
	switch {
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	case m.Histogram != nil:
		return float64(m.GetHistogram().GetSampleCount())
	}
	return m.GetUntyped().GetValue()
}

func TestMergesTheAgentEnvoyAndTheApplication(t *testing.T) {
	t.Parallel()
	envoy := page(t, "/stats/prometheus", envoyPage)
	app := page(t, "/custom?format=prom", appPage)
	reg := prometheus.NewRegistry()
	h := newHandler(t, promstats.Config{EnvoyAdmin: addr(envoy), Application: annotations(port(t, addr(app)), "/custom?format=prom"), Registerer: reg})
	code, families := scrape(t, h)
	if code != http.StatusOK {
		t.Fatalf("GET /stats/prometheus = %d, want 200", code)
	}
	for name, want := range map[string]float64{
		"meshid_agent_test_total":         3,
		"envoy_cluster_upstream_cx_total": 5,
		"envoy_server_live":               1,
		"envoy_cluster_upstream_rq_time":  3,
		"app_orders_total":                42,
	} {
		if got := value(t, families, name); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	if n := len(families["envoy_cluster_upstream_cx_total"].GetMetric()); n != 2 {
		t.Errorf("envoy_cluster_upstream_cx_total has %d series, want 2", n)
	}
	if got := families["envoy_cluster_upstream_rq_time"].GetType(); got != dto.MetricType_HISTOGRAM {
		t.Errorf("Envoy's histogram came out as %s", got)
	}
	if n := promtest.CollectAndCount(reg, "meshid_agent_scrape_failures_total"); n != 10 {
		t.Errorf("%d failure series, want each source's five reasons at 0", n)
	}
}

// Without Envoy's admin address and annotations the page is the agent's alone.
func TestAgentAlone(t *testing.T) {
	t.Parallel()
	code, families := scrape(t, newHandler(t, promstats.Config{}))
	if code != http.StatusOK || len(families) != 1 || value(t, families, "meshid_agent_test_total") != 3 {
		t.Fatalf("GET /stats/prometheus = %d %v, want 200 and the agent's family", code, families)
	}
}

// A source that fails is left out, counted by reason and logged; the scrape is 200 with the rest.
func TestAFailingSourceIsLeftOut(t *testing.T) {
	t.Parallel()
	const maxBytes = 1 << 10
	for _, tc := range []struct {
		name, reason string
		app          func(t *testing.T) string // the application's address
	}{
		{"refused", "connect", closedPort},
		{"status", "status", func(t *testing.T) string {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				http.Error(w, "app_down 1", http.StatusInternalServerError)
			}))
			t.Cleanup(srv.Close)
			return addr(srv)
		}},
		{"garbage", "parse", func(t *testing.T) string { return addr(page(t, "/metrics", "<html>not { metrics\n")) }},
		{"utf8 name", "parse", func(t *testing.T) string { return addr(page(t, "/metrics", "{\"app.orders\"} 1\n")) }},
		{"too large", "too_large", func(t *testing.T) string {
			return addr(page(t, "/metrics", appPage+strings.Repeat("# padding comment\n", maxBytes/10)))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			envoy := page(t, "/stats/prometheus", envoyPage)
			reg := prometheus.NewRegistry()
			var logs testutil.SyncBuffer
			h := newHandler(t, promstats.Config{EnvoyAdmin: addr(envoy), Application: annotations(port(t, tc.app(t)), "/metrics"),
				MaxBytes: maxBytes, Registerer: reg, Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
			code, families := scrape(t, h)
			if code != http.StatusOK {
				t.Fatalf("GET /stats/prometheus = %d, want 200", code)
			}
			if _, ok := families["app_orders_total"]; ok {
				t.Error("the failed application's family is in the page")
			}
			if value(t, families, "envoy_server_live") != 1 || value(t, families, "meshid_agent_test_total") != 3 {
				t.Error("the other sources are missing")
			}
			got := promtest.ToFloat64(failures(t, reg, "application", tc.reason))
			if got != 1 {
				t.Errorf("failures{application,%s} = %v, want 1", tc.reason, got)
			}
			if got := promtest.ToFloat64(failures(t, reg, "envoy", tc.reason)); got != 0 {
				t.Errorf("failures{envoy,%s} = %v, want 0", tc.reason, got)
			}
			recs := logs.Records(t, "/stats/prometheus: a source was left out of the scrape")
			if len(recs) != 1 || recs[0]["source"] != "application" || recs[0]["reason"] != tc.reason {
				t.Errorf("logged %v, want one line naming the application and %s", recs, tc.reason)
			}
		})
	}
}

// failures returns the collector of one failures series, read back from reg.
func failures(t *testing.T, reg *prometheus.Registry, source, reason string) prometheus.Collector {
	t.Helper()
	return gathered{t: t, reg: reg, name: "meshid_agent_scrape_failures_total", labels: map[string]string{"source": source, "reason": reason}}
}

// gathered is one series of a registry, as a collector for promtest.ToFloat64.
type gathered struct {
	t      *testing.T
	reg    *prometheus.Registry
	name   string
	labels map[string]string
}

func (g gathered) Describe(chan<- *prometheus.Desc) {}

func (g gathered) Collect(ch chan<- prometheus.Metric) {
	mfs, err := g.reg.Gather()
	if err != nil {
		g.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != g.name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if g.labels[lp.GetName()] != lp.GetValue() {
					continue series
				}
			}
			ch <- prometheus.MustNewConstMetric(prometheus.NewDesc(g.name, "", nil, nil), prometheus.CounterValue, m.GetCounter().GetValue())
			return
		}
	}
	g.t.Fatalf("no series %s%v", g.name, g.labels)
}

// A source slower than the timeout is cut off when the clock passes it; the scrape answers with
// the rest.
func TestASlowSourceTimesOut(t *testing.T) {
	t.Parallel()
	arrived := make(chan struct{}, 1)
	app := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-r.Context().Done() // the agent closed the connection
	}))
	t.Cleanup(app.Close)
	clk := testutil.NewFakeClock(time.Unix(1e9, 0))
	reg := prometheus.NewRegistry()
	h := newHandler(t, promstats.Config{Application: annotations(port(t, addr(app)), "/metrics"), Timeout: 3 * time.Second,
		Clock: clk, Registerer: reg})
	type answer struct {
		code     int
		families map[string]*dto.MetricFamily
	}
	done := make(chan answer, 1)
	go func() {
		code, families := scrape(t, h)
		done <- answer{code, families}
	}()
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	if err := clk.WaitForTimers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	<-arrived
	select {
	case <-done:
		t.Fatal("the scrape answered before its timeout passed")
	default:
	}
	clk.Advance(3 * time.Second)
	var a answer
	select {
	case a = <-done:
	case <-ctx.Done():
		t.Fatal("the scrape went on past its timeout")
	}
	if a.code != http.StatusOK || value(t, a.families, "meshid_agent_test_total") != 3 {
		t.Fatalf("GET /stats/prometheus = %d %v, want 200 with the agent's metrics", a.code, a.families)
	}
	if got := promtest.ToFloat64(failures(t, reg, "application", "timeout")); got != 1 {
		t.Errorf("failures{application,timeout} = %v, want 1", got)
	}
}

// A family name seen in an earlier source keeps the earlier family: the agent's, then Envoy's,
// then the application's. The application's duplicates are counted.
func TestAConflictKeepsTheFirstSource(t *testing.T) {
	t.Parallel()
	envoy := page(t, "/stats/prometheus", envoyPage)
	app := page(t, "/metrics", appPage+"# TYPE envoy_server_live gauge\nenvoy_server_live 0\n"+
		"# TYPE meshid_agent_test_total counter\nmeshid_agent_test_total 99\n")
	reg := prometheus.NewRegistry()
	h := newHandler(t, promstats.Config{EnvoyAdmin: addr(envoy), Application: annotations(port(t, addr(app)), "/metrics"), Registerer: reg})
	code, families := scrape(t, h)
	if code != http.StatusOK {
		t.Fatalf("GET /stats/prometheus = %d, want 200", code)
	}
	if value(t, families, "envoy_server_live") != 1 || value(t, families, "meshid_agent_test_total") != 3 || value(t, families, "app_orders_total") != 42 {
		t.Errorf("an application's family shadowed an earlier one, or its own is missing")
	}
	if got := promtest.ToFloat64(conflicts(t, reg, "application")); got != 2 {
		t.Errorf("conflicts{application} = %v, want 2", got)
	}
	if got := promtest.ToFloat64(conflicts(t, reg, "envoy")); got != 0 {
		t.Errorf("conflicts{envoy} = %v, want 0", got)
	}
}

func conflicts(t *testing.T, reg *prometheus.Registry, source string) prometheus.Collector {
	t.Helper()
	return gathered{t: t, reg: reg, name: "meshid_agent_scrape_conflicts_total", labels: map[string]string{"source": source}}
}

// Past MaxInFlight scrapes at once, a scrape is answered 503 without scraping, counted and logged
// with its peer.
func TestScrapesAreBounded(t *testing.T) {
	t.Parallel()
	arrived := make(chan struct{}, 2)
	release := make(chan struct{})
	app := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		select {
		case <-release:
		case <-r.Context().Done():
		}
		_, _ = io.WriteString(w, appPage)
	}))
	t.Cleanup(app.Close)
	reg := prometheus.NewRegistry()
	var logs testutil.SyncBuffer
	h := newHandler(t, promstats.Config{Application: annotations(port(t, addr(app)), "/metrics"), MaxInFlight: 2,
		Registerer: reg, Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
	var wg sync.WaitGroup
	codes := make([]int, 2)
	for i := range codes {
		wg.Go(func() { codes[i], _ = scrape(t, h) })
	}
	for range codes {
		select {
		case <-arrived:
		case <-time.After(wait):
			t.Fatal("the first scrapes did not reach the application")
		}
	}
	if code, _ := scrape(t, h); code != http.StatusServiceUnavailable {
		t.Errorf("a third scrape at once = %d, want 503", code)
	}
	close(release)
	wg.Wait()
	for i, code := range codes {
		if code != http.StatusOK {
			t.Errorf("scrape %d = %d, want 200", i, code)
		}
	}
	if got := promtest.ToFloat64(gathered{t: t, reg: reg, name: "meshid_agent_scrape_refusals_total"}); got != 1 {
		t.Errorf("refusals = %v, want 1", got)
	}
	recs := logs.Records(t, "/stats/prometheus scrape refused: as many scrapes are being served already")
	if len(recs) != 1 || recs[0]["peer"] != "10.0.0.9:4242" {
		t.Errorf("logged %v, want one line naming the peer", recs)
	}
	if code, _ := scrape(t, h); code != http.StatusOK {
		t.Errorf("a scrape after the others ended = %d, want 200", code)
	}
}

// A source failing scrape after scrape is logged once a minute, with how many lines were held back.
func TestFailureLogsArePaced(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(time.Unix(1e9, 0))
	reg := prometheus.NewRegistry()
	var logs testutil.SyncBuffer
	h := newHandler(t, promstats.Config{EnvoyAdmin: closedPort(t), Clock: clk, Registerer: reg,
		Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
	const msg = "/stats/prometheus: a source was left out of the scrape"
	for range 3 {
		if code, _ := scrape(t, h); code != http.StatusOK {
			t.Fatalf("GET /stats/prometheus = %d, want 200", code)
		}
	}
	if n := len(logs.Records(t, msg)); n != 1 {
		t.Fatalf("3 failures within a minute logged %d lines, want 1", n)
	}
	clk.Step(time.Minute)
	scrape(t, h)
	recs := logs.Records(t, msg)
	if len(recs) != 2 || recs[1]["dropped"] != float64(2) || recs[1]["source"] != "envoy" {
		t.Fatalf("a minute later: %v, want a second line saying 2 were held back", recs)
	}
	if got := promtest.ToFloat64(failures(t, reg, "envoy", "connect")); got != 4 {
		t.Errorf("failures{envoy,connect} = %v, want every failure counted: 4", got)
	}
}

func TestParseAnnotations(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, in string
		want     *promstats.Annotations
		err      string
	}{
		{"empty", "", nil, ""},
		{"istio's", `{"scrape":"true","path":"/metrics","port":"9090"}`, &promstats.Annotations{Path: "/metrics", Port: 9090, Scheme: "http"}, ""},
		{"istio's defaults", `{"scrape":"true","path":"","port":""}`, &promstats.Annotations{Path: "/metrics", Port: 80, Scheme: "http"}, ""},
		{"no scrape annotation", `{"scrape":"","path":"","port":"8080"}`, &promstats.Annotations{Path: "/metrics", Port: 8080, Scheme: "http"}, ""},
		{"number port, query, https", `{"scrape":"True","path":"/m?x=1","port":8443,"scheme":"HTTPS"}`, &promstats.Annotations{Path: "/m?x=1", Port: 8443, Scheme: "https"}, ""},
		{"scrape false", `{"scrape":"false","port":"9090"}`, nil, ""},
		{"bad JSON", `{"scrape":`, nil, "want JSON as"},
		{"not an object", `["9090"]`, nil, "want JSON as"},
		{"two objects", `{"port":"1"}{"port":"2"}`, nil, "want one JSON object"},
		{"unknown field", `{"scrape":"true","prot":"9090"}`, nil, `unknown field "prot"`},
		{"scrape", `{"scrape":"yes","port":"9090"}`, nil, `scrape: "yes": want "true" or "false"`},
		{"named port", `{"port":"metrics"}`, nil, "want a port number"},
		{"port 0", `{"port":"0"}`, nil, "want a port number"},
		{"port too big", `{"port":70000}`, nil, "want a port number"},
		{"relative path", `{"path":"metrics","port":"9090"}`, nil, `path: "metrics": want an absolute path`},
		{"path with a fragment", `{"path":"/metrics#x","port":"9090"}`, nil, "want an absolute path"},
		{"path with a line break", `{"path":"/m\r\nX: y","port":"9090"}`, nil, "want an absolute path"},
		{"scheme", `{"scheme":"ftp","port":"9090"}`, nil, `scheme: "ftp": want http or https`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := promstats.ParseAnnotations(tc.in)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("ParseAnnotations(%s) = %v, %v; want an error with %q", tc.in, got, err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseAnnotations(%s): %v", tc.in, err)
			}
			if (got == nil) != (tc.want == nil) || (got != nil && *got != *tc.want) {
				t.Fatalf("ParseAnnotations(%s) = %+v, want %+v", tc.in, got, tc.want)
			}
		})
	}
}

func TestNewRefuses(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	for name, cfg := range map[string]promstats.Config{
		"no agent":         {},
		"envoy admin URL":  {Agent: reg, EnvoyAdmin: "http://127.0.0.1:15000"},
		"envoy admin port": {Agent: reg, EnvoyAdmin: "127.0.0.1"},
		"annotations":      {Agent: reg, Application: `{"port":"x"}`},
		"host":             {Agent: reg, Application: `{"port":"1"}`, ApplicationHost: "10.0.0.1/24"},
		"negative":         {Agent: reg, Timeout: -time.Second},
	} {
		if _, err := promstats.New(cfg); err == nil {
			t.Errorf("%s: New accepted %+v", name, cfg)
		}
	}
}

// The application is scraped on the host it is given, the workload's address.
func TestApplicationHost(t *testing.T) {
	t.Parallel()
	lis, err := net.Listen("tcp", "127.0.0.2:0") // loopback, but not 127.0.0.1
	if err != nil {
		t.Skipf("no 127.0.0.2 to stand for a pod IP here: %v", err)
	}
	app := &httptest.Server{Listener: lis, Config: &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, appPage)
	}), ReadHeaderTimeout: wait}}
	app.Start()
	t.Cleanup(app.Close)
	p, err := strconv.Atoi(port(t, lis.Addr().String()))
	if err != nil {
		t.Fatal(err)
	}
	for host, want := range map[string]bool{"127.0.0.2": true, "": false} {
		h := newHandler(t, promstats.Config{Application: annotations(strconv.Itoa(p), "/metrics"), ApplicationHost: host})
		_, families := scrape(t, h)
		if _, got := families["app_orders_total"]; got != want {
			t.Errorf("host %q: application scraped %v, want %v", host, got, want)
		}
	}
}

// In the merged page the agent's Go runtime and process families are meshid_agent_go_* and
// meshid_agent_process_*, so that a Go application's own go_* and process_* come through; the
// agent's registry keeps the plain names, which its /metrics serves.
func TestTheAgentsRuntimeFamiliesArePrefixed(t *testing.T) {
	t.Parallel()
	reg := agentRegistry(t)
	goroutines := prometheus.NewGauge(prometheus.GaugeOpts{Name: "go_goroutines", Help: "The agent's goroutines."})
	goroutines.Set(30)
	fds := prometheus.NewGauge(prometheus.GaugeOpts{Name: "process_open_fds", Help: "The agent's open files."})
	fds.Set(9)
	reg.MustRegister(goroutines, fds)
	app := page(t, "/metrics", appPage+"# HELP go_goroutines The application's goroutines.\n# TYPE go_goroutines gauge\ngo_goroutines 12\n"+
		"# TYPE process_open_fds gauge\nprocess_open_fds 4\n")
	metrics := prometheus.NewRegistry()
	h := newHandler(t, promstats.Config{Agent: reg, Application: annotations(port(t, addr(app)), "/metrics"), Registerer: metrics})
	_, families := scrape(t, h)
	for name, want := range map[string]float64{
		"go_goroutines":                 12,
		"process_open_fds":              4,
		"meshid_agent_go_goroutines":    30,
		"meshid_agent_process_open_fds": 9,
		"meshid_agent_test_total":       3,
		"app_orders_total":              42,
	} {
		if got := value(t, families, name); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	if got := families["meshid_agent_go_goroutines"].GetHelp(); got != "The agent's goroutines." {
		t.Errorf("meshid_agent_go_goroutines has help %q, want the agent's", got)
	}
	if got := promtest.ToFloat64(conflicts(t, metrics, "application")); got != 0 {
		t.Errorf("conflicts{application} = %v, want 0", got)
	}
	if n, err := promtest.GatherAndCount(reg, "go_goroutines", "process_open_fds", "meshid_agent_go_goroutines"); err != nil || n != 2 {
		t.Errorf("the agent's registry has %d of go_goroutines and process_open_fds (%v), want both under their own names", n, err)
	}
}

// A family of Envoy's that claims a name the agent's families write (its name, a histogram's
// _bucket, _sum or _count, a counter's name with or without _total) is left out of the page and
// counted once, its HELP and TYPE lines with it; the rest of Envoy's page is written as it came,
// scrape after scrape.
func TestEnvoysFamiliesThatTheAgentHasAreLeftOut(t *testing.T) {
	t.Parallel()
	reg := agentRegistry(t) // meshid_agent_test_total, a counter at 3
	latency := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "meshid_agent_latency_seconds", Help: "h", Buckets: []float64{1}})
	latency.Observe(0.5)
	reg.MustRegister(latency)
	envoy := page(t, "/stats/prometheus", `# HELP meshid_agent_test_total Envoy's counter of the same name.
# TYPE meshid_agent_test_total counter
meshid_agent_test_total 99
# TYPE envoy_server_live gauge
envoy_server_live 1
# TYPE meshid_agent_latency_seconds_count gauge
meshid_agent_latency_seconds_count 5
meshid_agent_test 7
# TYPE envoy_cluster_upstream_cx_total counter
envoy_cluster_upstream_cx_total{envoy_cluster_name="a"} 5
envoy_cluster_upstream_cx_total{envoy_cluster_name="b"} 6
`)
	metrics := prometheus.NewRegistry()
	h := newHandler(t, promstats.Config{Agent: reg, EnvoyAdmin: addr(envoy), Registerer: metrics})
	const scrapes = 3
	for range scrapes {
		_, families := scrape(t, h)
		for name, want := range map[string]float64{
			"meshid_agent_test_total":         3,
			"meshid_agent_latency_seconds":    1,
			"envoy_server_live":               1,
			"envoy_cluster_upstream_cx_total": 5,
		} {
			if got := value(t, families, name); got != want {
				t.Errorf("%s = %v, want %v", name, got, want)
			}
		}
		if len(families) != 4 {
			t.Errorf("the page has %d families, want the agent's 2 and Envoy's 2", len(families))
		}
		if got := families["meshid_agent_test_total"].GetHelp(); got != "A counter of the agent's." {
			t.Errorf("meshid_agent_test_total has help %q, want the agent's", got)
		}
		if n := len(families["envoy_cluster_upstream_cx_total"].GetMetric()); n != 2 {
			t.Errorf("envoy_cluster_upstream_cx_total has %d series, want 2", n)
		}
	}
	if got := promtest.ToFloat64(conflicts(t, metrics, "envoy")); got != 3*scrapes {
		t.Errorf("conflicts{envoy} = %v, want Envoy's 3 families counted at each of %d scrapes", got, scrapes)
	}
}

// An application's family that claims one of Envoy's names, a histogram's _count or a counter's
// name without _total among them, is left out and counted.
func TestApplicationFamiliesThatEnvoyHasAreLeftOut(t *testing.T) {
	t.Parallel()
	envoy := page(t, "/stats/prometheus", envoyPage)
	app := page(t, "/metrics", appPage+"# TYPE envoy_cluster_upstream_rq_time_count gauge\nenvoy_cluster_upstream_rq_time_count 0\n"+
		"# TYPE envoy_cluster_upstream_cx gauge\nenvoy_cluster_upstream_cx 0\n")
	metrics := prometheus.NewRegistry()
	h := newHandler(t, promstats.Config{EnvoyAdmin: addr(envoy), Application: annotations(port(t, addr(app)), "/metrics"), Registerer: metrics})
	_, families := scrape(t, h)
	if value(t, families, "envoy_cluster_upstream_rq_time") != 3 || value(t, families, "app_orders_total") != 42 {
		t.Error("Envoy's histogram or the application's own family is missing")
	}
	if _, ok := families["envoy_cluster_upstream_cx"]; ok {
		t.Error("the application's envoy_cluster_upstream_cx is in the page")
	}
	if got := promtest.ToFloat64(conflicts(t, metrics, "application")); got != 2 {
		t.Errorf("conflicts{application} = %v, want 2", got)
	}
}

// An Envoy page that is not whole (cut within its last line, over MaxBytes) or not the text
// format is left out whole, counted and logged; the agent's and the application's families are
// served.
func TestABrokenEnvoyPageIsLeftOutWhole(t *testing.T) {
	t.Parallel()
	const maxBytes = 1 << 10
	for _, tc := range []struct {
		name, reason, page string
	}{
		{"no final newline", "parse", strings.TrimSuffix(envoyPage, "\n")},
		{"cut within a value", "parse", envoyPage + "envoy_server_uptime 8640"},
		{"too large", "too_large", envoyPage + strings.Repeat("envoy_server_live 1\n", maxBytes/20)},
		{"not the text format", "parse", envoyPage + "<html>\n"},
		{"a quoted name", "parse", envoyPage + "{\"envoy.server.live\"} 1\n"},
		{"an unknown type", "parse", envoyPage + "# TYPE envoy_x countre\nenvoy_x 1\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			envoy := page(t, "/stats/prometheus", tc.page)
			app := page(t, "/metrics", appPage)
			reg := prometheus.NewRegistry()
			var logs testutil.SyncBuffer
			h := newHandler(t, promstats.Config{EnvoyAdmin: addr(envoy), Application: annotations(port(t, addr(app)), "/metrics"),
				MaxBytes: maxBytes, Registerer: reg, Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
			code, families := scrape(t, h)
			if code != http.StatusOK {
				t.Fatalf("GET /stats/prometheus = %d, want 200", code)
			}
			for name := range families {
				if strings.HasPrefix(name, "envoy_") {
					t.Errorf("Envoy's %s is in the page", name)
				}
			}
			if value(t, families, "app_orders_total") != 42 || value(t, families, "meshid_agent_test_total") != 3 {
				t.Error("the other sources are missing")
			}
			if got := promtest.ToFloat64(failures(t, reg, "envoy", tc.reason)); got != 1 {
				t.Errorf("failures{envoy,%s} = %v, want 1", tc.reason, got)
			}
			recs := logs.Records(t, "/stats/prometheus: a source was left out of the scrape")
			if len(recs) != 1 || recs[0]["source"] != "envoy" || recs[0]["reason"] != tc.reason {
				t.Errorf("logged %v, want one line naming Envoy and %s", recs, tc.reason)
			}
		})
	}
}

// An admin on a port of the kernel's choosing is asked its address at each scrape: until Envoy
// has said it, Envoy is left out and counted; then its page comes.
func TestEnvoysAdminAddressIsAskedAtEachScrape(t *testing.T) {
	t.Parallel()
	envoy := page(t, "/stats/prometheus", envoyPage)
	reg := prometheus.NewRegistry()
	known := ""
	h := newHandler(t, promstats.Config{Registerer: reg, EnvoyAdminAddr: func() (string, error) {
		if known == "" {
			return "", errors.New("Envoy has not written its admin's address yet")
		}
		return known, nil
	}})
	if _, families := scrape(t, h); families["envoy_server_live"] != nil {
		t.Fatal("Envoy's page before its address is known")
	}
	if got := promtest.ToFloat64(failures(t, reg, "envoy", "connect")); got != 1 {
		t.Errorf("failures{envoy,connect} = %v, want 1", got)
	}
	known = addr(envoy)
	if _, families := scrape(t, h); value(t, families, "envoy_server_live") != 1 {
		t.Fatal("Envoy's page is missing once its address is known")
	}
}
