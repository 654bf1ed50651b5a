package cli

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/agent/envoy/bootstrapcheck"
	"github.com/meshid/meshid/internal/testutil"
)

// mainBootstrap runs `meshid agent bootstrap` as the process does, through Main, with env as the
// whole environment. It returns the exit code, stdout and stderr.
func mainBootstrap(t *testing.T, env map[string]string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	return mainMeshidAgent(t, env, append([]string{"agent", "bootstrap"}, args...)...)
}

// mainMeshidAgent runs meshid's agent command, with its bootstrap subcommand, as the process
// does; the agent itself never runs.
func mainMeshidAgent(t *testing.T, env map[string]string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	g := &Globals{}
	root := NewRoot("meshid", "", "", g)
	lookupEnv := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	environ := func() []string {
		var kvs []string
		for k, v := range env {
			kvs = append(kvs, k+"="+v)
		}
		return kvs
	}
	agentCmd := NewAgentCommand(g, nil, lookupEnv, stubEmbed, bootstrapcheck.Merge, nil)
	agentCmd.AddCommand(NewBootstrapCommand(g, lookupEnv, environ, stubEmbed, bootstrapcheck.Merge))
	root.AddCommand(agentCmd)
	var out, errOut bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetArgs(args)
	code = Main(root)
	return code, out.String(), errOut.String()
}

func parseBootstrap(t *testing.T, data []byte) *bootstrapv3.Bootstrap {
	t.Helper()
	var b bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(data, &b); err != nil {
		t.Fatalf("not a bootstrap: %v\n%s", err, data)
	}
	if err := b.ValidateAll(); err != nil {
		t.Fatalf("ValidateAll: %v", err)
	}
	return &b
}

func sdsPipe(b *bootstrapv3.Bootstrap) string {
	for _, c := range b.GetStaticResources().GetClusters() {
		if c.GetName() == "sds-grpc" {
			return c.GetLoadAssignment().GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint().GetAddress().GetPipe().GetPath()
		}
	}
	return ""
}

func TestBootstrapToStdout(t *testing.T) {
	t.Parallel()
	root := testutil.ShortTempDir(t)
	env := map[string]string{
		"POD_NAME": "web-1", "POD_NAMESPACE": "shop", "SERVICE_ACCOUNT": "cart", "INSTANCE_IP": "10.0.0.9",
		"CA_ADDR": "ca:15012", "ISTIO_META_FOO": "bar", "ISTIO_META_CLUSTER_ID": "east", "UNRELATED": "x",
	}
	code, stdout, stderr := mainBootstrap(t, env, "--root-dir", root, "--envoy-admin-port", "15111")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	b := parseBootstrap(t, []byte(stdout))
	if want := "sidecar~10.0.0.9~web-1.shop~shop.svc.cluster.local"; b.GetNode().GetId() != want {
		t.Errorf("node id %q, want %q", b.GetNode().GetId(), want)
	}
	meta := b.GetNode().GetMetadata().GetFields()
	for k, v := range map[string]string{"FOO": "bar", "CLUSTER_ID": "east", "POD_NAME": "web-1", "NAMESPACE": "shop"} {
		if meta[k].GetStringValue() != v {
			t.Errorf("metadata %s = %v, want %q", k, meta[k], v)
		}
	}
	if _, ok := meta["UNRELATED"]; ok {
		t.Error("a variable without ISTIO_META_ in the metadata")
	}
	if got, want := sdsPipe(b), filepath.Join(root, agent.DefaultSocketDir, "socket"); got != want {
		t.Errorf("SDS pipe %q, want %q", got, want)
	}
	if port := b.GetAdmin().GetAddress().GetSocketAddress().GetPortValue(); port != 15111 {
		t.Errorf("admin port %d, want 15111", port)
	}

	// A flag wins over its variable.
	code, stdout, stderr = mainBootstrap(t, env, "--root-dir", root, "--pod-name", "flagged")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if got := parseBootstrap(t, []byte(stdout)).GetNode().GetId(); !strings.Contains(got, "~flagged.shop~") {
		t.Errorf("node id %q: --pod-name did not win over POD_NAME", got)
	}
}

func TestBootstrapToFile(t *testing.T) {
	t.Parallel()
	dir := testutil.ShortTempDir(t)
	out := filepath.Join(dir, "envoy.json")
	if err := os.WriteFile(out, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := mainBootstrap(t, nil, "--root-dir", dir, "-o", out, "--proxy-xds-via-agent=false")
	if code != 0 || stdout != "" {
		t.Fatalf("exit %d, stdout %q: %s", code, stdout, stderr)
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if b := parseBootstrap(t, data); b.GetDynamicResources() != nil {
		t.Errorf("ADS without the xDS proxy: %v", b.GetDynamicResources())
	}
	info, err := os.Stat(out)
	if err != nil {
		t.Fatal(err)
	}
	// 0644 though the file was 0600: it was replaced, not written in place.
	if info.Mode().Perm() != 0o644 {
		t.Errorf("mode %v, want 0644", info.Mode().Perm())
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if strings.Contains(e.Name(), ".tmp-") {
			t.Errorf("temporary file %s left behind", e.Name())
		}
	}

	code, _, stderr = mainBootstrap(t, nil, "--root-dir", dir, "-o", filepath.Join(dir, "missing", "envoy.json"))
	if code != ExitUsage || !strings.Contains(stderr, "missing does not exist") {
		t.Errorf("-o in a missing directory: exit %d, %s", code, stderr)
	}
}

func TestBootstrapOverride(t *testing.T) {
	t.Parallel()
	dir := testutil.ShortTempDir(t)
	good := filepath.Join(dir, "good.yaml")
	bad := filepath.Join(dir, "bad.yaml")
	other := filepath.Join(dir, "other.yaml")
	for path, content := range map[string]string{
		good:  "admin: {address: {socket_address: {port_value: 16000}}}\n",
		other: "admin: {address: {socket_address: {port_value: 17000}}}\n",
		bad:   "static_resources: {clusters: [{name: x, conect_timeout: 1s}]}\n",
	} {
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	port := func(stdout string) uint32 {
		return parseBootstrap(t, []byte(stdout)).GetAdmin().GetAddress().GetSocketAddress().GetPortValue()
	}
	code, stdout, stderr := mainBootstrap(t, map[string]string{"ISTIO_BOOTSTRAP_OVERRIDE": good}, "--root-dir", dir)
	if code != 0 || port(stdout) != 16000 {
		t.Fatalf("ISTIO_BOOTSTRAP_OVERRIDE: exit %d: %s", code, stderr)
	}
	code, stdout, stderr = mainBootstrap(t, map[string]string{"ISTIO_BOOTSTRAP_OVERRIDE": good}, "--root-dir", dir, "--bootstrap-override", other)
	if code != 0 || port(stdout) != 17000 {
		t.Fatalf("--bootstrap-override over the variable: exit %d: %s", code, stderr)
	}

	for name, args := range map[string][]string{
		"bad file":     {"--bootstrap-override", bad},
		"missing file": {"--bootstrap-override", filepath.Join(dir, "missing.yaml")},
	} {
		code, stdout, stderr = mainBootstrap(t, nil, append([]string{"--root-dir", dir}, args...)...)
		if code != ExitUsage || stdout != "" {
			t.Errorf("%s: exit %d, stdout %q; want %d and nothing written", name, code, stdout, ExitUsage)
		}
		wants := []string{"--bootstrap-override", "(ISTIO_BOOTSTRAP_OVERRIDE)", args[1]}
		if name == "bad file" {
			wants = append(wants, "conect_timeout")
		}
		for _, want := range wants {
			if !strings.Contains(stderr, want) {
				t.Errorf("%s: stderr does not name %q:\n%s", name, want, stderr)
			}
		}
	}
}

func TestBootstrapRefusesBadPorts(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"--envoy-admin-port", "0"},
		{"--envoy-prometheus-port", "70000"},
		{"--envoy-prometheus-port", "15000"},
	} {
		code, _, stderr := mainBootstrap(t, nil, append([]string{"--root-dir", testutil.ShortTempDir(t)}, args...)...)
		if code != ExitUsage || !strings.Contains(stderr, args[0]) {
			t.Errorf("%v: exit %d; want %d naming %s:\n%s", args, code, ExitUsage, args[0], stderr)
		}
	}
}

// The agent starts no Envoy yet: the flags that only shape the bootstrap are refused there,
// naming the command that takes them.
func TestAgentRefusesBootstrapOnlyFlags(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"--pod-name", "web-1"},
		{"--bootstrap-override", "/etc/override.yaml"},
		{"--envoy-admin-port", "15001"},
		{"--envoy-prometheus-port", "0"},
	} {
		code, stderr := mainAgent(t, map[string]string{"POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo"}, args...)
		want := args[0] + " applies to the bootstrap `meshid bootstrap` writes"
		if code != ExitUsage || !strings.Contains(stderr, want) {
			t.Errorf("%v: exit %d; want %d and %q:\n%s", args, code, ExitUsage, want, stderr)
		}
	}
	// In meshid, the bootstrap command is the agent's own.
	code, _, stderr := mainMeshidAgent(t, nil, "agent", "--envoy-admin-port", "1")
	if want := "--envoy-admin-port applies to the bootstrap `meshid agent bootstrap` writes"; code != ExitUsage || !strings.Contains(stderr, want) {
		t.Errorf("exit %d; want %d and %q:\n%s", code, ExitUsage, want, stderr)
	}
	// POD_NAME, which Kubernetes sets in every pod, is not a mistake.
	env := map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo", "POD_NAME": "web-1"}
	if code, stderr := mainAgent(t, env); code != 0 {
		t.Errorf("POD_NAME set: exit %d:\n%s", code, stderr)
	}
}

// mainSlimBootstrap runs `meshid-agent bootstrap`, the binary without Envoy's types, as the
// process does.
func mainSlimBootstrap(t *testing.T, env map[string]string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	g := &Globals{}
	root := NewRoot("meshid-agent", "", "", g)
	lookupEnv := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	root.AddCommand(NewBootstrapCommand(g, lookupEnv, nil, nil, nil))
	var out, errOut bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetArgs(append([]string{"bootstrap"}, args...))
	code = Main(root)
	return code, out.String(), errOut.String()
}

// The slim binary writes the same bootstrap as meshid, but cannot merge an override: it refuses
// one, saying what can.
func TestSlimBootstrapRefusesAnOverride(t *testing.T) {
	t.Parallel()
	dir := testutil.ShortTempDir(t)
	env := map[string]string{"CA_ADDR": "ca:15012", "POD_NAME": "web-1", "POD_NAMESPACE": "shop", "SERVICE_ACCOUNT": "cart"}
	code, slim, stderr := mainSlimBootstrap(t, env, "--root-dir", dir)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	code, full, stderr := mainBootstrap(t, env, "--root-dir", dir)
	if code != 0 {
		t.Fatalf("meshid: exit %d: %s", code, stderr)
	}
	if slim != full {
		t.Errorf("meshid-agent bootstrap\n%s\ndiffers from meshid agent bootstrap\n%s", slim, full)
	}
	parseBootstrap(t, []byte(slim))

	override := filepath.Join(dir, "override.yaml")
	if err := os.WriteFile(override, []byte("admin: {address: {socket_address: {port_value: 16000}}}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "envoy.json")
	withVar := map[string]string{"ISTIO_BOOTSTRAP_OVERRIDE": override}
	for name, run := range map[string]func() (int, string, string){
		"flag": func() (int, string, string) {
			return mainSlimBootstrap(t, nil, "--root-dir", dir, "--bootstrap-override", override)
		},
		"variable": func() (int, string, string) { return mainSlimBootstrap(t, withVar, "--root-dir", dir, "-o", out) },
	} {
		code, stdout, stderr := run()
		if code != ExitUsage || stdout != "" {
			t.Errorf("%s: exit %d, stdout %q; want %d and nothing written", name, code, stdout, ExitUsage)
		}
		for _, want := range []string{"--bootstrap-override (ISTIO_BOOTSTRAP_OVERRIDE) " + override,
			"meshid-agent leaves Envoy's configuration types out", "`meshid agent bootstrap`", "--envoy-path", "--config-yaml"} {
			if !strings.Contains(stderr, want) {
				t.Errorf("%s: stderr does not say %q:\n%s", name, want, stderr)
			}
		}
	}
	if _, err := os.Stat(out); err == nil {
		t.Error("-o written though the override was refused")
	}
}
