// Package logkey names the attributes of meshid's structured logs, so that every component spells
// them the same way.
package logkey

// Attribute keys.
const (
	Component   = "component"
	Error       = "error"
	Reason      = "reason"
	Code        = "code"
	Identity    = "identity"
	Namespace   = "namespace"
	Peer        = "peer"
	Method      = "auth_method"
	Serial      = "serial"
	NotAfter    = "not_after"
	Address     = "address"
	Path        = "path"
	Dir         = "dir"
	Source      = "source"
	Subject     = "subject"
	Root        = "root"
	Version     = "version"
	TrustDomain = "trust_domain"
	Duration    = "duration"
	KeyID       = "kid"
)
