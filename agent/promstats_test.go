package agent_test

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/meshid/meshid/agent"
)

// The status server's /stats/prometheus is one page, which Prometheus' parser reads, of the
// agent's metrics and of the application's that ISTIO_PROMETHEUS_ANNOTATIONS names.
func TestStatusServerMergesMetrics(t *testing.T) {
	t.Parallel()
	app := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/app-metrics" {
			http.NotFound(w, r)
			return
		}
		_, _ = io.WriteString(w, "# TYPE app_orders_total counter\napp_orders_total 42\n")
	}))
	t.Cleanup(app.Close)
	_, port, err := net.SplitHostPort(app.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	for _, annotations := range []string{"", fmt.Sprintf(`{"scrape":"true","path":"/app-metrics","port":%q}`, port)} {
		cfg := testConfig(t, newFakeClock(), nil, nil)
		cfg.Servers.PrometheusAnnotations = annotations
		a := newAgent(t, cfg)
		runAgent(t, a)
		code, body := httpGet(t, "http://"+a.StatusAddr()+"/stats/prometheus")
		if code != http.StatusOK {
			t.Fatalf("GET /stats/prometheus = %d %q, want 200", code, body)
		}
		p := expfmt.NewTextParser(model.LegacyValidation)
		families, err := p.TextToMetricFamilies(strings.NewReader(body))
		if err != nil {
			t.Fatalf("the page does not parse: %v", err)
		}
		for _, name := range []string{"meshid_agent_go_goroutines", "meshid_agent_scrape_refusals_total"} {
			if _, ok := families[name]; !ok {
				t.Errorf("annotations %q: the agent's %s is not on the page", annotations, name)
			}
		}
		// /stats/prometheus prefixes the agent's runtime families; /metrics keeps their names.
		if code, metrics := httpGet(t, "http://"+a.StatusAddr()+"/metrics"); code != http.StatusOK || !strings.Contains(metrics, "\ngo_goroutines ") {
			t.Errorf("GET /metrics = %d without go_goroutines", code)
		}
		orders, ok := families["app_orders_total"]
		if ok != (annotations != "") {
			t.Fatalf("annotations %q: the application's metrics on the page: %v", annotations, ok)
		}
		if ok && orders.GetMetric()[0].GetCounter().GetValue() != 42 {
			t.Errorf("app_orders_total = %v, want 42", orders.GetMetric()[0].GetCounter().GetValue())
		}
	}
}

// Annotations that cannot work are refused when the agent is made, naming the field.
func TestPrometheusAnnotationsAreValidated(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, status, annotations, want string }{
		{"bad JSON", "127.0.0.1:0", `{"port":`, "want JSON"},
		{"status port", "127.0.0.1:15020", `{"port":"15020"}`, "would scrape itself"},
	} {
		cfg := testConfig(t, newFakeClock(), nil, nil)
		cfg.Servers.StatusAddr, cfg.Servers.PrometheusAnnotations = tc.status, tc.annotations
		_, err := agent.New(cfg)
		var fe *agent.FieldError
		if err == nil || !strings.Contains(err.Error(), tc.want) || !errors.As(err, &fe) || fe.Field != "Servers.PrometheusAnnotations" {
			t.Errorf("%s: New = %v, want a Servers.PrometheusAnnotations error with %q", tc.name, err, tc.want)
		}
	}
}
