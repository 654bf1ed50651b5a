// Package agent is the composition root of one meshid agent: it builds the CA client, the secret
// manager and the status server from its Config, runs them under one context, and stops them.
package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/sds"
)

// Defaults of `meshid agent`; paths are relative to RootDir.
const (
	DefaultStatusAddr   = ":15020"
	DefaultDebugAddr    = "127.0.0.1:15004"
	DefaultSocketDir    = "var/run/secrets/workload-spiffe-uds"
	DefaultCredentials  = "var/run/secrets/workload-spiffe-credentials" //nolint:gosec // a path, not a credential
	DefaultMountedCerts = "etc/certs"
	DefaultEmbeddedDir  = "var/lib/meshid"
	// Identity of the workload when the agent runs its own CA and none is given.
	DefaultEmbeddedNamespace      = "default"
	DefaultEmbeddedServiceAccount = "default"
	DefaultTrustDomain            = "cluster.local"
	DefaultTokenPath              = "var/run/secrets/tokens/istio-token" //nolint:gosec // a path, not a credential
	DefaultCARootCert             = "var/run/secrets/istio/root-cert.pem"
	DefaultSecretTTL              = 24 * time.Hour
	DefaultGraceRatio             = 0.5
	DefaultGraceJitter            = 0.01
	DefaultCAServerName           = "istiod.istio-system.svc"
)

// Config is everything an agent needs; cmd builds it from flags and environment and validates it.
type Config struct {
	// Identity of the workload: spiffe://TrustDomain/ns/Namespace/sa/ServiceAccount.
	TrustDomain    string
	Namespace      string
	ServiceAccount string

	// CAAddress is the CA (CA_ADDR); empty runs the control plane in-process (embedded mode).
	// CARootCert is the file that verifies it (CA_ROOT_CA); when
	// empty, PROV_CERT/root-cert.pem and then RootDir/var/run/secrets/istio/root-cert.pem are used,
	// whichever exists first, as Istio does.
	CAAddress    string
	CARootCert   string
	CAServerName string // ISTIOD_SAN
	ClusterID    string // ISTIO_META_CLUSTER_ID
	TokenPath    string
	ProvCert     string // PROV_CERT: a key pair for mTLS to the CA

	KeyAlgorithm     pki.KeyAlgorithm
	RSAKeySize       int
	SecretTTL        time.Duration
	GraceRatio       float64
	GraceRatioJitter float64
	OutputCerts      string // OUTPUT_CERTS

	// WorkloadSocketDir holds the SDS socket; CredentialsDir may hold cert-chain.pem, key.pem and
	// root-cert.pem to serve instead of a CA's; FileMountedCerts serves <root>/etc/certs/ instead.
	WorkloadSocketDir string
	CredentialsDir    string
	FileMountedCerts  bool
	SocketMode        os.FileMode
	// FileResourceDirs are the directories file-cert: and file-root: secrets may read; default: the
	// credentials dir and <root>/etc/certs.
	FileResourceDirs []string
	DrainDuration    time.Duration

	StatusAddr string
	DebugAddr  string // loopback only; empty disables it
	RootDir    string

	Logger *slog.Logger
	Clock  clock.Clock
}

// DefaultConfig returns the configuration `meshid agent` starts from (paths under rootDir).
func DefaultConfig(rootDir string) Config {
	return Config{
		TrustDomain:      DefaultTrustDomain,
		CAServerName:     DefaultCAServerName,
		TokenPath:        filepath.Join(rootDirOrSlash(rootDir), DefaultTokenPath),
		KeyAlgorithm:     pki.ECDSA,
		RSAKeySize:       pki.DefaultRSAKeySize,
		SecretTTL:        DefaultSecretTTL,
		GraceRatio:       DefaultGraceRatio,
		GraceRatioJitter: DefaultGraceJitter,
		StatusAddr:       DefaultStatusAddr,
		DebugAddr:        DefaultDebugAddr,
		RootDir:          rootDir,
	}
}

// path returns a default path under the root dir (the real absolute path when it is empty).
func (c *Config) path(rel string) string { return filepath.Join(rootDirOrSlash(c.RootDir), rel) }

func (c *Config) socketDir() string {
	if c.WorkloadSocketDir != "" {
		return c.WorkloadSocketDir
	}
	return c.path(DefaultSocketDir)
}

func (c *Config) credentialsDir() string {
	if c.CredentialsDir != "" {
		return c.CredentialsDir
	}
	return c.path(DefaultCredentials)
}

func (c *Config) fileResourceDirs() []string {
	if len(c.FileResourceDirs) > 0 {
		return c.FileResourceDirs
	}
	return []string{c.credentialsDir(), c.path(DefaultMountedCerts)}
}

// embedded reports whether the agent runs its own control plane: no CA is given.
func (c *Config) embedded() bool { return c.CAAddress == "" }

func rootDirOrSlash(rootDir string) string {
	if rootDir == "" {
		return "/"
	}
	return rootDir
}

// Identity returns the workload's SPIFFE ID; with an embedded CA, an unset namespace or service
// account is "default".
func (c *Config) Identity() (pki.SPIFFEID, error) {
	ns, sa := c.Namespace, c.ServiceAccount
	if c.embedded() {
		if ns == "" {
			ns = DefaultEmbeddedNamespace
		}
		if sa == "" {
			sa = DefaultEmbeddedServiceAccount
		}
	}
	return pki.NewSPIFFEID(c.TrustDomain, ns, sa)
}

// Validate reports every problem with the configuration at once.
func (c *Config) Validate() error {
	var errs []error
	if _, err := c.Identity(); err != nil {
		errs = append(errs, fmt.Errorf("workload identity (--trust-domain, --namespace/POD_NAMESPACE, --service-account/SERVICE_ACCOUNT): %w", err))
	}
	if err := sds.CheckSocketPath(filepath.Join(c.socketDir(), sds.SocketName)); err != nil {
		errs = append(errs, fmt.Errorf("--workload-socket-dir: %w", err))
	}
	if c.DebugAddr != "" {
		if host, _, err := net.SplitHostPort(c.DebugAddr); err != nil {
			errs = append(errs, fmt.Errorf("--debug-addr %q: want HOST:PORT: %w", c.DebugAddr, err))
		} else if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
			errs = append(errs, fmt.Errorf("--debug-addr %q: the debug server shows secrets' metadata and listens on loopback only", c.DebugAddr))
		}
	}
	if c.DrainDuration < 0 {
		errs = append(errs, fmt.Errorf("--drain-duration %s must not be negative", c.DrainDuration))
	}
	switch c.KeyAlgorithm {
	case pki.ECDSA:
	case pki.RSA:
		if c.RSAKeySize < pki.MinRSAKeySize || c.RSAKeySize > pki.MaxRSAKeySize {
			errs = append(errs, fmt.Errorf("RSA key size %d (WORKLOAD_RSA_KEY_SIZE) out of range [%d, %d]", c.RSAKeySize, pki.MinRSAKeySize, pki.MaxRSAKeySize))
		}
	default:
		errs = append(errs, fmt.Errorf("--key-algorithm %q: want ECDSA or RSA", c.KeyAlgorithm))
	}
	if c.SecretTTL <= 0 {
		errs = append(errs, fmt.Errorf("--secret-ttl %s must be positive", c.SecretTTL))
	}
	if c.GraceRatio <= 0 || c.GraceRatio >= 1 {
		errs = append(errs, fmt.Errorf("--grace-period-ratio %v must be between 0 and 1", c.GraceRatio))
	}
	if c.GraceRatioJitter < 0 || c.GraceRatioJitter >= c.GraceRatio || c.GraceRatio+c.GraceRatioJitter >= 1 {
		errs = append(errs, fmt.Errorf("--grace-period-ratio-jitter %v must keep the ratio %v within (0, 1)", c.GraceRatioJitter, c.GraceRatio))
	}
	if _, _, err := net.SplitHostPort(c.StatusAddr); err != nil {
		errs = append(errs, fmt.Errorf("--status-addr %q: want HOST:PORT: %w", c.StatusAddr, err))
	}
	return errors.Join(errs...)
}
