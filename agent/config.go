// Package agent is the composition root of one meshid agent: it builds the CA client, the secret
// manager and the status server from its Config, runs them under one context, and stops them.
//
// Config is grouped by component. Every refusal of it, Validate's and New's, names a field by its
// path in Config (*FieldError), and the other fields a rule involves as {Path} in its text; cmd,
// which alone knows the flags and variables, renders them with them.
package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/credentials"

	"github.com/meshid/meshid/agent/appprobe"
	"github.com/meshid/meshid/agent/envoy"
	"github.com/meshid/meshid/agent/promstats"
	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/configerr"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/gcemetadata"
	"github.com/meshid/meshid/internal/hostport"
	"github.com/meshid/meshid/internal/istio"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/tokenexchange"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/secretmanager"
	"github.com/meshid/meshid/xdsproxy"
)

// Defaults of `meshid agent`; paths are relative to RootDir.
const (
	DefaultStatusAddr   = ":15020"
	DefaultDebugAddr    = "127.0.0.1:15004"
	DefaultSocketDir    = "var/run/secrets/workload-spiffe-uds"
	DefaultCredentials  = "var/run/secrets/workload-spiffe-credentials" //nolint:gosec // a path, not a credential
	DefaultMountedCerts = "etc/certs"
	DefaultEmbeddedDir  = "var/lib/meshid"
	DefaultXDSSocket    = "etc/istio/proxy/XDS"
	// XDSDebugSocketName is the Unix socket of /debug/<type>, next to the XDS socket.
	XDSDebugSocketName = "debug.sock"
	// Identity of the workload when the agent runs its own CA and none is given.
	DefaultEmbeddedNamespace      = "default"
	DefaultEmbeddedServiceAccount = "default"
	DefaultTrustDomain            = istio.DefaultTrustDomain
	DefaultTokenPath              = "var/run/secrets/tokens/istio-token" //nolint:gosec // a path, not a credential
	// CredentialFetcherJWT and CredentialFetcherGCE are CA.CredentialFetcherType's values, as
	// Istio names them: the token file, and the GCE metadata server's identity token.
	CredentialFetcherJWT = "JWT"
	CredentialFetcherGCE = "GoogleComputeEngine"
	// CAProviderCitadel and CAProviderGoogleCA are CA.Provider's values (CA_PROVIDER): Istio's
	// CA protocol, and the Mesh CA's.
	CAProviderCitadel   = caclient.ProviderCitadel
	CAProviderGoogleCA  = caclient.ProviderGoogleCA
	DefaultCARootCert   = "var/run/secrets/istio/root-cert.pem"
	DefaultSecretTTL    = istio.DefaultSecretTTL
	DefaultGraceRatio   = istio.DefaultGraceRatio
	DefaultGraceJitter  = istio.DefaultGraceRatioJitter
	DefaultCAServerName = istio.IstiodSAN
	// DefaultTokenExchangeAudience is the audience asked of a token exchange: the one meshid ca
	// (and Istio's CA) verifies by default.
	DefaultTokenExchangeAudience = "istio-ca"
	// Envoy's admin port and the port of its Prometheus stats, Istio's.
	DefaultEnvoyAdminPort      = 15000
	DefaultEnvoyPrometheusPort = 15090
	// DefaultEnvoyConcurrency is Envoy's worker threads, as Istio's mesh config sets them for a
	// sidecar: two, not one per core of the node.
	DefaultEnvoyConcurrency = 2
)

// Config is everything an agent needs; cmd builds it from flags and environment and validates
// it. Its fields are grouped by the component they configure; Validate's errors name them by
// their path here (FieldError), and cmd renders each with its flag and variable.
type Config struct {
	Identity    IdentityConfig
	CA          CAConfig
	Certificate CertificateConfig
	SDS         SDSConfig
	XDS         XDSConfig
	Output      OutputConfig
	Servers     ServersConfig
	Envoy       EnvoyConfig
	// RootDir prefixes every default path, so that a non-root user can run the agent anywhere.
	RootDir string

	Logger *slog.Logger
	Clock  clock.Clock
	// SocketClock paces the look at the SDS and XDS socket paths (every few seconds, for the
	// agent's life); nil: the real clock.
	SocketClock clock.Clock
	// OnEvent, when set, is told of the secret manager's events: certificates obtained, failed
	// renewals, OUTPUT_CERTS written or not, secrets changing state.
	OnEvent func(secretmanager.Event)
	// OnSocket, when set, is told after the fact when the path of the SDS or the XDS socket stops
	// leading to the agent (why) and when it leads there again (nil).
	OnSocket func(socket string, err error)
}

// IdentityConfig is the workload's identity: spiffe://TrustDomain/ns/Namespace/sa/ServiceAccount.
type IdentityConfig struct {
	TrustDomain    string
	Namespace      string
	ServiceAccount string
	// InstanceIP is the workload's address (INSTANCE_IP, the pod IP on Kubernetes): application
	// probes go there, as Istio's agent sends them; empty: 127.0.0.1.
	InstanceIP string
	// PodName (POD_NAME) names the workload in Envoy's node; empty: the host's name, which is
	// the pod's on Kubernetes.
	PodName string
}

// CAConfig is the CA the agent asks for its certificate.
type CAConfig struct {
	// Address is the CA (CA_ADDR); empty runs the control plane in-process (embedded mode).
	// RootCert is the file that verifies it (CA_ROOT_CA); when empty, PROV_CERT/root-cert.pem and
	// then RootDir/var/run/secrets/istio/root-cert.pem are used, whichever exists first, as Istio
	// does.
	Address  string
	RootCert string
	// Provider is the CA protocol (CA_PROVIDER): "" or CAProviderCitadel, IstioCertificateService;
	// CAProviderGoogleCA, the Mesh CA's MeshCertificateService, which meshid ca (and the embedded
	// control plane) serve too. Every credential below fits either.
	Provider string
	// GKEClusterURL (GKE_CLUSTER_URL), with CAProviderGoogleCA only, names the cluster's
	// location, sent with each Mesh CA request as Istio's client sent it.
	GKEClusterURL string
	ServerName    string // ISTIOD_SAN
	ClusterID     string // ISTIO_META_CLUSTER_ID
	TokenPath     string
	ProvCert      string // PROV_CERT: a key pair for mTLS to the CA
	// CredentialFetcherType is where the token comes from (CREDENTIAL_FETCHER_TYPE): "" or
	// CredentialFetcherJWT, the file at TokenPath; CredentialFetcherGCE, the metadata server's
	// identity token for CredentialIdentityProvider, the audience, from MetadataHost
	// (GCE_METADATA_HOST; empty: gcemetadata.DefaultHost). The CA client and the xDS proxy share
	// one fetcher and its cached token.
	CredentialFetcherType      string
	CredentialIdentityProvider string
	MetadataHost               string
	// TokenExchangeURL, when set, is an OAuth 2.0 token exchange endpoint (RFC 8693): the token
	// above, from the file or the fetcher, is exchanged there for a JWT with audience
	// TokenExchangeAudience (empty: DefaultTokenExchangeAudience, the CA's own), and only the
	// exchanged token is presented, to the CA and the discovery server alike, from one cache.
	// The endpoint is https, verified with TokenExchangeRootCert (empty: the system roots), or
	// http to loopback.
	TokenExchangeURL      string
	TokenExchangeAudience string
	TokenExchangeRootCert string
	// Embed starts a CA in-process when no CA address is given; cmd/meshid supplies it, and
	// meshid-agent, which links no CA, does not.
	Embed EmbedFunc
}

// CertificateConfig is the workload certificate asked of the CA: its key, its lifetime, and when
// it is renewed.
type CertificateConfig struct {
	KeyAlgorithm     pki.KeyAlgorithm
	RSAKeySize       int
	TTL              time.Duration // SECRET_TTL
	GraceRatio       float64       // SECRET_GRACE_PERIOD_RATIO
	GraceRatioJitter float64       // SECRET_GRACE_PERIOD_RATIO_JITTER
}

// SDSConfig is the SDS server and where its secrets come from when no CA is used.
type SDSConfig struct {
	// SocketDir holds the SDS socket; CredentialsDir may hold cert-chain.pem, key.pem and
	// root-cert.pem to serve instead of a CA's; FileMountedCerts serves <root>/etc/certs/ instead.
	SocketDir        string
	CredentialsDir   string
	FileMountedCerts bool
	SocketMode       os.FileMode
	// FileResourceDirs are the directories file-cert: and file-root: secrets may read; default: the
	// credentials dir and <root>/etc/certs.
	FileResourceDirs []string
	DrainDuration    time.Duration
	// MaxStreams bounds the SDS streams and FetchSecrets calls open at once, and the
	// connections; MaxStreamsPerConnection bounds one connection's streams.
	MaxStreams              int
	MaxStreamsPerConnection int
	// WorkloadAPI serves the SPIFFE Workload API (X.509-SVIDs of the workload's identity) on the
	// SDS socket, whenever the agent serves SDS.
	WorkloadAPI bool
	// WorkloadAttestation, when set, is the rules file of node mode (--workload-attestation):
	// each caller on the socket is attested (internal/attest) and gets the identity its rule
	// gives, obtained from the CA as a node agent (ImpersonatedIdentity); the agent's own
	// identity is the node account the CA trusts. The file is watched.
	WorkloadAttestation string
	// AttestPods, when Enabled, is node mode's Kubernetes source, alone or after the rules: a
	// caller in a pod no rule matches gets its pod's namespace and service account, among the
	// pods the API server has bound to this node.
	AttestPods AttestPods
	// Node makes node mode (agent/nodemode's New, with its attestor); cmd/meshid supplies it, and
	// meshid-agent, the binary of a sidecar that serves one workload, does not, so that it links
	// neither node mode nor a rules parser.
	Node NodeFunc
}

// AttestPods is where node mode finds the pods of its node: the Kubernetes API of Kubeconfig,
// or of the cluster the agent runs in (InCluster); exactly one.
type AttestPods struct {
	Enabled    bool
	NodeName   string
	Kubeconfig string
	InCluster  bool
}

// AttestFunc makes node mode's attestor of the rules file (internal/attest's New); agent/nodemode
// calls it.
type AttestFunc func(AttestConfig) (Attestor, error)

// AttestConfig is what the agent gives an AttestFunc.
type AttestConfig struct {
	RulesFile  string // "": none
	Pods       AttestPods
	Clock      clock.Clock
	Logger     *slog.Logger
	Registerer prometheus.Registerer
}

// Attestor says who each caller on the SDS socket is: its credentials attest every connection,
// Caller gives a call's caller the namespace and service account of its rule, Run watches the
// rules file (and the pods of the node), and Loaded's channel is closed after each load (node
// mode then checks the open streams' callers again). internal/attest's Attestor is one; neither
// the agent nor agent/nodemode imports it, so that meshid-agent links none of it. An Attestor
// that cannot identify callers yet (the node's pods not listed) says why with a Problem() error
// method; the agent is not ready meanwhile.
type Attestor interface {
	Credentials(inner credentials.TransportCredentials) credentials.TransportCredentials
	Caller(ctx context.Context) (namespace, serviceAccount string, err error)
	Run(ctx context.Context) error
	Loaded() <-chan struct{}
}

// XDSConfig is the proxy of Envoy's xDS to the discovery server.
type XDSConfig struct {
	// DiscoveryAddress is the discovery server Envoy's xDS is proxied to (Istio's
	// discoveryAddress); empty: the CA's address (meshid ca serves both), or the embedded
	// control plane. RootCert verifies it (XDS_ROOT_CA); empty: the CA's root.
	DiscoveryAddress string
	RootCert         string
	// Proxy serves Envoy's ADS on Socket (default <root>/etc/istio/proxy/XDS) and proxies it
	// upstream (PROXY_XDS_VIA_AGENT); ProxyDebug answers /debug/<type> from the upstream's
	// istio.io/debug (PROXY_XDS_DEBUG_VIA_AGENT) on DebugSocket (default: debug.sock next to the
	// XDS socket, with its mode: whoever may open the XDS socket may read what it shows) and,
	// with DebugTCP, on the debug server too.
	Proxy, ProxyDebug bool
	Socket            string
	DebugSocket       string
	DebugTCP          bool
	// MaxStreams bounds Envoy's ADS streams open at once, and the connections;
	// MaxStreamsPerConnection bounds one connection's streams.
	MaxStreams              int
	MaxStreamsPerConnection int
}

// OutputConfig is OUTPUT_CERTS: a directory that receives the workload key pair and roots.
type OutputConfig struct {
	Dir string // OUTPUT_CERTS
	// GroupRead makes Dir's directories and certificate files readable by the agent's group;
	// KeyGroupRead the key too.
	GroupRead, KeyGroupRead bool
	// Sync flushes each file and directory written to Dir; nil: fsync. Tests hold it.
	Sync fsutil.Syncer
}

// ServersConfig are the agent's own HTTP servers.
type ServersConfig struct {
	StatusAddr string
	DebugAddr  string // loopback only; empty disables it
	// AppProbers is ISTIO_KUBE_APP_PROBERS: JSON of /app-health/<container>/{livez,readyz,startupz}
	// paths and the probes of the application the status server runs for them (appprobe.Parse).
	AppProbers string
	// PrometheusAnnotations is ISTIO_PROMETHEUS_ANNOTATIONS: where the application serves the
	// metrics that /stats/prometheus merges (promstats.ParseAnnotations); empty: none.
	PrometheusAnnotations string
}

// EnvoyConfig is the Envoy the agent serves, as its bootstrap (Bootstrap) describes it, and,
// with Path, the Envoy the agent starts and supervises.
type EnvoyConfig struct {
	// Path is Envoy's binary: the agent writes the bootstrap to BootstrapPath (default
	// <root>/etc/istio/proxy/envoy-rev.json), starts Envoy once the workload certificate is in
	// service, and ends with it. Empty: Envoy runs elsewhere.
	Path          string
	BootstrapPath string
	// LogLevel and ComponentLogLevel are Envoy's -l and --component-log-level; Concurrency its
	// worker threads (0: one per core); DrainDuration its --drain-time-s.
	LogLevel, ComponentLogLevel string
	Concurrency                 int
	DrainDuration               time.Duration
	// MinimumDrainDuration, TerminationDrainDuration and ExitOnZeroActiveConnections are Istio's
	// MINIMUM_DRAIN_DURATION, TERMINATION_DRAIN_DURATION_SECONDS and
	// EXIT_ON_ZERO_ACTIVE_CONNECTIONS: how the agent drains Envoy on SIGTERM (envoy.DrainConfig).
	MinimumDrainDuration, TerminationDrainDuration time.Duration
	ExitOnZeroActiveConnections                    bool
	// Signals are forwarded to Envoy (SIGHUP, SIGUSR1); Stdout and Stderr receive Envoy's.
	Signals        <-chan os.Signal
	Stdout, Stderr io.Writer

	// AdminPort is Envoy's admin port on 127.0.0.1 (Istio's proxyAdminPort); PrometheusPort, when
	// not 0, the port of a listener on every address that serves Envoy's /stats/prometheus.
	AdminPort      int
	PrometheusPort int
	// BootstrapOverride (ISTIO_BOOTSTRAP_OVERRIDE) is a file, JSON or YAML, merged over the
	// bootstrap: by CheckBootstrap when set, else by Envoy (--config-yaml).
	BootstrapOverride string
	// CheckBootstrap checks the bootstrap with Envoy's types and merges the override over it;
	// cmd/meshid supplies it (bootstrapcheck.Merge). Nil in meshid-agent, which leaves Envoy's
	// types out to stay small: the bootstrap is written as built.
	CheckBootstrap BootstrapCheckFunc
	// Metadata is the node's metadata from the ISTIO_META_<KEY> variables, as KEY.
	Metadata map[string]string
}

// BootstrapCheckFunc checks bootstrap and returns it with override (JSON or YAML, read from
// overridePath; empty: none) merged over it; an error caused by the override wraps
// envoy.ErrOverride.
type BootstrapCheckFunc func(bootstrap, override []byte, overridePath string) ([]byte, error)

// EmbedFunc starts a control plane in-process for an agent given no CA address.
type EmbedFunc func(EmbedConfig) (ControlPlane, error)

// EmbedConfig is what an embedded control plane is given: a state dir the agent has locked, the
// private socket to serve the CA protocol on, and the workload's identity to mint tokens for.
type EmbedConfig struct {
	StateDir    string
	SocketPath  string
	TrustDomain string
	Identity    pki.SPIFFEID
	// NodeAgent: the agent is a node agent, and the control plane trusts Identity's account to
	// ask for its workloads' identities (as meshid ca --trusted-node-accounts).
	NodeAgent bool
	Clock     clock.Clock
	Logger    *slog.Logger
}

// ControlPlane is a control plane run in-process, as the agent uses it.
type ControlPlane interface {
	// GRPCAddr (unix:///path) and RootCertFile are where the CA client finds and verifies it.
	GRPCAddr() string
	RootCertFile() string
	// Token mints the workload's token for a request.
	Token(ctx context.Context) (string, error)
	// Run serves until ctx ends; Close releases a control plane that will not Run.
	Run(ctx context.Context) error
	Close()
}

// DefaultConfig returns the configuration `meshid agent` starts from (paths under rootDir).
func DefaultConfig(rootDir string) Config {
	return Config{
		Identity: IdentityConfig{TrustDomain: DefaultTrustDomain},
		CA: CAConfig{
			ServerName: DefaultCAServerName,
			TokenPath:  filepath.Join(rootDirOrSlash(rootDir), DefaultTokenPath),
		},
		Certificate: CertificateConfig{
			KeyAlgorithm:     pki.ECDSA,
			RSAKeySize:       pki.DefaultRSAKeySize,
			TTL:              DefaultSecretTTL,
			GraceRatio:       DefaultGraceRatio,
			GraceRatioJitter: DefaultGraceJitter,
		},
		SDS: SDSConfig{
			MaxStreams:              sds.DefaultMaxStreams,
			MaxStreamsPerConnection: sds.DefaultMaxStreamsPerConnection,
			WorkloadAPI:             true,
		},
		XDS: XDSConfig{
			Proxy:                   true,
			ProxyDebug:              true,
			MaxStreams:              xdsproxy.DefaultMaxStreams,
			MaxStreamsPerConnection: xdsproxy.DefaultMaxStreamsPerConnection,
		},
		Servers: ServersConfig{StatusAddr: DefaultStatusAddr, DebugAddr: DefaultDebugAddr},
		Envoy: EnvoyConfig{
			AdminPort:                DefaultEnvoyAdminPort,
			PrometheusPort:           DefaultEnvoyPrometheusPort,
			LogLevel:                 envoy.DefaultLogLevel,
			ComponentLogLevel:        envoy.DefaultComponentLogLevel,
			Concurrency:              DefaultEnvoyConcurrency,
			DrainDuration:            envoy.DefaultDrainDuration,
			MinimumDrainDuration:     envoy.DefaultMinimumDrainDuration,
			TerminationDrainDuration: envoy.DefaultTerminationDrainDuration,
		},
		RootDir: rootDir,
	}
}

// path returns a default path under the root dir (the real absolute path when it is empty).
func (c *Config) path(rel string) string { return filepath.Join(rootDirOrSlash(c.RootDir), rel) }

func (c *Config) socketDir() string {
	if c.SDS.SocketDir != "" {
		return c.SDS.SocketDir
	}
	return c.path(DefaultSocketDir)
}

func (c *Config) xdsSocket() string {
	if c.XDS.Socket != "" {
		return c.XDS.Socket
	}
	return c.path(DefaultXDSSocket)
}

func (c *Config) xdsDebugSocket() string {
	if c.XDS.DebugSocket != "" {
		return c.XDS.DebugSocket
	}
	return filepath.Join(filepath.Dir(c.xdsSocket()), XDSDebugSocketName)
}

func (c *Config) credentialsDir() string {
	if c.SDS.CredentialsDir != "" {
		return c.SDS.CredentialsDir
	}
	return c.path(DefaultCredentials)
}

func (c *Config) fileResourceDirs() []string {
	if len(c.SDS.FileResourceDirs) > 0 {
		return c.SDS.FileResourceDirs
	}
	return []string{c.credentialsDir(), c.path(DefaultMountedCerts)}
}

// NodeMode reports whether the agent serves every workload of its node (WorkloadAttestation,
// AttestPods).
func (c *Config) NodeMode() bool { return c.SDS.WorkloadAttestation != "" || c.SDS.AttestPods.Enabled }

// checkAttestPods refuses a Kubernetes source of node mode that names no node or no API, or
// two, and its settings without it.
func (c *Config) checkAttestPods() []error {
	p := c.SDS.AttestPods
	var errs []error
	if !p.Enabled {
		if p.Kubeconfig != "" {
			errs = append(errs, configerr.Errorf("SDS.AttestPods.Kubeconfig", "{SDS.AttestPods.Kubeconfig} is the API of {SDS.AttestPods.Enabled}, which is not set: set it, or unset {SDS.AttestPods.Kubeconfig}"))
		}
		if p.InCluster {
			errs = append(errs, configerr.Errorf("SDS.AttestPods.InCluster", "{SDS.AttestPods.InCluster} is the API of {SDS.AttestPods.Enabled}, which is not set: set it, or unset {SDS.AttestPods.InCluster}"))
		}
		return errs
	}
	if c.SDS.Node == nil {
		errs = append(errs, configerr.Errorf("SDS.AttestPods.Enabled", "{SDS.AttestPods.Enabled}: node mode is in meshid (meshid agent); this binary, a sidecar's, serves one workload and links no Kubernetes client"))
	}
	if p.NodeName == "" {
		errs = append(errs, configerr.Errorf("SDS.AttestPods.NodeName", "{SDS.AttestPods.NodeName} is required with {SDS.AttestPods.Enabled}: the pods watched are the ones bound to this node"))
	}
	switch {
	case p.Kubeconfig != "" && p.InCluster:
		errs = append(errs, configerr.Errorf("SDS.AttestPods.Kubeconfig", "{SDS.AttestPods.Kubeconfig} and {SDS.AttestPods.InCluster} both name the Kubernetes API: give one"))
	case p.Kubeconfig == "" && !p.InCluster:
		errs = append(errs, configerr.Errorf("SDS.AttestPods.Enabled", "{SDS.AttestPods.Enabled} reads the pods from the Kubernetes API: give {SDS.AttestPods.Kubeconfig} or {SDS.AttestPods.InCluster}"))
	case p.Kubeconfig != "":
		if _, err := statRegular(p.Kubeconfig); err != nil {
			errs = append(errs, &FieldError{Field: "SDS.AttestPods.Kubeconfig", Value: p.Kubeconfig, Err: err})
		}
	}
	return errs
}

// checkNodeMode refuses what node mode cannot do: one workload's credentials (files, OUTPUT_CERTS),
// the Mesh CA protocol, whose requests cannot name another identity, and the xDS proxy, which
// has only the node's.
func (c *Config) checkNodeMode() []error {
	if !c.NodeMode() {
		return nil
	}
	var errs []error
	mode := "SDS.WorkloadAttestation"
	if c.SDS.WorkloadAttestation == "" {
		mode = "SDS.AttestPods.Enabled"
	}
	why := "{" + mode + "} serves each caller its own identity, "
	if c.SDS.Node == nil && c.SDS.WorkloadAttestation != "" {
		errs = append(errs, configerr.Errorf("SDS.WorkloadAttestation", "{SDS.WorkloadAttestation}: node mode is in meshid (meshid agent); this binary, a sidecar's, serves one workload and carries no attestation"))
	}
	if c.Output.Dir != "" {
		errs = append(errs, configerr.Errorf("Output.Dir", "%sso there is no one key pair to write to {Output.Dir}; unset it", why))
	}
	if c.SDS.FileMountedCerts {
		errs = append(errs, configerr.Errorf("SDS.FileMountedCerts", "%sfrom the CA: {SDS.FileMountedCerts} would serve every caller one workload's files; unset it", why))
	}
	if c.SDS.CredentialsDir != "" {
		errs = append(errs, configerr.Errorf("SDS.CredentialsDir", "%sfrom the CA: the files of {SDS.CredentialsDir} are one workload's, and are not served in node mode; unset it", why))
	}
	if c.CA.Provider == CAProviderGoogleCA {
		errs = append(errs, configerr.Errorf("CA.Provider", "%swhich the CA signs on the agent's request: {CA.Provider} %s cannot ask for another identity (the Mesh CA's request has no metadata); use %s",
			why, CAProviderGoogleCA, CAProviderCitadel))
	}
	if c.CA.ProvCert != "" {
		errs = append(errs, configerr.Errorf("CA.ProvCert", "%swhich the CA signs only for a caller authenticated by a token: {CA.ProvCert}'s certificate would not be enough; unset it", why))
	}
	if c.XDS.Proxy {
		// The proxy authenticates upstream as the agent: every Envoy on the node would get the
		// node account's configuration.
		errs = append(errs, configerr.Errorf("XDS.Proxy", "%sbut {XDS.Proxy} would proxy every Envoy's xDS as the node agent's own identity, and so give any workload the node's configuration; unset it", why))
	}
	return errs
}

// embedded reports whether the agent runs its own control plane: no CA is given.
func (c *Config) embedded() bool { return c.CA.Address == "" }

func rootDirOrSlash(rootDir string) string {
	if rootDir == "" {
		return "/"
	}
	return rootDir
}

// SPIFFEID returns the workload's SPIFFE ID; with an embedded CA, an unset namespace or service
// account is "default".
func (c *Config) SPIFFEID() (pki.SPIFFEID, error) {
	ns, sa := c.Identity.Namespace, c.Identity.ServiceAccount
	if c.embedded() {
		if ns == "" {
			ns = DefaultEmbeddedNamespace
		}
		if sa == "" {
			sa = DefaultEmbeddedServiceAccount
		}
	}
	return pki.NewSPIFFEID(c.Identity.TrustDomain, ns, sa)
}

// FieldError is a problem with one field of Config, named by its path in Config
// ("Certificate.GraceRatio"), and a rule over several fields names the others in its text as
// {Path}. cmd, which alone knows the flag and the variable that set each field, renders it with
// them; its own text names each field by its path.
type FieldError = configerr.FieldError

// Validate reports every problem with the configuration at once, joined (errors.Join); a problem
// with one field is a *FieldError.
func (c *Config) Validate() error {
	var errs []error
	switch {
	case !c.embedded() && (c.Identity.Namespace == "" || c.Identity.ServiceAccount == ""):
		if c.Identity.Namespace == "" {
			errs = append(errs, configerr.Errorf("Identity.Namespace", "{Identity.Namespace} is required with {CA.Address}: the CA signs for the workload's own namespace"))
		}
		if c.Identity.ServiceAccount == "" {
			errs = append(errs, configerr.Errorf("Identity.ServiceAccount", "{Identity.ServiceAccount} is required with {CA.Address}: the CA signs for the workload's own service account"))
		}
	default:
		if _, err := c.SPIFFEID(); err != nil {
			errs = append(errs, configerr.Errorf("Identity.TrustDomain", "workload identity ({Identity.TrustDomain}, {Identity.Namespace}, {Identity.ServiceAccount}): %w", err))
		}
	}
	errs = append(errs, c.checkCredentialFetcher()...)
	errs = append(errs, c.checkTokenExchange()...)
	errs = append(errs, c.checkCAProvider()...)
	errs = append(errs, c.checkNodeMode()...)
	errs = append(errs, c.checkAttestPods()...)
	if c.Output.KeyGroupRead && !c.Output.GroupRead {
		errs = append(errs, configerr.Errorf("Output.KeyGroupRead", "{Output.KeyGroupRead}: a group-readable {Output.Dir} key needs group-readable directories too"))
	}
	if err := fsutil.CheckSocketPath(filepath.Join(c.socketDir(), sds.SocketName)); err != nil {
		errs = append(errs, &FieldError{Field: "SDS.SocketDir", Err: err})
	}
	errs = append(errs, c.checkAddresses()...)
	if _, err := appprobe.Parse(c.Servers.AppProbers); err != nil {
		errs = append(errs, &FieldError{Field: "Servers.AppProbers", Err: err})
	}
	if err := c.checkPrometheusAnnotations(); err != nil {
		errs = append(errs, err)
	}
	if ip := c.Identity.InstanceIP; ip != "" {
		if _, err := netip.ParseAddr(ip); err != nil {
			errs = append(errs, &FieldError{Field: "Identity.InstanceIP", Value: ip, Err: errors.New("is not an IP address")})
		}
	}
	if c.SDS.DrainDuration < 0 {
		errs = append(errs, &FieldError{Field: "SDS.DrainDuration", Value: c.SDS.DrainDuration, Err: configerr.ErrMustNotBeNegative})
	}
	if c.SDS.MaxStreams <= 0 {
		errs = append(errs, &FieldError{Field: "SDS.MaxStreams", Value: c.SDS.MaxStreams, Err: configerr.ErrMustBePositive})
	}
	if c.SDS.MaxStreamsPerConnection <= 0 {
		errs = append(errs, &FieldError{Field: "SDS.MaxStreamsPerConnection", Value: c.SDS.MaxStreamsPerConnection, Err: configerr.ErrMustBePositive})
	}
	errs = append(errs, c.validateXDS()...)
	errs = append(errs, c.validateEnvoy()...)
	switch c.Certificate.KeyAlgorithm {
	case pki.ECDSA:
	case pki.RSA:
		if err := pki.ValidateRSAKeySize(c.Certificate.RSAKeySize); err != nil {
			errs = append(errs, &FieldError{Field: "Certificate.RSAKeySize", Err: err})
		}
	default:
		errs = append(errs, &FieldError{Field: "Certificate.KeyAlgorithm", Value: string(c.Certificate.KeyAlgorithm), Err: errors.New("want ECDSA or RSA")})
	}
	if c.Certificate.TTL <= 0 {
		errs = append(errs, &FieldError{Field: "Certificate.TTL", Value: c.Certificate.TTL, Err: configerr.ErrMustBePositive})
	}
	if err := secretmanager.ValidateGrace(c.Certificate.GraceRatio, c.Certificate.GraceRatioJitter); err != nil {
		field := "Certificate.GraceRatioJitter"
		if secretmanager.ValidateGrace(c.Certificate.GraceRatio, 0) != nil {
			field = "Certificate.GraceRatio"
		}
		errs = append(errs, &FieldError{Field: field, Err: err})
	}
	errs = append(errs, c.checkFileResourceDirs()...)
	return errors.Join(errs...)
}

// validateXDS checks the xDS proxy's settings.
func (c *Config) validateXDS() []error {
	var errs []error
	if c.XDS.MaxStreams <= 0 {
		errs = append(errs, &FieldError{Field: "XDS.MaxStreams", Value: c.XDS.MaxStreams, Err: configerr.ErrMustBePositive})
	}
	if c.XDS.MaxStreamsPerConnection <= 0 {
		errs = append(errs, &FieldError{Field: "XDS.MaxStreamsPerConnection", Value: c.XDS.MaxStreamsPerConnection, Err: configerr.ErrMustBePositive})
	}
	if c.XDS.DebugTCP && !c.XDS.ProxyDebug {
		errs = append(errs, configerr.Errorf("XDS.DebugTCP", "{XDS.DebugTCP} serves the xDS debug endpoint, which {XDS.ProxyDebug=false} turns off"))
	}
	if c.XDS.DebugTCP && c.Servers.DebugAddr == "" {
		errs = append(errs, configerr.Errorf("XDS.DebugTCP", "{XDS.DebugTCP} serves /debug/<type> on {Servers.DebugAddr}, which is empty"))
	}
	if c.XDS.ProxyDebug {
		if err := fsutil.CheckSocketPath(c.xdsDebugSocket()); err != nil {
			errs = append(errs, &FieldError{Field: "XDS.DebugSocket", Err: err})
		}
	}
	return errs
}

// maxOverrideSize bounds the bootstrap override read: a bootstrap takes a few kilobytes.
const maxOverrideSize = 1 << 20

var (
	errPortOrKernel  = errors.New("must be a port, 1-65535, or 0 for one the kernel chooses, which Envoy writes to a file the agent reads")
	errPortOrNone    = errors.New("must be a port, 1-65535, or 0 for none")
	errOverrideLarge = fmt.Errorf("is larger than %d bytes", maxOverrideSize)
)

// validateEnvoy checks what the bootstrap is made of; the override file must be there now, as
// every path given explicitly.
func (c *Config) validateEnvoy() []error {
	var errs []error
	admin, stats := c.Envoy.AdminPort, c.Envoy.PrometheusPort
	switch {
	case admin < 0 || admin > 65535:
		errs = append(errs, &FieldError{Field: "Envoy.AdminPort", Value: admin, Err: errPortOrKernel})
	case admin == 0 && stats != 0:
		errs = append(errs, configerr.Errorf("Envoy.AdminPort", "{Envoy.AdminPort} 0 (the kernel's choice) needs {Envoy.PrometheusPort} 0: the stats listener forwards to the admin's port"))
	}
	switch {
	case stats < 0 || stats > 65535:
		errs = append(errs, &FieldError{Field: "Envoy.PrometheusPort", Value: stats, Err: errPortOrNone})
	case stats != 0 && stats == admin:
		errs = append(errs, configerr.Errorf("Envoy.PrometheusPort", "{Envoy.PrometheusPort} %d is {Envoy.AdminPort} too: Envoy cannot listen twice on one port", stats))
	}
	if path := c.Envoy.BootstrapOverride; path != "" {
		if err := checkOverrideFile(path); err != nil {
			errs = append(errs, &FieldError{Field: "Envoy.BootstrapOverride", Value: path, Err: err})
		}
	}
	if path := c.Envoy.Path; path != "" {
		if err := checkExecutable(path); err != nil {
			errs = append(errs, &FieldError{Field: "Envoy.Path", Value: path, Err: err})
		}
	}
	for _, d := range []struct {
		field string
		value time.Duration
	}{
		{"Envoy.DrainDuration", c.Envoy.DrainDuration},
		{"Envoy.MinimumDrainDuration", c.Envoy.MinimumDrainDuration},
		{"Envoy.TerminationDrainDuration", c.Envoy.TerminationDrainDuration},
	} {
		if d.value < 0 {
			errs = append(errs, &FieldError{Field: d.field, Value: d.value, Err: errors.New("must not be negative")})
		}
	}
	if c.Envoy.Concurrency < 0 {
		errs = append(errs, &FieldError{Field: "Envoy.Concurrency", Value: c.Envoy.Concurrency, Err: errors.New("must be 0 (one per core) or more")})
	}
	return errs
}

// checkExecutable says what keeps path from being run, completing "PATH ...".
func checkExecutable(path string) error {
	info, err := statRegular(path)
	if err == nil && info.Mode().Perm()&0o111 == 0 {
		return errors.New("is not executable")
	}
	return err
}

// checkOverrideFile says what is wrong with a bootstrap override file, completing "PATH ...".
func checkOverrideFile(path string) error {
	info, err := statRegular(path)
	if err == nil && info.Size() > maxOverrideSize {
		return errOverrideLarge
	}
	return err
}

// statRegular says, completing "PATH ...", why path is not a regular file there is.
func statRegular(path string) (fs.FileInfo, error) {
	info, err := os.Stat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil, errors.New("does not exist")
	case err != nil:
		return nil, fmt.Errorf("cannot be read: %w", err)
	case !info.Mode().IsRegular():
		return nil, fmt.Errorf("is not a regular file (%s)", info.Mode().Type())
	}
	return info, nil
}

// checkAddresses refuses an address that is not HOST:PORT: without a port, gRPC would dial 443
// and retry forever; with a scheme, the scheme is taken for a host; a port out of range would
// fail only when the agent listens.
func (c *Config) checkAddresses() []error {
	var errs []error
	if err := hostport.CheckListen(c.Servers.StatusAddr); err != nil {
		errs = append(errs, &FieldError{Field: "Servers.StatusAddr", Value: c.Servers.StatusAddr, Err: err})
	}
	if c.Servers.DebugAddr != "" {
		if err := hostport.CheckListen(c.Servers.DebugAddr); err != nil {
			errs = append(errs, &FieldError{Field: "Servers.DebugAddr", Value: c.Servers.DebugAddr, Err: err})
		} else if host, _, _ := net.SplitHostPort(c.Servers.DebugAddr); host != "localhost" && !isLoopback(host) {
			errs = append(errs, &FieldError{Field: "Servers.DebugAddr", Value: c.Servers.DebugAddr,
				Err: errors.New("the debug server shows secrets' metadata and listens on loopback only")})
		}
	}
	// The CA address defaults to the discovery address: its mistake is reported once, as the
	// field given.
	if c.CA.Address != "" && c.CA.Address != c.XDS.DiscoveryAddress {
		if err := checkDialAddr(c.CA.Address); err != nil {
			errs = append(errs, &FieldError{Field: "CA.Address", Value: c.CA.Address, Err: err})
		}
	}
	if c.XDS.DiscoveryAddress != "" {
		if err := checkDialAddr(c.XDS.DiscoveryAddress); err != nil {
			errs = append(errs, &FieldError{Field: "XDS.DiscoveryAddress", Value: c.XDS.DiscoveryAddress, Err: err})
		}
	}
	return errs
}

// checkCredentialFetcher checks the token's source: a known type, the GCE fetcher's audience
// and host given with it and only with it, and a CA to present its token to.
func (c *Config) checkCredentialFetcher() []error {
	var errs []error
	gce := c.CA.CredentialFetcherType == CredentialFetcherGCE
	switch c.CA.CredentialFetcherType {
	case "", CredentialFetcherJWT:
	case CredentialFetcherGCE:
		if c.embedded() {
			errs = append(errs, configerr.Errorf("CA.CredentialFetcherType", "{CA.CredentialFetcherType} %s needs {CA.Address}: the embedded control plane mints its own token, and the fetched one would go nowhere", CredentialFetcherGCE))
		}
		if c.CA.CredentialIdentityProvider == "" {
			errs = append(errs, configerr.Errorf("CA.CredentialIdentityProvider", "{CA.CredentialIdentityProvider} is required with {CA.CredentialFetcherType} %s: it is the audience of the identity token asked of the metadata server", CredentialFetcherGCE))
		}
	default:
		errs = append(errs, &FieldError{Field: "CA.CredentialFetcherType", Value: c.CA.CredentialFetcherType,
			Err: fmt.Errorf("is unknown: want %s (the token file, also the default) or %s", CredentialFetcherJWT, CredentialFetcherGCE)})
	}
	if !gce && c.CA.CredentialIdentityProvider != "" {
		errs = append(errs, configerr.Errorf("CA.CredentialIdentityProvider", "{CA.CredentialIdentityProvider} has no effect without {CA.CredentialFetcherType} %s: the token file is presented as it is; unset it", CredentialFetcherGCE))
	}
	if !gce && c.CA.MetadataHost != "" {
		errs = append(errs, configerr.Errorf("CA.MetadataHost", "{CA.MetadataHost} has no effect without {CA.CredentialFetcherType} %s: nothing asks the metadata server; unset it", CredentialFetcherGCE))
	}
	if gce && c.CA.MetadataHost != "" {
		if err := gcemetadata.CheckHost(c.CA.MetadataHost); err != nil {
			errs = append(errs, &FieldError{Field: "CA.MetadataHost", Value: c.CA.MetadataHost, Err: err})
		}
	}
	return errs
}

// checkCAProvider checks the CA protocol and what goes with it only. Each credential fits either
// protocol, since meshid ca authenticates both services alike: the token file, the GCE identity
// token, the exchanged token, the provisioned or held certificate over mTLS, and the embedded
// control plane's own token (it serves both services too). So no credential is refused with a
// provider; GKEClusterURL is refused without GoogleCA, and one that names no location.
func (c *Config) checkCAProvider() []error {
	var errs []error
	switch c.CA.Provider {
	case "", CAProviderCitadel, CAProviderGoogleCA:
	default:
		errs = append(errs, &FieldError{Field: "CA.Provider", Value: c.CA.Provider,
			Err: fmt.Errorf("is unknown: want %s (the default) or %s", CAProviderCitadel, CAProviderGoogleCA)})
	}
	if c.CA.GKEClusterURL == "" {
		return errs
	}
	if c.CA.Provider != CAProviderGoogleCA {
		errs = append(errs, configerr.Errorf("CA.GKEClusterURL", "{CA.GKEClusterURL} has no effect without {CA.Provider} %s: only the Mesh CA protocol sends a location; unset it", CAProviderGoogleCA))
	} else if _, err := caclient.LocationFromClusterURL(c.CA.GKEClusterURL); err != nil {
		errs = append(errs, &FieldError{Field: "CA.GKEClusterURL", Value: c.CA.GKEClusterURL, Err: err})
	}
	return errs
}

// caLocation is the location the Mesh CA requests name; Validate has checked the URL.
func (c *Config) caLocation() string {
	loc, _ := caclient.LocationFromClusterURL(c.CA.GKEClusterURL)
	return loc
}

// checkTokenExchange checks the token exchange: a usable endpoint, a CA to present its token
// to, and its audience and root given only with it.
func (c *Config) checkTokenExchange() []error {
	var errs []error
	if c.CA.TokenExchangeURL == "" {
		if c.CA.TokenExchangeAudience != "" {
			errs = append(errs, configerr.Errorf("CA.TokenExchangeAudience", "{CA.TokenExchangeAudience} has no effect without {CA.TokenExchangeURL}: nothing is exchanged; unset it"))
		}
		if c.CA.TokenExchangeRootCert != "" {
			errs = append(errs, configerr.Errorf("CA.TokenExchangeRootCert", "{CA.TokenExchangeRootCert} has no effect without {CA.TokenExchangeURL}: nothing is exchanged; unset it"))
		}
		return errs
	}
	if err := tokenexchange.CheckURL(c.CA.TokenExchangeURL); err != nil {
		errs = append(errs, &FieldError{Field: "CA.TokenExchangeURL", Value: c.CA.TokenExchangeURL, Err: err})
	} else if c.CA.TokenExchangeRootCert != "" && strings.HasPrefix(c.CA.TokenExchangeURL, "http:") {
		errs = append(errs, configerr.Errorf("CA.TokenExchangeRootCert", "{CA.TokenExchangeRootCert} has no effect with an http {CA.TokenExchangeURL}: nothing is verified; unset it or use https"))
	}
	if c.embedded() {
		errs = append(errs, configerr.Errorf("CA.TokenExchangeURL", "{CA.TokenExchangeURL} needs {CA.Address}: the embedded control plane mints its own token, and the exchanged one would go nowhere"))
	}
	return errs
}

func isLoopback(host string) bool {
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// checkDialAddr checks the address of a CA or discovery server: HOST:PORT, or unix:///path.
func checkDialAddr(addr string) error {
	if path, ok := strings.CutPrefix(addr, fsutil.UnixScheme); ok {
		if !filepath.IsAbs(path) {
			return fmt.Errorf("a Unix socket needs an absolute path: %s/PATH", fsutil.UnixScheme)
		}
		return nil
	}
	return hostport.CheckDial(addr)
}

// checkFileResourceDirs refuses a dir file resources may read that overlaps the embedded CA's
// state dir, as written or once its symlinks are resolved: any local client could then be served
// the CA's key. In every mode, since the state dir keeps the keys of an earlier embedded run.
func (c *Config) checkFileResourceDirs() []error {
	field := "{SDS.FileResourceDirs}"
	if len(c.SDS.FileResourceDirs) == 0 {
		field += " (default: the credentials dir and <root-dir>/etc/certs)"
	}
	state := c.path(DefaultEmbeddedDir)
	var errs []error
	for _, dir := range c.fileResourceDirs() {
		abs, err := filepath.Abs(dir)
		if err != nil {
			errs = append(errs, configerr.Errorf("SDS.FileResourceDirs", "%s: %s: %w", field, dir, err))
			continue
		}
		if fsutil.Overlap(abs, state) {
			errs = append(errs, configerr.Errorf("SDS.FileResourceDirs", "%s: %s overlaps the embedded CA's state dir %s, which holds the CA's keys", field, dir, state))
		}
	}
	return errs
}

// checkPrometheusAnnotations refuses annotations that cannot be read, and, as Istio's agent does,
// an application port that is the status port's: /stats/prometheus would scrape itself.
func (c *Config) checkPrometheusAnnotations() error {
	app, err := promstats.ParseAnnotations(c.Servers.PrometheusAnnotations)
	if err != nil {
		return &FieldError{Field: "Servers.PrometheusAnnotations", Err: err}
	}
	if _, port, err := net.SplitHostPort(c.Servers.StatusAddr); app != nil && err == nil && port == strconv.Itoa(app.Port) {
		return configerr.Errorf("Servers.PrometheusAnnotations", "{Servers.PrometheusAnnotations}: port %d is {Servers.StatusAddr}'s: /stats/prometheus would scrape itself", app.Port)
	}
	return nil
}
