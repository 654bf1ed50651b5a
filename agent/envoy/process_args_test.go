package envoy_test

import (
	"slices"
	"testing"

	"github.com/meshid/meshid/agent/envoy"
)

// An override the agent cannot merge goes to Envoy as --config-yaml, text as the file holds it,
// one argument; without one there is no --config-yaml.
func TestArgsConfigYAML(t *testing.T) {
	t.Parallel()
	o := envoy.Options{BootstrapPath: "/b.json", LogLevel: "warning"}
	if slices.Contains(o.Args(), "--config-yaml") {
		t.Errorf("--config-yaml without an override: %q", o.Args())
	}
	o.ConfigYAML = "admin:\n  address: {socket_address: {port_value: 16000}}\n"
	args := o.Args()
	i := slices.Index(args, "--config-yaml")
	if i < 0 || i+1 >= len(args) || args[i+1] != o.ConfigYAML {
		t.Fatalf("args %q: want --config-yaml and the override's text", args)
	}
	if j := slices.Index(args, "-c"); j < 0 || args[j+1] != "/b.json" {
		t.Errorf("args %q: the bootstrap file is still -c", args)
	}
}
