package main

import (
	"strings"
	"testing"
)

func TestExtractTags(t *testing.T) {
	t.Parallel()
	rules := tagRules()
	for _, tc := range []struct {
		stat, name, labels string
	}{
		{"listener.127.0.0.1_15006.downstream_cx_active", "listener.downstream_cx_active", `envoy_listener_address="127.0.0.1_15006"`},
		{"listener.[__1]_15006.downstream_cx_total", "listener.downstream_cx_total", `envoy_listener_address="[__1]_15006"`},
		{"listener.0.0.0.0_0.downstream_cx_total", "listener.downstream_cx_total", `envoy_listener_address="0.0.0.0_0"`},
		// Not an address: left whole, as Envoy's extractor leaves it.
		{"listener.admin.downstream_cx_active", "listener.admin.downstream_cx_active", ""},
		{"http.admin.downstream_cx_active", "http.downstream_cx_active", `envoy_http_conn_manager_prefix="admin"`},
		{"sds.default.update_success", "sds.update_success", `envoy_sds_secret_name="default"`},
		{"server.live", "server.live", ""},
		{"listener_manager.lds.update_success", "listener_manager.lds.update_success", ""},
	} {
		name, labels := extractTags(rules, tc.stat)
		if name != tc.name || labels != tc.labels {
			t.Errorf("%s: %s{%s}, want %s{%s}", tc.stat, name, labels, tc.name, tc.labels)
		}
	}
}

func TestWritePrometheus(t *testing.T) {
	t.Parallel()
	var b strings.Builder
	writePrometheus(&b, []statValue{
		{name: "server.live", gauge: true, value: 1},
		{name: "listener.127.0.0.1_1.downstream_cx_total", value: 3},
		{name: "listener.127.0.0.1_2.downstream_cx_total", value: 4},
		{name: `sds.file-root:/etc/"x".update_success`, value: 1},
	})
	want := `# TYPE envoy_listener_downstream_cx_total counter
envoy_listener_downstream_cx_total{envoy_listener_address="127.0.0.1_1"} 3
envoy_listener_downstream_cx_total{envoy_listener_address="127.0.0.1_2"} 4
# TYPE envoy_sds_update_success counter
envoy_sds_update_success{envoy_sds_secret_name="file-root:/etc/\"x\""} 1
# TYPE envoy_server_live gauge
envoy_server_live{} 1
`
	if b.String() != want {
		t.Errorf("got\n%s\nwant\n%s", b.String(), want)
	}
}

func TestParseOptions(t *testing.T) {
	t.Parallel()
	short, err := parseOptions([]string{"-c", "b.yaml", "-l", "debug"})
	if err != nil {
		t.Fatal(err)
	}
	long, err := parseOptions([]string{"--config-path", "b.yaml", "--log-level", "debug"})
	if err != nil {
		t.Fatal(err)
	}
	if short.configPath != "b.yaml" || long.configPath != "b.yaml" || short.logLevel != "debug" || long.logLevel != "debug" {
		t.Errorf("short %+v, long %+v: want the same options", short, long)
	}
	if _, err := parseOptions([]string{"--concurrency", "4294967296"}); err == nil {
		t.Error("a concurrency over 32 bits is taken")
	}
	if _, err := parseOptions([]string{"--component-log-level", "upstream"}); err == nil {
		t.Error("a component log level without its level is taken")
	}
}
