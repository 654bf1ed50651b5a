package agent_test

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/configerr"
	"github.com/meshid/meshid/internal/testutil"
)

func bootstrapOf(t *testing.T, cfg agent.Config) *bootstrapv3.Bootstrap {
	t.Helper()
	if err := cfg.Validate(); err != nil {
		t.Fatalf("Validate: %v", err)
	}
	data, err := agent.Bootstrap(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Bootstrap: %v", err)
	}
	var b bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(data, &b); err != nil {
		t.Fatalf("the bootstrap does not parse: %v", err)
	}
	if err := b.ValidateAll(); err != nil {
		t.Fatalf("ValidateAll: %v", err)
	}
	return &b
}

// pipes returns each static cluster's pipe path, by cluster name.
func pipes(b *bootstrapv3.Bootstrap) map[string]string {
	out := map[string]string{}
	for _, c := range b.GetStaticResources().GetClusters() {
		if p := c.GetLoadAssignment().GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint().GetAddress().GetPipe(); p != nil {
			out[c.GetName()] = p.GetPath()
		}
	}
	return out
}

// The bootstrap leads Envoy to the sockets an agent run with the same configuration listens on.
func TestBootstrapResolvesTheAgentsSockets(t *testing.T) {
	t.Parallel()
	root := testutil.ShortTempDir(t)
	other := testutil.ShortTempDir(t)
	for _, tc := range []struct {
		name     string
		modify   func(*agent.Config)
		sds, xds string // "": none
	}{
		{"defaults under the root dir", func(*agent.Config) {},
			filepath.Join(root, agent.DefaultSocketDir, "socket"), filepath.Join(root, agent.DefaultXDSSocket)},
		{"given paths", func(c *agent.Config) {
			c.SDS.SocketDir, c.XDS.Socket = filepath.Join(other, "uds"), filepath.Join(other, "xds.sock")
		}, filepath.Join(other, "uds", "socket"), filepath.Join(other, "xds.sock")},
		{"no xDS proxy", func(c *agent.Config) { c.XDS.Proxy, c.XDS.ProxyDebug = false, false },
			filepath.Join(root, agent.DefaultSocketDir, "socket"), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := agent.DefaultConfig(root)
			tc.modify(&cfg)
			b := bootstrapOf(t, cfg)
			want := map[string]string{"sds-grpc": tc.sds}
			if tc.xds != "" {
				want["xds-grpc"] = tc.xds
			}
			got := pipes(b)
			if len(got) != len(want) || got["sds-grpc"] != want["sds-grpc"] || got["xds-grpc"] != want["xds-grpc"] {
				t.Errorf("pipes = %v, want %v", got, want)
			}
			if ads := b.GetDynamicResources().GetAdsConfig() != nil; ads != (tc.xds != "") {
				t.Errorf("ADS configured: %v, want %v", ads, tc.xds != "")
			}
		})
	}
}

func TestBootstrapNode(t *testing.T) {
	t.Parallel()
	cfg := agent.DefaultConfig(testutil.ShortTempDir(t))
	cfg.Identity.PodName = "web-1"
	cfg.Envoy.Metadata = map[string]string{"FOO": "bar"}
	// The embedded CA's workload is default/default; INSTANCE_IP defaults to loopback.
	b := bootstrapOf(t, cfg)
	if want := "sidecar~127.0.0.1~web-1.default~default.svc.cluster.local"; b.GetNode().GetId() != want {
		t.Errorf("node id %q, want %q", b.GetNode().GetId(), want)
	}
	meta := b.GetNode().GetMetadata().GetFields()
	if meta["FOO"].GetStringValue() != "bar" || meta["INSTANCE_IPS"].GetStringValue() != "127.0.0.1" {
		t.Errorf("metadata %v", meta)
	}

	cfg.CA.Address, cfg.Identity.Namespace, cfg.Identity.ServiceAccount = "ca:15012", "shop", "cart"
	cfg.Identity.InstanceIP, cfg.CA.ClusterID = "10.0.0.7", "east"
	cfg.Envoy.AdminPort, cfg.Envoy.PrometheusPort = 19000, 0
	b = bootstrapOf(t, cfg)
	if want := "sidecar~10.0.0.7~web-1.shop~shop.svc.cluster.local"; b.GetNode().GetId() != want || b.GetNode().GetCluster() != "cart.shop" {
		t.Errorf("node %q cluster %q, want %q cart.shop", b.GetNode().GetId(), b.GetNode().GetCluster(), want)
	}
	if got := b.GetNode().GetMetadata().GetFields()["CLUSTER_ID"].GetStringValue(); got != "east" {
		t.Errorf("CLUSTER_ID %q, want east", got)
	}
	if port := b.GetAdmin().GetAddress().GetSocketAddress().GetPortValue(); port != 19000 {
		t.Errorf("admin port %d, want 19000", port)
	}
	if n := len(b.GetStaticResources().GetListeners()); n != 0 {
		t.Errorf("%d listeners with no Prometheus port", n)
	}
}

func TestEnvoyConfigRefusals(t *testing.T) {
	t.Parallel()
	dir := testutil.ShortTempDir(t)
	large := filepath.Join(dir, "large.yaml")
	if err := os.WriteFile(large, []byte(strings.Repeat("#", 1<<20+1)), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, field, text string
		modify            func(*agent.Config)
	}{
		{"admin port 0", "Envoy.AdminPort", "1-65535", func(c *agent.Config) { c.Envoy.AdminPort = 0 }},
		{"admin port too big", "Envoy.AdminPort", "1-65535", func(c *agent.Config) { c.Envoy.AdminPort = 65536 }},
		{"stats port negative", "Envoy.PrometheusPort", "0 for none", func(c *agent.Config) { c.Envoy.PrometheusPort = -1 }},
		{"stats port is the admin's", "Envoy.PrometheusPort", "{Envoy.AdminPort} too", func(c *agent.Config) { c.Envoy.PrometheusPort = c.Envoy.AdminPort }},
		{"override missing", "Envoy.BootstrapOverride", "does not exist", func(c *agent.Config) { c.Envoy.BootstrapOverride = filepath.Join(dir, "missing") }},
		{"override a directory", "Envoy.BootstrapOverride", "not a regular file", func(c *agent.Config) { c.Envoy.BootstrapOverride = dir }},
		{"override too large", "Envoy.BootstrapOverride", "larger than", func(c *agent.Config) { c.Envoy.BootstrapOverride = large }},
	} {
		cfg := agent.DefaultConfig(dir)
		tc.modify(&cfg)
		err := cfg.Validate()
		var fe *configerr.FieldError
		if !errors.As(err, &fe) || !slices.Contains(configerr.Fields(err), tc.field) || !strings.Contains(fe.Err.Error(), tc.text) {
			t.Errorf("%s: Validate = %v, want a FieldError of %s saying %q", tc.name, err, tc.field, tc.text)
		}
	}
}

// An override that does not parse or makes the bootstrap invalid is refused as the field's
// mistake: cmd names the flag and the variable, and exits 2.
func TestBootstrapRefusesABadOverride(t *testing.T) {
	t.Parallel()
	dir := testutil.ShortTempDir(t)
	for name, content := range map[string]string{
		"unknown field": "admin: {place: {}}\n",
		"invalid":       "static_resources: {clusters: [{type: STATIC}]}\n",
	} {
		path := filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+".yaml")
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg := agent.DefaultConfig(dir)
		cfg.Envoy.BootstrapOverride = path
		if err := cfg.Validate(); err != nil {
			t.Fatalf("%s: Validate: %v", name, err)
		}
		_, err := agent.Bootstrap(t.Context(), cfg)
		if !slices.Equal(configerr.Fields(err), []string{"Envoy.BootstrapOverride"}) || !errors.Is(err, agent.ErrConfigRefused) {
			t.Errorf("%s: Bootstrap = %v (fields %v), want a refusal of Envoy.BootstrapOverride", name, err, configerr.Fields(err))
		}
		if err != nil && !strings.Contains(err.Error(), path) {
			t.Errorf("%s: %v does not name the file", name, err)
		}
	}

	// A good one is merged.
	path := filepath.Join(dir, "good.json")
	if err := os.WriteFile(path, []byte(`{"admin": {"address": {"socketAddress": {"portValue": 15555}}}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := agent.DefaultConfig(dir)
	cfg.Envoy.BootstrapOverride = path
	if port := bootstrapOf(t, cfg).GetAdmin().GetAddress().GetSocketAddress().GetPortValue(); port != 15555 {
		t.Errorf("admin port %d, want the override's 15555", port)
	}
}
