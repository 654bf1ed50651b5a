// Package controller decides which namespaces this CA instance serves (seed 000's targeting rules)
// and runs the service-account secret controller over a store of namespaces and service accounts.
package controller

import (
	"context"
	"fmt"
	"strconv"
)

// Namespace labels that steer CA instances.
const (
	// LabelOverride forces every CA instance to serve ("true") or ignore ("false") a namespace.
	LabelOverride = "ca.istio.io/override"
	// LabelEnv names the namespace of the CA instance that serves this namespace.
	LabelEnv = "ca.istio.io/env"
)

// Targets applies the targeting truth table to a namespace's labels for the CA instance running
// in caNamespace. nil labels stand for a namespace the store does not know.
func Targets(labels map[string]string, caNamespace string, enabledByDefault bool) bool {
	if v, ok := labels[LabelOverride]; ok {
		if override, err := strconv.ParseBool(v); err == nil {
			return override
		}
	}
	if env, ok := labels[LabelEnv]; ok {
		return env == caNamespace
	}
	return enabledByDefault
}

// NamespaceLabels looks up a namespace's labels; found is false for a namespace it does not know.
type NamespaceLabels interface {
	NamespaceLabels(ctx context.Context, namespace string) (labels map[string]string, found bool, err error)
}

// Targeting answers whether this CA instance serves a namespace.
type Targeting struct {
	store            NamespaceLabels
	caNamespace      string
	enabledByDefault bool
}

// TargetingConfig configures Targeting. A nil Store knows no namespace, so every namespace follows
// EnabledByDefault.
type TargetingConfig struct {
	Store            NamespaceLabels
	CANamespace      string
	EnabledByDefault bool
}

// NewTargeting returns a Targeting.
func NewTargeting(cfg TargetingConfig) *Targeting {
	return &Targeting{store: cfg.Store, caNamespace: cfg.CANamespace, enabledByDefault: cfg.EnabledByDefault}
}

// Targets reports whether namespace is served by this instance.
func (t *Targeting) Targets(ctx context.Context, namespace string) (bool, error) {
	var labels map[string]string
	if t.store != nil {
		l, found, err := t.store.NamespaceLabels(ctx, namespace)
		if err != nil {
			return false, fmt.Errorf("look up namespace %s: %w", namespace, err)
		}
		if found {
			labels = l
		}
	}
	return Targets(labels, t.caNamespace, t.enabledByDefault), nil
}
