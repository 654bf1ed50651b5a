package cli

import (
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/pki"
)

// The agent keys what Validate refuses by the field's path in its Config; the command renders
// each with the flag and the variable that set it. These are agent's TestConfigValidate cases
// whose text the rendering now makes, with the assertions they had there.
func TestAgentConfigErrorsNameFlagsAndVariables(t *testing.T) {
	t.Parallel()
	good := func() agent.Config {
		c := agent.DefaultConfig("")
		c.Identity.Namespace, c.Identity.ServiceAccount, c.CA.Address = "default", "demo", "127.0.0.1:15012"
		return c
	}
	tests := []struct {
		name   string
		modify func(*agent.Config)
		want   string
	}{
		{"negative drain", func(c *agent.Config) { c.SDS.DrainDuration = -time.Second }, "--drain-duration"},
		{"RSA too small", func(c *agent.Config) { c.Certificate.KeyAlgorithm, c.Certificate.RSAKeySize = pki.RSA, 1024 }, "WORKLOAD_RSA_KEY_SIZE"},
		{"ratio", func(c *agent.Config) { c.Certificate.GraceRatio = 1 }, "--grace-period-ratio"},
		{"jitter", func(c *agent.Config) { c.Certificate.GraceRatioJitter = 0.6 }, "--grace-period-ratio-jitter"},
		{"ttl", func(c *agent.Config) { c.Certificate.TTL = 0 }, "--secret-ttl"},
		{"status addr", func(c *agent.Config) { c.Servers.StatusAddr = "15020" }, "--status-addr"},
		{"CA address, relative Unix socket", func(c *agent.Config) { c.CA.Address = "unix://ca.sock" }, `--ca-addr "unix://ca.sock" (CA_ADDR): a Unix socket needs an absolute path`},
		{"discovery address, no host", func(c *agent.Config) { c.XDS.DiscoveryAddress = ":15012" }, `--discovery-addr ":15012": no host`},
		{"every address at once", func(c *agent.Config) {
			c.Servers.StatusAddr, c.Servers.DebugAddr, c.CA.Address, c.XDS.DiscoveryAddress = "127.0.0.1:99999", "localhost", "https://ca:15012", "istiod"
		}, "--status-addr \"127.0.0.1:99999\": port \"99999\": want a number from 0 to 65535\n" +
			"--debug-addr \"localhost\": no port: give HOST:PORT, as in \"localhost:PORT\"\n" +
			"--ca-addr \"https://ca:15012\" (CA_ADDR): https:// is not part of an address: give HOST:PORT, as in \"ca:15012\"\n" +
			"--discovery-addr \"istiod\": no port: give HOST:PORT, as in \"istiod:PORT\""},
		{"no SDS streams", func(c *agent.Config) { c.SDS.MaxStreams = 0 }, "--sds-max-streams 0 must be positive"},
		{"key algorithm", func(c *agent.Config) { c.Certificate.KeyAlgorithm = "DSA" }, `--key-algorithm "DSA" (ECC_SIGNATURE_ALGORITHM): want ECDSA or RSA`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := good()
			tt.modify(&c)
			if err := renderConfigErrors(c.Validate()); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one mentioning %q", err, tt.want)
			}
		})
	}
}

// A bad grace period ratio, from the flag or from the variable, is refused naming both.
func TestAgentBadGraceRatioNamesFlagAndVariable(t *testing.T) {
	t.Parallel()
	for name, run := range map[string]func() error{
		"flag": func() error {
			_, err := runAgentCommand(t, nil, "--grace-period-ratio", "2")
			return err
		},
		"variable": func() error {
			_, err := runAgentCommand(t, map[string]string{"SECRET_GRACE_PERIOD_RATIO": "2"})
			return err
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			err := run()
			if err == nil {
				t.Fatal("a grace period ratio of 2 was accepted")
			}
			for _, want := range []string{"--grace-period-ratio", "SECRET_GRACE_PERIOD_RATIO", "grace period ratio 2"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not name %q", err, want)
				}
			}
			if strings.Contains(err.Error(), "Certificate.GraceRatio") {
				t.Errorf("error %q names the Config field, not the flag", err)
			}
		})
	}
}

// Every field the agent may name has a flag of the agent command.
func TestAgentFieldFlagsExist(t *testing.T) {
	t.Parallel()
	cmd := NewAgentCommand(&Globals{}, nil, func(string) (string, bool) { return "", false }, stubEmbed)
	for field, flag := range agentFieldFlags() {
		if cmd.Flags().Lookup(flag) == nil {
			t.Errorf("%s: no flag --%s", field, flag)
		}
	}
}
