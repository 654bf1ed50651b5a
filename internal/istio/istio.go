// Package istio names what meshid shares with Istio's agent and CA — file names, the CA's name,
// defaults — so that each is spelled in one place and meshid stays a drop-in.
package istio

import "time"

// Files of a workload key pair and its trust bundle: OUTPUT_CERTS, PROV_CERT, the credentials
// dir, etc/certs, a service-account secret.
const (
	CertChainFile = "cert-chain.pem"
	KeyFile       = "key.pem"
	RootCertFile  = "root-cert.pem"
)

// IstiodSAN is the name Istio's agents verify in the CA's certificate (ISTIOD_SAN).
const IstiodSAN = "istiod.istio-system.svc"

// Defaults of Istio's agent and CA.
const (
	DefaultTrustDomain      = "cluster.local"
	DefaultCANamespace      = "istio-system"
	DefaultSecretTTL        = 24 * time.Hour // SECRET_TTL
	DefaultGraceRatio       = 0.5            // SECRET_GRACE_PERIOD_RATIO
	DefaultGraceRatioJitter = 0.01           // SECRET_GRACE_PERIOD_RATIO_JITTER
)
