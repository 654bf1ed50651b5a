package cli

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/fsutil"
)

// bootstrapUse is the bootstrap command's name.
const bootstrapUse = "bootstrap"

// NewBootstrapCommand returns `bootstrap`, which writes the bootstrap of the Envoy that the agent
// run with the same flags and variables serves. lookupEnv reads one variable and environ lists
// them all (os.LookupEnv and os.Environ in production); embed is the agent command's; check
// checks the bootstrap with Envoy's types and merges the override, nil in a binary that leaves
// them out, which then refuses an override.
func NewBootstrapCommand(g *Globals, lookupEnv func(string) (string, bool), environ func() []string, embed agent.EmbedFunc, check agent.BootstrapCheckFunc) *cobra.Command {
	o := newAgentOptions(lookupEnv, environ, embed, check, nil)
	overrideHelp := `--bootstrap-override (ISTIO_BOOTSTRAP_OVERRIDE) names a bootstrap file, JSON or YAML, merged
over this one as Istio merges it: a value the file sets replaces the written one, a message is
merged field by field, and a list (clusters, listeners) is appended to. A field Envoy does not
know, a value of the wrong type or a merged bootstrap Envoy would refuse is an error naming the
field, and nothing is written. A typed_config in the file may name only the types this binary
links: those of envoy.config.{bootstrap,cluster,core,endpoint,listener,route,trace,metrics,
overload,accesslog}.v3, the HTTP connection manager, the router, the upstream HTTP protocol
options, the TLS transport sockets, and those of its discovery server (RBAC, TCP proxy, TLS
inspector, file and stream access loggers); any other is refused as unknown.`
	checked := "It is checked with Envoy's own types and\nvalidation rules before anything is written."
	if check == nil {
		overrideHelp = `--bootstrap-override (ISTIO_BOOTSTRAP_OVERRIDE) is refused: this binary leaves Envoy's
configuration types out to stay small, so it can neither merge nor check an override. "meshid
agent bootstrap" writes the bootstrap with the override merged; an agent run with --envoy-path
gives the override to Envoy, which merges it (--config-yaml).`
		checked = "It is written as protojson writes Envoy's\nBootstrap; Envoy checks it when it starts."
	}
	var output string
	cmd := &cobra.Command{
		Use:   bootstrapUse,
		Short: "Write the bootstrap of the Envoy the agent serves (JSON), for envoy -c",
		Long: `Write Envoy's bootstrap, as JSON, for the agent that the same flags and variables describe:
"bootstrap --root-dir ./run" is the bootstrap of the Envoy next to "agent --root-dir ./run".
It takes all the agent's flags and Istio's variables. ` + checked + ` It holds:
  - the node, as Istio's agent derives it: the id
    sidecar~<INSTANCE_IP>~<POD_NAME>.<POD_NAMESPACE>~<POD_NAMESPACE>.svc.cluster.local
    (--instance-ip, 127.0.0.1 when empty; --pod-name, the host's name when empty), the cluster
    <SERVICE_ACCOUNT>.<POD_NAMESPACE> (the identity of the workload's certificate), and the
    metadata NAMESPACE, NAME and POD_NAME, INSTANCE_IPS, SERVICE_ACCOUNT, CLUSTER_ID, and KEY
    for every ISTIO_META_KEY variable;
  - the cluster sds-grpc on the agent's SDS socket (<workload-socket-dir>/socket), which the
    xDS server's configuration names for certificates;
  - with the xDS proxy (--proxy-xds-via-agent, the default), ADS on the agent's --xds-socket
    (cluster xds-grpc) for listeners and clusters; without it, no dynamic resources;
  - the admin on 127.0.0.1:--envoy-admin-port, and, unless --envoy-prometheus-port is 0, a
    listener on 0.0.0.0:--envoy-prometheus-port that serves the admin's /stats/prometheus, as
    Istio's 15090.

` + overrideHelp + `

The bootstrap goes to stdout, or with -o to FILE, replaced atomically (mode 0644) in a
directory that must exist. A refusal exits 2.

Istio's variables are honoured as by the agent; a flag wins over its variable:
` + envHelp(agentEnv()) + fmt.Sprintf("  %-34s %s", "ISTIO_META_<KEY>", "node metadata <KEY>, with the variable's value"),
		Args: cobra.NoArgs,
		PreRunE: func(cmd *cobra.Command, _ []string) error {
			errs := o.resolve(cmd, g.Logger())
			if err := refuseUnmergedOverride(cmd, o); err != nil {
				errs = append(errs, err)
			}
			if output != "" {
				if err := checkOutputFile(output); err != nil {
					errs = append(errs, err)
				}
			}
			return o.validate(errs)
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			eb, err := agent.Bootstrap(cmd.Context(), o.cfg)
			if err != nil {
				return RefusedAsCalled(RenderConfigErrors(err, agentFields()))
			}
			data := eb.Bootstrap
			if output == "" {
				_, err := cmd.OutOrStdout().Write(data)
				return err
			}
			return fsutil.WriteFileAtomic(output, data, fsutil.PublicFileMode)
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "", "write the bootstrap to this file, replaced atomically, instead of stdout; its directory must exist")
	o.bind(cmd.Flags())
	return cmd
}

// refuseUnmergedOverride refuses an override in a binary that cannot merge it (o has no
// CheckBootstrap): a bootstrap written without it would not be the one asked for.
func refuseUnmergedOverride(cmd *cobra.Command, o *agentOptions) error {
	path := o.cfg.Envoy.BootstrapOverride
	if path == "" || o.cfg.Envoy.CheckBootstrap != nil {
		return nil
	}
	return fmt.Errorf("--bootstrap-override (ISTIO_BOOTSTRAP_OVERRIDE) %s: %s leaves Envoy's configuration types out to stay small, "+
		"so it cannot merge the override into the bootstrap; use `meshid agent bootstrap`, or run the agent with --envoy-path, "+
		"which gives the override to Envoy to merge (--config-yaml)", path, cmd.Root().Name())
}

// checkOutputFile refuses an -o that cannot be written: its directory is missing, or it is a
// directory.
func checkOutputFile(path string) error {
	dir := filepath.Dir(path)
	if err := fsutil.CheckDir(dir, "create it first"); err != nil {
		return fmt.Errorf("-o %s: the directory %s %w", path, dir, err)
	}
	if fsutil.IsDir(path) {
		return errors.New("-o " + path + ": is a directory")
	}
	return nil
}
