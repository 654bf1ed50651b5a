// Command meshid gives every workload in a service mesh a short-lived X.509 identity: `meshid ca`
// runs the CA, `meshid token` mints service-account tokens for VMs and demos.
package main

import (
	"os"

	"github.com/spf13/cobra"

	"github.com/meshid/meshid/agent/envoy/bootstrapcheck"
	"github.com/meshid/meshid/agent/nodemode"
	"github.com/meshid/meshid/cmd/internal/cli"
)

func main() {
	os.Exit(cli.Main(newRootCommand(runCA, cli.RunAgent, os.LookupEnv, os.Environ)))
}

// newRootCommand returns meshid's commands; lookupEnv reads one variable and environ lists them
// all (os.LookupEnv and os.Environ; nil environ: none).
func newRootCommand(ca caRunner, agentRun cli.AgentRunner, lookupEnv func(string) (string, bool), environ func() []string) *cobra.Command {
	g := &cli.Globals{}
	root := cli.NewRoot("meshid", "Short-lived workload identities for a service mesh",
		`meshid gives every workload in a service mesh a short-lived X.509 identity (a SPIFFE ID)
and keeps it fresh. "meshid agent" runs next to a workload and keeps its certificate fresh ("meshid agent
bootstrap" writes the bootstrap of the Envoy it serves);
"meshid ca" runs a Citadel-style CA that Istio's agents can use;
"meshid token" mints Kubernetes-style service-account tokens for VMs and demos, and
"meshid vm bootstrap" writes everything one VM needs.`, g)
	agentCmd := cli.NewAgentCommand(g, agentRun, lookupEnv, embedControlPlane, bootstrapcheck.Merge, nodemode.New(newAttestor))
	agentCmd.AddCommand(cli.NewBootstrapCommand(g, lookupEnv, environ, embedControlPlane, bootstrapcheck.Merge))
	root.AddCommand(
		agentCmd,
		newCACommand(g, ca, lookupEnv),
		newTokenCommand(g),
		newVMCommand(g),
		cli.NewCertsCommand(),
		cli.NewProbeCommand(),
		cli.NewWaitCommand(),
		cli.NewVersionCommand(),
	)
	return root
}
