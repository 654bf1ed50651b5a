package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/spf13/cobra"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/cmd/internal/cli"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/istio"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// The files of a VM bundle, as deploy/vm/meshid-agent.service reads them from the install dir.
const (
	vmTokenFile = "istio-token"
	vmRootFile  = "root-cert.pem"
	vmEnvFile   = "agent.env"
)

// vmBundle is what one VM needs to obtain its identity from a CA.
type vmBundle struct {
	out, installDir, rootCert string
	caAddress, trustDomain    string
	outputCerts               string
	token                     token.MintParams
}

func newVMCommand(g *cli.Globals) *cobra.Command {
	vm := &cobra.Command{
		Use:   "vm",
		Short: "Prepare a VM to run the agent",
		Args:  cobra.NoArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
	}
	vm.AddCommand(newVMBootstrapCommand(g))
	return vm
}

func newVMBootstrapCommand(g *cli.Globals) *cobra.Command {
	var (
		keyPath  string
		stateDir = controlplane.DefaultStateDir
		b        = vmBundle{
			installDir:  "/etc/meshid",
			trustDomain: istio.DefaultTrustDomain,
			outputCerts: "/var/lib/meshid/certs",
			token: token.MintParams{
				Issuer:    token.DefaultIssuer,
				Audiences: []string{token.DefaultAudience},
				TTL:       24 * time.Hour,
			},
		}
	)
	cmd := &cobra.Command{
		Use:   "bootstrap",
		Short: "Write the token, CA root and agent environment one VM needs (see deploy/vm)",
		Long: `Write, into --out, what a VM needs to obtain spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>
from the CA at --ca-addr:
  istio-token    a service-account token for that identity (mode 0600), signed as "meshid token" signs
  root-cert.pem  the CA's trust bundle, which verifies the CA
  agent.env      the agent's environment (CA_ADDR, CA_ROOT_CA, POD_NAMESPACE, SERVICE_ACCOUNT,
                 TRUST_DOMAIN, OUTPUT_CERTS), with paths under --install-dir
Copy the directory to the VM's --install-dir and start deploy/vm/meshid-agent.service. The token
is needed once: the agent then renews over mTLS with the certificate it holds, and after a reboot
with the one it wrote to OUTPUT_CERTS, as long as that one has not expired.`,
		Example: `  meshid vm bootstrap --state-dir /var/lib/meshid/ca --namespace vm --service-account billing \
    --ca-addr ca.example.com:15012 --out ./billing-vm`,
		Args: cobra.NoArgs,
		PreRunE: func(*cobra.Command, []string) error {
			var errs []error
			for flag, v := range map[string]string{"--namespace": b.token.Namespace, "--service-account": b.token.ServiceAccount, "--ca-addr": b.caAddress, "--out": b.out} {
				if v == "" {
					errs = append(errs, fmt.Errorf("%s is required", flag))
				}
			}
			if b.caAddress != "" {
				if _, _, err := net.SplitHostPort(b.caAddress); err != nil {
					errs = append(errs, fmt.Errorf("--ca-addr %q: want HOST:PORT as the VM reaches the CA: %w", b.caAddress, err))
				}
			}
			if b.token.TTL <= 0 {
				errs = append(errs, fmt.Errorf("--ttl %s must be positive", b.token.TTL))
			}
			for flag, p := range map[string]string{"--install-dir": b.installDir, "--output-certs": b.outputCerts} {
				if !filepath.IsAbs(p) {
					errs = append(errs, fmt.Errorf("%s %q must be an absolute path on the VM", flag, p))
				}
			}
			// Every value below goes into agent.env or names a file: a newline would add a line of
			// its own to agent.env (CA_ADDR=, say), a NUL would cut a path short.
			for _, v := range []struct{ flag, value string }{
				{"--namespace", b.token.Namespace}, {"--service-account", b.token.ServiceAccount},
				{"--ca-addr", b.caAddress}, {"--trust-domain", b.trustDomain},
				{"--install-dir", b.installDir}, {"--output-certs", b.outputCerts}, {"--out", b.out},
				{"--state-dir", stateDir}, {"--key", keyPath}, {"--root-cert", b.rootCert},
			} {
				if i := strings.IndexFunc(v.value, isControl); i >= 0 {
					r, _ := utf8.DecodeRuneInString(v.value[i:])
					errs = append(errs, fmt.Errorf("%s %q holds a control character (%U at byte %d): give the value without it", v.flag, v.value, r, i))
				}
			}
			if strings.ContainsAny(b.token.Namespace+b.token.ServiceAccount+b.caAddress+b.trustDomain, "\n\"'$` ") {
				errs = append(errs, errors.New("--namespace, --service-account, --ca-addr and --trust-domain must not hold spaces, quotes or $"))
			}
			return errors.Join(errs...)
		},
		RunE: func(*cobra.Command, []string) error {
			if b.rootCert == "" {
				// The trust bundle is the state dir's: read only from one of ours.
				if err := ca.CheckStateDir(stateDir); err != nil {
					return cli.RefusedAsCalled(fmt.Errorf("--state-dir: %w", err))
				}
				b.rootCert = ca.RootCertPath(stateDir)
			}
			minter, err := loadMinter(keyPath, stateDir)
			if err != nil {
				return cli.RefusedAsCalled(err)
			}
			if err := b.write(minter, time.Now()); err != nil {
				return cli.RefusedAsCalled(err)
			}
			g.Logger().Info("VM bundle written", logkey.Path, b.out, logkey.Namespace, b.token.Namespace,
				logkey.ServiceAccount, b.token.ServiceAccount, logkey.Expires, b.token.Now.Add(b.token.TTL).UTC().Format(time.RFC3339))
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&b.out, "out", "", "directory to write the bundle to (created with mode 0700; required)")
	f.StringVar(&b.token.Namespace, "namespace", "", "namespace of the VM's identity (required)")
	f.StringVar(&b.token.ServiceAccount, "service-account", "", "service account of the VM's identity (required)")
	f.StringVar(&b.caAddress, "ca-addr", "", "address of the CA as the VM reaches it, HOST:PORT (required)")
	f.StringVar(&b.trustDomain, "trust-domain", b.trustDomain, "trust domain of the CA")
	f.StringVar(&stateDir, "state-dir", stateDir, `state directory of "meshid ca": its token-key.pem signs the token, its root-cert.pem is the trust bundle`)
	f.StringVar(&keyPath, "key", "", "PEM private key to sign the token with; default: <state-dir>/token-key.pem")
	f.StringVar(&b.rootCert, "root-cert", "", "PEM trust bundle that verifies the CA; default: <state-dir>/root-cert.pem")
	f.DurationVar(&b.token.TTL, "ttl", b.token.TTL, "lifetime of the token: the time to install the VM and start the agent once")
	f.StringVar(&b.installDir, "install-dir", b.installDir, "where the bundle will live on the VM (the paths in agent.env)")
	f.StringVar(&b.outputCerts, "output-certs", b.outputCerts, "OUTPUT_CERTS on the VM: where the agent keeps its key pair across restarts")
	return cmd
}

// isControl reports a control character (newline, carriage return, NUL, DEL, C1, ...) or a
// Unicode line or paragraph separator: nothing a value of agent.env or a file name needs.
func isControl(r rune) bool {
	return unicode.IsControl(r) || unicode.In(r, unicode.Zl, unicode.Zp)
}

// write mints the token and writes the bundle; an existing bundle's files are replaced.
func (b *vmBundle) write(minter *token.Minter, now time.Time) error {
	roots, err := os.ReadFile(b.rootCert)
	if err != nil {
		return fmt.Errorf("the CA's trust bundle: %w", err)
	}
	if _, err := pki.ParseCertificates(roots); err != nil {
		return fmt.Errorf("the CA's trust bundle %s: %w", b.rootCert, err)
	}
	b.token.Now = now
	jwt, err := minter.Mint(b.token)
	if err != nil {
		return err
	}
	// The agent takes its token and its CA root from here: write only into a directory of ours.
	if err := fsutil.EnsureOwnedDir(b.out, fsutil.PrivateDirMode); err != nil {
		return fmt.Errorf("--out: %w", err)
	}
	env := fmt.Sprintf(`# meshid-agent on a VM: spiffe://%s/ns/%s/sa/%s, written by "meshid vm bootstrap".
CA_ADDR=%s
CA_ROOT_CA=%s
POD_NAMESPACE=%s
SERVICE_ACCOUNT=%s
TRUST_DOMAIN=%s
OUTPUT_CERTS=%s
`, b.trustDomain, b.token.Namespace, b.token.ServiceAccount, b.caAddress, filepath.Join(b.installDir, vmRootFile),
		b.token.Namespace, b.token.ServiceAccount, b.trustDomain, b.outputCerts)
	if err := fsutil.WritePrivateFile(filepath.Join(b.out, vmTokenFile), []byte(jwt)); err != nil {
		return err
	}
	if err := fsutil.WriteFileAtomic(filepath.Join(b.out, vmRootFile), roots, 0o644); err != nil {
		return err
	}
	return fsutil.WriteFileAtomic(filepath.Join(b.out, vmEnvFile), []byte(env), 0o644)
}
