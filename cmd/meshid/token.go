package main

import (
	"errors"
	"fmt"
	"io/fs"
	"time"

	"github.com/spf13/cobra"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/cmd/internal/cli"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/logkey"
)

func newTokenCommand(g *cli.Globals) *cobra.Command {
	var (
		keyPath  string
		stateDir = controlplane.DefaultStateDir
		params   = token.MintParams{
			Issuer:    token.DefaultIssuer,
			Audiences: []string{token.DefaultAudience},
			TTL:       token.DefaultTTL,
		}
		output string
	)
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
			if params.Namespace == "" || params.ServiceAccount == "" {
				return errors.New("--namespace and --service-account are required")
			}
			if params.TTL <= 0 {
				return fmt.Errorf("--ttl %s must be positive", params.TTL)
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			minter, err := loadMinter(keyPath, stateDir)
			if err != nil {
				return cli.RefusedAsCalled(err)
			}
			params.Now = time.Now()
			jwt, err := minter.Mint(params)
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
			g.Logger().Info("token written", logkey.Path, output, logkey.Namespace, params.Namespace, logkey.ServiceAccount, params.ServiceAccount,
				logkey.Expires, params.Now.Add(params.TTL).UTC().Format(time.RFC3339))
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&keyPath, "key", "", "PEM private key to sign with (ECDSA P-256/P-384 or RSA); default: <state-dir>/token-key.pem")
	f.StringVar(&stateDir, "state-dir", stateDir, "state directory of \"meshid ca\", whose token-key.pem signs the token")
	f.StringVar(&params.Namespace, "namespace", "", "namespace of the service account (required)")
	f.StringVar(&params.ServiceAccount, "service-account", "", "name of the service account (required)")
	f.StringVar(&params.ServiceAccountUID, "uid", "", "UID of the service account (default: random)")
	f.StringSliceVar(&params.Audiences, "audience", params.Audiences, "audiences of the token, comma-separated")
	f.StringVar(&params.Issuer, "issuer", params.Issuer, "issuer (iss) of the token")
	f.DurationVar(&params.TTL, "ttl", params.TTL, "lifetime of the token")
	f.StringVarP(&output, "output", "o", "", "write the token to this file (mode 0600) instead of stdout")
	return cmd
}

// loadMinter loads the key of --key, or else the local token key of the CA whose state dir is
// --state-dir, which a first start of `meshid ca` creates: only when the state dir and the key
// are ours alone, as the CA trusts them (fsutil.ErrNotOwned otherwise).
func loadMinter(keyPath, stateDir string) (*token.Minter, error) {
	if keyPath != "" {
		return token.LoadMinter(keyPath)
	}
	if stateDir == "" {
		return nil, errors.New("give --key or --state-dir")
	}
	if err := ca.CheckStateDir(stateDir); err != nil {
		return nil, fmt.Errorf("--state-dir: %w", err)
	}
	minter, err := token.LoadMinter(ca.TokenKeyPath(stateDir))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w (start `meshid ca --state-dir %s` once to create it, or pass --key)", err, stateDir)
	}
	return minter, err
}
