package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/gcemetadata"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// AgentRunner runs the agent with a validated config; tests replace it to capture the config.
type AgentRunner func(ctx context.Context, cfg agent.Config) error

// RunAgent is the production AgentRunner.
func RunAgent(ctx context.Context, cfg agent.Config) error {
	a, err := agent.New(cfg)
	if err != nil {
		return err
	}
	return a.Run(ctx)
}

// envBinding maps a flag to the Istio variable that sets it when the flag is not given.
type envBinding struct{ flag, env string }

func agentEnv() []envBinding {
	return []envBinding{
		{"ca-addr", "CA_ADDR"},
		{"ca-provider", "CA_PROVIDER"},
		{"ca-root-cert", "CA_ROOT_CA"},
		{"istiod-san", "ISTIOD_SAN"},
		{"prov-cert", "PROV_CERT"},
		{"output-certs", "OUTPUT_CERTS"},
		{"secret-ttl", "SECRET_TTL"},
		{"grace-period-ratio", "SECRET_GRACE_PERIOD_RATIO"},
		{"grace-period-ratio-jitter", "SECRET_GRACE_PERIOD_RATIO_JITTER"},
		{"trust-domain", "TRUST_DOMAIN"},
		{"namespace", "POD_NAMESPACE"},
		{"service-account", "SERVICE_ACCOUNT"},
		{"instance-ip", "INSTANCE_IP"},
		{"cluster-id", "ISTIO_META_CLUSTER_ID"},
		{"key-algorithm", "ECC_SIGNATURE_ALGORITHM"},
		{"workload-rsa-key-size", "WORKLOAD_RSA_KEY_SIZE"},
		{"file-mounted-certs", "FILE_MOUNTED_CERTS"},
		{"xds-root-cert", "XDS_ROOT_CA"},
		{"proxy-xds-via-agent", "PROXY_XDS_VIA_AGENT"},
		{"proxy-xds-debug-via-agent", "PROXY_XDS_DEBUG_VIA_AGENT"},
		{"credential-fetcher-type", "CREDENTIAL_FETCHER_TYPE"},
		{"credential-identity-provider", "CREDENTIAL_IDENTITY_PROVIDER"},
		{"gce-metadata-host", "GCE_METADATA_HOST"},
		{"gke-cluster-url", "GKE_CLUSTER_URL"},
		{"pilot-cert-provider", "PILOT_CERT_PROVIDER"},
		{"istio-kube-app-probers", "ISTIO_KUBE_APP_PROBERS"},
		{"istio-prometheus-annotations", "ISTIO_PROMETHEUS_ANNOTATIONS"},
		{"pod-name", "POD_NAME"},
		{"bootstrap-override", "ISTIO_BOOTSTRAP_OVERRIDE"},
		{"minimum-drain-duration", "MINIMUM_DRAIN_DURATION"},
		{"termination-drain-duration-seconds", "TERMINATION_DRAIN_DURATION_SECONDS"},
		{"exit-on-zero-active-connections", "EXIT_ON_ZERO_ACTIVE_CONNECTIONS"},
		{"node-name", "NODE_NAME"},
	}
}

// unimplementedIstioEnv lists the variables that Istio's sidecar injector sets, or that users of
// pilot-agent commonly set, and that meshid does not implement. The agent names those that are
// set in one warning at start, rather than ignore them silently. meshid ignores them on purpose: it
// reads no mesh config (PROXY_CONFIG); it reads whatever token is at --token-path, first- or
// third-party (JWT_POLICY); it proxies no DNS (ISTIO_META_DNS_*); its debug server is
// --debug-addr (PROXY_XDS_DEBUG_VIA_AGENT_PORT); its ECDSA keys are P-256 (ECC_CURVE); it asks
// the CA for no particular signer (ISTIO_META_CERT_SIGNER); its SDS socket is always "socket"
// in --workload-socket-dir (WORKLOAD_IDENTITY_SOCKET_FILE).
func unimplementedIstioEnv() []string {
	return []string{
		"PROXY_CONFIG",
		"JWT_POLICY",
		"ISTIO_META_DNS_CAPTURE",
		"ISTIO_META_DNS_AUTO_ALLOCATE",
		"PROXY_XDS_DEBUG_VIA_AGENT_PORT",
		"ECC_CURVE",
		"ISTIO_META_CERT_SIGNER",
		"WORKLOAD_IDENTITY_SOCKET_FILE",
	}
}

// setVariables returns, in order, the names that are set to a value.
func setVariables(names []string, lookupEnv func(string) (string, bool)) []string {
	var set []string
	for _, name := range names {
		if v, ok := lookupEnv(name); ok && v != "" {
			set = append(set, name)
		}
	}
	return set
}

// credentialFetcherType is CREDENTIAL_FETCHER_TYPE's value as agent.Config names it, its case
// as Istio's documentation writes it whatever the case given; an unknown one is left for
// Validate to refuse.
func credentialFetcherType(v string) string {
	for _, known := range []string{agent.CredentialFetcherJWT, agent.CredentialFetcherGCE} {
		if strings.EqualFold(v, known) {
			return known
		}
	}
	return v
}

// checkIstioProviders refuses the values of Istio's PILOT_CERT_PROVIDER that meshid does not
// implement: each would change, in Istio's agent, which roots are trusted, so ignoring one would
// leave the agent doing something else than was asked. (CREDENTIAL_FETCHER_TYPE and its
// variables are agent.Config's, checked by Validate.)
func checkIstioProviders(pilotCertProvider string) []error {
	var errs []error
	const istiod = "meshid does what istiod means: --ca-root-cert (CA_ROOT_CA), else the mounted istio-ca-root-cert, verifies the CA, and --xds-root-cert (XDS_ROOT_CA), else the CA's roots, the discovery server"
	switch p := pilotCertProvider; {
	case p == "" || p == "istiod":
	case p == "kubernetes" || strings.HasPrefix(p, "kubernetes:"):
		errs = append(errs, fmt.Errorf("--pilot-cert-provider (PILOT_CERT_PROVIDER) %s is not supported: %s; to trust the Kubernetes CA, give its ca.crt as --ca-root-cert (CA_ROOT_CA) and --xds-root-cert (XDS_ROOT_CA)", p, istiod))
	case p == "custom":
		errs = append(errs, fmt.Errorf("--pilot-cert-provider (PILOT_CERT_PROVIDER) custom is not supported: %s; to trust etc/certs/root-cert.pem, give it as --ca-root-cert (CA_ROOT_CA)", istiod))
	case p == "none":
		errs = append(errs, fmt.Errorf("--pilot-cert-provider (PILOT_CERT_PROVIDER) none is not supported: %s; give the roots with --ca-root-cert (CA_ROOT_CA) and --xds-root-cert (XDS_ROOT_CA), and unset it", istiod))
	default:
		errs = append(errs, fmt.Errorf("--pilot-cert-provider (PILOT_CERT_PROVIDER) %q is unknown: want istiod (or nothing): %s", p, istiod))
	}
	return errs
}

// agentOptions are the agent's flags and variables, resolved into the agent.Config they describe:
// the agent command runs it, the bootstrap command writes the bootstrap of the Envoy it serves.
// One list of flags, so that the two always mean the same agent.
type agentOptions struct {
	cfg                                                   agent.Config
	keyAlgorithm, caProvider, socketMode, outputGroupRead string
	pilotCertProvider                                     string

	lookupEnv func(string) (string, bool)
	environ   func() []string
	// given are the flags set on the command line, before resolve sets flags from variables.
	given map[string]bool
}

// newAgentOptions returns the options of an agent; lookupEnv reads one variable and environ lists
// them all, KEY=value (os.LookupEnv and os.Environ in production; nil environ: none); embed
// starts the control plane in-process when no CA is given (nil in a binary without a CA); check
// checks Envoy's bootstrap and merges the override (nil in a binary without Envoy's types).
func newAgentOptions(lookupEnv func(string) (string, bool), environ func() []string, embed agent.EmbedFunc, check agent.BootstrapCheckFunc, node agent.NodeFunc) *agentOptions {
	o := &agentOptions{cfg: agent.DefaultConfig(""), lookupEnv: lookupEnv, environ: environ}
	o.cfg.CA.Embed = embed
	o.cfg.SDS.Node = node
	o.cfg.Envoy.CheckBootstrap = check
	return o
}

// bind defines the agent's flags on f.
func (o *agentOptions) bind(f *pflag.FlagSet) {
	embedded := o.cfg.CA.Embed != nil
	f.StringVar(&o.cfg.RootDir, "root-dir", "", "prefix of every default path, so that a non-root user can run the agent anywhere")
	caAddrHelp := "address of the CA, HOST:PORT (CA_ADDR); empty runs the control plane in-process"
	if !embedded {
		caAddrHelp = "address of the CA, HOST:PORT (CA_ADDR); required"
	}
	f.StringVar(&o.cfg.CA.Address, "ca-addr", "", caAddrHelp)
	f.StringVar(&o.caProvider, "ca-provider", agent.CAProviderCitadel, "CA protocol (CA_PROVIDER): Citadel, Istio's IstioCertificateService; GoogleCA, the Mesh CA's google.security.meshca.v1.MeshCertificateService, which meshid ca serves too. As in Istio, any other value means Citadel, but GoogleCA in another case is refused. Every credential (--token-path, --credential-fetcher-type, --token-exchange-url, --prov-cert, the embedded CA) works with either")
	f.StringVar(&o.cfg.CA.GKEClusterURL, "gke-cluster-url", "", "the GKE cluster's URL (GKE_CLUSTER_URL), https://container.googleapis.com/v1/projects/P/locations/L/clusters/C: its location L goes with each Mesh CA request (x-goog-request-params), as Istio's client sent it; a GKE Hub membership URL sends none; only with --ca-provider GoogleCA")
	f.StringVar(&o.cfg.CA.CredentialFetcherType, "credential-fetcher-type", "", "where the token presented to the CA and the discovery server comes from (CREDENTIAL_FETCHER_TYPE): JWT (or nothing), the token file at --token-path; GoogleComputeEngine, the VM's identity token from the GCE metadata server, cached until shortly before it expires (needs --ca-addr)")
	f.StringVar(&o.cfg.CA.CredentialIdentityProvider, "credential-identity-provider", "", "audience of the identity token asked of the metadata server (CREDENTIAL_IDENTITY_PROVIDER), such as the CA's istio-ca; required with --credential-fetcher-type GoogleComputeEngine, refused without it")
	f.StringVar(&o.cfg.CA.MetadataHost, "gce-metadata-host", "", "the GCE metadata server, host or host:port (GCE_METADATA_HOST, as Google's client libraries read it); default "+gcemetadata.DefaultHost+"; only with --credential-fetcher-type GoogleComputeEngine")
	f.StringVar(&o.cfg.CA.TokenExchangeURL, "token-exchange-url", "", "OAuth 2.0 token exchange endpoint (RFC 8693): the token (of --token-path or the credential fetcher) is exchanged there for a JWT, cached until shortly before it expires, and only that JWT is presented to the CA and the discovery server; https, or http to loopback only (needs --ca-addr; no Istio variable: Istio's agent has a fixed Google endpoint)")
	f.StringVar(&o.cfg.CA.TokenExchangeAudience, "token-exchange-audience", "", "audience asked of the token exchange, the CA's JWT audience; default "+agent.DefaultTokenExchangeAudience+"; only with --token-exchange-url (no Istio variable)")
	f.StringVar(&o.cfg.CA.TokenExchangeRootCert, "token-exchange-root-cert", "", "PEM roots that verify the https token exchange endpoint; default: the system roots; only with --token-exchange-url (no Istio variable)")
	f.StringVar(&o.pilotCertProvider, "pilot-cert-provider", "", "which roots verify the CA and the discovery server (PILOT_CERT_PROVIDER): istiod, what meshid does (--ca-root-cert, --xds-root-cert); kubernetes, custom and none are refused")
	f.StringVar(&o.cfg.CA.RootCert, "ca-root-cert", "", "PEM roots that verify the CA (CA_ROOT_CA); default: <prov-cert>/root-cert.pem, else <root-dir>/var/run/secrets/istio/root-cert.pem")
	f.StringVar(&o.cfg.CA.ServerName, "istiod-san", o.cfg.CA.ServerName, "name verified in the CA's certificate (ISTIOD_SAN)")
	f.StringVar(&o.cfg.CA.TokenPath, "token-path", "", "service-account token presented to the CA, re-read at every request (default <root-dir>/var/run/secrets/tokens/istio-token)")
	f.StringVar(&o.cfg.CA.ProvCert, "prov-cert", "", "directory of a provisioned key pair (cert-chain.pem, key.pem) for mTLS to the CA (PROV_CERT)")
	f.StringVar(&o.cfg.Output.Dir, "output-certs", "", "directory that receives key.pem, cert-chain.pem and root-cert.pem on every renewal (OUTPUT_CERTS); made 0700 when missing, refused when another user owns it or can write in it, and locked by this agent while it runs")
	f.StringVar(&o.outputGroupRead, "output-certs-group-read", "none", "what the agent's group may read in --output-certs: none, certs (directories 0750, cert-chain.pem and root-cert.pem 0640) or all (key.pem 0640 too)")
	f.StringVar(&o.cfg.Identity.TrustDomain, "trust-domain", o.cfg.Identity.TrustDomain, "trust domain of the workload's SPIFFE ID (TRUST_DOMAIN)")
	f.StringVar(&o.cfg.Identity.Namespace, "namespace", "", "namespace of the workload (POD_NAMESPACE)")
	f.StringVar(&o.cfg.Identity.ServiceAccount, "service-account", "", "service account of the workload (SERVICE_ACCOUNT)")
	f.StringVar(&o.cfg.CA.ClusterID, "cluster-id", "", "cluster ID sent to the CA (ISTIO_META_CLUSTER_ID)")
	f.StringVar(&o.keyAlgorithm, "key-algorithm", string(pki.ECDSA), "workload key: ECDSA (P-256) or RSA (ECC_SIGNATURE_ALGORITHM)")
	f.IntVar(&o.cfg.Certificate.RSAKeySize, "workload-rsa-key-size", o.cfg.Certificate.RSAKeySize, "RSA key size when --key-algorithm is RSA (WORKLOAD_RSA_KEY_SIZE)")
	f.DurationVar(&o.cfg.Certificate.TTL, "secret-ttl", o.cfg.Certificate.TTL, "certificate lifetime asked of the CA (SECRET_TTL)")
	f.Float64Var(&o.cfg.Certificate.GraceRatio, "grace-period-ratio", o.cfg.Certificate.GraceRatio, "renew when this share of the certificate's lifetime is left (SECRET_GRACE_PERIOD_RATIO)")
	f.Float64Var(&o.cfg.Certificate.GraceRatioJitter, "grace-period-ratio-jitter", o.cfg.Certificate.GraceRatioJitter, "random ± spread of the ratio, so that workloads do not renew in step (SECRET_GRACE_PERIOD_RATIO_JITTER)")
	f.StringVar(&o.cfg.SDS.SocketDir, "workload-socket-dir", "", "directory of the SDS socket (default <root-dir>/var/run/secrets/workload-spiffe-uds)")
	f.StringVar(&o.socketMode, "socket-mode", "0660", "file mode of the SDS socket")
	f.StringVar(&o.cfg.SDS.CredentialsDir, "credentials-dir", "", "directory whose cert-chain.pem, key.pem and root-cert.pem are served instead of a CA's (default <root-dir>/var/run/secrets/workload-spiffe-credentials)")
	f.BoolVar(&o.cfg.SDS.FileMountedCerts, "file-mounted-certs", false, "serve <root-dir>/etc/certs/{cert-chain,key,root-cert}.pem and use no CA (FILE_MOUNTED_CERTS)")
	f.StringSliceVar(&o.cfg.SDS.FileResourceDirs, "file-resource-dirs", nil, "directories that file-cert: and file-root: secrets may read (default: the credentials dir and <root-dir>/etc/certs)")
	f.DurationVar(&o.cfg.SDS.DrainDuration, "drain-duration", 0, "how long SDS streams may go on after SIGTERM")
	f.IntVar(&o.cfg.SDS.MaxStreams, "sds-max-streams", o.cfg.SDS.MaxStreams, "SDS streams and FetchSecrets calls open at once, over all connections, and open connections; past it a stream is refused (ResourceExhausted) and a connection closed. Envoy opens one stream per secret name: a sidecar a handful, a gateway one more per file-mounted certificate; each costs about 17 kB")
	f.IntVar(&o.cfg.SDS.MaxStreamsPerConnection, "sds-max-streams-per-connection", o.cfg.SDS.MaxStreamsPerConnection, "SDS streams one connection may carry at once, told to the client (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS), which holds further ones back until one ends")
	f.BoolVar(&o.cfg.SDS.WorkloadAPI, "workload-api", o.cfg.SDS.WorkloadAPI, "serve the SPIFFE Workload API (X.509-SVIDs of this workload's identity, pushed on every rotation, and JWT-SVIDs the CA signs) on the SDS socket, for go-spiffe and other SPIFFE clients (SPIFFE_ENDPOINT_SOCKET=unix://<socket>); not when another server answers on the socket (no Istio variable)")
	f.StringVar(&o.cfg.SDS.WorkloadAttestation, "workload-attestation", "", "node mode: a YAML rules file (watched) that gives each caller on the SDS socket, identified by the kernel (uid, gid, pid, executable path, cgroup, pod), its namespace and service account; the agent then serves every workload of its node, asking the CA for each identity as a trusted node account (meshid ca --trusted-node-accounts; the embedded CA trusts the agent's own account). A caller no rule matches is refused. Not with --output-certs, --file-mounted-certs, --credentials-dir, --prov-cert or --ca-provider GoogleCA, and the xDS proxy is off (--proxy-xds-via-agent is refused: it would fetch every Envoy's configuration as the node agent); meshid agent only: meshid-agent, a sidecar's binary, serves one workload (no Istio variable)")
	f.BoolVar(&o.cfg.SDS.AttestPods.Enabled, "workload-attestation-pods", false, "node mode on Kubernetes, alone or with --workload-attestation (its rules are tried first): a caller in a pod, found by the pod UID of its cgroup (a static pod by its config hash), gets that pod's namespace and service account, among the pods the API server has bound to --node-name, watched with --kubeconfig or --in-cluster (deploy/kubernetes/rbac-node-agent-pods.yaml grants the watch). A pod not listed yet is waited for a few seconds; one of another node, ended or unknown is refused. The agent is not ready until the pods are listed. meshid agent only (no Istio variable)")
	f.StringVar(&o.cfg.SDS.AttestPods.NodeName, "node-name", "", "the node whose pods --workload-attestation-pods reads (NODE_NAME; the pod's spec.nodeName through the downward API); required with it")
	f.StringVar(&o.cfg.SDS.AttestPods.Kubeconfig, "kubeconfig", "", "kubeconfig file of the Kubernetes API that --workload-attestation-pods reads the node's pods from; or --in-cluster")
	f.BoolVar(&o.cfg.SDS.AttestPods.InCluster, "in-cluster", false, "read the node's pods for --workload-attestation-pods from the Kubernetes API of the cluster this pod runs in, as its service account; or --kubeconfig")
	f.StringVar(&o.cfg.XDS.DiscoveryAddress, "discovery-addr", "", "discovery server Envoy's xDS is proxied to, HOST:PORT (Istio's discoveryAddress; CA_ADDR defaults to it); default: the CA's address, or the in-process control plane")
	f.StringVar(&o.cfg.XDS.Socket, "xds-socket", "", "Unix socket Envoy's ADS connects to (default <root-dir>/etc/istio/proxy/XDS)")
	f.StringVar(&o.cfg.XDS.RootCert, "xds-root-cert", "", "PEM roots that verify the discovery server (XDS_ROOT_CA); default: the CA's roots")
	f.IntVar(&o.cfg.XDS.MaxStreams, "xds-proxy-max-streams", o.cfg.XDS.MaxStreams, "Envoy's ADS streams open at once through the xDS proxy, and open connections; past it a stream is refused (ResourceExhausted) and a connection closed. Envoy opens one ADS stream; each costs about 41 kB here and one stream upstream")
	f.IntVar(&o.cfg.XDS.MaxStreamsPerConnection, "xds-proxy-max-streams-per-connection", o.cfg.XDS.MaxStreamsPerConnection, "ADS streams one connection to the xDS proxy may carry at once, told to the client (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS)")
	f.StringVar(&o.cfg.XDS.DebugSocket, "xds-debug-socket", "", "Unix socket of /debug/<type>, with the XDS socket's mode (default: "+agent.XDSDebugSocketName+" next to --xds-socket)")
	f.BoolVar(&o.cfg.XDS.DebugTCP, "xds-debug-tcp", false, "also answer /debug/<type> on --debug-addr: any local user, not only who may open the XDS socket, can then read this namespace's configuration and its other proxies")
	f.BoolVar(&o.cfg.XDS.Proxy, "proxy-xds-via-agent", o.cfg.XDS.Proxy, "serve Envoy's ADS on --xds-socket and proxy it to the discovery server (PROXY_XDS_VIA_AGENT); off, and refused, with --workload-attestation: the proxy authenticates as the agent alone")
	f.BoolVar(&o.cfg.XDS.ProxyDebug, "proxy-xds-debug-via-agent", o.cfg.XDS.ProxyDebug, "answer /debug/<type> on --xds-debug-socket with the discovery server's istio.io/debug/<type> for this proxy (PROXY_XDS_DEBUG_VIA_AGENT)")
	f.StringVar(&o.cfg.Servers.StatusAddr, "status-addr", o.cfg.Servers.StatusAddr, "listen address of /healthz/ready, /metrics, /stats/prometheus, /app-health/ and POST /quitquitquit (loopback only)")
	f.StringVar(&o.cfg.Servers.AppProbers, "istio-kube-app-probers", "", `the workload's probes as Istio's injector writes them (ISTIO_KUBE_APP_PROBERS), JSON of path: probe, such as {"/app-health/web/livez":{"httpGet":{"path":"/healthz","port":8080},"timeoutSeconds":1}}; each path is answered on --status-addr by running its httpGet, tcpSocket or grpc probe on --instance-ip (127.0.0.1 when empty), at most 4 of a path at once`)
	f.StringVar(&o.cfg.Servers.PrometheusAnnotations, "istio-prometheus-annotations", "", `where the application serves its metrics, as Istio's injector writes the pod's prometheus.io annotations (ISTIO_PROMETHEUS_ANNOTATIONS), such as {"scrape":"true","path":"/metrics","port":"9090"} (path /metrics and port 80 when empty, "scheme":"https" too); GET /stats/prometheus on --status-addr merges them, scraped on --instance-ip (127.0.0.1 when empty), with the agent's and Envoy's`)
	f.StringVar(&o.cfg.Identity.InstanceIP, "instance-ip", "", "the workload's address (INSTANCE_IP, the pod IP on Kubernetes), where application probes go, as Istio's agent sends them; empty: 127.0.0.1")
	f.StringVar(&o.cfg.Servers.DebugAddr, "debug-addr", o.cfg.Servers.DebugAddr, "loopback listen address of /debug/secrets (and /debug/<type> with --xds-debug-tcp); answers only a Host naming loopback; empty disables it")
	f.StringVar(&o.cfg.Identity.PodName, "pod-name", "", "the workload's pod (POD_NAME), in Envoy's node id and metadata; empty: the host's name, which is the pod's on Kubernetes")
	f.StringVar(&o.cfg.Envoy.BootstrapOverride, "bootstrap-override", "", "a bootstrap, JSON or YAML, merged over the one written (ISTIO_BOOTSTRAP_OVERRIDE), as Istio merges it: a value it sets replaces the written one, a list it gives is appended to")
	f.IntVar(&o.cfg.Envoy.AdminPort, "envoy-admin-port", o.cfg.Envoy.AdminPort, "port of Envoy's admin, on 127.0.0.1 (Istio's proxyAdminPort); 0: a port of the kernel's choosing, which Envoy writes to envoy-admin-address next to --envoy-bootstrap for the agent (with --envoy-prometheus-port 0)")
	f.IntVar(&o.cfg.Envoy.PrometheusPort, "envoy-prometheus-port", o.cfg.Envoy.PrometheusPort, "port of Envoy's listener that serves its /stats/prometheus on every address, for Prometheus to scrape; 0: none")
	f.StringVar(&o.cfg.Envoy.Path, "envoy-path", "", "Envoy's binary: the agent writes its bootstrap to --envoy-bootstrap, starts it once the workload certificate is in service, drains it on SIGTERM and exits with it; empty: Envoy runs elsewhere")
	f.StringVar(&o.cfg.Envoy.BootstrapPath, "envoy-bootstrap", "", "where the agent writes the bootstrap of the Envoy it starts (default <root-dir>/"+agent.DefaultBootstrapPath+")")
	f.StringVar(&o.cfg.Envoy.LogLevel, "proxy-log-level", o.cfg.Envoy.LogLevel, "Envoy's log level (-l): trace, debug, info, warning, error, critical or off (Istio's --proxyLogLevel)")
	f.StringVar(&o.cfg.Envoy.ComponentLogLevel, "proxy-component-log-level", o.cfg.Envoy.ComponentLogLevel, "Envoy's --component-log-level, such as misc:error,upstream:debug (Istio's --proxyComponentLogLevel)")
	f.IntVar(&o.cfg.Envoy.Concurrency, "concurrency", o.cfg.Envoy.Concurrency, "Envoy's worker threads (--concurrency); 0: one per core of the machine, which on a node is more than a sidecar needs")
	f.DurationVar(&o.cfg.Envoy.DrainDuration, "envoy-drain-duration", o.cfg.Envoy.DrainDuration, "how long Envoy takes to drain a listener it is told to (--drain-time-s; Istio's drainDuration)")
	f.DurationVar(&o.cfg.Envoy.MinimumDrainDuration, "minimum-drain-duration", o.cfg.Envoy.MinimumDrainDuration, "on SIGTERM, how long the agent lets Envoy drain before it looks at Envoy's connections (MINIMUM_DRAIN_DURATION)")
	f.Var(secondsValue{&o.cfg.Envoy.TerminationDrainDuration}, "termination-drain-duration-seconds", "on SIGTERM, seconds from the start of the drain after which the agent stops Envoy, whatever connections are left (TERMINATION_DRAIN_DURATION_SECONDS)")
	f.BoolVar(&o.cfg.Envoy.ExitOnZeroActiveConnections, "exit-on-zero-active-connections", false, "on SIGTERM, stop Envoy as soon as it holds no downstream connection after the minimum drain, rather than at the termination drain (EXIT_ON_ZERO_ACTIVE_CONNECTIONS)")
}

// secondsValue is a duration given in whole seconds, as Istio's *_SECONDS variables are.
type secondsValue struct{ d *time.Duration }

func (v secondsValue) String() string {
	if v.d == nil {
		return "0"
	}
	return strconv.FormatInt(int64(*v.d/time.Second), 10)
}

func (v secondsValue) Set(s string) error {
	n, err := strconv.ParseInt(s, 10, 32)
	if err != nil || n < 0 {
		return fmt.Errorf("%q: want a whole number of seconds, 0 or more", s)
	}
	*v.d = time.Duration(n) * time.Second
	return nil
}

func (secondsValue) Type() string { return "seconds" }

// resolve merges the variables under the flags not given and resolves what the flags and
// variables mean into o.cfg; it returns every problem at once, a newcomer fixes them in one go.
// The caller validates o.cfg.
func (o *agentOptions) resolve(cmd *cobra.Command, log *slog.Logger) []error {
	if set := setVariables(unimplementedIstioEnv(), o.lookupEnv); len(set) > 0 {
		log.Warn("set but not implemented by meshid; ignored", logkey.Variables, set)
	}
	var errs []error
	flags := cmd.Flags()
	o.given = map[string]bool{}
	flags.Visit(func(f *pflag.Flag) { o.given[f.Name] = true })
	for _, b := range agentEnv() {
		if v, ok := o.lookupEnv(b.env); ok && v != "" && !flags.Changed(b.flag) {
			if err := flags.Set(b.flag, v); err != nil {
				errs = append(errs, fmt.Errorf("%s=%q: %w", b.env, v, err))
			}
		}
	}
	o.cfg.Envoy.Metadata = istioMeta(o.environ)
	cfg := &o.cfg
	alg, err := pki.ParseKeyAlgorithm(o.keyAlgorithm)
	if err != nil {
		errs = append(errs, fmt.Errorf("--key-algorithm (ECC_SIGNATURE_ALGORITHM): %w", err))
	} else {
		cfg.Certificate.KeyAlgorithm = alg
	}
	switch p := o.caProvider; {
	case p == agent.CAProviderGoogleCA:
		cfg.CA.Provider = agent.CAProviderGoogleCA
	case strings.EqualFold(p, agent.CAProviderGoogleCA):
		// Istio's agent compares exactly and would speak Citadel: what was meant is plain, and
		// doing the other would fail, or succeed against a CA that was not meant.
		errs = append(errs, fmt.Errorf("--ca-provider (CA_PROVIDER) %q: write %s for the Mesh CA protocol, or %s; Istio reads only %s, exactly, as the Mesh CA, and would speak Citadel", p, agent.CAProviderGoogleCA, agent.CAProviderCitadel, agent.CAProviderGoogleCA))
	default:
		cfg.CA.Provider = agent.CAProviderCitadel // anything else means Citadel, as in Istio
	}
	errs = append(errs, checkIstioProviders(o.pilotCertProvider)...)
	cfg.CA.CredentialFetcherType = credentialFetcherType(cfg.CA.CredentialFetcherType)
	if cfg.CA.CredentialFetcherType == agent.CredentialFetcherGCE && flags.Changed("token-path") {
		errs = append(errs, fmt.Errorf("--token-path is ignored with --credential-fetcher-type (CREDENTIAL_FETCHER_TYPE) %s: the token comes from the metadata server; give one or the other", agent.CredentialFetcherGCE))
	}
	if cfg.RootDir != "" {
		if abs, err := filepath.Abs(cfg.RootDir); err != nil {
			errs = append(errs, fmt.Errorf("--root-dir: %w", err))
		} else {
			cfg.RootDir = abs
		}
	}
	if !flags.Changed("token-path") {
		cfg.CA.TokenPath = filepath.Join(rootOrSlash(cfg.RootDir), agent.DefaultTokenPath)
	}
	if mode, err := strconv.ParseUint(o.socketMode, 8, 32); err != nil || mode > 0o777 {
		errs = append(errs, fmt.Errorf("--socket-mode %q: want an octal file mode such as 0660", o.socketMode))
	} else {
		cfg.SDS.SocketMode = os.FileMode(mode)
	}
	switch o.outputGroupRead {
	case "none":
	case "certs":
		cfg.Output.GroupRead = true
	case "all":
		cfg.Output.GroupRead, cfg.Output.KeyGroupRead = true, true
	default:
		errs = append(errs, fmt.Errorf("--output-certs-group-read %q: want none, certs or all", o.outputGroupRead))
	}
	if o.outputGroupRead != "none" && cfg.Output.Dir == "" {
		errs = append(errs, errors.New("--output-certs-group-read needs --output-certs (OUTPUT_CERTS)"))
	}
	if cfg.CA.Address == "" && cfg.XDS.DiscoveryAddress != "" {
		cfg.CA.Address = cfg.XDS.DiscoveryAddress // CA_ADDR defaults to the discovery address, as in Istio
	}
	proxyOff := "--proxy-xds-via-agent=false (PROXY_XDS_VIA_AGENT)"
	if cfg.NodeMode() && !flags.Changed("proxy-xds-via-agent") {
		// Off by default in node mode: upstream, the proxy could only be the node agent. Asked
		// for (flag or variable), it is refused by the config's validation.
		cfg.XDS.Proxy, proxyOff = false, "node mode (--workload-attestation, --workload-attestation-pods)"
	}
	if !cfg.XDS.Proxy {
		if flags.Changed("proxy-xds-debug-via-agent") && cfg.XDS.ProxyDebug {
			errs = append(errs, fmt.Errorf("--proxy-xds-debug-via-agent (PROXY_XDS_DEBUG_VIA_AGENT) needs the xDS proxy, which %s turns off", proxyOff))
		}
		for _, name := range []string{"discovery-addr", "xds-socket", "xds-root-cert", "xds-debug-socket", "xds-debug-tcp",
			"xds-proxy-max-streams", "xds-proxy-max-streams-per-connection"} {
			if flags.Changed(name) {
				errs = append(errs, fmt.Errorf("--%s configures the xDS proxy, which %s turns off", name, proxyOff))
			}
		}
		cfg.XDS.ProxyDebug = false
	} else if !cfg.XDS.ProxyDebug && flags.Changed("xds-debug-socket") {
		errs = append(errs, errors.New("--xds-debug-socket serves /debug/<type>, which --proxy-xds-debug-via-agent=false (PROXY_XDS_DEBUG_VIA_AGENT) turns off"))
	}
	// NODE_NAME may be set for other reasons (the downward API in any pod): only the flag is
	// refused without the source that reads it.
	if o.given["node-name"] && !cfg.SDS.AttestPods.Enabled {
		errs = append(errs, errors.New("--node-name names the node whose pods --workload-attestation-pods reads, which is not given: give it, or drop --node-name"))
	}
	cfg.Logger = log
	return errs
}

// validate returns errs and o.cfg's refusals, rendered with the flags and variables, joined.
func (o *agentOptions) validate(errs []error) error {
	return errors.Join(append(errs, RenderConfigErrors(o.cfg.Validate(), agentFields()))...)
}

// istioMetaPrefix starts the variables whose rest is a key of Envoy's node metadata, as in Istio.
const istioMetaPrefix = "ISTIO_META_"

// istioMeta returns the ISTIO_META_<KEY>=v variables of environ as KEY: v.
func istioMeta(environ func() []string) map[string]string {
	meta := map[string]string{}
	if environ == nil {
		return meta
	}
	for _, kv := range environ() {
		name, value, _ := strings.Cut(kv, "=")
		if key, ok := strings.CutPrefix(name, istioMetaPrefix); ok && key != "" {
			meta[key] = value
		}
	}
	return meta
}

// envoyOnlyFlags shape only the bootstrap (the bootstrap command's, or the Envoy the agent
// starts); envoyRunFlags only the Envoy the agent starts (--envoy-path).
func envoyOnlyFlags() []string {
	return []string{"pod-name", "bootstrap-override", "envoy-admin-port", "envoy-prometheus-port"}
}

func envoyRunFlags() []string {
	return []string{"envoy-bootstrap", "proxy-log-level", "proxy-component-log-level", "concurrency", "envoy-drain-duration",
		"minimum-drain-duration", "termination-drain-duration-seconds", "exit-on-zero-active-connections"}
}

// refuseEnvoyFlagsWithoutEnvoy refuses, in an agent that starts no Envoy (no --envoy-path), the
// flags that shape only the bootstrap or the Envoy it would start: they would do nothing. The
// variables among them, which a pod may set for an Envoy run elsewhere (Istio's injector sets the
// drain ones), are named in one warning and dropped.
func refuseEnvoyFlagsWithoutEnvoy(cmd *cobra.Command, o *agentOptions, log *slog.Logger) []error {
	if o.cfg.Envoy.Path != "" {
		return nil
	}
	var errs []error
	for _, name := range envoyOnlyFlags() {
		if o.given[name] {
			errs = append(errs, fmt.Errorf("--%s applies to the bootstrap `%s` writes, or to the Envoy the agent starts with --envoy-path; here it would do nothing", name, bootstrapCommandPath(cmd)))
		}
	}
	for _, name := range envoyRunFlags() {
		if o.given[name] {
			errs = append(errs, fmt.Errorf("--%s applies to the Envoy the agent starts with --envoy-path; here it would do nothing", name))
		}
	}
	var ignored []string
	for _, b := range agentEnv() {
		if slices.Contains(envoyRunFlags(), b.flag) || b.flag == "bootstrap-override" {
			if v, ok := o.lookupEnv(b.env); ok && v != "" && !o.given[b.flag] {
				ignored = append(ignored, b.env)
			}
		}
	}
	if len(ignored) > 0 {
		log.Warn("set for the Envoy the agent starts with --envoy-path, which this agent does not start: ignored", logkey.Variables, ignored)
	}
	o.cfg.Envoy.BootstrapOverride = ""
	return errs
}

// bootstrapCommandPath names the bootstrap command of the binary agent belongs to: a
// subcommand of agent (meshid agent bootstrap) or its sibling (meshid-agent bootstrap).
func bootstrapCommandPath(agentCmd *cobra.Command) string {
	for _, c := range agentCmd.Commands() {
		if c.Name() == bootstrapUse {
			return c.CommandPath()
		}
	}
	return agentCmd.Root().CommandPath() + " " + bootstrapUse
}

// NewAgentCommand returns `agent`. lookupEnv reads the environment (os.LookupEnv in production);
// embed starts the control plane in-process when no CA is given (nil in a binary without a CA);
// check merges the bootstrap override of the Envoy the agent runs (nil in a binary without
// Envoy's types: Envoy merges it); node makes node mode (nil in a sidecar's binary, which
// serves one workload).
func NewAgentCommand(g *Globals, run AgentRunner, lookupEnv func(string) (string, bool), embed agent.EmbedFunc, check agent.BootstrapCheckFunc, node agent.NodeFunc) *cobra.Command {
	// The agent reads no ISTIO_META_*: only the bootstrap carries them.
	o := newAgentOptions(lookupEnv, nil, embed, check, node)
	caSource := `  3. else a CA: the one at --ca-addr or, when none is given, a control plane run in-process
     under --root-dir (meshid agent --root-dir ./run needs nothing else).`
	if embed == nil {
		caSource = `  3. else the CA at --ca-addr (required: this binary carries no CA; "meshid agent" can run
     one in-process).`
	}
	cmd := &cobra.Command{
		Use:   "agent",
		Short: "Run the workload agent: obtain, renew and hand out the workload certificate",
		Long: `Run the meshid agent next to a workload (a sidecar, or a service on a VM). It serves Envoy's
Secret Discovery Service on <workload-socket-dir>/socket ("default": the workload key pair,
"ROOTCA": the trust bundle, and file-cert:<chain>~<key> / file-root:<roots> for files under
--file-resource-dirs), choosing its source at start-up:
  1. something already answers on the socket: leave it to that server;
  2. --file-mounted-certs, or cert-chain.pem, key.pem and root-cert.pem in --credentials-dir:
     serve those files, watched;
` + caSource + `
From a CA it obtains a certificate for spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>,
authenticating with the token at --token-path (re-read at every request), or the GCE metadata
server's identity token with --credential-fetcher-type GoogleComputeEngine, or, once it holds a
valid certificate, with that certificate over mTLS. It renews the certificate when
--grace-period-ratio of its lifetime is left, whether or not anyone is asking, keeps the current
one while renewals fail, pushes each new one to Envoy and writes it to --output-certs (retried
until it succeeds; the agent is not ready meanwhile).

Istio's variables are honoured, so the agent is a drop-in; a flag wins over its variable:
` + envHelp(agentEnv()) + `
What meshid does not implement is refused, not ignored: CREDENTIAL_FETCHER_TYPE takes JWT (the
token file at --token-path) or GoogleComputeEngine (with CREDENTIAL_IDENTITY_PROVIDER, the
audience, and GCE_METADATA_HOST; each refused without it, and --token-path with it); with
--token-exchange-url, that token is exchanged (RFC 8693) and only the exchanged one presented;
PILOT_CERT_PROVIDER istiod only. CA_PROVIDER=GoogleCA speaks the Mesh CA protocol instead of
Citadel's, to meshid ca (or the embedded CA), which serves both, or to another Mesh CA: the same
credentials, retries and trust (unlike Istio, --ca-addr still defaults to the discovery address,
not meshca.googleapis.com:443); GoogleCA in another case is refused, and --gke-cluster-url
without it. Istio's other variables that meshid does not
implement (JWT_POLICY, PROXY_CONFIG, ...) are named in one warning at
start when set. A path given must exist (--credentials-dir, --prov-cert) and a root file hold
a PEM certificate (--ca-root-cert, --xds-root-cert); only the defaults may be absent. Addresses are HOST:PORT. A refusal exits 2, before anything runs.

The status server (--status-addr) answers /healthz/ready, 200 once the workload certificate is
held (and written to --output-certs; a node agent holds none, and with --workload-attestation-pods
waits for its node's pods to be listed), Envoy's sockets lead to the agent, an Envoy connected to
the xDS proxy has acknowledged clusters and listeners, and the Envoy the agent runs says LIVE;
otherwise 503 naming every condition unmet. It answers /metrics (the agent's) and
/stats/prometheus (the agent's, Envoy's and, with --istio-prometheus-annotations, the
application's, merged), the kubelet's probes of the workload's containers as Istio's injector
rewrites them, /app-health/<container>/{livez,readyz,startupz} (the agent runs the HTTP, TCP or
gRPC probe of --istio-kube-app-probers on --instance-ip, which Envoy's mTLS does not guard),
and POST /quitquitquit from loopback, which ends Envoy and the agent at once with status 0 (a
Job's sidecar). The debug server (--debug-addr, loopback, answering only a Host that names
loopback) answers /debug/secrets. Envoy's xDS (ADS, state of the world or delta) is proxied from
--xds-socket to --discovery-addr (by default the CA, or the in-process control plane),
authenticated as the CA client is; /debug/<type> (syncz, config_dump) from the discovery server
is answered on --xds-debug-socket, next to the XDS socket and with its mode (curl
--unix-socket <socket> http://localhost/debug/config_dump), and on --debug-addr only with
--xds-debug-tcp. Every default path lives under --root-dir, so no root is needed.

With --envoy-path the agent runs Envoy as its child, as Istio's agent does: it writes Envoy's
bootstrap (that of the bootstrap command, with the same flags) to --envoy-bootstrap, starts
Envoy once the workload certificate is in service, with --proxy-log-level,
--proxy-component-log-level, --concurrency and --envoy-drain-duration, and passes it SIGHUP and
SIGUSR1. Envoy's exit ends the agent with Envoy's status, so that the kubelet or systemd restarts
the pair. On SIGTERM (or SIGINT) readiness fails at once, Envoy drains its inbound listeners,
and the agent stops it after --minimum-drain-duration and then, with
--exit-on-zero-active-connections, as soon as no downstream connection is left, or at
--termination-drain-duration-seconds since the drain began; SDS and the xDS proxy serve until
Envoy has exited. A second signal stops everything at once. Without --envoy-path Envoy runs
elsewhere, with the bootstrap the bootstrap command writes: the flags of the Envoy the agent
would run are refused, and their variables named in a warning and ignored.`,
		Args: cobra.NoArgs,
		PreRunE: func(cmd *cobra.Command, _ []string) error {
			log := g.Logger()
			errs := o.resolve(cmd, log)
			errs = append(errs, refuseEnvoyFlagsWithoutEnvoy(cmd, o, log)...)
			return o.validate(errs)
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			if o.cfg.Envoy.Path != "" {
				// Envoy's output is the agent's, as a container's or a unit's; SIGHUP and SIGUSR1
				// (reopen the logs) are Envoy's.
				o.cfg.Envoy.Stdout, o.cfg.Envoy.Stderr = cmd.OutOrStdout(), cmd.ErrOrStderr()
				signals := make(chan os.Signal, 1)
				signal.Notify(signals, syscall.SIGHUP, syscall.SIGUSR1)
				defer signal.Stop(signals)
				o.cfg.Envoy.Signals = signals
			}
			return RefusedAsCalled(RenderConfigErrors(run(cmd.Context(), o.cfg), agentFields()))
		},
	}
	o.bind(cmd.Flags())
	return cmd
}

// agentFieldFlags maps each field of agent.Config, by its path, to the flag that sets it; the
// variable, when there is one, is agentEnv's.
func agentFieldFlags() map[string]string {
	return map[string]string{ //nolint:gosec // field and flag names, not credentials
		"Identity.TrustDomain":              "trust-domain",
		"Identity.Namespace":                "namespace",
		"Identity.ServiceAccount":           "service-account",
		"Identity.InstanceIP":               "instance-ip",
		"Identity.PodName":                  "pod-name",
		"Envoy.Path":                        "envoy-path",
		"Envoy.BootstrapPath":               "envoy-bootstrap",
		"Envoy.LogLevel":                    "proxy-log-level",
		"Envoy.ComponentLogLevel":           "proxy-component-log-level",
		"Envoy.Concurrency":                 "concurrency",
		"Envoy.DrainDuration":               "envoy-drain-duration",
		"Envoy.MinimumDrainDuration":        "minimum-drain-duration",
		"Envoy.TerminationDrainDuration":    "termination-drain-duration-seconds",
		"Envoy.ExitOnZeroActiveConnections": "exit-on-zero-active-connections",
		"CA.Address":                        "ca-addr",
		"CA.Provider":                       "ca-provider",
		"CA.GKEClusterURL":                  "gke-cluster-url",
		"CA.RootCert":                       "ca-root-cert",
		"CA.ServerName":                     "istiod-san",
		"CA.ClusterID":                      "cluster-id",
		"CA.TokenPath":                      "token-path",
		"CA.ProvCert":                       "prov-cert",
		"CA.CredentialFetcherType":          "credential-fetcher-type",
		"CA.CredentialIdentityProvider":     "credential-identity-provider",
		"CA.MetadataHost":                   "gce-metadata-host",
		"CA.TokenExchangeURL":               "token-exchange-url",
		"CA.TokenExchangeAudience":          "token-exchange-audience",
		"CA.TokenExchangeRootCert":          "token-exchange-root-cert",
		"Certificate.KeyAlgorithm":          "key-algorithm",
		"Certificate.RSAKeySize":            "workload-rsa-key-size",
		"Certificate.TTL":                   "secret-ttl",
		"Certificate.GraceRatio":            "grace-period-ratio",
		"Certificate.GraceRatioJitter":      "grace-period-ratio-jitter",
		"SDS.SocketDir":                     "workload-socket-dir",
		"SDS.CredentialsDir":                "credentials-dir",
		"SDS.FileMountedCerts":              "file-mounted-certs",
		"SDS.SocketMode":                    "socket-mode",
		"SDS.FileResourceDirs":              "file-resource-dirs",
		"SDS.DrainDuration":                 "drain-duration",
		"SDS.MaxStreams":                    "sds-max-streams",
		"SDS.MaxStreamsPerConnection":       "sds-max-streams-per-connection",
		"SDS.WorkloadAPI":                   "workload-api",
		"SDS.WorkloadAttestation":           "workload-attestation",
		"SDS.AttestPods.Enabled":            "workload-attestation-pods",
		"SDS.AttestPods.NodeName":           "node-name",
		"SDS.AttestPods.Kubeconfig":         "kubeconfig",
		"SDS.AttestPods.InCluster":          "in-cluster",
		"XDS.DiscoveryAddress":              "discovery-addr",
		"XDS.RootCert":                      "xds-root-cert",
		"XDS.Proxy":                         "proxy-xds-via-agent",
		"XDS.ProxyDebug":                    "proxy-xds-debug-via-agent",
		"XDS.Socket":                        "xds-socket",
		"XDS.DebugSocket":                   "xds-debug-socket",
		"XDS.DebugTCP":                      "xds-debug-tcp",
		"XDS.MaxStreams":                    "xds-proxy-max-streams",
		"XDS.MaxStreamsPerConnection":       "xds-proxy-max-streams-per-connection",
		"Output.Dir":                        "output-certs",
		"Output.GroupRead":                  "output-certs-group-read",
		"Output.KeyGroupRead":               "output-certs-group-read",
		"Servers.StatusAddr":                "status-addr",
		"Servers.DebugAddr":                 "debug-addr",
		"Servers.AppProbers":                "istio-kube-app-probers",
		"Envoy.AdminPort":                   "envoy-admin-port",
		"Envoy.PrometheusPort":              "envoy-prometheus-port",
		"Envoy.BootstrapOverride":           "bootstrap-override",
		"RootDir":                           "root-dir",

		"Servers.PrometheusAnnotations": "istio-prometheus-annotations",
	}
}

// AgentVariables maps each flag of the agent command that an Istio variable sets to that
// variable, for the README's configuration table to be checked against.
func AgentVariables() map[string]string {
	env := map[string]string{}
	for _, b := range agentEnv() {
		env[b.flag] = b.env
	}
	return env
}

// agentFields names the fields of agent.Config as a user of the agent command sets them.
func agentFields() FieldNames {
	return FieldNames{Flags: agentFieldFlags(), Env: AgentVariables()}
}

func envHelp(bindings []envBinding) string {
	var b strings.Builder
	for _, e := range bindings {
		fmt.Fprintf(&b, "  %-34s --%s\n", e.env, e.flag)
	}
	return b.String()
}

func rootOrSlash(dir string) string {
	if dir == "" {
		return "/"
	}
	return dir
}
