// Package pki holds small, pure helpers for X.509 material: PEM, keys, CSRs and SPIFFE IDs.
package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
)

// PEM block types.
const (
	BlockCertificate        = "CERTIFICATE"
	BlockPrivateKey         = "PRIVATE KEY"
	BlockECPrivateKey       = "EC PRIVATE KEY"
	BlockRSAPrivateKey      = "RSA PRIVATE KEY"
	BlockPublicKey          = "PUBLIC KEY"
	BlockRSAPublicKey       = "RSA PUBLIC KEY"
	BlockCertificateRequest = "CERTIFICATE REQUEST"
)

// ErrNoPEM reports input that holds no PEM block of the expected type.
var ErrNoPEM = errors.New("no PEM data found")

// ParseCertificates decodes every CERTIFICATE block in data, in order. Other blocks are skipped.
// Input without any certificate yields ErrNoPEM.
func ParseCertificates(data []byte) ([]*x509.Certificate, error) {
	var certs []*x509.Certificate
	for rest := data; ; {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			break
		}
		if block.Type != BlockCertificate {
			continue
		}
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("parse certificate %d: %w", len(certs)+1, err)
		}
		certs = append(certs, cert)
	}
	if len(certs) == 0 {
		return nil, fmt.Errorf("certificates: %w", ErrNoPEM)
	}
	return certs, nil
}

// EncodeCertificate returns one certificate as PEM.
func EncodeCertificate(cert *x509.Certificate) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: BlockCertificate, Bytes: cert.Raw})
}

// EncodeCertificates concatenates the PEM of each certificate, in order.
func EncodeCertificates(certs ...*x509.Certificate) []byte {
	var out []byte
	for _, c := range certs {
		out = append(out, EncodeCertificate(c)...)
	}
	return out
}

// ParsePrivateKey decodes the first private key block in data: PKCS#8, SEC 1 (EC) or PKCS#1 (RSA).
func ParsePrivateKey(data []byte) (crypto.Signer, error) {
	for rest := data; ; {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			return nil, fmt.Errorf("private key: %w", ErrNoPEM)
		}
		var (
			key any
			err error
		)
		switch block.Type {
		case BlockPrivateKey:
			key, err = x509.ParsePKCS8PrivateKey(block.Bytes)
		case BlockECPrivateKey:
			key, err = x509.ParseECPrivateKey(block.Bytes)
		case BlockRSAPrivateKey:
			key, err = x509.ParsePKCS1PrivateKey(block.Bytes)
		default:
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("parse %s: %w", block.Type, err)
		}
		signer, ok := key.(crypto.Signer)
		if !ok {
			return nil, fmt.Errorf("private key of type %T cannot sign", key)
		}
		return signer, nil
	}
}

// EncodePrivateKey returns key as a PKCS#8 PEM block.
func EncodePrivateKey(key crypto.Signer) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("marshal private key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: BlockPrivateKey, Bytes: der}), nil
}

// ParsePublicKeys decodes every public key in data: PUBLIC KEY (PKIX), RSA PUBLIC KEY (PKCS#1),
// and the subject key of each CERTIFICATE. A key of an algorithm crypto/x509 does not know is an
// error; no key returned is nil.
func ParsePublicKeys(data []byte) ([]crypto.PublicKey, error) {
	var keys []crypto.PublicKey
	for rest := data; ; {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			break
		}
		var (
			key any
			err error
		)
		switch block.Type {
		case BlockPublicKey:
			key, err = x509.ParsePKIXPublicKey(block.Bytes)
		case BlockRSAPublicKey:
			key, err = x509.ParsePKCS1PublicKey(block.Bytes)
		case BlockCertificate:
			var cert *x509.Certificate
			cert, err = x509.ParseCertificate(block.Bytes)
			switch {
			case err != nil:
			case cert.PublicKey == nil:
				// crypto/x509 parses a certificate whose key algorithm it does not know, and
				// leaves its key nil.
				err = errors.New("its subject key is of an unknown algorithm")
			default:
				key = cert.PublicKey
			}
		default:
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("parse %s %d: %w", block.Type, len(keys)+1, err)
		}
		keys = append(keys, key)
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("public keys: %w", ErrNoPEM)
	}
	return keys, nil
}

// PublicKeysEqual reports whether a and b are the same key.
func PublicKeysEqual(a, b crypto.PublicKey) bool {
	type equaler interface{ Equal(crypto.PublicKey) bool }
	e, ok := a.(equaler)
	return ok && e.Equal(b)
}

// KeyMatchesCertificate reports whether key is the private half of cert's public key.
func KeyMatchesCertificate(key crypto.Signer, cert *x509.Certificate) bool {
	return PublicKeysEqual(key.Public(), cert.PublicKey)
}

// DescribeKey names a public key's algorithm and size, e.g. "ECDSA P-256" or "RSA 2048".
func DescribeKey(pub crypto.PublicKey) string {
	switch k := pub.(type) {
	case *ecdsa.PublicKey:
		return "ECDSA " + k.Curve.Params().Name
	case *rsa.PublicKey:
		return fmt.Sprintf("RSA %d", k.N.BitLen())
	case ed25519.PublicKey:
		return "Ed25519"
	default:
		return fmt.Sprintf("%T", pub)
	}
}
