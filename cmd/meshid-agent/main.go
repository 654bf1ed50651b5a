// Command meshid-agent is the slim sidecar binary: the agent, Envoy's bootstrap, certs, probe and
// version, without the CA and without any Kubernetes client.
package main

import (
	"os"

	"github.com/spf13/cobra"

	"github.com/meshid/meshid/cmd/internal/cli"
)

func main() {
	os.Exit(cli.Main(newRootCommand(cli.RunAgent, os.LookupEnv, os.Environ)))
}

// newRootCommand returns meshid-agent's commands; lookupEnv reads one variable and environ lists
// them all (os.LookupEnv and os.Environ; nil environ: none).
func newRootCommand(run cli.AgentRunner, lookupEnv func(string) (string, bool), environ func() []string) *cobra.Command {
	g := &cli.Globals{}
	root := cli.NewRoot("meshid-agent", "The meshid workload agent",
		`meshid-agent runs next to a workload and keeps its short-lived X.509 identity fresh.
It is the agent of meshid for sidecar images: it links no CA and no Kubernetes client, so
it needs a CA at --ca-addr ("meshid agent" can run one in-process).`, g)
	root.AddCommand(
		// No embedded CA, and no Envoy types to merge a bootstrap override with.
		cli.NewAgentCommand(g, run, lookupEnv, nil, nil, nil),
		cli.NewBootstrapCommand(g, lookupEnv, environ, nil, nil),
		cli.NewCertsCommand(),
		cli.NewProbeCommand(),
		cli.NewWaitCommand(),
		cli.NewVersionCommand(),
	)
	return root
}
