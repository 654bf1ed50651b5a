package cli

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/meshid/meshid/internal/version"
)

// NewVersionCommand returns `version`.
func NewVersionCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the build version",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			_, err := fmt.Fprintln(cmd.OutOrStdout(), version.String())
			return err
		},
	}
}
