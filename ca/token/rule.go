package token

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// Rule trusts an external token issuer, as Istio's JWT_RULE does: its tokens are checked with
// the keys its JWKS URL serves, against its audiences, and mapped to a namespace and service
// account. Issuer, JWKSURI and Audiences are Istio's JWTRule fields; the two mapping fields are
// meshid's: both empty keeps Kubernetes' mapping (sub system:serviceaccount:NS:SA); both set names
// the string claims that hold the namespace and the service account.
type Rule struct {
	Issuer                string   `json:"issuer"`
	JWKSURI               string   `json:"jwksUri"`
	Audiences             []string `json:"audiences"`
	ClaimToNamespace      string   `json:"claimToNamespace,omitempty"`
	ClaimToServiceAccount string   `json:"claimToServiceAccount,omitempty"`
}

// ParseRules reads JWT_RULE: a JSON list of rules, or one rule alone as istiod reads it. A member
// Rule does not know (Istio's jwks, fromHeaders, ...) is refused rather than ignored. The rules
// are not validated: see ValidateRules.
func ParseRules(text string) ([]Rule, error) {
	trimmed := bytes.TrimSpace([]byte(text))
	if len(trimmed) == 0 {
		return nil, nil
	}
	dec := json.NewDecoder(bytes.NewReader(trimmed))
	dec.DisallowUnknownFields()
	var rules []Rule
	if trimmed[0] == '{' {
		var r Rule
		if err := dec.Decode(&r); err != nil {
			return nil, fmt.Errorf("parse the JWT rule: %w", err)
		}
		rules = []Rule{r}
	} else if err := dec.Decode(&rules); err != nil {
		return nil, fmt.Errorf("parse the JWT rules (a JSON list of {\"issuer\", \"jwksUri\", \"audiences\"}): %w", err)
	}
	if dec.More() {
		return nil, errors.New("parse the JWT rules: text after the JSON value")
	}
	return rules, nil
}

// ValidateRules checks every rule, each error naming the rule by its position and issuer and the
// field at fault.
func ValidateRules(rules []Rule) error {
	var errs []error
	seen := map[string]int{}
	for i, r := range rules {
		name := fmt.Sprintf("rule %d (issuer %q)", i+1, r.Issuer)
		if first, dup := seen[r.Issuer]; dup && r.Issuer != "" {
			errs = append(errs, fmt.Errorf("%s: issuer: already the issuer of rule %d", name, first))
		}
		seen[r.Issuer] = i + 1
		if err := r.validate(); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

func (r Rule) validate() error {
	var errs []error
	if r.Issuer == "" {
		errs = append(errs, errors.New("issuer: required"))
	}
	if u, err := url.Parse(r.JWKSURI); r.JWKSURI == "" {
		errs = append(errs, errors.New("jwksUri: required"))
	} else if err != nil || u.Scheme != "https" || u.Host == "" || u.User != nil {
		errs = append(errs, fmt.Errorf("jwksUri %q: want an https:// URL with a host and no user", r.JWKSURI))
	}
	if len(r.Audiences) == 0 {
		errs = append(errs, errors.New("audiences: at least one is required, so that a token meant for another service is not accepted"))
	}
	for _, a := range r.Audiences {
		if strings.TrimSpace(a) == "" {
			errs = append(errs, errors.New("audiences: an empty audience"))
		}
	}
	if (r.ClaimToNamespace == "") != (r.ClaimToServiceAccount == "") {
		errs = append(errs, errors.New("claimToNamespace and claimToServiceAccount: set both, or neither for Kubernetes' sub system:serviceaccount:NS:SA"))
	}
	return errors.Join(errs...)
}

// ErrIdentityClaims reports a token whose claims do not name a namespace and service account
// the way its rule maps them.
var ErrIdentityClaims = errors.New("token claims do not name a service account")

// serviceAccount maps a verified token's claims to the namespace and service account it stands
// for, by the rule. The claims are the client's: errors quote them bounded.
func (r Rule) serviceAccount(c *ruleClaims) (namespace, name string, err error) {
	if r.ClaimToNamespace == "" {
		return c.ServiceAccount()
	}
	namespace, err = c.stringClaim(r.ClaimToNamespace)
	if err != nil {
		return "", "", err
	}
	name, err = c.stringClaim(r.ClaimToServiceAccount)
	if err != nil {
		return "", "", err
	}
	if pki.ValidateNamespace(namespace) != nil {
		return "", "", fmt.Errorf("%w: claim %q %q: want an RFC 1123 label (lower-case alphanumerics and '-', at most 63)",
			ErrIdentityClaims, r.ClaimToNamespace, logkey.Untrusted(namespace))
	}
	if pki.ValidateServiceAccount(name) != nil {
		return "", "", fmt.Errorf("%w: claim %q %q: want an RFC 1123 subdomain (lower-case alphanumerics, '-' and '.')",
			ErrIdentityClaims, r.ClaimToServiceAccount, logkey.Untrusted(name))
	}
	return namespace, name, nil
}

// ruleClaims are a token's claims as Claims reads them, and every top-level claim raw, for the
// claims a rule names.
type ruleClaims struct {
	Claims
	raw map[string]json.RawMessage
}

func (c *ruleClaims) UnmarshalJSON(data []byte) error {
	if err := c.Claims.UnmarshalJSON(data); err != nil {
		return err
	}
	return json.Unmarshal(data, &c.raw)
}

func (c *ruleClaims) stringClaim(name string) (string, error) {
	raw, ok := c.raw[name]
	if !ok {
		return "", fmt.Errorf("%w: no claim %q", ErrIdentityClaims, name)
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return "", fmt.Errorf("%w: claim %q is not a string", ErrIdentityClaims, name)
	}
	return s, nil
}
