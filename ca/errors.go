// Package ca is the CA core: it loads or creates the signing key and certificate, holds them as an
// atomically swappable Bundle, applies the issuance policy, signs, and verifies what it signed.
// It has no transport; ca/server puts it on gRPC.
package ca

import "errors"

// Errors a caller maps to a refusal. They are wrapped with detail; test with errors.Is.
var (
	// ErrNotReady: no usable signing key is loaded.
	ErrNotReady = errors.New("CA has no usable signing certificate")
	// ErrMalformedCSR: the request is not a parseable PEM certificate request.
	ErrMalformedCSR = errors.New("malformed certificate request")
	// ErrCSRSignature: the request's self-signature does not verify.
	ErrCSRSignature = errors.New("certificate request signature does not verify")
	// ErrUnsupportedKey: the request's key is weak or of a kind the CA does not sign.
	ErrUnsupportedKey = errors.New("certificate request key is weak or unsupported")
	// ErrIdentityMismatch: the request asks for an identity other than the caller's.
	ErrIdentityMismatch = errors.New("certificate request asks for another identity")
	// ErrForbiddenSAN: the request asks for DNS names, IP addresses or email addresses.
	ErrForbiddenSAN = errors.New("certificate request asks for names the CA does not issue")
	// ErrCSRSignatureAlgorithm: the request is signed with SHA-1, MD5 or another algorithm the CA
	// does not accept.
	ErrCSRSignatureAlgorithm = errors.New("certificate request signed with a weak or unsupported algorithm")
	// ErrRootRetired: a chain ends at a root that was replaced and whose trust overlap has ended.
	ErrRootRetired = errors.New("root was replaced and its trust overlap has ended")
	// ErrCACertsNotSigned: a CA certificate was asked of a CA that signs none (no --sign-ca-certs).
	ErrCACertsNotSigned = errors.New("this CA does not sign CA certificates")
	// ErrCACertIdentity: a CA certificate was asked by an identity not allowed one
	// (--ca-cert-identities).
	ErrCACertIdentity = errors.New("caller may not have a CA certificate")
	// ErrInvalidTTL: the requested lifetime is negative.
	ErrInvalidTTL = errors.New("invalid certificate lifetime")
)
