package controlplane

import (
	"context"
	"errors"
	"log/slog"

	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/internal/configerr"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// TargetsConfig is what `meshid ca targets` reads: the flags of `meshid ca` that targeting uses.
type TargetsConfig struct {
	Manifests                 string // empty: no namespace is known
	CANamespace               string
	EnableNamespacesByDefault bool
	Logger                    *slog.Logger // told of malformed manifests
}

// Validate reports every problem with the configuration at once.
func (c *TargetsConfig) Validate() error {
	var errs []error
	if err := pki.ValidateNamespace(c.CANamespace); err != nil {
		errs = append(errs, &configerr.FieldError{Field: "CANamespace", Err: err})
	}
	return errors.Join(errs...)
}

// TargetsReport is the targeting decision of one CA instance for every namespace it knows.
type TargetsReport struct {
	CANamespace               string
	EnableNamespacesByDefault bool
	Namespaces                []controller.NamespaceDecision // sorted by name
	// Others is the decision for a namespace no manifest names.
	Others controller.Decision
}

// Targets reads the manifests once and decides, for the CA instance cfg describes, every
// namespace they name, as `meshid ca` with the same flags would.
func Targets(ctx context.Context, cfg TargetsConfig) (TargetsReport, error) {
	if err := cfg.Validate(); err != nil {
		return TargetsReport{}, err
	}
	if err := checkManifestsDir(cfg.Manifests); err != nil {
		return TargetsReport{}, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	var store controller.NamespaceStore
	if cfg.Manifests != "" {
		m, err := controller.NewManifests(controller.ManifestsConfig{Dir: cfg.Manifests, Logger: log.With(logkey.Component, "manifests")})
		if err != nil {
			return TargetsReport{}, &configerr.FieldError{Field: "Manifests", Err: err}
		}
		store = m
	}
	t := controller.NewTargeting(controller.TargetingConfig{
		Store: store, CANamespace: cfg.CANamespace, EnabledByDefault: cfg.EnableNamespacesByDefault,
		Logger: log.With(logkey.Component, "targeting"),
	})
	decisions, err := t.Decisions(ctx)
	if err != nil {
		return TargetsReport{}, err
	}
	return TargetsReport{
		CANamespace:               cfg.CANamespace,
		EnableNamespacesByDefault: cfg.EnableNamespacesByDefault,
		Namespaces:                decisions,
		Others:                    t.Default(),
	}, nil
}
