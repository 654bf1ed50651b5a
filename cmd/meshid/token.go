package main

import (
	"errors"
	"fmt"
	"time"

	"github.com/meshid/meshid/internal/logkey"

	"github.com/spf13/cobra"

	"github.com/meshid/meshid/cmd/internal/cli"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/fsutil"
)

func newTokenCommand(g *cli.Globals) *cobra.Command {
	var (
		req    = controlplane.TokenRequest{StateDir: controlplane.DefaultStateDir}
		output string
	)
	req.Issuer = controlplane.DefaultTokenIssuer
	req.Audiences = []string{controlplane.DefaultTokenAudience}
	req.TTL = controlplane.DefaultTokenTTL
	cmd := &cobra.Command{
		Use:   "token",
		Short: "Mint a Kubernetes-style service-account token (for VMs, demos and tests)",
		Long: `Mint a bound service-account JWT with the claims a kube-apiserver TokenRequest gives
(iss, sub: system:serviceaccount:NS:SA, aud, exp, iat, nbf, jti and the kubernetes.io block),
signed with --key or, by default, with <state-dir>/token-key.pem, the key "meshid ca" creates
and trusts. Give it to an agent with --token-path; the CA maps it to
spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>.`,
		Example: `  meshid token --state-dir ./ca-state --namespace default --service-account demo -o ./istio-token`,
		Args:    cobra.NoArgs,
		PreRunE: func(*cobra.Command, []string) error {
			if req.Namespace == "" || req.ServiceAccount == "" {
				return errors.New("--namespace and --service-account are required")
			}
			if req.TTL <= 0 {
				return fmt.Errorf("--ttl %s must be positive", req.TTL)
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			req.Now = time.Now()
			jwt, err := controlplane.MintToken(req)
			if err != nil {
				return err
			}
			if output == "" || output == "-" {
				_, err := fmt.Fprintln(cmd.OutOrStdout(), jwt)
				return err
			}
			if err := fsutil.WritePrivateFile(output, []byte(jwt)); err != nil {
				return err
			}
			g.Logger().Info("token written", logkey.Path, output, logkey.Namespace, req.Namespace, logkey.ServiceAccount, req.ServiceAccount,
				logkey.Expires, req.Now.Add(req.TTL).UTC().Format(time.RFC3339))
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&req.KeyPath, "key", "", "PEM private key to sign with (ECDSA P-256/P-384 or RSA); default: <state-dir>/token-key.pem")
	f.StringVar(&req.StateDir, "state-dir", req.StateDir, "state directory of \"meshid ca\", whose token-key.pem signs the token")
	f.StringVar(&req.Namespace, "namespace", "", "namespace of the service account (required)")
	f.StringVar(&req.ServiceAccount, "service-account", "", "name of the service account (required)")
	f.StringVar(&req.ServiceAccountUID, "uid", "", "UID of the service account (default: random)")
	f.StringSliceVar(&req.Audiences, "audience", req.Audiences, "audiences of the token, comma-separated")
	f.StringVar(&req.Issuer, "issuer", req.Issuer, "issuer (iss) of the token")
	f.DurationVar(&req.TTL, "ttl", req.TTL, "lifetime of the token")
	f.StringVarP(&output, "output", "o", "", "write the token to this file (mode 0600) instead of stdout")
	return cmd
}
