// Package controller decides which namespaces this CA instance serves (seed 000's targeting rules)
// and runs the service-account secret controller over a store of namespaces and service accounts.
package controller

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/meshid/meshid/internal/logkey"
)

// Namespace labels that steer CA instances.
const (
	// LabelOverride forces every CA instance to serve ("true") or ignore ("false") a namespace.
	LabelOverride = "ca.istio.io/override"
	// LabelEnv names the namespace of the CA instance that serves this namespace.
	LabelEnv = "ca.istio.io/env"
)

// The values of the truth table's columns, spelled as seed 000 spells them.
const (
	Unset = "unset"
	Yes   = "yes"
	No    = "no"
)

// Decision is the targeting truth table's answer for one namespace and one CA instance.
type Decision struct {
	Served bool
	// Row is the row of seed 000's table that decided, 1 to 18.
	Row int
	// Override is the table's first column: "true", "false" or "unset". A value that is neither
	// "true" nor "false" counts as unset: InvalidOverride is then true, and OverrideValue holds it.
	Override        string
	InvalidOverride bool
	OverrideValue   string
	// EnvMatch is the second column: "yes" (ca.istio.io/env names this instance's namespace),
	// "no" (it names another) or "unset".
	EnvMatch         string
	EnabledByDefault bool
	// Rule says, for a person, which of the seed's rules decided.
	Rule string
}

// Decide applies seed 000's targeting truth table to a namespace's labels for the CA instance
// running in caNamespace. nil labels stand for a namespace the store does not know.
func Decide(labels map[string]string, caNamespace string, enabledByDefault bool) Decision {
	d := Decision{Override: Unset, EnvMatch: Unset, EnabledByDefault: enabledByDefault}
	if v, ok := labels[LabelOverride]; ok {
		// Exactly "true" or "false", as the seed says: strconv.ParseBool would also take "1",
		// "T" or "FALSE", which Kubernetes tooling does not treat as booleans.
		switch v {
		case "true", "false":
			d.Override = v
		default:
			d.InvalidOverride, d.OverrideValue = true, v
		}
	}
	env, envSet := labels[LabelEnv]
	if envSet {
		d.EnvMatch = No
		if env == caNamespace {
			d.EnvMatch = Yes
		}
	}
	switch {
	case d.Override == "true":
		d.Served, d.Rule = true, LabelOverride+"=true: every CA instance serves it"
	case d.Override == "false":
		d.Served, d.Rule = false, LabelOverride+"=false: no CA instance serves it"
	case d.EnvMatch == Yes:
		d.Served, d.Rule = true, fmt.Sprintf("%s=%s names this CA instance's namespace", LabelEnv, strconv.Quote(env))
	case d.EnvMatch == No:
		d.Served, d.Rule = false, fmt.Sprintf("%s=%s names another CA instance's namespace, not %s", LabelEnv, strconv.Quote(env), caNamespace)
	case enabledByDefault:
		d.Served, d.Rule = true, "neither label is set, and --enable-namespaces-by-default=true"
	default:
		d.Served, d.Rule = false, "neither label is set, and --enable-namespaces-by-default=false"
	}
	if d.InvalidOverride {
		d.Rule += fmt.Sprintf(" (%s=%s is neither true nor false, so it counts as unset)", LabelOverride, strconv.Quote(d.OverrideValue))
	}
	d.Row = row(d.Override, d.EnvMatch, enabledByDefault)
	return d
}

// row numbers the table as the seed orders it: override true, false, unset; within each, env
// match yes, no, unset; within each, enableNamespacesByDefault true, false.
func row(override, envMatch string, enabledByDefault bool) int {
	n := 1 + 6*slices.Index([]string{"true", "false", Unset}, override) + 2*slices.Index([]string{Yes, No, Unset}, envMatch)
	if !enabledByDefault {
		n++
	}
	return n
}

// NamespaceStore is what Targeting reads of a Store.
type NamespaceStore interface {
	// NamespaceLabels looks up a namespace's labels; found is false for a namespace it does not
	// know.
	NamespaceLabels(ctx context.Context, namespace string) (labels map[string]string, found bool, err error)
	// Namespaces lists every namespace it knows, sorted by name.
	Namespaces(ctx context.Context) ([]Namespace, error)
}

// Targeting answers whether this CA instance serves a namespace, from a store's labels.
type Targeting struct {
	store            NamespaceStore
	caNamespace      string
	enabledByDefault bool
	log              *slog.Logger

	mu     sync.Mutex
	warned map[string]string // namespace → the invalid override value last warned about
}

// TargetingConfig configures Targeting. A nil Store knows no namespace, so every namespace follows
// EnabledByDefault.
type TargetingConfig struct {
	Store            NamespaceStore
	CANamespace      string
	EnabledByDefault bool
	Logger           *slog.Logger
}

// NewTargeting returns a Targeting.
func NewTargeting(cfg TargetingConfig) *Targeting {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Targeting{store: cfg.Store, caNamespace: cfg.CANamespace, enabledByDefault: cfg.EnabledByDefault, log: log, warned: map[string]string{}}
}

// NamespaceDecision is the decision for one namespace, with what it was made from.
type NamespaceDecision struct {
	Namespace string
	Known     bool              // the store knows the namespace
	Labels    map[string]string // its targeting labels (ca.istio.io/override, ca.istio.io/env) that are set
	Decision
}

// String explains the decision, naming the namespace, its labels and the rule.
func (d NamespaceDecision) String() string {
	var labels string
	if !d.Known {
		labels = "unknown to the store, so unlabelled"
	} else {
		var parts []string
		for _, key := range []string{LabelOverride, LabelEnv} {
			if v, ok := d.Labels[key]; ok {
				parts = append(parts, key+"="+strconv.Quote(v))
			} else {
				parts = append(parts, key+" unset")
			}
		}
		labels = strings.Join(parts, ", ")
	}
	return fmt.Sprintf("namespace %s (%s): row %d of the targeting truth table: %s", d.Namespace, labels, d.Row, d.Rule)
}

// Decide returns the decision for namespace.
func (t *Targeting) Decide(ctx context.Context, namespace string) (NamespaceDecision, error) {
	var (
		labels map[string]string
		found  bool
	)
	if t.store != nil {
		l, ok, err := t.store.NamespaceLabels(ctx, namespace)
		if err != nil {
			return NamespaceDecision{}, fmt.Errorf("look up namespace %s: %w", namespace, err)
		}
		labels, found = l, ok
	}
	if !found {
		labels = nil
	}
	return t.decide(namespace, found, labels), nil
}

// Targets reports whether namespace is served by this instance, and when it is not, why.
func (t *Targeting) Targets(ctx context.Context, namespace string) (served bool, why string, err error) {
	d, err := t.Decide(ctx, namespace)
	if err != nil {
		return false, "", err
	}
	if d.Served {
		return true, "", nil
	}
	return false, d.String(), nil
}

// Decisions returns the decision for every namespace the store knows, sorted by name.
func (t *Targeting) Decisions(ctx context.Context) ([]NamespaceDecision, error) {
	if t.store == nil {
		return nil, nil
	}
	namespaces, err := t.store.Namespaces(ctx)
	if err != nil {
		return nil, fmt.Errorf("list namespaces: %w", err)
	}
	out := make([]NamespaceDecision, 0, len(namespaces))
	for _, ns := range namespaces {
		out = append(out, t.decide(ns.Name, true, ns.Labels))
	}
	slices.SortFunc(out, func(a, b NamespaceDecision) int { return cmp.Compare(a.Namespace, b.Namespace) })
	return out, nil
}

// Default is the decision for a namespace the store does not know.
func (t *Targeting) Default() Decision {
	return Decide(nil, t.caNamespace, t.enabledByDefault)
}

func (t *Targeting) decide(namespace string, known bool, labels map[string]string) NamespaceDecision {
	d := NamespaceDecision{Namespace: namespace, Known: known, Labels: map[string]string{}, Decision: Decide(labels, t.caNamespace, t.enabledByDefault)}
	for _, key := range []string{LabelOverride, LabelEnv} {
		if v, ok := labels[key]; ok {
			d.Labels[key] = v
		}
	}
	t.warnInvalidOverride(namespace, d.InvalidOverride, d.OverrideValue)
	return d
}

// warnInvalidOverride warns once per namespace and value about an override label that counts as
// unset, so that a typo ("True", "yes") does not go unnoticed, nor flood the log at every request.
func (t *Targeting) warnInvalidOverride(namespace string, invalid bool, value string) {
	t.mu.Lock()
	last, warned := t.warned[namespace]
	warn := invalid && (!warned || last != value)
	switch {
	case !invalid:
		delete(t.warned, namespace)
	case warn:
		t.warned[namespace] = value
	}
	t.mu.Unlock()
	if warn {
		t.log.Warn("namespace label is neither true nor false; it counts as unset",
			logkey.Namespace, namespace, logkey.Label, LabelOverride, logkey.Value, logkey.Untrusted(value))
	}
}
