// Package agent is the composition root of one meshid agent: it builds the CA client, the secret
// manager and the status server from its Config, runs them under one context, and stops them.
package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"time"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/pki"
)

// Defaults of `meshid agent`; paths are relative to RootDir.
const (
	DefaultStatusAddr   = ":15020"
	DefaultTrustDomain  = "cluster.local"
	DefaultTokenPath    = "var/run/secrets/tokens/istio-token" //nolint:gosec // a path, not a credential
	DefaultCARootCert   = "var/run/secrets/istio/root-cert.pem"
	DefaultSecretTTL    = 24 * time.Hour
	DefaultGraceRatio   = 0.5
	DefaultGraceJitter  = 0.01
	DefaultCAServerName = "istiod.istio-system.svc"
)

// Config is everything an agent needs; cmd builds it from flags and environment and validates it.
type Config struct {
	// Identity of the workload: spiffe://TrustDomain/ns/Namespace/sa/ServiceAccount.
	TrustDomain    string
	Namespace      string
	ServiceAccount string

	// CAAddress is the CA (CA_ADDR). CARootCert is the file that verifies it (CA_ROOT_CA); when
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

	StatusAddr string
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
		RootDir:          rootDir,
	}
}

func rootDirOrSlash(rootDir string) string {
	if rootDir == "" {
		return "/"
	}
	return rootDir
}

// Identity returns the workload's SPIFFE ID.
func (c *Config) Identity() (pki.SPIFFEID, error) {
	return pki.NewSPIFFEID(c.TrustDomain, c.Namespace, c.ServiceAccount)
}

// Validate reports every problem with the configuration at once.
func (c *Config) Validate() error {
	var errs []error
	if _, err := c.Identity(); err != nil {
		errs = append(errs, fmt.Errorf("workload identity (--trust-domain, --namespace/POD_NAMESPACE, --service-account/SERVICE_ACCOUNT): %w", err))
	}
	if c.CAAddress == "" {
		errs = append(errs, errors.New("--ca-addr (CA_ADDR) is required"))
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
