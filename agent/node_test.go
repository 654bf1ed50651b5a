package agent_test

import (
	"testing"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/attest"
)

// newAttestor is meshid's attestor hook (cmd/meshid), which meshid-agent leaves out.
func newAttestor(c agent.AttestConfig) (agent.Attestor, error) {
	a, err := attest.New(attest.Config{RulesFile: c.RulesFile, Clock: c.Clock, Logger: c.Logger, Registerer: c.Registerer})
	if err != nil {
		return nil, err
	}
	return a, nil
}

// Node mode refuses at start what would give every caller one workload's credentials (or, the
// xDS proxy, the node's configuration), or what cannot ask the CA for another identity.
func TestNodeModeRefusals(t *testing.T) {
	t.Parallel()
	node := func(edit func(*agent.Config)) func(*agent.Config) {
		return func(c *agent.Config) {
			c.SDS.WorkloadAttestation = "/etc/meshid/rules.yaml"
			c.SDS.Attest = newAttestor
			c.XDS.Proxy = false
			edit(c)
		}
	}
	wantRefused(t, []refusal{
		{"output certs", node(func(c *agent.Config) { c.Output.Dir = "/out" }), "Output.Dir", "no one key pair"},
		{"file-mounted certs", node(func(c *agent.Config) { c.SDS.FileMountedCerts = true }), "SDS.FileMountedCerts", "one workload's files"},
		{"credentials dir", node(func(c *agent.Config) { c.SDS.CredentialsDir = "/creds" }), "SDS.CredentialsDir", "not served in node mode"},
		{"Mesh CA", node(func(c *agent.Config) { withCA(c); c.CA.Provider = agent.CAProviderGoogleCA }), "CA.Provider", "cannot ask for another identity"},
		{"provisioned certificate", node(func(c *agent.Config) { withCA(c); c.CA.ProvCert = "/prov" }), "CA.ProvCert", "authenticated by a token"},
		{"the xDS proxy", node(func(c *agent.Config) { c.XDS.Proxy = true }), "XDS.Proxy", "as the node agent's own identity"},
		{"a binary without attestation (meshid-agent)", node(func(c *agent.Config) { c.SDS.Attest = nil }), "SDS.WorkloadAttestation", "node mode is in meshid"},
	})
}
