package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/testutil"
)

// proxyContainer is what the test needs of the one-container pod's proxy container.
type proxyContainer struct {
	Name string   `json:"name"`
	Args []string `json:"args"`
	Env  []struct {
		Name      string `json:"name"`
		Value     string `json:"value"`
		ValueFrom *struct {
			FieldRef struct {
				FieldPath string `json:"fieldPath"`
			} `json:"fieldRef"`
		} `json:"valueFrom"`
	} `json:"env"`
	Lifecycle struct {
		PostStart struct {
			Exec struct {
				Command []string `json:"command"`
			} `json:"exec"`
		} `json:"postStart"`
	} `json:"lifecycle"`
	VolumeMounts []struct {
		MountPath string `json:"mountPath"`
		ReadOnly  bool   `json:"readOnly"`
	} `json:"volumeMounts"`
}

// proxyEntrypoint returns the ENTRYPOINT of the Dockerfile's proxy stage.
func proxyEntrypoint(t *testing.T) []string {
	t.Helper()
	f, err := os.Open(filepath.Join("..", "..", "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	inProxy := false
	for sc := bufio.NewScanner(f); sc.Scan(); {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "FROM ") {
			inProxy = strings.HasSuffix(line, " AS proxy")
		}
		if raw, ok := strings.CutPrefix(line, "ENTRYPOINT "); ok && inProxy {
			var argv []string
			if err := json.Unmarshal([]byte(raw), &argv); err != nil {
				t.Fatalf("the proxy stage's ENTRYPOINT %s: %v", raw, err)
			}
			return argv
		}
	}
	t.Fatal("the Dockerfile has no proxy stage with an ENTRYPOINT")
	return nil
}

// The proxy container of deploy/kubernetes/proxy, run by the proxy image's entrypoint with the
// values Kubernetes gives its variables, is accepted by this binary: every flag is one it has,
// every variable one it implements, and its paths are on the pod's volumes. Its postStart hook
// is a command this binary accepts, asking the port the agent serves.
func TestProxyManifestConfiguresTheAgent(t *testing.T) {
	t.Parallel()
	data, err := os.ReadFile(filepath.Join("..", "..", "deploy", "kubernetes", "proxy", "demo.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var found *proxyContainer
	for _, doc := range strings.Split(string(data), "\n---\n") {
		var d struct {
			Kind string `json:"kind"`
			Spec struct {
				Template struct {
					Spec struct {
						Containers []proxyContainer `json:"containers"`
					} `json:"spec"`
				} `json:"template"`
			} `json:"spec"`
		}
		if err := yaml.Unmarshal([]byte(doc), &d); err != nil {
			t.Fatal(err)
		}
		if d.Kind == "Deployment" && len(d.Spec.Template.Spec.Containers) > 0 {
			found = &d.Spec.Template.Spec.Containers[0]
		}
	}
	if found == nil || found.Name != "istio-proxy" {
		t.Fatalf("the Deployment's first container is %+v, want istio-proxy", found)
	}
	fieldValues := map[string]string{"metadata.namespace": "demo-proxy", "spec.serviceAccountName": "demo",
		"metadata.name": "demo-6d4cf56db6-x2x7k", "status.podIP": "10.244.1.7"}
	env := map[string]string{}
	for _, e := range found.Env {
		env[e.Name] = e.Value
		if e.ValueFrom != nil {
			env[e.Name] = fieldValues[e.ValueFrom.FieldRef.FieldPath]
		}
	}
	entrypoint := proxyEntrypoint(t)
	if len(entrypoint) < 2 || entrypoint[0] != "/usr/local/bin/meshid-agent" || entrypoint[1] != "agent" {
		t.Fatalf("the proxy image runs %q, want /usr/local/bin/meshid-agent agent", entrypoint)
	}

	var got agent.Config
	root := newRootCommand(func(_ context.Context, cfg agent.Config) error { got = cfg; return nil },
		func(k string) (string, bool) { v, ok := env[k]; return v, ok }, nil)
	var stderr bytes.Buffer
	root.SetErr(&stderr)
	// The image's Envoy is /usr/local/bin/envoy; here a stand-in, so that the command line is
	// checked as it is.
	local, envoyPath := testutil.StandInFor(t, "envoy-path", append(entrypoint[1:], found.Args...))
	if envoyPath != "/usr/local/bin/envoy" {
		t.Errorf("--envoy-path %s, want the Envoy image's /usr/local/bin/envoy", envoyPath)
	}
	root.SetArgs(local)
	if err := root.ExecuteContext(t.Context()); err != nil {
		t.Fatalf("meshid-agent refuses the proxy image's entrypoint with the manifest's args and env: %v\n%s", err, stderr.String())
	}
	if strings.Contains(stderr.String(), "not implemented") {
		t.Errorf("the agent ignores variables the manifest sets:\n%s", stderr.String())
	}
	agentCmd, _, err := root.Find([]string{"agent"})
	if err != nil {
		t.Fatal(err)
	}
	// Every variable is one the agent reads: its help's table of variables, or a flag's usage,
	// names it (and the warning above did not).
	for name := range env {
		word := regexp.MustCompile(`\b` + regexp.QuoteMeta(name) + `\b`)
		inTable := regexp.MustCompile(`(?m)^\s+` + regexp.QuoteMeta(name) + `\s+--[a-z-]+$`).MatchString(agentCmd.Long)
		if !inTable && !word.MatchString(agentCmd.Flags().FlagUsages()) {
			t.Errorf("%s is not a variable meshid-agent agent implements (see its --help)", name)
		}
	}

	if got.CA.Address != "meshid-ca.istio-system.svc:15012" || got.Identity.Namespace != "demo-proxy" || got.Identity.ServiceAccount != "demo" {
		t.Errorf("CA %q, identity %s/%s; want the meshid-ca Service and demo-proxy/demo", got.CA.Address, got.Identity.Namespace, got.Identity.ServiceAccount)
	}
	if got.Servers.StatusAddr != ":15020" {
		t.Errorf("status address %s: the probes, the postStart hook and Prometheus ask :15020", got.Servers.StatusAddr)
	}
	// The root filesystem is read-only: what the agent writes must be on a writable volume.
	mounted := func(path string, write bool) bool {
		for _, m := range found.VolumeMounts {
			if strings.HasPrefix(path, strings.TrimSuffix(m.MountPath, "/")+"/") && (!write || !m.ReadOnly) {
				return true
			}
		}
		return false
	}
	for path, write := range map[string]bool{
		got.CA.TokenPath: false, "/" + agent.DefaultCARootCert: false,
		filepath.Join("/", agent.DefaultSocketDir, "socket"): true, "/" + agent.DefaultXDSSocket: true,
	} {
		if !mounted(path, write) {
			t.Errorf("the agent uses %s, which no volume of its container holds (writable: %v)", path, write)
		}
	}
	bootstrap := got.Envoy.BootstrapPath
	if bootstrap == "" {
		bootstrap = "/" + agent.DefaultBootstrapPath
	}
	if !mounted(bootstrap, true) {
		t.Errorf("Envoy's bootstrap %s: the agent writes it, so it must be on a writable volume", bootstrap)
	}

	hook := found.Lifecycle.PostStart.Exec.Command
	if len(hook) < 2 || hook[0] != entrypoint[0] || hook[1] != "wait" {
		t.Fatalf("postStart runs %q, want %s wait", hook, entrypoint[0])
	}
	waitRoot := newRootCommand(func(context.Context, agent.Config) error { return nil }, func(string) (string, bool) { return "", false }, nil)
	waitCmd, rest, err := waitRoot.Find(hook[1:])
	if err != nil || waitCmd.Name() != "wait" {
		t.Fatalf("postStart %q: %v", hook, err)
	}
	if err := waitCmd.ParseFlags(rest); err != nil {
		t.Fatalf("postStart %q: %v", hook, err)
	}
	if addr := waitCmd.Flags().Lookup("addr").Value.String(); !strings.HasSuffix(addr, got.Servers.StatusAddr) {
		t.Errorf("postStart waits on %s, the agent's status server is %s", addr, got.Servers.StatusAddr)
	}
}
