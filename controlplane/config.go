// Package controlplane is the composition root of `meshid ca`: it wires the CA core, its gRPC
// server, namespace targeting and the monitoring server, and runs them until its context ends.
//
// New builds in stages, each a function returning finished parts to the next: the listeners,
// the stores (nothing is written before they are checked), the key material and its authority,
// the authenticators, the controllers, the servers. No part is filled in after it is made. It
// holds wiring only: what the parts do, down to the state dir's layout, is in their packages.
//
// Validate, New and Targets name a refused field by its path in Config (*configerr.FieldError);
// cmd, which alone knows the flags, renders it with them.
package controlplane

import (
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"time"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller"
	caserver "github.com/meshid/meshid/ca/server"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/discovery"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/configerr"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/hostport"
	"github.com/meshid/meshid/internal/istio"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// Defaults of `meshid ca`.
const (
	DefaultGRPCAddr       = ":15012"
	DefaultMonitoringAddr = ":9093"
	DefaultTrustDomain    = istio.DefaultTrustDomain
	DefaultCANamespace    = istio.DefaultCANamespace
	DefaultStateDir       = "/var/lib/meshid/ca"

	// DefaultMaxConnectionAge is istiod's: long enough that reconnecting costs nothing to
	// speak of, short enough that a stream opened with a credential that has since expired (a
	// token, a client certificate whose root's overlap ended) ends within it.
	DefaultMaxConnectionAge = 30 * time.Minute
	// DefaultMaxConnectionAgeGrace lets a response in flight reach the client before its
	// connection is closed; Envoy and gRPC clients reconnect as soon as they are told to go.
	DefaultMaxConnectionAgeGrace = 10 * time.Second
)

// Config is everything the control plane needs; cmd builds it from flags and validates it.
type Config struct {
	StateDir       string
	CACertsDir     string // optional plugged-in CA
	GRPCAddr       string
	MonitoringAddr string // empty disables the monitoring server
	TrustDomain    string

	SelfSigned ca.SelfSignedConfig

	RootCheckInterval     time.Duration
	RootRotationThreshold float64
	TrustBundleOverlap    time.Duration // 0: a replaced root stays trusted until it expires
	CACertsDebounce       time.Duration // 0: the default

	JWTKeysFile string // empty: trust StateDir/token-key.pem
	JWTAudience string
	JWTIssuer   string // checked when set

	// JWTRules trust external OIDC issuers (JWT_RULE): a token whose iss is a rule's is checked
	// with the keys fetched from its jwksUri and mapped by the rule; any other token is checked
	// as above. JWTRuleRootCert, when set, is the PEM roots the jwksUri servers' certificates
	// must chain to, instead of the system's.
	JWTRules        []token.Rule
	JWTRuleRootCert string

	// Manifests is a directory of Namespace and ServiceAccount YAML that namespace targeting
	// reads, and follows; empty: no namespace is known, so each follows EnableNamespacesByDefault.
	Manifests                 string
	CANamespace               string
	EnableNamespacesByDefault bool

	WorkloadCertTTL    time.Duration
	MaxWorkloadCertTTL time.Duration
	GRPCHostIdentities []string

	// JWTSVIDTTL is the lifetime of a JWT-SVID (--jwt-svid-ttl), and the most a request gets.
	JWTSVIDTTL time.Duration

	// XDSConfig is the discovery server's configuration (--xds-config), served on the gRPC port
	// beside the CA, as istiod does; empty: Envoy gets an empty configuration (no listeners, no
	// clusters), which it ACKs.
	XDSConfig string
	// embeddedXDSConfig is, in an embedded control plane, where its configuration would be:
	// what the start log names when there is none.
	embeddedXDSConfig string
	// XDSMaxStreams bounds the discovery streams open at once, XDSMaxStreamsPerCredential those
	// opened with one credential (--xds-max-streams, --xds-max-streams-per-credential).
	XDSMaxStreams              int
	XDSMaxStreamsPerCredential int

	// MaxConnectionAge ends a connection to the gRPC port after this long (±10%, gRPC's
	// jitter), and its streams MaxConnectionAgeGrace later, so that a client reconnects and its
	// credential is checked again (--max-connection-age).
	MaxConnectionAge      time.Duration
	MaxConnectionAgeGrace time.Duration

	// Upstream, when its Address is set, makes this CA an intermediate of another CA (Citadel's
	// --upstream-ca-address): its signing certificate comes from there, not from CACertsDir or a
	// self-signed root.
	Upstream UpstreamConfig

	// SignCACerts lets this CA sign CA certificates (Citadel's --sign-ca-certs) for the callers
	// whose SPIFFE IDs are in CACertIdentities, and for no one else.
	SignCACerts      bool
	CACertIdentities []string

	// TrustedNodeAccounts are the service accounts, "NAMESPACE/NAME", that may ask for the
	// identities of other workloads, as node agents do (Istio's CA_TRUSTED_NODE_ACCOUNTS). On
	// Kubernetes only for a service account with a running pod on the node of the caller's pod;
	// elsewhere there are no pods to check, and the trusted account alone decides.
	TrustedNodeAccounts []string

	// Kubernetes, when enabled, replaces Manifests with the Kubernetes API (see KubernetesConfig).
	Kubernetes KubernetesConfig

	// Secrets configures the service-account secret controller, which runs when Manifests is set
	// (writing to <StateDir>/secrets) or on Kubernetes (writing Secrets).
	Secrets SecretsConfig

	Logger *slog.Logger
	Clock  clock.Clock
	// OnKeyEvent, when set, is told of every reload, rotation and pruning of the key material.
	OnKeyEvent func(ca.Event)
}

// UpstreamConfig is where this CA's signing certificate comes from when it is an intermediate
// of another CA.
type UpstreamConfig struct {
	// Address is the upstream CA's HOST:PORT; empty: no upstream.
	Address string
	// RootCertFile holds the upstream's roots: they verify its serving certificate and the chain
	// it answers with, and are what this CA publishes as its trust anchors.
	RootCertFile string
	// TokenPath is the token this CA authenticates with, read at every request.
	TokenPath string
	// RequestedTTL is the lifetime asked for (--requested-ca-cert-ttl); the upstream may give less.
	RequestedTTL time.Duration
	// StartTimeout bounds the first request at start, when the state dir holds no valid
	// upstream-signed certificate; 0: DefaultUpstreamStartTimeout.
	StartTimeout time.Duration
}

// DefaultUpstreamStartTimeout bounds the first request to the upstream CA at start.
const DefaultUpstreamStartTimeout = time.Minute

// Enabled reports whether an upstream CA is configured.
func (u UpstreamConfig) Enabled() bool { return u.Address != "" }

func (u UpstreamConfig) validate(c *Config) []error {
	var errs []error
	if !u.Enabled() {
		if u.RootCertFile != "" {
			errs = append(errs, configerr.Errorf("Upstream.RootCertFile", "{Upstream.RootCertFile} needs {Upstream.Address}"))
		}
		if u.TokenPath != "" {
			errs = append(errs, configerr.Errorf("Upstream.TokenPath", "{Upstream.TokenPath} needs {Upstream.Address}"))
		}
		return errs
	}
	if err := hostport.CheckDial(u.Address); err != nil {
		errs = append(errs, &configerr.FieldError{Field: "Upstream.Address", Value: u.Address, Err: err})
	}
	if u.RootCertFile == "" {
		errs = append(errs, configerr.Errorf("Upstream.RootCertFile", "{Upstream.RootCertFile} is required with {Upstream.Address}: it verifies the upstream CA and is the trust anchor this CA publishes"))
	}
	if u.TokenPath == "" {
		errs = append(errs, configerr.Errorf("Upstream.TokenPath", "{Upstream.TokenPath} is required with {Upstream.Address}: the upstream CA signs for the identity of its token"))
	}
	if u.RequestedTTL <= 0 {
		errs = append(errs, &configerr.FieldError{Field: "Upstream.RequestedTTL", Value: u.RequestedTTL, Err: configerr.ErrMustBePositive})
	}
	if c.CACertsDir != "" {
		errs = append(errs, configerr.Errorf("CACertsDir", "{CACertsDir} and {Upstream.Address} both give the signing certificate: choose one"))
	}
	return errs
}

// validateCACertSigning checks SignCACerts and CACertIdentities: each needs the other (a flag
// that does nothing is refused), and each identity is a workload SPIFFE ID of this trust domain,
// the only one a caller is ever mapped to.
func (c *Config) validateCACertSigning() []error {
	switch {
	case !c.SignCACerts && len(c.CACertIdentities) > 0:
		return []error{configerr.Errorf("CACertIdentities", "{CACertIdentities} needs {SignCACerts}")}
	case c.SignCACerts && len(c.CACertIdentities) == 0:
		return []error{configerr.Errorf("SignCACerts", "{SignCACerts} needs {CACertIdentities}: the SPIFFE IDs allowed CA certificates")}
	}
	var errs []error
	if c.SignCACerts && c.Upstream.Enabled() {
		errs = append(errs, configerr.Errorf("SignCACerts", "{SignCACerts} with {Upstream.Address}: the upstream signs this CA's certificate with path length 0, so a CA certificate under it would verify nowhere"))
	}
	for _, s := range c.CACertIdentities {
		id, err := pki.ParseSPIFFEID(s)
		if err == nil && id.TrustDomain != c.TrustDomain {
			err = fmt.Errorf("trust domain %q is not this CA's %q: no caller is ever that identity", id.TrustDomain, c.TrustDomain)
		}
		if err != nil {
			errs = append(errs, &configerr.FieldError{Field: "CACertIdentities", Value: s, Err: err})
		}
	}
	return errs
}

// caCertIdentities returns CACertIdentities parsed (Validate checked them).
func (c *Config) caCertIdentities() []pki.SPIFFEID {
	var ids []pki.SPIFFEID
	for _, s := range c.CACertIdentities {
		if id, err := pki.ParseSPIFFEID(s); err == nil {
			ids = append(ids, id)
		}
	}
	return ids
}

// parseNodeAccount reads a trusted node account, NAMESPACE/NAME.
func parseNodeAccount(s string) (caserver.NodeAccount, error) {
	ns, sa, ok := strings.Cut(s, "/")
	if !ok {
		return caserver.NodeAccount{}, errors.New("want NAMESPACE/SERVICE_ACCOUNT")
	}
	if err := pki.ValidateNamespace(ns); err != nil {
		return caserver.NodeAccount{}, err
	}
	if err := pki.ValidateServiceAccount(sa); err != nil {
		return caserver.NodeAccount{}, err
	}
	return caserver.NodeAccount{Namespace: ns, ServiceAccount: sa}, nil
}

// nodeAccounts returns TrustedNodeAccounts parsed (Validate checked them).
func (c *Config) nodeAccounts() []caserver.NodeAccount {
	var out []caserver.NodeAccount
	for _, s := range c.TrustedNodeAccounts {
		if a, err := parseNodeAccount(s); err == nil {
			out = append(out, a)
		}
	}
	return out
}

// SecretsConfig configures the service-account secret controller (Citadel's flags).
type SecretsConfig struct {
	// ListenedNamespace limits the controller to one namespace; empty: all.
	ListenedNamespace string
	// A secret is refreshed when less than max(GracePeriodRatio × lifetime, MinGracePeriod) is left.
	GracePeriodRatio float64
	MinGracePeriod   time.Duration
	// AppendDNSNames adds Citadel's webhook DNS names and CustomDNSNames ("<sa>.<ns>:<dns>,…").
	AppendDNSNames bool
	CustomDNSNames string
	// ResyncInterval is how often every secret is checked on disk; 0: the controller's default.
	ResyncInterval time.Duration
	// LivenessProbePath, when set, is touched every LivenessProbeInterval while the controller
	// is healthy (see `meshid probe --probe-path`).
	LivenessProbePath     string
	LivenessProbeInterval time.Duration
	// OnEvent, when set, is told of every reconcile.
	OnEvent func(controller.SecretEvent)
}

// logNoXDSConfig says, once at start, that there is no discovery configuration and how to give
// one.
func (c *Config) logNoXDSConfig() {
	if c.embeddedXDSConfig != "" {
		c.Logger.Info("no xds.yaml in the state dir: Envoy gets an empty configuration (no listeners, no clusters)",
			logkey.Path, c.embeddedXDSConfig)
		return
	}
	c.Logger.Info("no --xds-config: Envoy gets an empty configuration (no listeners, no clusters)")
}

// DefaultConfig returns the configuration `meshid ca` starts from.
func DefaultConfig() Config {
	return Config{
		StateDir:                   DefaultStateDir,
		GRPCAddr:                   DefaultGRPCAddr,
		MonitoringAddr:             DefaultMonitoringAddr,
		TrustDomain:                DefaultTrustDomain,
		SelfSigned:                 ca.SelfSignedConfig{KeyAlgorithm: pki.ECDSA, RSAKeySize: pki.DefaultRSAKeySize, TTL: ca.DefaultSelfSignedRootTTL},
		RootCheckInterval:          ca.DefaultRootCheckInterval,
		RootRotationThreshold:      ca.DefaultRootRotationThreshold,
		JWTAudience:                token.DefaultAudience,
		CANamespace:                DefaultCANamespace,
		EnableNamespacesByDefault:  true,
		WorkloadCertTTL:            ca.DefaultWorkloadCertTTL,
		MaxWorkloadCertTTL:         ca.DefaultMaxWorkloadCertTTL,
		JWTSVIDTTL:                 ca.DefaultJWTSVIDTTL,
		XDSMaxStreams:              discovery.DefaultMaxStreams,
		XDSMaxStreamsPerCredential: discovery.DefaultMaxStreamsPerCredential,
		MaxConnectionAge:           DefaultMaxConnectionAge,
		MaxConnectionAgeGrace:      DefaultMaxConnectionAgeGrace,
		Upstream:                   UpstreamConfig{RequestedTTL: ca.DefaultRequestedCACertTTL},
		Secrets: SecretsConfig{
			GracePeriodRatio: controller.DefaultGracePeriodRatio,
			MinGracePeriod:   controller.DefaultMinGracePeriod,
			AppendDNSNames:   true,
		},
	}
}

// Validate reports every problem with the configuration at once, joined (errors.Join); a problem
// with a field is a *configerr.FieldError keyed by the field's path in Config, which cmd renders
// with its flag.
func (c *Config) Validate() error {
	var errs []error
	if c.StateDir == "" {
		errs = append(errs, configerr.Errorf("StateDir", "{StateDir} is required"))
	}
	if path, ok := strings.CutPrefix(c.GRPCAddr, fsutil.UnixScheme); ok {
		if len(path) > fsutil.MaxSocketPath || !filepath.IsAbs(path) {
			errs = append(errs, &configerr.FieldError{Field: "GRPCAddr", Value: c.GRPCAddr, Err: fmt.Errorf("a Unix socket needs an absolute path of at most %d bytes", fsutil.MaxSocketPath)})
		}
	} else if err := hostport.CheckListen(c.GRPCAddr); err != nil {
		errs = append(errs, &configerr.FieldError{Field: "GRPCAddr", Value: c.GRPCAddr, Err: err})
	}
	if c.MonitoringAddr != "" {
		if err := hostport.CheckListen(c.MonitoringAddr); err != nil {
			errs = append(errs, &configerr.FieldError{Field: "MonitoringAddr", Value: c.MonitoringAddr, Err: err})
		}
	}
	if err := pki.ValidateTrustDomain(c.TrustDomain); err != nil {
		errs = append(errs, &configerr.FieldError{Field: "TrustDomain", Err: err})
	}
	if err := pki.ValidateNamespace(c.CANamespace); err != nil {
		errs = append(errs, &configerr.FieldError{Field: "CANamespace", Err: err})
	}
	if c.JWTAudience == "" {
		errs = append(errs, configerr.Errorf("JWTAudience", "{JWTAudience} must not be empty"))
	}
	if err := token.ValidateRules(c.JWTRules); err != nil {
		errs = append(errs, &configerr.FieldError{Field: "JWTRules", Err: err})
	}
	if c.JWTRuleRootCert != "" && len(c.JWTRules) == 0 {
		errs = append(errs, configerr.Errorf("JWTRuleRootCert", "{JWTRuleRootCert} needs {JWTRules}"))
	}
	if c.WorkloadCertTTL <= 0 {
		errs = append(errs, &configerr.FieldError{Field: "WorkloadCertTTL", Value: c.WorkloadCertTTL, Err: configerr.ErrMustBePositive})
	}
	if c.MaxWorkloadCertTTL < c.WorkloadCertTTL {
		errs = append(errs, configerr.Errorf("MaxWorkloadCertTTL", "{MaxWorkloadCertTTL} %s is below {WorkloadCertTTL} %s", c.MaxWorkloadCertTTL, c.WorkloadCertTTL))
	}
	if c.JWTSVIDTTL <= 0 || c.JWTSVIDTTL > ca.MaxJWTSVIDTTL {
		errs = append(errs, configerr.Errorf("JWTSVIDTTL", "{JWTSVIDTTL} %s is not in (0, %s]: a JWT-SVID is a bearer token that cannot be revoked", c.JWTSVIDTTL, ca.MaxJWTSVIDTTL))
	}
	if c.SelfSigned.TTL <= 0 {
		errs = append(errs, &configerr.FieldError{Field: "SelfSigned.TTL", Value: c.SelfSigned.TTL, Err: configerr.ErrMustBePositive})
	}
	if c.RootCheckInterval <= 0 {
		errs = append(errs, &configerr.FieldError{Field: "RootCheckInterval", Value: c.RootCheckInterval, Err: configerr.ErrMustBePositive})
	}
	if err := ca.ValidateRootRotationThreshold(c.RootRotationThreshold); err != nil {
		errs = append(errs, &configerr.FieldError{Field: "RootRotationThreshold", Err: err})
	}
	if c.XDSMaxStreams <= 0 {
		errs = append(errs, &configerr.FieldError{Field: "XDSMaxStreams", Value: c.XDSMaxStreams, Err: configerr.ErrMustBePositive})
	}
	if c.XDSMaxStreamsPerCredential <= 0 {
		errs = append(errs, &configerr.FieldError{Field: "XDSMaxStreamsPerCredential", Value: c.XDSMaxStreamsPerCredential, Err: configerr.ErrMustBePositive})
	}
	if c.MaxConnectionAge <= 0 {
		errs = append(errs, &configerr.FieldError{Field: "MaxConnectionAge", Value: c.MaxConnectionAge, Err: configerr.ErrMustBePositive})
	}
	if c.MaxConnectionAgeGrace <= 0 {
		// No flag sets it: not a FieldError, which cmd renders with a flag.
		errs = append(errs, fmt.Errorf("the connection age grace %s must be positive", c.MaxConnectionAgeGrace))
	}
	if c.TrustBundleOverlap < 0 {
		errs = append(errs, &configerr.FieldError{Field: "TrustBundleOverlap", Value: c.TrustBundleOverlap, Err: configerr.ErrMustNotBeNegative})
	}
	errs = append(errs, c.Secrets.validate()...)
	errs = append(errs, c.Upstream.validate(c)...)
	errs = append(errs, c.validateCACertSigning()...)
	for _, s := range c.TrustedNodeAccounts {
		if _, err := parseNodeAccount(s); err != nil {
			errs = append(errs, &configerr.FieldError{Field: "TrustedNodeAccounts", Value: s, Err: err})
		}
	}
	errs = append(errs, c.Kubernetes.validate(c)...)
	switch c.SelfSigned.KeyAlgorithm {
	case pki.ECDSA:
	case pki.RSA:
		if err := pki.ValidateRSAKeySize(c.SelfSigned.RSAKeySize); err != nil {
			errs = append(errs, &configerr.FieldError{Field: "SelfSigned.RSAKeySize", Err: err})
		}
	default:
		errs = append(errs, &configerr.FieldError{Field: "SelfSigned.KeyAlgorithm", Value: string(c.SelfSigned.KeyAlgorithm), Err: errors.New("want ECDSA or RSA")})
	}
	return errors.Join(errs...)
}

// ErrConfigRefused marks what New (and Targets) refuse because of how the control plane was
// configured, found against the machine rather than in the values, which Validate checks: a
// --cacerts-dir or --manifests directory that does not exist. Like a bad flag, it is the
// caller's mistake, and no retry will fix it.
var ErrConfigRefused = errors.New("the control plane's configuration cannot work on this machine")

// refused is an error that wraps ErrConfigRefused without adding its text to the message.
type refused struct{ error }

func (r refused) Unwrap() []error { return []error{r.error, ErrConfigRefused} }

// checkGivenPaths refuses a directory given that is not one, each problem wrapping
// ErrConfigRefused: a typo in --cacerts-dir would fall back to a self-signed CA unnoticed, and
// one in --manifests would leave every namespace unknown.
func (c *Config) checkGivenPaths() error {
	var errs []error
	if c.CACertsDir != "" {
		if err := ca.CheckCACertsDir(c.CACertsDir); err != nil {
			errs = append(errs, refused{&configerr.FieldError{Field: "CACertsDir", Err: err}})
		}
	}
	if c.Upstream.Enabled() && c.Upstream.RootCertFile != "" {
		if err := caclient.CheckRootFile(c.Upstream.RootCertFile, ""); err != nil {
			errs = append(errs, refused{configerr.Errorf("Upstream.RootCertFile", "{Upstream.RootCertFile} %s %w", c.Upstream.RootCertFile, err)})
		}
	}
	if err := checkManifestsDir(c.Manifests); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// checkManifestsDir refuses a --manifests that is not a directory, wrapping ErrConfigRefused.
func checkManifestsDir(dir string) error {
	if dir == "" {
		return nil
	}
	if err := fsutil.CheckDir(dir, "an empty directory is fine"); err != nil {
		return refused{configerr.Errorf("Manifests", "{Manifests} %s %w", dir, err)}
	}
	return nil
}

func (c *SecretsConfig) validate() []error {
	var errs []error
	if c.ListenedNamespace != "" {
		if err := pki.ValidateNamespace(c.ListenedNamespace); err != nil {
			errs = append(errs, &configerr.FieldError{Field: "Secrets.ListenedNamespace", Err: err})
		}
	}
	if !(c.GracePeriodRatio > 0 && c.GracePeriodRatio < 1) {
		errs = append(errs, configerr.Errorf("Secrets.GracePeriodRatio", "{Secrets.GracePeriodRatio} %g: want above 0 and below 1", c.GracePeriodRatio))
	}
	if c.MinGracePeriod < 0 {
		errs = append(errs, &configerr.FieldError{Field: "Secrets.MinGracePeriod", Value: c.MinGracePeriod, Err: configerr.ErrMustNotBeNegative})
	}
	if c.CustomDNSNames != "" {
		if !c.AppendDNSNames {
			// Citadel ignores them then; a flag that does nothing is refused.
			errs = append(errs, configerr.Errorf("Secrets.CustomDNSNames", "{Secrets.CustomDNSNames} needs {Secrets.AppendDNSNames}"))
		} else if _, err := controller.DNSNames(DefaultCANamespace, c.CustomDNSNames); err != nil {
			errs = append(errs, &configerr.FieldError{Field: "Secrets.CustomDNSNames", Err: err})
		}
	}
	if c.LivenessProbePath != "" && c.LivenessProbeInterval <= 0 {
		errs = append(errs, configerr.Errorf("Secrets.LivenessProbeInterval", "{Secrets.LivenessProbeInterval} %s must be positive with {Secrets.LivenessProbePath}", c.LivenessProbeInterval))
	}
	if c.LivenessProbePath == "" && c.LivenessProbeInterval != 0 {
		errs = append(errs, configerr.Errorf("Secrets.LivenessProbeInterval", "{Secrets.LivenessProbeInterval} needs {Secrets.LivenessProbePath}"))
	}
	return errs
}
