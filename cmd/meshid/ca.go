package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"

	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/cmd/internal/cli"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// caRunner runs the CA with a validated config; tests replace it to capture the config.
type caRunner func(ctx context.Context, cfg controlplane.Config) error

func runCA(ctx context.Context, cfg controlplane.Config) error {
	if cfg.Kubernetes.Enabled() {
		routeClientGoLogs(cfg.Logger)
	}
	cp, err := controlplane.New(ctx, cfg)
	if err != nil {
		return err
	}
	return cp.Run(ctx)
}

// routeClientGoLogs sends client-go's logs, which go through klog, to logger: one stream, one
// format. klog's logger is the process's, set without a lock that its readers take, so only the
// runners of the real commands set it, before any client exists; never a command's parsing.
func routeClientGoLogs(logger *slog.Logger) {
	klog.SetSlogLogger(logger.With(logkey.Component, "client-go"))
}

// secretFlags are the secret controller's flags: they need a store of service accounts to run on,
// --manifests or the Kubernetes API.
func secretFlags() []string {
	return []string{"listened-namespace", "workload-cert-grace-period-ratio", "workload-cert-min-grace-period",
		"append-dns-names", "custom-dns-names", "liveness-probe-path", "liveness-probe-interval"}
}

func newCACommand(g *cli.Globals, run caRunner, lookupEnv func(string) (string, bool)) *cobra.Command {
	cfg := controlplane.DefaultConfig()
	var keyAlgorithm, jwtRule string
	cmd := &cobra.Command{
		Use:   "ca",
		Short: "Run the Citadel-style certificate authority",
		Long: `Run a Citadel-style CA serving Istio's CA protocol
(istio.v1.auth.IstioCertificateService/CreateCertificate) over TLS on --grpc-addr, and beside it
the Mesh CA protocol of agents with CA_PROVIDER=GoogleCA
(google.security.meshca.v1.MeshCertificateService/CreateCertificate), through the same
authentication, targeting and signing; its validity is clamped as validity_duration is.

Key material, in this order:
  1. a plugged-in CA in --cacerts-dir: ca-cert.pem, ca-key.pem, cert-chain.pem, root-cert.pem
     (or tls.crt, tls.key, ca.crt);
  2. else the self-signed CA persisted in --state-dir (ca-cert.pem, ca-key.pem);
  3. else a new self-signed root, persisted there.
The trust bundle clients need (CA_ROOT_CA) is written to <state-dir>/root-cert.pem.

The CA runs for years while its keys change under it: --cacerts-dir is watched (plain rewrites
and Kubernetes ..data swaps), and a complete, valid new bundle replaces the old one with no
restart; anything else is logged and ignored. A self-signed root is renewed from the same key
when less than --root-rotation-threshold of its life is left. A replaced root stays in the trust
bundle (root-cert.pem, and for client certificates) until it expires or --trust-bundle-overlap.

Callers authenticate with a service-account JWT ("authorization: Bearer ...", verified with
--jwt-keys or the state dir's token-key.pem, which "meshid token" signs with) or with a client
certificate this CA issued; a token of an external OIDC issuer named by --jwt-rule (JWT_RULE) is
checked with the keys its JWKS URL serves instead. Each gets a certificate for its own identity only:
spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>.

A node agent (Istio's ztunnel, or meshid's) asks for the certificate of a workload of its node:
the request's metadata names it, ImpersonatedIdentity: spiffe://<trust-domain>/ns/NS/sa/SA. It
is signed only when the caller's service account is in --trusted-node-accounts
(CA_TRUSTED_NODE_ACCOUNTS), authenticated by a token, for an identity of this trust domain
whose namespace this instance serves, never as a CA certificate. On Kubernetes, the CA also
watches every live pod (not Succeeded or Failed): the caller's token must be bound to its
own live pod, and the identity must have a live pod on that pod's node. Off Kubernetes there
are no pods: the trusted account alone decides. Istio's protocol only (the Mesh CA's has no metadata). Each
refusal is PermissionDenied (InvalidArgument for a malformed identity), logged with who asked
for whom, and counted by reason (impersonation_*).

Several CA instances can share a cluster: each serves the namespaces that Istio's Citadel
targeting rules give it (ca.istio.io/override, then ca.istio.io/env against --ca-namespace,
then --enable-namespaces-by-default), and refuses the others with PermissionDenied, saying
which labels and rule excluded the namespace. The labels come from the Namespace objects in
--manifests: Kubernetes YAML or JSON, several documents to a file, in the directory's *.yaml,
*.yml and *.json files (not its subdirectories). The directory is watched: edits take effect
without a restart, and a malformed file or object is reported and skipped, keeping what it
held before. A namespace no manifest names counts as unlabelled. "meshid ca targets" shows
the decision for every namespace.

With --manifests, the secret controller keeps, for every ServiceAccount of every namespace this
instance serves, a secret istio.<sa> in <state-dir>/secrets/<namespace>/istio.<sa>/:
cert-chain.pem, key.pem (0600) and root-cert.pem, for spiffe://<trust-domain>/ns/<ns>/sa/<sa>,
laid out as the kubelet mounts a secret (..data), so that "meshid agent --credentials-dir" can
use it. A secret is re-issued when less than max(--workload-cert-grace-period-ratio x lifetime,
--workload-cert-min-grace-period) is left, when the CA's roots change, and when it is found
deleted or altered (checked every minute); it is removed when its ServiceAccount goes or its
namespace stops being served. Directories it did not make are never touched, and a link in
the tree (a namespace or secret directory) is never followed: that secret is refused, logged
once and counted. A service-account name too long for a directory name (it may have 253
characters, a file name 255) gets istio.<its first 232 characters>_<the first 16 hex digits of
its SHA-256>, always the same, which the directory's .meshid-secret marker ties to the account.

On Kubernetes (--kubeconfig FILE, or --in-cluster in a pod), the API server replaces the files:
  - namespaces and service accounts come from informers, labels taking effect as they change;
  - the secrets are Secrets istio.<sa> of type istio.io/key-and-cert in each served namespace,
    kept by the one replica holding the Lease "meshid-ca" in --ca-namespace (every replica signs);
    a service account whose istio.<sa> would be longer than a Secret's name may be (253) is
    refused, logged once and counted, not retried;
  - the key material is the Secret cacerts in --ca-namespace: mounted files in --cacerts-dir
    first; else cacerts, created from istio-ca-secret when only that exists, or from a new
    self-signed root when neither does. A cacerts the CA generated carries the annotation
    meshid.io/generated and its root is rotated in place; one an operator writes is never
    rotated. Every replica watches cacerts: a rotation or a plug-in reaches all of them with no
    restart, the old root trusted for the overlap;
  - the roots are published as ConfigMap istio-ca-root-cert (root-cert.pem) in served namespaces;
  - tokens are checked with TokenReview (audience --jwt-audience), besides --jwt-keys when given.
The RBAC this needs is in deploy/kubernetes/rbac.yaml, and with --trusted-node-accounts
rbac-node-agents.yaml too.

The gRPC port also serves Envoy's aggregated discovery service (state of the world and delta),
as istiod does: from the --xds-config file, else an empty configuration, which Envoy ACKs and
runs with no listeners and no clusters (logged once at start). A client authenticates as for a
certificate, and its namespace must be one this instance serves (checked at the stream's open
and at each request); the namespace of its credential picks the configuration. Every Envoy type
go-control-plane knows is answered (empty where the file has none), and istio.io/debug/syncz and
config_dump on state-of-the-world streams; any other type ends the stream (InvalidArgument).

What a client can make the gRPC port hold is bounded:
  - messages of 4 MiB at most, each way (a file whose answer for one type would be larger is
    refused), headers of 64 KiB, 100 calls at once on one connection, pings every 5 s at most;
  - --xds-max-streams discovery streams at once, --xds-max-streams-per-credential with one token
    or client certificate (ResourceExhausted past either);
  - a node of 512 KiB; syncz answers of 1,000 nodes; four debug answers built at once;
  - --max-connection-age: a connection is told to go after it, and closed 10 s later.
Refusals are counted (meshid_discovery_refusals_total, meshid_ca_requests_refused_total) and
logged, each reason at most ten lines at once then one a second.

One root can serve several CAs, each with its own intermediate (Citadel's upstream CA):
  - the upstream runs with --sign-ca-certs --ca-cert-identities spiffe://TD/ns/NS/sa/SA,...
    A CSR whose extension request holds basicConstraints with cA TRUE asks for a CA
    certificate; it is signed (CA:true, path length 0, certSign and cRLSign, URI names
    constrained to the trust domain) for the caller's authenticated identity only, when that
    identity is listed, for at most --max-workload-cert-ttl and never past the upstream's own
    signing certificate, and only to a caller authenticated by a token (any CA under the root
    could mint a client certificate for a listed identity). Anyone else is refused
    (PermissionDenied), logged and counted.
    Workload requests are signed as always;
  - the downstream runs with --upstream-ca-address H:P --upstream-ca-root-cert FILE
    --upstream-token-path FILE. At start it reuses the key and chain in
    <state-dir>/upstream-ca.pem (0600) while they are valid and chain to the root file, else
    makes a new key (--key-algorithm) and asks the upstream for a CA certificate of
    --requested-ca-cert-ttl, checked (a CA certificate for its key, chained to the root file)
    before it is used or saved; the start fails if none can be had. It serves leaf,
    intermediate(s), root, and <state-dir>/root-cert.pem holds the upstream's roots. It renews
    its certificate when half of its lifetime (±1%) is left, signing with the current one until
    the new one checks out, and retries with backoff (1s to 5m) while the upstream is down,
    logging each failure as an error (meshid_ca_upstream_renewals_total{outcome}). The token is
    read at every request. The signing certificate's expiry is
    meshid_ca_signing_cert_expiry_timestamp_seconds{source="upstream"}.`,
		Args: cobra.NoArgs,
		PreRunE: func(cmd *cobra.Command, _ []string) error {
			alg, err := pki.ParseKeyAlgorithm(keyAlgorithm)
			if err != nil {
				return fmt.Errorf("--key-algorithm: %w", err)
			}
			if flags := cmd.Flags(); flags.Changed("key-size") {
				if !flags.Changed("key-algorithm") {
					alg = pki.RSA // a key size only means something for RSA
				} else if alg != pki.RSA {
					return fmt.Errorf("--key-size applies to RSA keys only, but --key-algorithm is %s", alg)
				}
			}
			cfg.SelfSigned.KeyAlgorithm = alg
			flags := cmd.Flags()
			hasStore := cfg.Manifests != "" || cfg.Kubernetes.Enabled()
			if !hasStore {
				for _, name := range secretFlags() {
					if flags.Changed(name) {
						return fmt.Errorf("--%s configures the secret controller, which runs only with a store of service accounts: --manifests, --kubeconfig or --in-cluster", name)
					}
				}
			}
			// Citadel's order: the flag, then $NAMESPACE.
			if !flags.Changed("listened-namespace") && hasStore {
				if ns, ok := lookupEnv("NAMESPACE"); ok {
					cfg.Secrets.ListenedNamespace = ns
				}
			}
			// istiod's order: the flag, then $JWT_RULE.
			ruleFrom := "--jwt-rule"
			if !flags.Changed("jwt-rule") {
				if env, ok := lookupEnv("JWT_RULE"); ok {
					jwtRule, ruleFrom = env, "JWT_RULE"
				}
			}
			rules, err := token.ParseRules(jwtRule)
			if err != nil {
				return fmt.Errorf("%s: %w", ruleFrom, err)
			}
			cfg.JWTRules = rules
			if flags.Changed("requested-ca-cert-ttl") && cfg.Upstream.Address == "" {
				return errors.New("--requested-ca-cert-ttl needs --upstream-ca-address")
			}
			// istiod's order: the flag, then $CA_TRUSTED_NODE_ACCOUNTS.
			if !flags.Changed("trusted-node-accounts") {
				if env, ok := lookupEnv("CA_TRUSTED_NODE_ACCOUNTS"); ok {
					cfg.TrustedNodeAccounts = strings.Split(env, ",")
				}
			}
			cfg.TrustedNodeAccounts = trimAll(cfg.TrustedNodeAccounts)
			cfg.GRPCHostIdentities = trimAll(cfg.GRPCHostIdentities)
			cfg.CACertIdentities = trimAll(cfg.CACertIdentities)
			cfg.Logger = g.Logger()
			return cli.RenderConfigErrors(cfg.Validate(), caFields())
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			return refusedAsCalled(cli.RenderConfigErrors(run(cmd.Context(), cfg), caFields()))
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.GRPCAddr, "grpc-addr", cfg.GRPCAddr, "listen address of the CA protocol (TLS gRPC); port 0 picks a free port")
	f.StringVar(&cfg.MonitoringAddr, "monitoring-addr", cfg.MonitoringAddr, "listen address of /metrics, /version, /healthz, /healthz/ready, /debug/ca (the key material in service); empty disables it")
	f.StringVar(&cfg.StateDir, "state-dir", cfg.StateDir, "directory of the self-signed CA (ca-cert.pem, ca-key.pem), the trust bundle root-cert.pem, and token-key.pem; made 0700 when missing, and refused when another user owns it or can write in it")
	f.StringVar(&cfg.CACertsDir, "cacerts-dir", cfg.CACertsDir, "directory of a plugged-in CA (Istio's cacerts secret); takes precedence over the self-signed CA. It must exist but may be empty: files that appear in it later take over")
	f.StringVar(&cfg.TrustDomain, "trust-domain", cfg.TrustDomain, "trust domain of the SPIFFE IDs this CA issues")
	f.StringVar(&keyAlgorithm, "key-algorithm", string(pki.ECDSA), "key of a newly generated self-signed root: ECDSA (P-256) or RSA")
	f.IntVar(&cfg.SelfSigned.RSAKeySize, "key-size", cfg.SelfSigned.RSAKeySize, "RSA key size of a newly generated self-signed root (implies --key-algorithm RSA)")
	f.StringVar(&cfg.SelfSigned.Org, "self-signed-ca-org", "", "organization of a newly generated self-signed root (default: the trust domain)")
	f.DurationVar(&cfg.SelfSigned.TTL, "self-signed-ca-cert-ttl", cfg.SelfSigned.TTL, "lifetime of a newly generated self-signed root")
	f.DurationVar(&cfg.RootCheckInterval, "root-check-interval", cfg.RootCheckInterval, "how often a self-signed root's remaining life is checked (±5%)")
	f.Float64Var(&cfg.RootRotationThreshold, "root-rotation-threshold", cfg.RootRotationThreshold, "renew a self-signed root (same key) when less than this share of its lifetime is left")
	f.DurationVar(&cfg.TrustBundleOverlap, "trust-bundle-overlap", cfg.TrustBundleOverlap, "how long a replaced root stays in the trust bundle; 0 keeps it until it expires")
	f.StringVar(&cfg.JWTKeysFile, "jwt-keys", "", "PEM public keys or JWKS of the token issuer (e.g. the kube-apiserver's service-account keys); default: <state-dir>/token-key.pem")
	f.StringVar(&cfg.JWTAudience, "jwt-audience", cfg.JWTAudience, "audience tokens must carry")
	f.StringVar(&cfg.JWTIssuer, "jwt-issuer", "", "issuer tokens must carry; empty accepts any")
	f.StringVar(&jwtRule, "jwt-rule", "", `external OIDC issuers to trust (env JWT_RULE, as istiod reads it): a JSON list of rules, or one rule, {"issuer": ISS, "jwksUri": "https://...", "audiences": [AUD, ...], "claimToNamespace": CLAIM, "claimToServiceAccount": CLAIM}. A token whose iss is a rule's issuer is checked with the keys fetched from jwksUri (every 20m, and on an unknown kid at most once a minute; a failed fetch keeps the last keys), must carry one of the audiences, and gets spiffe://<trust-domain>/ns/NS/sa/SA: without the two claim fields, from its sub system:serviceaccount:NS:SA (as Kubernetes'); with them, from those string claims. Other tokens are checked as before`)
	f.StringVar(&cfg.JWTRuleRootCert, "jwt-rule-root-cert", "", "PEM roots that the jwksUri servers of --jwt-rule must chain to, instead of the system's")
	f.StringVar(&cfg.Manifests, "manifests", "", "directory of Namespace and ServiceAccount manifests (*.yaml, *.yml, *.json; not its subdirectories), watched; their labels decide which namespaces this CA serves. It must exist but may be empty. Empty: no namespace is known")
	f.StringVar(&cfg.XDSConfig, "xds-config", "", "serve Envoy's aggregated discovery service on the gRPC port from this file (YAML or JSON shaped like bootstrap's static_resources: listeners, clusters, routes, endpoints, and namespaces: {<ns>: {...}} replacing them for that namespace); watched, and a bad edit keeps the last good one. Empty: Envoy gets an empty configuration (no listeners, no clusters)")
	f.IntVar(&cfg.XDSMaxStreams, "xds-max-streams", cfg.XDSMaxStreams, "most discovery streams open at once over every client; past it a stream is refused with ResourceExhausted")
	f.IntVar(&cfg.XDSMaxStreamsPerCredential, "xds-max-streams-per-credential", cfg.XDSMaxStreamsPerCredential, "most discovery streams open at once with one token or client certificate (Envoy opens one per connection, an agent one more for its debug endpoint); past it ResourceExhausted")
	f.DurationVar(&cfg.MaxConnectionAge, "max-connection-age", cfg.MaxConnectionAge, "a connection to --grpc-addr is told to go after this long (±10%), and closed 10s later, so that its client reconnects and shows its credential again: a stream opened with a token that has since expired, or a client certificate whose root's overlap has ended, ends within it")
	f.StringVar(&cfg.Kubernetes.Kubeconfig, "kubeconfig", "", "kubeconfig file of the Kubernetes API to run on, instead of --manifests")
	f.BoolVar(&cfg.Kubernetes.InCluster, "in-cluster", false, "run on the Kubernetes API of the cluster this pod runs in, as its service account (see deploy/kubernetes)")
	f.StringVar(&cfg.CANamespace, "ca-namespace", cfg.CANamespace, "namespace of this CA instance, matched against the ca.istio.io/env namespace label; on Kubernetes, where its cacerts Secret and its Lease are")
	f.BoolVar(&cfg.EnableNamespacesByDefault, "enable-namespaces-by-default", cfg.EnableNamespacesByDefault, "serve namespaces that carry neither the ca.istio.io/override nor the ca.istio.io/env label")
	f.DurationVar(&cfg.WorkloadCertTTL, "workload-cert-ttl", cfg.WorkloadCertTTL, "lifetime of a workload certificate when the request asks for none")
	f.DurationVar(&cfg.MaxWorkloadCertTTL, "max-workload-cert-ttl", cfg.MaxWorkloadCertTTL, "longest workload certificate lifetime; longer requests are clamped")
	f.DurationVar(&cfg.JWTSVIDTTL, "jwt-svid-ttl", cfg.JWTSVIDTTL, "lifetime of a JWT-SVID (signed for the Workload API's FetchJWTSVID with <state-dir>/jwt-svid-key.pem, on Kubernetes with the Secret meshid-jwt-svid), and the most a request gets; at most 24h")
	f.StringSliceVar(&cfg.GRPCHostIdentities, "grpc-host-identities", nil, "extra DNS names or IPs for the CA's serving certificate, comma-separated (istiod.istio-system.svc, istio-ca, localhost and loopback are always there)")
	f.StringVar(&cfg.Secrets.ListenedNamespace, "listened-namespace", "", "the only namespace whose service accounts get secrets (env NAMESPACE); empty: every served namespace. Needs --manifests or Kubernetes")
	f.Float64Var(&cfg.Secrets.GracePeriodRatio, "workload-cert-grace-period-ratio", cfg.Secrets.GracePeriodRatio, "re-issue a service-account secret when less than this share of its lifetime is left. Needs --manifests or Kubernetes")
	f.DurationVar(&cfg.Secrets.MinGracePeriod, "workload-cert-min-grace-period", cfg.Secrets.MinGracePeriod, "re-issue a service-account secret at least this long before it expires. Needs --manifests or Kubernetes")
	f.BoolVar(&cfg.Secrets.AppendDNSNames, "append-dns-names", cfg.Secrets.AppendDNSNames, "add DNS names to secrets as Citadel does: <svc>.<ca-namespace>.svc and <svc>.<ca-namespace> for istio-sidecar-injector-service-account and istio-galley-service-account in --ca-namespace, and --custom-dns-names. Needs --manifests or Kubernetes")
	f.StringVar(&cfg.Secrets.CustomDNSNames, "custom-dns-names", "", "extra DNS names for secrets, <sa>.<namespace>:<dns name>, comma-separated; needs --append-dns-names, and --manifests or Kubernetes")
	f.StringVar(&cfg.Secrets.LivenessProbePath, "liveness-probe-path", "", "file whose modification time is updated every --liveness-probe-interval while the secret controller is healthy; check it with \"meshid probe --probe-path\". Needs --manifests")
	f.DurationVar(&cfg.Secrets.LivenessProbeInterval, "liveness-probe-interval", 0, "how often --liveness-probe-path is updated. Needs --manifests")
	f.StringVar(&cfg.Upstream.Address, "upstream-ca-address", "", "HOST:PORT of an upstream CA (another meshid ca with --sign-ca-certs) that signs this CA's certificate; needs --upstream-ca-root-cert and --upstream-token-path, and excludes --cacerts-dir")
	f.StringVar(&cfg.Upstream.RootCertFile, "upstream-ca-root-cert", "", "PEM roots of the upstream CA: they verify it and the chain it signs, and are the trust anchors this CA publishes in <state-dir>/root-cert.pem")
	f.StringVar(&cfg.Upstream.TokenPath, "upstream-token-path", "", "token this CA authenticates to the upstream CA with (its identity must be in the upstream's --ca-cert-identities), read at every request")
	f.DurationVar(&cfg.Upstream.RequestedTTL, "requested-ca-cert-ttl", cfg.Upstream.RequestedTTL, "lifetime of the CA certificate asked of the upstream CA (it may give less: its --max-workload-cert-ttl, its own certificate's expiry)")
	f.BoolVar(&cfg.SignCACerts, "sign-ca-certs", false, "sign CA certificates for other CAs (their --upstream-ca-address is this one), for the identities of --ca-cert-identities only; not with --upstream-ca-address")
	f.StringSliceVar(&cfg.TrustedNodeAccounts, "trusted-node-accounts", nil, "service accounts, NAMESPACE/NAME comma-separated (env CA_TRUSTED_NODE_ACCOUNTS, as istiod reads it), that may ask for another workload's certificate, as node agents (ztunnel, meshid's node agent) do: the ImpersonatedIdentity metadata of Istio's protocol, with a token, not a client certificate. On Kubernetes only for a service account with a live pod (scheduled, not Succeeded or Failed) on the node of the pod the caller's token is bound to (the CA then watches every pod); off Kubernetes there are no pods to check, and the trusted account alone decides")
	f.StringSliceVar(&cfg.CACertIdentities, "ca-cert-identities", nil, "SPIFFE IDs (spiffe://<trust-domain>/ns/NS/sa/SA, comma-separated) that may have a CA certificate; needs --sign-ca-certs")
	cmd.AddCommand(newCATargetsCommand(g))
	return cmd
}

// caFieldFlags maps each field of controlplane.Config, by its path, to the flag of `meshid ca`
// that sets it.
func caFieldFlags() map[string]string {
	return map[string]string{ //nolint:gosec // flag names, not credentials
		"StateDir":                      "state-dir",
		"CACertsDir":                    "cacerts-dir",
		"GRPCAddr":                      "grpc-addr",
		"MonitoringAddr":                "monitoring-addr",
		"TrustDomain":                   "trust-domain",
		"SelfSigned.KeyAlgorithm":       "key-algorithm",
		"SelfSigned.RSAKeySize":         "key-size",
		"SelfSigned.Org":                "self-signed-ca-org",
		"SelfSigned.TTL":                "self-signed-ca-cert-ttl",
		"RootCheckInterval":             "root-check-interval",
		"RootRotationThreshold":         "root-rotation-threshold",
		"TrustBundleOverlap":            "trust-bundle-overlap",
		"JWTKeysFile":                   "jwt-keys",
		"JWTAudience":                   "jwt-audience",
		"JWTIssuer":                     "jwt-issuer",
		"JWTRules":                      "jwt-rule",
		"JWTRuleRootCert":               "jwt-rule-root-cert",
		"Manifests":                     "manifests",
		"XDSConfig":                     "xds-config",
		"XDSMaxStreams":                 "xds-max-streams",
		"XDSMaxStreamsPerCredential":    "xds-max-streams-per-credential",
		"MaxConnectionAge":              "max-connection-age",
		"Kubernetes.Kubeconfig":         "kubeconfig",
		"Kubernetes.InCluster":          "in-cluster",
		"CANamespace":                   "ca-namespace",
		"EnableNamespacesByDefault":     "enable-namespaces-by-default",
		"WorkloadCertTTL":               "workload-cert-ttl",
		"MaxWorkloadCertTTL":            "max-workload-cert-ttl",
		"GRPCHostIdentities":            "grpc-host-identities",
		"JWTSVIDTTL":                    "jwt-svid-ttl",
		"Secrets.ListenedNamespace":     "listened-namespace",
		"Secrets.GracePeriodRatio":      "workload-cert-grace-period-ratio",
		"Secrets.MinGracePeriod":        "workload-cert-min-grace-period",
		"Secrets.AppendDNSNames":        "append-dns-names",
		"Secrets.CustomDNSNames":        "custom-dns-names",
		"Secrets.LivenessProbePath":     "liveness-probe-path",
		"Secrets.LivenessProbeInterval": "liveness-probe-interval",
		"Upstream.Address":              "upstream-ca-address",
		"Upstream.RootCertFile":         "upstream-ca-root-cert",
		"Upstream.TokenPath":            "upstream-token-path",
		"Upstream.RequestedTTL":         "requested-ca-cert-ttl",
		"SignCACerts":                   "sign-ca-certs",
		"CACertIdentities":              "ca-cert-identities",
		"TrustedNodeAccounts":           "trusted-node-accounts",
	}
}

// caFields names the fields of controlplane.Config as a user of `meshid ca` sets them; NAMESPACE
// sets --listened-namespace, as in Citadel, and JWT_RULE --jwt-rule, as in istiod.
func caFields() cli.FieldNames {
	return cli.FieldNames{Flags: caFieldFlags(), Env: map[string]string{"listened-namespace": "NAMESPACE", "jwt-rule": "JWT_RULE",
		"trusted-node-accounts": "CA_TRUSTED_NODE_ACCOUNTS"}}
}

// refusedAsCalled is cli.RefusedAsCalled with the control plane's refusals, which package cli,
// linked into meshid-agent, cannot name.
func refusedAsCalled(err error) error {
	if errors.Is(err, controlplane.ErrConfigRefused) {
		return cli.UsageError{Err: err}
	}
	return cli.RefusedAsCalled(err)
}

// trimAll drops empty entries and spaces from a comma-separated flag's values.
func trimAll(values []string) []string {
	var out []string
	for _, v := range values {
		if v = strings.TrimSpace(v); v != "" {
			out = append(out, v)
		}
	}
	return out
}
