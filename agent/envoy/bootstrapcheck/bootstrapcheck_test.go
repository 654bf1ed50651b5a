package bootstrapcheck_test

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/meshid/meshid/agent/envoy"
	"github.com/meshid/meshid/agent/envoy/bootstrapcheck"
)

// baseBootstrap is the bootstrap of a sidecar with xDS and the stats listener, as the agent
// writes it.
func baseBootstrap(t *testing.T) []byte {
	t.Helper()
	data, err := envoy.Bootstrap(envoy.BootstrapConfig{
		Node: envoy.SidecarNode(envoy.Workload{
			InstanceIP: "10.1.2.3", PodName: "web-7d9f", Namespace: "shop", ServiceAccount: "web",
			ClusterID: "Kubernetes", Meta: map[string]string{"FOO": "bar"},
		}),
		SDSSocket:      "/run/uds/socket",
		XDSSocket:      "/run/proxy/XDS",
		AdminPort:      15000,
		PrometheusPort: 15090,
	})
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func parse(t *testing.T, data []byte) *bootstrapv3.Bootstrap {
	t.Helper()
	var b bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(data, &b); err != nil {
		t.Fatalf("not a Bootstrap: %v\n%s", err, data)
	}
	return &b
}

func TestCheck(t *testing.T) {
	t.Parallel()
	if err := bootstrapcheck.Check(baseBootstrap(t)); err != nil {
		t.Fatalf("Check refuses the agent's bootstrap: %v", err)
	}
	for name, tc := range map[string]struct{ bootstrap, want string }{
		"not JSON":      {"admin: {}", "not Envoy's Bootstrap"},
		"unknown field": {`{"admni": {}}`, `unknown field "admni"`},
		"invalid":       {`{"staticResources": {"clusters": [{"type": "STATIC"}]}}`, "Cluster.Name"},
		"invalid typed_config": {`{"staticResources": {"listeners": [{"name": "l", "filterChains": [{"filters": [{"name": "hcm",
"typedConfig": {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"}}]}]}]}}`,
			"HttpConnectionManager.StatPrefix"},
		"unknown type": {`{"staticResources": {"listeners": [{"name": "l", "filterChains": [{"filters": [{"name": "x",
"typedConfig": {"@type": "type.googleapis.com/no.such.Type"}}]}]}]}}`, "no.such.Type"},
	} {
		err := bootstrapcheck.Check([]byte(tc.bootstrap))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Check = %v, want an error saying %q", name, err, tc.want)
		}
		if errors.Is(err, envoy.ErrOverride) {
			t.Errorf("%s: %v blames an override", name, err)
		}
	}
}

// With no override, Merge checks the bootstrap and returns it as it is; a bad bootstrap is not
// the override's fault.
func TestMergeWithoutOverride(t *testing.T) {
	t.Parallel()
	base := baseBootstrap(t)
	for _, override := range [][]byte{nil, {}} {
		got, err := bootstrapcheck.Merge(base, override, "")
		if err != nil || !bytes.Equal(got, base) {
			t.Errorf("Merge(base, %q) = %v; want the bootstrap as it is", override, err)
		}
	}
	_, err := bootstrapcheck.Merge([]byte(`{"staticResources": {"clusters": [{}]}}`), []byte(`{"admin": {}}`), "/o.json")
	if err == nil || errors.Is(err, envoy.ErrOverride) {
		t.Errorf("Merge of an invalid bootstrap = %v, want an error that does not blame the override", err)
	}
}

// The same bootstrap and override give the same bytes.
func TestMergeDeterministic(t *testing.T) {
	t.Parallel()
	base := baseBootstrap(t)
	override := []byte("node: {metadata: {Z: z, A: a, M: m}}\nstatic_resources: {clusters: [{name: extra, type: STATIC, load_assignment: {cluster_name: extra}}]}\n")
	first, err := bootstrapcheck.Merge(base, override, "/o.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for range 20 {
		again, err := bootstrapcheck.Merge(base, override, "/o.yaml")
		if err != nil || !bytes.Equal(first, again) {
			t.Fatalf("two merges differ (%v):\n%s\n---\n%s", err, first, again)
		}
	}
	if !bytes.HasPrefix(first, []byte("{\n  \"node\": {\n")) || !bytes.HasSuffix(first, []byte("}\n")) {
		t.Errorf("not indented JSON:\n%s", first)
	}
}

// The override is merged as Istio merges ISTIO_BOOTSTRAP_OVERRIDE: a scalar replaces, a repeated
// field is appended to.
func TestMergeOverride(t *testing.T) {
	t.Parallel()
	for name, override := range map[string]string{
		"yaml": `
admin:
  address: {socket_address: {port_value: 16000}}
node:
  metadata: {EXTRA: "yes"}
static_resources:
  clusters:
  - name: zipkin
    type: STRICT_DNS
    connect_timeout: 2s
    load_assignment:
      cluster_name: zipkin
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: zipkin.istio-system, port_value: 9411}}}
`,
		"json": `{"admin": {"address": {"socketAddress": {"portValue": 16000}}},
"node": {"metadata": {"EXTRA": "yes"}},
"staticResources": {"clusters": [{"name": "zipkin", "type": "STRICT_DNS", "connectTimeout": "2s"}]}}`,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			data := baseBootstrap(t)
			base := parse(t, data)
			merged, err := bootstrapcheck.Merge(data, []byte(override), "/etc/override."+name)
			if err != nil {
				t.Fatalf("Merge: %v", err)
			}
			b := parse(t, merged)
			admin := b.GetAdmin().GetAddress().GetSocketAddress()
			if admin.GetPortValue() != 16000 || admin.GetAddress() != "127.0.0.1" {
				t.Errorf("admin on %s:%d, want 127.0.0.1:16000 (the port replaced, the address kept)", admin.GetAddress(), admin.GetPortValue())
			}
			got, was := b.GetStaticResources().GetClusters(), base.GetStaticResources().GetClusters()
			if len(got) != len(was)+1 || got[len(got)-1].GetName() != "zipkin" {
				t.Fatalf("clusters %d, last %q; want the %d built and zipkin appended", len(got), got[len(got)-1].GetName(), len(was))
			}
			for i := range was {
				if !proto.Equal(got[i], was[i]) {
					t.Errorf("built cluster %s changed by the override", was[i].GetName())
				}
			}
			meta := b.GetNode().GetMetadata().GetFields()
			if meta["EXTRA"].GetStringValue() != "yes" || meta["NAMESPACE"].GetStringValue() != "shop" {
				t.Errorf("node metadata %v: want EXTRA added and NAMESPACE kept", meta)
			}
		})
	}
}

func TestMergeRefusesOverride(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, override string
		want           []string // in the message, besides the file
	}{
		{"unknown field", "admin: {address: {socket_address: {port_value: 1}}}\nstatic_resources:\n  clusters:\n  - name: x\n    conect_timeout: 1s\n", []string{`unknown field "conect_timeout"`}},
		{"unknown field, JSON", `{"admni": {}}`, []string{`unknown field "admni"`}},
		{"bad enum", "static_resources:\n  clusters:\n  - name: x\n    type: STATICX\n", []string{"field type", "STATICX"}},
		{"wrong type", `{"admin": {"address": {"socket_address": {"port_value": "x"}}}}`, []string{"portValue"}},
		{"bad yaml", "static_resources: [clusters\n", []string{"YAML", "line 1"}},
		{"cluster without a name", "static_resources:\n  clusters:\n  - type: STATIC\n", []string{"Clusters[3]", "Cluster.Name"}},
		{"invalid typed_config", `
static_resources:
  listeners:
  - name: l
    filter_chains:
    - filters:
      - name: hcm
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ""
`, []string{"static_resources.listeners[1].filter_chains[0].filters[0].typed_config", "HttpConnectionManager.StatPrefix"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			const path = "/etc/istio/custom-bootstrap.yaml"
			b, err := bootstrapcheck.Merge(baseBootstrap(t), []byte(tc.override), path)
			if err == nil {
				t.Fatalf("Merge accepted the override:\n%s", b)
			}
			if !errors.Is(err, envoy.ErrOverride) {
				t.Errorf("error %v does not wrap ErrOverride", err)
			}
			for _, want := range append([]string{path}, tc.want...) {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not name %q", err, want)
				}
			}
		})
	}
}
