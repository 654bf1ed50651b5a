package main

import (
	"bytes"
	"context"
	"os/exec"
	"strings"
	"testing"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/cmd/internal/cli"
	"github.com/meshid/meshid/internal/testutil"
)

// The sidecar binary must stay small: it links no Kubernetes client, no CA and no discovery server.
func TestLinksNoKubernetesClientAndNoCA(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-deps", "github.com/meshid/meshid/cmd/meshid-agent").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for _, dep := range strings.Fields(string(out)) {
		if strings.HasPrefix(dep, "k8s.io/") || strings.HasPrefix(dep, "sigs.k8s.io/") ||
			dep == "github.com/meshid/meshid/ca" || strings.HasPrefix(dep, "github.com/meshid/meshid/ca/") ||
			strings.HasPrefix(dep, "github.com/meshid/meshid/controlplane") || dep == "github.com/meshid/meshid/discovery" {
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
		})
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
	for _, want := range []string{"agent", "certs", "probe", "version"} {
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
	root := newRootCommand(cli.RunAgent, func(string) (string, bool) { return "", false })
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
	root := newRootCommand(cli.RunAgent, func(string) (string, bool) { return "", false })
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
