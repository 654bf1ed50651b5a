package promstats_test

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/meshid/meshid/agent/promstats"
)

// envoyStats is a sidecar's Envoy page as its admin writes it: per cluster, Envoy's usual
// counters and gauges and a request-time histogram, for clusters clusters.
func envoyStats(clusters int) string {
	counters := []string{"upstream_cx_total", "upstream_cx_destroy", "upstream_cx_connect_fail", "upstream_cx_connect_timeout",
		"upstream_cx_overflow", "upstream_cx_rx_bytes_total", "upstream_cx_tx_bytes_total", "upstream_rq_total",
		"upstream_rq_completed", "upstream_rq_timeout", "upstream_rq_retry", "upstream_rq_retry_success",
		"upstream_rq_pending_total", "upstream_rq_pending_overflow", "upstream_rq_cancelled", "upstream_rq_per_try_timeout",
		"upstream_rq_2xx", "upstream_rq_4xx", "upstream_rq_5xx", "upstream_flow_control_paused_reading_total",
		"lb_healthy_panic", "lb_zone_no_capacity_left", "membership_change", "update_attempt", "update_success",
		"update_rejected", "update_empty", "update_no_rebuild", "assignment_stale", "assignment_timeout_received"}
	gauges := []string{"upstream_cx_active", "upstream_rq_active", "upstream_rq_pending_active", "membership_healthy",
		"membership_total", "membership_degraded", "membership_excluded", "max_host_weight", "version", "circuit_breakers_default_cx_open"}
	buckets := []string{"0.5", "1", "5", "10", "25", "50", "100", "250", "500", "1000", "2500", "5000", "10000",
		"30000", "60000", "300000", "600000", "1.8e+06", "3.6e+06", "+Inf"}
	var b strings.Builder
	cluster := func(i int) string {
		return fmt.Sprintf(`envoy_cluster_name="outbound|%d||svc-%d.ns-%d.svc.cluster.local"`, 8000+i%50, i, i%7)
	}
	for _, c := range counters {
		fmt.Fprintf(&b, "# TYPE envoy_cluster_%s counter\n", c)
		for i := range clusters {
			fmt.Fprintf(&b, "envoy_cluster_%s{%s} %d\n", c, cluster(i), i*31+7)
		}
	}
	for _, g := range gauges {
		fmt.Fprintf(&b, "# TYPE envoy_cluster_%s gauge\n", g)
		for i := range clusters {
			fmt.Fprintf(&b, "envoy_cluster_%s{%s} %d\n", g, cluster(i), i%5)
		}
	}
	b.WriteString("# TYPE envoy_cluster_upstream_rq_time histogram\n")
	for i := range clusters {
		for j, le := range buckets {
			fmt.Fprintf(&b, "envoy_cluster_upstream_rq_time_bucket{%s,le=%q} %d\n", cluster(i), le, j*3+i)
		}
		fmt.Fprintf(&b, "envoy_cluster_upstream_rq_time_sum{%s} %d.5\n", cluster(i), i*1000)
		fmt.Fprintf(&b, "envoy_cluster_upstream_rq_time_count{%s} %d\n", cluster(i), 19*3+i)
	}
	b.WriteString("# TYPE envoy_server_live gauge\nenvoy_server_live 1\n# TYPE envoy_server_uptime gauge\nenvoy_server_uptime 86400\n")
	return b.String()
}

// BenchmarkStatsPrometheus measures one /stats/prometheus scrape merging a sidecar's Envoy page
// (60 clusters, about 4,000 lines, from an admin server on loopback) with the agent's own metrics,
// against serving the agent's /metrics alone, and with a Go application's page as well.
func BenchmarkStatsPrometheus(b *testing.B) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	stats := envoyStats(60)
	envoy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, stats)
	}))
	b.Cleanup(envoy.Close)
	// A Go application's page: its own runtime and process families, and a few of its own.
	appReg := prometheus.NewRegistry()
	appReg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	app := httptest.NewServer(promhttp.HandlerFor(appReg, promhttp.HandlerOpts{}))
	b.Cleanup(app.Close)
	_, appPort, err := net.SplitHostPort(app.Listener.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("Envoy page: %d lines, %d bytes", strings.Count(stats, "\n"), len(stats))

	serve := func(b *testing.B, h http.Handler) {
		b.Helper()
		b.ReportAllocs()
		req := httptest.NewRequest(http.MethodGet, "/stats/prometheus", nil)
		for b.Loop() {
			w := discard{header: http.Header{}}
			h.ServeHTTP(&w, req)
			if w.code != 0 && w.code != http.StatusOK || w.n == 0 {
				b.Fatalf("answered %d, %d bytes", w.code, w.n)
			}
		}
	}
	b.Run("baseline_agent_metrics", func(b *testing.B) {
		serve(b, promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	})
	b.Run("merged_agent_envoy", func(b *testing.B) {
		h, err := promstats.New(promstats.Config{Agent: reg, EnvoyAdmin: envoy.Listener.Addr().String()})
		if err != nil {
			b.Fatal(err)
		}
		serve(b, h)
	})
	b.Run("merged_agent_envoy_application", func(b *testing.B) {
		h, err := promstats.New(promstats.Config{Agent: reg, EnvoyAdmin: envoy.Listener.Addr().String(),
			Application: `{"scrape":"true","path":"/metrics","port":"` + appPort + `"}`})
		if err != nil {
			b.Fatal(err)
		}
		serve(b, h)
	})
}

// discard is a ResponseWriter that keeps only the status and the length of the page, so that
// what is measured is the handler, not a recorder's copy of the page.
type discard struct {
	header http.Header
	code   int
	n      int
}

func (d *discard) Header() http.Header { return d.header }

func (d *discard) Write(p []byte) (int, error) {
	d.n += len(p)
	return len(p), nil
}

func (d *discard) WriteHeader(code int) { d.code = code }
