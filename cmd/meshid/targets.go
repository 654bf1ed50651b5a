package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/meshid/meshid/cmd/internal/cli"
	"github.com/meshid/meshid/controlplane"
)

// newCATargetsCommand returns `ca targets`: which namespaces a CA instance with these flags serves.
func newCATargetsCommand(g *cli.Globals) *cobra.Command {
	cfg := controlplane.TargetsConfig{CANamespace: controlplane.DefaultCANamespace, EnableNamespacesByDefault: true}
	var output string
	cmd := &cobra.Command{
		Use:   "targets",
		Short: "Show which namespaces a CA instance serves, and the rule behind each",
		Long: `Targets reads the namespaces of --manifests as "meshid ca" does, and shows for each its
ca.istio.io/override and ca.istio.io/env labels, whether a CA instance with this --ca-namespace
and --enable-namespaces-by-default serves it, and the row of the targeting truth table that
decides (Istio's Citadel namespace targeting):

  1. ca.istio.io/override=true: every CA instance serves the namespace; =false: none does.
     Any other value counts as unset, and is warned about.
  2. Else ca.istio.io/env names the namespace of the one CA instance that serves it.
  3. Else --enable-namespaces-by-default decides.

The last line is the decision for every namespace the manifests do not name. Malformed
manifests are reported on stderr and skipped.`,
		Example: `  meshid ca targets --manifests ./manifests
  meshid ca targets --manifests ./manifests --ca-namespace istio-canary -o json`,
		Args: cobra.NoArgs,
		PreRunE: func(*cobra.Command, []string) error {
			if output != "table" && output != "json" {
				return fmt.Errorf("-o %q: want table or json", output)
			}
			cfg.Logger = g.Logger()
			return cli.RenderConfigErrors(cfg.Validate(), targetsFields())
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			report, err := controlplane.Targets(cmd.Context(), cfg)
			if err != nil {
				return refusedAsCalled(cli.RenderConfigErrors(err, targetsFields()))
			}
			if output == "json" {
				return writeTargetsJSON(cmd.OutOrStdout(), report)
			}
			return writeTargetsTable(cmd.OutOrStdout(), report)
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Manifests, "manifests", "", "directory of Namespace and ServiceAccount manifests, as for \"meshid ca --manifests\"; empty: no namespace is known")
	f.StringVar(&cfg.CANamespace, "ca-namespace", cfg.CANamespace, "namespace of the CA instance, matched against the ca.istio.io/env namespace label")
	f.BoolVar(&cfg.EnableNamespacesByDefault, "enable-namespaces-by-default", cfg.EnableNamespacesByDefault, "whether the CA instance serves namespaces that carry neither label")
	f.StringVarP(&output, "output", "o", "table", "table or json")
	return cmd
}

// targetsFields names the fields of controlplane.TargetsConfig as a user of `ca targets` sets them.
func targetsFields() cli.FieldNames {
	return cli.FieldNames{Flags: map[string]string{
		"Manifests":                 "manifests",
		"CANamespace":               "ca-namespace",
		"EnableNamespacesByDefault": "enable-namespaces-by-default",
	}}
}

// targetsJSON is the shape of `ca targets -o json`.
type targetsJSON struct {
	CANamespace               string          `json:"ca_namespace"`
	EnableNamespacesByDefault bool            `json:"enable_namespaces_by_default"`
	Namespaces                []namespaceJSON `json:"namespaces"`
	OtherNamespaces           decisionJSON    `json:"other_namespaces"`
}

type namespaceJSON struct {
	Name   string            `json:"name"`
	Labels map[string]string `json:"labels"` // the targeting labels that are set
	decisionJSON
}

type decisionJSON struct {
	Served   bool   `json:"served"`
	Row      int    `json:"row"`
	Override string `json:"override"`
	EnvMatch string `json:"env_match"`
	Rule     string `json:"rule"`
}

func writeTargetsJSON(w io.Writer, r controlplane.TargetsReport) error {
	out := targetsJSON{
		CANamespace:               r.CANamespace,
		EnableNamespacesByDefault: r.EnableNamespacesByDefault,
		Namespaces:                []namespaceJSON{},
		OtherNamespaces:           decisionJSON{Served: r.Others.Served, Row: r.Others.Row, Override: r.Others.Override, EnvMatch: r.Others.EnvMatch, Rule: r.Others.Rule},
	}
	for _, d := range r.Namespaces {
		out.Namespaces = append(out.Namespaces, namespaceJSON{Name: d.Namespace, Labels: d.Labels,
			decisionJSON: decisionJSON{Served: d.Served, Row: d.Row, Override: d.Override, EnvMatch: d.EnvMatch, Rule: d.Rule}})
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}

func writeTargetsTable(w io.Writer, r controlplane.TargetsReport) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	_, _ = fmt.Fprintf(tw, "NAMESPACE\tca.istio.io/override\tca.istio.io/env\tSERVED\tROW\tRULE\n")
	label := func(labels map[string]string, key string) string {
		if v, ok := labels[key]; ok {
			return strconv.Quote(v)
		}
		return "-"
	}
	served := map[bool]string{true: "yes", false: "no"}
	for _, d := range r.Namespaces {
		_, _ = fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\n", d.Namespace, label(d.Labels, "ca.istio.io/override"), label(d.Labels, "ca.istio.io/env"),
			served[d.Served], d.Row, d.Rule)
	}
	_, _ = fmt.Fprintf(tw, "(any other)\t-\t-\t%s\t%d\t%s\n", served[r.Others.Served], r.Others.Row, r.Others.Rule)
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "CA instance: --ca-namespace=%s --enable-namespaces-by-default=%t\n", r.CANamespace, r.EnableNamespacesByDefault)
	return err
}
