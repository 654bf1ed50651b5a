package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"fmt"
	"strings"
)

// KeyAlgorithm selects the kind of key to generate.
type KeyAlgorithm string

// Supported key algorithms. ECDSA means P-256.
const (
	ECDSA KeyAlgorithm = "ECDSA"
	RSA   KeyAlgorithm = "RSA"
)

// Sizes accepted for generated RSA keys.
const (
	MinRSAKeySize     = 2048
	MaxRSAKeySize     = 8192
	DefaultRSAKeySize = 2048
)

// ValidateRSAKeySize checks that an RSA key of bits is one this project generates or accepts:
// from MinRSAKeySize to MaxRSAKeySize bits, both included.
func ValidateRSAKeySize(bits int) error {
	if bits < MinRSAKeySize || bits > MaxRSAKeySize {
		return fmt.Errorf("RSA key size %d out of range [%d, %d]", bits, MinRSAKeySize, MaxRSAKeySize)
	}
	return nil
}

// ParseKeyAlgorithm accepts ECDSA (also EC, ECC, P256) and RSA, in any case.
func ParseKeyAlgorithm(s string) (KeyAlgorithm, error) {
	switch strings.ToUpper(strings.TrimSpace(s)) {
	case "ECDSA", "EC", "ECC", "P256", "P-256":
		return ECDSA, nil
	case "RSA":
		return RSA, nil
	default:
		return "", fmt.Errorf("unknown key algorithm %q: want ECDSA or RSA", s)
	}
}

// GenerateKey creates a private key: ECDSA P-256, or RSA of rsaBits (DefaultRSAKeySize when 0).
func GenerateKey(alg KeyAlgorithm, rsaBits int) (crypto.Signer, error) {
	switch alg {
	case ECDSA, "":
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, fmt.Errorf("generate ECDSA P-256 key: %w", err)
		}
		return key, nil
	case RSA:
		if rsaBits == 0 {
			rsaBits = DefaultRSAKeySize
		}
		if err := ValidateRSAKeySize(rsaBits); err != nil {
			return nil, err
		}
		key, err := rsa.GenerateKey(rand.Reader, rsaBits)
		if err != nil {
			return nil, fmt.Errorf("generate RSA %d key: %w", rsaBits, err)
		}
		return key, nil
	default:
		return nil, fmt.Errorf("unknown key algorithm %q", alg)
	}
}

// KeyID derives a stable identifier for a public key the way kube-apiserver names its token
// signing keys: the unpadded base64url SHA-256 of the key's PKIX encoding.
func KeyID(pub crypto.PublicKey) (string, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return "", fmt.Errorf("marshal public key: %w", err)
	}
	sum := sha256.Sum256(der)
	return base64.RawURLEncoding.EncodeToString(sum[:]), nil
}
