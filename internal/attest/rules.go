package attest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"path/filepath"
	"strings"

	"sigs.k8s.io/yaml"

	"github.com/meshid/meshid/internal/pki"
)

// Rule gives the callers it matches an identity. Every selector given must match (AND); a rule
// gives at least one. The rules of a file are tried in the file's order and the first that
// matches wins, so a narrow rule goes before a broad one.
type Rule struct {
	// UID matches the caller's user id as the kernel saw it connect.
	UID *uint32 `json:"uid,omitempty"`
	// GID matches the caller's primary group or one of its supplementary groups.
	GID *uint32 `json:"gid,omitempty"`
	// Path matches the caller's executable path exactly (absolute and clean); a binary replaced
	// or removed on disk reads as "PATH (deleted)" and matches no path.
	Path string `json:"path,omitempty"`
	// Cgroup is a path.Match pattern matched against each of the caller's cgroup paths and
	// each directory above them: a plain path ("/system.slice/app.service") matches that cgroup
	// and everything below it, whole segments only; "*" stands for part of one segment
	// ("/kubepods.slice/*/kubepods-besteffort-pod*.slice").
	Cgroup string `json:"cgroup,omitempty"`
	// PodUID matches the Kubernetes pod read from the caller's cgroup.
	PodUID string `json:"podUID,omitempty"`

	Namespace      string `json:"namespace"`
	ServiceAccount string `json:"serviceAccount"`
}

// Identity is the Kubernetes-style identity a caller is given.
type Identity struct {
	Namespace, ServiceAccount string
}

func (r Rule) identity() Identity {
	return Identity{Namespace: r.Namespace, ServiceAccount: r.ServiceAccount}
}

// validate says why a rule cannot be used.
func (r *Rule) validate() error {
	if r.Namespace == "" {
		return errors.New("namespace is required")
	}
	if err := pki.ValidateNamespace(r.Namespace); err != nil {
		return err
	}
	if r.ServiceAccount == "" {
		return errors.New("serviceAccount is required")
	}
	if err := pki.ValidateServiceAccount(r.ServiceAccount); err != nil {
		return err
	}
	if r.UID == nil && r.GID == nil && r.Path == "" && r.Cgroup == "" && r.PodUID == "" {
		// A rule without selectors would give its identity to every process that can reach
		// the socket.
		return errors.New("no selector: give at least one of uid, gid, path, cgroup, podUID")
	}
	if r.Path != "" && (!filepath.IsAbs(r.Path) || filepath.Clean(r.Path) != r.Path) {
		return fmt.Errorf("path %q: want an absolute, clean path", r.Path)
	}
	if r.Cgroup != "" {
		if !strings.HasPrefix(r.Cgroup, "/") {
			return fmt.Errorf("cgroup %q: want a pattern that starts with /", r.Cgroup)
		}
		if _, err := path.Match(r.Cgroup, ""); err != nil {
			return fmt.Errorf("cgroup %q: %w", r.Cgroup, err)
		}
	}
	if r.PodUID != "" {
		uid := normalizePodUID(r.PodUID)
		if !podUIDPattern.MatchString(uid) {
			return fmt.Errorf("podUID %q: want a pod UID", r.PodUID)
		}
		r.PodUID = uid
	}
	return nil
}

// matches reports whether p satisfies every selector of r.
func (r *Rule) matches(p Process) bool {
	switch {
	case r.UID != nil && *r.UID != p.UID,
		r.GID != nil && !p.hasGID(*r.GID),
		r.Path != "" && r.Path != p.Exe,
		r.PodUID != "" && r.PodUID != p.PodUID,
		r.Cgroup != "" && !cgroupMatches(r.Cgroup, p.Cgroups):
		return false
	}
	return true
}

// cgroupMatches reports whether pattern matches one of cgroups or a directory above one.
func cgroupMatches(pattern string, cgroups []string) bool {
	for _, c := range cgroups {
		for p := path.Clean(c); ; p = path.Dir(p) {
			if ok, _ := path.Match(pattern, p); ok { // the pattern was checked when loaded
				return true
			}
			if p == "/" {
				break
			}
		}
	}
	return false
}

// BadRule is a rule of a file that was skipped, and why.
type BadRule struct {
	Index int // from 0, in the file's order
	Err   error
}

// rulesFile is the file's shape; each rule is decoded on its own, so that one that does not
// decode is skipped and the others kept.
type rulesFile struct {
	Rules []json.RawMessage `json:"rules"`
}

// ParseRules reads a rules file: the usable rules in the file's order, and the rules skipped.
// An error means the file as a whole could not be read as rules.
func ParseRules(data []byte) ([]Rule, []BadRule, error) {
	doc, err := yaml.YAMLToJSON(data)
	if err != nil {
		return nil, nil, fmt.Errorf("parse YAML: %w", err)
	}
	var file rulesFile
	if err := strictUnmarshal(doc, &file); err != nil {
		return nil, nil, fmt.Errorf("parse rules: %w", err)
	}
	var (
		rules []Rule
		bad   []BadRule
	)
	for i, raw := range file.Rules {
		var r Rule
		if err := strictUnmarshal(raw, &r); err != nil {
			bad = append(bad, BadRule{Index: i, Err: err})
			continue
		}
		if err := r.validate(); err != nil {
			bad = append(bad, BadRule{Index: i, Err: err})
			continue
		}
		rules = append(rules, r)
	}
	return rules, bad, nil
}

// strictUnmarshal refuses unknown fields: a misspelt selector must not widen a rule.
func strictUnmarshal(data []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if dec.More() {
		return errors.New("trailing data")
	}
	return nil
}
