package agent_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/agent/envoy/bootstrapcheck"
	"github.com/meshid/meshid/internal/configerr"
	"github.com/meshid/meshid/internal/testutil"
)

func bootstrapOf(t *testing.T, cfg agent.Config) *bootstrapv3.Bootstrap {
	t.Helper()
	if err := cfg.Validate(); err != nil {
		t.Fatalf("Validate: %v", err)
	}
	eb, err := agent.Bootstrap(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Bootstrap: %v", err)
	}
	if len(eb.Override) > 0 {
		t.Fatalf("the override given apart: %s", eb.Override)
	}
	return parseChecked(t, eb.Bootstrap)
}

func parseChecked(t *testing.T, data []byte) *bootstrapv3.Bootstrap {
	t.Helper()
	if err := bootstrapcheck.Check(data); err != nil {
		t.Fatalf("bootstrapcheck.Check: %v\n%s", err, data)
	}
	var b bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(data, &b); err != nil {
		t.Fatalf("the bootstrap does not parse: %v", err)
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
		{"admin port 0 with the stats listener", "Envoy.AdminPort", "needs {Envoy.PrometheusPort} 0", func(c *agent.Config) { c.Envoy.AdminPort, c.Envoy.PrometheusPort = 0, 15090 }},
		{"admin port negative", "Envoy.AdminPort", "1-65535, or 0", func(c *agent.Config) { c.Envoy.AdminPort = -1 }},
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

// With CheckBootstrap (meshid), an override that does not parse or makes the bootstrap invalid is
// refused as the field's mistake: cmd names the flag and the variable, and exits 2.
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
		cfg.Envoy.BootstrapOverride, cfg.Envoy.CheckBootstrap = path, bootstrapcheck.Merge
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
	cfg.Envoy.BootstrapOverride, cfg.Envoy.CheckBootstrap = path, bootstrapcheck.Merge
	if port := bootstrapOf(t, cfg).GetAdmin().GetAddress().GetSocketAddress().GetPortValue(); port != 15555 {
		t.Errorf("admin port %d, want the override's 15555", port)
	}
}

// Without CheckBootstrap (meshid-agent), the bootstrap is the one built, and the override's text,
// as the file holds it, is given apart for Envoy to merge (--config-yaml): as long as a command
// line can carry it.
func TestBootstrapWithoutCheckGivesTheOverrideApart(t *testing.T) {
	t.Parallel()
	dir := testutil.ShortTempDir(t)
	write := func(name, content string) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	base, err := agent.Bootstrap(t.Context(), agent.DefaultConfig(dir))
	if err != nil {
		t.Fatal(err)
	}
	// Not checked here: Envoy parses it, and says what is wrong with it when it starts.
	const text = "admin: {address: {socket_address: {port_value: 16000}}}\nstatic_resources: {clusters: [{name: x, conect_timeout: 1s}]}\n"
	cfg := agent.DefaultConfig(dir)
	cfg.Envoy.BootstrapOverride = write("override.yaml", text)
	eb, err := agent.Bootstrap(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Bootstrap: %v", err)
	}
	if !bytes.Equal(eb.Bootstrap, base.Bootstrap) || string(eb.Override) != text {
		t.Errorf("bootstrap\n%s\noverride %q; want the one built and the file's text", eb.Bootstrap, eb.Override)
	}
	parseChecked(t, eb.Bootstrap)

	// An empty file is no override, as for meshid.
	cfg.Envoy.BootstrapOverride = write("empty.yaml", "")
	if eb, err := agent.Bootstrap(t.Context(), cfg); err != nil || len(eb.Override) != 0 {
		t.Errorf("empty override: %v, override %q", err, eb.Override)
	}

	for name, tc := range map[string]struct{ content, want string }{
		"too long for a command line": {"# " + strings.Repeat("x", 128<<10), "--config-yaml"},
		"NUL":                         {"admin: {}\x00\n", "NUL"},
	} {
		cfg.Envoy.BootstrapOverride = write(strings.ReplaceAll(name, " ", "-"), tc.content)
		if err := cfg.Validate(); err != nil {
			t.Fatalf("%s: Validate: %v", name, err)
		}
		_, err := agent.Bootstrap(t.Context(), cfg)
		if !slices.Equal(configerr.Fields(err), []string{"Envoy.BootstrapOverride"}) || !errors.Is(err, agent.ErrConfigRefused) ||
			!strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Bootstrap = %v, want a refusal of Envoy.BootstrapOverride saying %q", name, err, tc.want)
		}
	}
	// The longest a command line carries is given.
	cfg.Envoy.BootstrapOverride = write("longest.yaml", "#"+strings.Repeat("x", 128<<10-2))
	if eb, err := agent.Bootstrap(t.Context(), cfg); err != nil || len(eb.Override) != 128<<10-1 {
		t.Errorf("override of 128 KiB - 1: %v, %d bytes given", err, len(eb.Override))
	}
}

// A bootstrap the check refuses for another reason than the override is the agent's own
// failure, not the user's.
func TestBootstrapCheckFailureIsNotTheUsers(t *testing.T) {
	t.Parallel()
	cfg := agent.DefaultConfig(testutil.ShortTempDir(t))
	cfg.Envoy.CheckBootstrap = func([]byte, []byte, string) ([]byte, error) { return nil, errors.New("built wrong") }
	_, err := agent.Bootstrap(t.Context(), cfg)
	if err == nil || errors.Is(err, agent.ErrConfigRefused) || !strings.Contains(err.Error(), "built wrong") {
		t.Errorf("Bootstrap = %v, want the check's error, not a refusal", err)
	}
}

// The agent that runs Envoy writes the bootstrap merged when it can merge (meshid), and otherwise
// the one built, with the override on Envoy's command line (meshid-agent).
func TestAgentRunningEnvoyGivesItTheOverride(t *testing.T) {
	t.Parallel()
	dir := testutil.ShortTempDir(t)
	override := filepath.Join(dir, "override.json")
	const text = `{"admin": {"address": {"socketAddress": {"portValue": 16000}}}}`
	if err := os.WriteFile(override, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	for name, check := range map[string]agent.BootstrapCheckFunc{"meshid": bootstrapcheck.Merge, "meshid-agent": nil} {
		cfg := agent.DefaultConfig(dir)
		cfg.Envoy.BootstrapPath = filepath.Join(dir, name+".json")
		cfg.Envoy.BootstrapOverride, cfg.Envoy.CheckBootstrap = override, check
		opts, err := agent.WriteBootstrap(cfg)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		data, err := os.ReadFile(opts.BootstrapPath)
		if err != nil {
			t.Fatal(err)
		}
		port := parseChecked(t, data).GetAdmin().GetAddress().GetSocketAddress().GetPortValue()
		args := strings.Join(opts.Args(), " ")
		if check != nil && (port != 16000 || strings.Contains(args, "--config-yaml")) {
			t.Errorf("%s: admin port %d, args %q; want the override merged into the file", name, port, args)
		}
		if check == nil && (port != agent.DefaultEnvoyAdminPort || !strings.Contains(args, "--config-yaml "+text)) {
			t.Errorf("%s: admin port %d, args %q; want the bootstrap built and --config-yaml with the override", name, port, args)
		}
	}
}
