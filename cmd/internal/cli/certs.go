package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/meshid/meshid/sds/sdsclient"
)

// NewCertsCommand returns `certs`: show what the SDS server on a socket hands Envoy.
func NewCertsCommand() *cobra.Command {
	var socket, output string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "certs",
		Short: "Show the certificate an SDS server hands Envoy, and check its chain",
		Long: `Certs asks the SDS server on --socket for "default" and "ROOTCA" and shows the workload's
SPIFFE ID, serial, validity and time left, and whether the chain verifies against the trust
bundle. It exits 1 when it does not, when nothing answers, or when the agent holds no valid
certificate (it then says why, at once).`,
		Example: `  meshid certs --socket ./run/var/run/secrets/workload-spiffe-uds/socket`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "text" && output != "json" {
				return fmt.Errorf("-o %q: want text or json", output)
			}
			path, err := filepath.Abs(socket)
			if err != nil {
				return err
			}
			ctx, cancel := contextWithTimeout(cmd, timeout)
			defer cancel()
			report, err := sdsclient.Inspect(ctx, path, time.Now())
			if err != nil {
				return err
			}
			if output == "json" {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				if err := enc.Encode(report); err != nil {
					return err
				}
			} else {
				printReport(cmd.OutOrStdout(), report)
			}
			if !report.Verified {
				return errors.New("the certificate chain does not verify against ROOTCA: " + report.VerifyError)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&socket, "socket", "/var/run/secrets/workload-spiffe-uds/socket", "the SDS socket")
	cmd.Flags().StringVarP(&output, "output", "o", "text", "text or json")
	cmd.Flags().DurationVar(&timeout, "timeout", 10*time.Second, "give up after this long")
	return cmd
}

func printReport(w io.Writer, r *sdsclient.CertReport) {
	verified := "yes"
	if !r.Verified {
		verified = "NO: " + r.VerifyError
	}
	_, _ = fmt.Fprintf(w, `SPIFFE ID:   %s
Serial:      %s
Issuer:      %s
Valid:       %s to %s
Time left:   %s
Chain:       %d certificates, verifies against ROOTCA: %s
Roots:       %s
`, r.SPIFFEID, r.Serial, r.Issuer, r.NotBefore.UTC().Format(time.RFC3339), r.NotAfter.UTC().Format(time.RFC3339),
		r.TimeLeft, r.ChainLen, verified, strings.Join(r.Roots, "; "))
}
