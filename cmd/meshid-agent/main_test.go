package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/cmd/internal/cli"
	"github.com/meshid/meshid/internal/testutil"
)

// The sidecar binary must stay small: it links no Kubernetes client (nor sigs.k8s.io/yaml, which
// only meshid's bootstrap override and node mode's rules file need), no CA, no discovery server,
// and no node mode (agent/nodemode, and the attestor of internal/attest): it serves one workload.
func TestLinksNoKubernetesClientAndNoCA(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-deps", "github.com/meshid/meshid/cmd/meshid-agent").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for _, dep := range strings.Fields(string(out)) {
		if strings.HasPrefix(dep, "k8s.io/") || strings.HasPrefix(dep, "sigs.k8s.io/") ||
			dep == "github.com/meshid/meshid/ca" || strings.HasPrefix(dep, "github.com/meshid/meshid/ca/") ||
			strings.HasPrefix(dep, "github.com/meshid/meshid/controlplane") || dep == "github.com/meshid/meshid/discovery" ||
			dep == "github.com/meshid/meshid/agent/nodemode" || dep == "github.com/meshid/meshid/internal/attest" {
			t.Fatalf("meshid-agent links %s", dep)
		}
	}
}

func TestCommands(t *testing.T) {
	t.Parallel()
	var ran bool
	root := newRootCommand(func(context.Context, agent.Config) error { ran = true; return nil },
		func(k string) (string, bool) {
			v, ok := map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo"}[k]
			return v, ok
		}, nil)
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetArgs([]string{"agent"})
	if err := root.ExecuteContext(t.Context()); err != nil || !ran {
		t.Fatalf("agent: ran=%v err=%v", ran, err)
	}
	var names []string
	for _, c := range root.Commands() {
		names = append(names, c.Name())
	}
	for _, want := range []string{"agent", "bootstrap", "certs", "probe", "version"} {
		if !strings.Contains(strings.Join(names, " "), want) {
			t.Errorf("meshid-agent lacks %q (has %v)", want, names)
		}
	}
	for _, n := range names {
		if n == "ca" || n == "token" {
			t.Errorf("meshid-agent carries the %q command", n)
		}
	}
}

// With neither credential files nor a CA address, the slim binary says what it needs: it has no
// CA to run in-process.
func TestNoCAAddressWithoutCredentials(t *testing.T) {
	t.Parallel()
	root := newRootCommand(cli.RunAgent, func(string) (string, bool) { return "", false }, nil)
	var stderr bytes.Buffer
	root.SetErr(&stderr)
	root.SetArgs([]string{"agent", "--root-dir", testutil.ShortTempDir(t), "--status-addr", "127.0.0.1:0", "--debug-addr", ""})
	err := root.ExecuteContext(t.Context())
	if err == nil || !strings.Contains(err.Error(), "no --ca-addr (CA_ADDR)") || !strings.Contains(err.Error(), "meshid agent") {
		t.Fatalf("error %v, want one asking for --ca-addr and naming meshid agent", err)
	}
}

// Without credentials and without --ca-addr the slim agent has nowhere to get a certificate:
// it says so and exits 2, as for any other mistake in how it was called.
func TestAgentWithoutACAExitsTwo(t *testing.T) {
	t.Parallel()
	root := newRootCommand(cli.RunAgent, func(string) (string, bool) { return "", false }, nil)
	var stderr bytes.Buffer
	root.SetErr(&stderr)
	root.SetArgs([]string{"agent", "--root-dir", testutil.ShortTempDir(t), "--status-addr", "127.0.0.1:0", "--debug-addr", ""})
	if code := cli.Main(root); code != cli.ExitUsage {
		t.Fatalf("exit code %d, want %d; stderr:\n%s", code, cli.ExitUsage, stderr.String())
	}
	if !strings.Contains(stderr.String(), "no --ca-addr (CA_ADDR): this binary carries no CA") {
		t.Fatalf("stderr does not say why:\n%s", stderr.String())
	}
}

// Node mode's Kubernetes source is meshid's: the sidecar's binary links no Kubernetes client,
// and refuses it at start (exit 2) saying where it is.
func TestAgentRefusesWorkloadAttestationPods(t *testing.T) {
	t.Parallel()
	root := newRootCommand(cli.RunAgent, func(string) (string, bool) { return "", false }, nil)
	var stderr bytes.Buffer
	root.SetErr(&stderr)
	root.SetArgs([]string{"agent", "--root-dir", testutil.ShortTempDir(t), "--status-addr", "127.0.0.1:0", "--debug-addr", "",
		"--ca-addr", "127.0.0.1:15012", "--namespace", "istio-system", "--service-account", "node-agent",
		"--workload-attestation-pods", "--node-name", "n1", "--in-cluster"})
	if code := cli.Main(root); code != cli.ExitUsage {
		t.Fatalf("exit code %d, want %d; stderr:\n%s", code, cli.ExitUsage, stderr.String())
	}
	if want := "--workload-attestation-pods: node mode is in meshid (meshid agent); this binary, a sidecar's, serves one workload and links no Kubernetes client"; !strings.Contains(stderr.String(), want) {
		t.Fatalf("stderr does not say %q:\n%s", want, stderr.String())
	}
}

// The agent container of deploy/kubernetes/sidecar, with the values Kubernetes gives its
// variables, is accepted by this binary, and the agent's default paths are where the pod mounts
// the token, the CA root and the two sockets Envoy dials.
func TestSidecarManifestConfiguresTheAgent(t *testing.T) {
	t.Parallel()
	data, err := os.ReadFile(filepath.Join("..", "..", "deploy", "kubernetes", "sidecar", "demo.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	type container struct {
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
		Ports []struct {
			ContainerPort int `json:"containerPort"`
		} `json:"ports"`
		VolumeMounts []struct {
			MountPath string `json:"mountPath"`
		} `json:"volumeMounts"`
	}
	var found *container
	for _, doc := range strings.Split(string(data), "\n---\n") {
		var d struct {
			Kind string `json:"kind"`
			Spec struct {
				Template struct {
					Spec struct {
						Containers []container `json:"containers"`
					} `json:"spec"`
				} `json:"template"`
			} `json:"spec"`
		}
		if err := yaml.Unmarshal([]byte(doc), &d); err != nil {
			t.Fatal(err)
		}
		for _, c := range d.Spec.Template.Spec.Containers {
			if d.Kind == "Deployment" && c.Name == "meshid-agent" {
				found = &c
			}
		}
	}
	if found == nil {
		t.Fatal("no meshid-agent container in the Deployment")
	}
	fieldValues := map[string]string{"metadata.namespace": "demo", "spec.serviceAccountName": "demo"}
	env := map[string]string{}
	for _, e := range found.Env {
		env[e.Name] = e.Value
		if e.ValueFrom != nil {
			env[e.Name] = fieldValues[e.ValueFrom.FieldRef.FieldPath]
		}
	}

	var got agent.Config
	root := newRootCommand(func(_ context.Context, cfg agent.Config) error { got = cfg; return nil },
		func(k string) (string, bool) { v, ok := env[k]; return v, ok }, nil)
	var stderr bytes.Buffer
	root.SetErr(&stderr)
	root.SetArgs(found.Args)
	if err := root.ExecuteContext(t.Context()); err != nil {
		t.Fatalf("meshid-agent refuses the manifest's container: %v\n%s", err, stderr.String())
	}
	if got.CA.Address != "meshid-ca.istio-system.svc:15012" || got.Identity.Namespace != "demo" || got.Identity.ServiceAccount != "demo" {
		t.Errorf("CA %q, identity %s/%s; want the meshid-ca Service and demo/demo", got.CA.Address, got.Identity.Namespace, got.Identity.ServiceAccount)
	}
	mounted := func(path string) bool {
		for _, m := range found.VolumeMounts {
			if strings.HasPrefix(path, strings.TrimSuffix(m.MountPath, "/")+"/") {
				return true
			}
		}
		return false
	}
	for _, path := range []string{got.CA.TokenPath, "/" + agent.DefaultCARootCert, filepath.Join("/", agent.DefaultSocketDir, "socket"), "/" + agent.DefaultXDSSocket} {
		if !mounted(path) {
			t.Errorf("the agent uses %s, which no volume of its container holds", path)
		}
	}
	if got.CA.RootCert != "" {
		t.Errorf("CA root %q set: the manifest relies on the default %s", got.CA.RootCert, agent.DefaultCARootCert)
	}
	if _, port, _ := strings.Cut(got.Servers.StatusAddr, ":"); len(found.Ports) != 1 || port != strconv.Itoa(found.Ports[0].ContainerPort) {
		t.Errorf("status address %s, container ports %+v: the readiness probe would miss it", got.Servers.StatusAddr, found.Ports)
	}
}

// `meshid-agent bootstrap` writes the bootstrap of the agent the same flags and variables
// describe, ISTIO_META_* included.
func TestBootstrapCommand(t *testing.T) {
	t.Parallel()
	env := map[string]string{"CA_ADDR": "ca:15012", "POD_NAMESPACE": "shop", "SERVICE_ACCOUNT": "cart", "ISTIO_META_FOO": "bar"}
	root := newRootCommand(cli.RunAgent, func(k string) (string, bool) { v, ok := env[k]; return v, ok },
		func() []string { return []string{"ISTIO_META_FOO=bar", "CA_ADDR=ca:15012"} })
	var stdout, stderr bytes.Buffer
	root.SetOut(&stdout)
	root.SetErr(&stderr)
	dir := t.TempDir()
	root.SetArgs([]string{"bootstrap", "--root-dir", dir})
	if err := root.ExecuteContext(t.Context()); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	for _, want := range []string{`"FOO": "bar"`, `"cluster": "cart.shop"`, `"path": "` + filepath.Join(dir, agent.DefaultXDSSocket) + `"`} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("bootstrap lacks %s:\n%s", want, stdout.String())
		}
	}
}

// meshid-agent links no Envoy types to merge a bootstrap override with: `meshid-agent bootstrap`
// refuses one (exit 2) and says what merges it.
func TestBootstrapCommandRefusesAnOverride(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	override := filepath.Join(dir, "override.yaml")
	if err := os.WriteFile(override, []byte("admin: {address: {socket_address: {port_value: 16000}}}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"CA_ADDR": "ca:15012", "ISTIO_BOOTSTRAP_OVERRIDE": override}
	root := newRootCommand(cli.RunAgent, func(k string) (string, bool) { v, ok := env[k]; return v, ok }, nil)
	var stdout, stderr bytes.Buffer
	root.SetOut(&stdout)
	root.SetErr(&stderr)
	root.SetArgs([]string{"bootstrap", "--root-dir", dir})
	if code := cli.Main(root); code != cli.ExitUsage || stdout.Len() != 0 {
		t.Fatalf("exit %d, stdout %q; want %d and nothing written", code, stdout.String(), cli.ExitUsage)
	}
	for _, want := range []string{"meshid-agent leaves Envoy's configuration types out", "`meshid agent bootstrap`", "--envoy-path"} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("stderr does not say %q:\n%s", want, stderr.String())
		}
	}
}
