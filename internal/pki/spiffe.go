package pki

import (
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"strings"
)

// ErrInvalidSPIFFEID reports a URI that is not a workload SPIFFE ID of the form
// spiffe://TRUST_DOMAIN/ns/NAMESPACE/sa/SERVICE_ACCOUNT.
var ErrInvalidSPIFFEID = errors.New("invalid workload SPIFFE ID")

var (
	dns1123Label     = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	dns1123Subdomain = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)
	trustDomainChars = regexp.MustCompile(`^[a-z0-9._-]+$`)
)

// SPIFFEID is a Kubernetes-style workload identity.
type SPIFFEID struct {
	TrustDomain    string
	Namespace      string
	ServiceAccount string
}

// NewSPIFFEID validates the parts of a workload identity.
func NewSPIFFEID(trustDomain, namespace, serviceAccount string) (SPIFFEID, error) {
	id := SPIFFEID{TrustDomain: trustDomain, Namespace: namespace, ServiceAccount: serviceAccount}
	if err := ValidateTrustDomain(trustDomain); err != nil {
		return SPIFFEID{}, err
	}
	if err := ValidateNamespace(namespace); err != nil {
		return SPIFFEID{}, err
	}
	if err := ValidateServiceAccount(serviceAccount); err != nil {
		return SPIFFEID{}, err
	}
	return id, nil
}

// String returns spiffe://TRUST_DOMAIN/ns/NAMESPACE/sa/SERVICE_ACCOUNT.
func (id SPIFFEID) String() string {
	return "spiffe://" + id.TrustDomain + "/ns/" + id.Namespace + "/sa/" + id.ServiceAccount
}

// URL returns the identity as a URI SAN.
func (id SPIFFEID) URL() *url.URL {
	return &url.URL{Scheme: "spiffe", Host: id.TrustDomain, Path: "/ns/" + id.Namespace + "/sa/" + id.ServiceAccount}
}

// ParseSPIFFEID parses a workload SPIFFE ID.
func ParseSPIFFEID(s string) (SPIFFEID, error) {
	u, err := url.Parse(s)
	if err != nil {
		return SPIFFEID{}, fmt.Errorf("%w: %q: %w", ErrInvalidSPIFFEID, s, err)
	}
	id, err := SPIFFEIDFromURL(u)
	if err != nil {
		return SPIFFEID{}, err
	}
	if id.String() != s { // e.g. an empty fragment, which url.URL does not record
		return SPIFFEID{}, fmt.Errorf("%w: %q is not in canonical form", ErrInvalidSPIFFEID, s)
	}
	return id, nil
}

// SPIFFEIDFromURL reads a workload SPIFFE ID from a parsed URI SAN.
func SPIFFEIDFromURL(u *url.URL) (SPIFFEID, error) {
	if u.Scheme != "spiffe" || u.User != nil || u.Port() != "" || u.RawQuery != "" || u.Fragment != "" || u.Opaque != "" {
		return SPIFFEID{}, fmt.Errorf("%w: %q", ErrInvalidSPIFFEID, u.String())
	}
	parts := strings.Split(strings.TrimPrefix(u.Path, "/"), "/")
	if len(parts) != 4 || parts[0] != "ns" || parts[2] != "sa" {
		return SPIFFEID{}, fmt.Errorf("%w: %q: path must be /ns/NAMESPACE/sa/SERVICE_ACCOUNT", ErrInvalidSPIFFEID, u.String())
	}
	id, err := NewSPIFFEID(u.Host, parts[1], parts[3])
	if err != nil {
		return SPIFFEID{}, fmt.Errorf("%w: %q: %w", ErrInvalidSPIFFEID, u.String(), err)
	}
	if u.String() != id.String() { // an empty query ("?") or percent-encoded characters
		return SPIFFEID{}, fmt.Errorf("%w: %q is not in canonical form", ErrInvalidSPIFFEID, u.String())
	}
	return id, nil
}

// ValidateTrustDomain accepts a SPIFFE trust domain name: lower-case letters, digits, '.', '-', '_'.
func ValidateTrustDomain(td string) error {
	if td == "" || len(td) > 255 || !trustDomainChars.MatchString(td) {
		return fmt.Errorf("trust domain %q: want lower-case letters, digits, '.', '-' or '_'", td)
	}
	return nil
}

// ValidateNamespace accepts a Kubernetes namespace name (an RFC 1123 label).
func ValidateNamespace(ns string) error {
	if len(ns) > 63 || !dns1123Label.MatchString(ns) {
		return fmt.Errorf("namespace %q: want an RFC 1123 label (lower-case alphanumerics and '-', at most 63)", ns)
	}
	return nil
}

// ValidateServiceAccount accepts a Kubernetes service account name (an RFC 1123 subdomain).
func ValidateServiceAccount(sa string) error {
	if len(sa) > 253 || !dns1123Subdomain.MatchString(sa) {
		return fmt.Errorf("service account %q: want an RFC 1123 subdomain (lower-case alphanumerics, '-' and '.')", sa)
	}
	return nil
}
