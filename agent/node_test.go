package agent_test

import (
	"testing"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/agent/nodemode"
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
			c.SDS.Node = nodemode.New(newAttestor)
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
		{"a binary without attestation (meshid-agent)", node(func(c *agent.Config) { c.SDS.Node = nil }), "SDS.WorkloadAttestation", "node mode is in meshid"},
	})
	pods := func(edit func(*agent.AttestPods)) func(*agent.Config) {
		return func(c *agent.Config) {
			c.SDS.AttestPods = agent.AttestPods{Enabled: true, NodeName: "n1", InCluster: true}
			c.SDS.Node = nodemode.New(newAttestor)
			edit(&c.SDS.AttestPods)
		}
	}
	wantRefused(t, []refusal{
		{"pods without a node", pods(func(p *agent.AttestPods) { p.NodeName = "" }), "SDS.AttestPods.NodeName", "is required"},
		{"pods without an API", pods(func(p *agent.AttestPods) { p.InCluster = false }), "SDS.AttestPods.Enabled", "give SDS.AttestPods.Kubeconfig or"},
		{"pods with two APIs", pods(func(p *agent.AttestPods) { p.Kubeconfig = "/kc" }), "SDS.AttestPods.Kubeconfig", "give one"},
		{"a kubeconfig without pods", func(c *agent.Config) { c.SDS.AttestPods.Kubeconfig = "/kc" }, "SDS.AttestPods.Kubeconfig", "which is not set"},
		{"in-cluster without pods", func(c *agent.Config) { c.SDS.AttestPods.InCluster = true }, "SDS.AttestPods.InCluster", "which is not set"},
		{"pods in a binary without attestation (meshid-agent)", func(c *agent.Config) {
			pods(func(*agent.AttestPods) {})(c)
			c.SDS.Node = nil
		}, "SDS.AttestPods.Enabled", "links no Kubernetes client"},
		{"pods only, output certs", func(c *agent.Config) {
			pods(func(*agent.AttestPods) {})(c)
			c.Output.Dir = "/out"
		}, "Output.Dir", "SDS.AttestPods.Enabled serves each caller its own identity, so there is no one key pair"},
	})
}
