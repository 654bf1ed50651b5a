package controller_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/meshid/meshid/ca/controller"
)

const caNamespace = "istio-system"

// labelsFor builds a namespace's labels from a truth-table row: override "true", "false" or
// "unset"; env match "yes" (ca.istio.io/env names this CA's namespace), "no" (another namespace)
// or "unset".
func labelsFor(t *testing.T, override, envMatch string) map[string]string {
	t.Helper()
	labels := map[string]string{}
	switch override {
	case "true", "false":
		labels[controller.LabelOverride] = override
	case "unset":
	default:
		t.Fatalf("bad override %q in table", override)
	}
	switch envMatch {
	case "yes":
		labels[controller.LabelEnv] = caNamespace
	case "no":
		labels[controller.LabelEnv] = "other-ca-system"
	case "unset":
	default:
		t.Fatalf("bad env match %q in table", envMatch)
	}
	return labels
}

// TestTargetsTruthTable is seed 000's table, row for row.
func TestTargetsTruthTable(t *testing.T) {
	t.Parallel()
	table := []struct {
		override, envMatch string
		enabledByDefault   bool
		want               string // "yes": a workload secret is created
	}{
		{"true", "yes", true, "yes"},
		{"true", "yes", false, "yes"},
		{"true", "no", true, "yes"},
		{"true", "no", false, "yes"},
		{"true", "unset", true, "yes"},
		{"true", "unset", false, "yes"},
		{"false", "yes", true, "no"},
		{"false", "yes", false, "no"},
		{"false", "no", true, "no"},
		{"false", "no", false, "no"},
		{"false", "unset", true, "no"},
		{"false", "unset", false, "no"},
		{"unset", "yes", true, "yes"},
		{"unset", "yes", false, "yes"},
		{"unset", "no", true, "no"},
		{"unset", "no", false, "no"},
		{"unset", "unset", true, "yes"},
		{"unset", "unset", false, "no"},
	}
	if len(table) != 18 {
		t.Fatalf("truth table has %d rows, want 18", len(table))
	}
	for _, row := range table {
		name := "override=" + row.override + "/env=" + row.envMatch + "/default=" + map[bool]string{true: "true", false: "false"}[row.enabledByDefault]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			labels := labelsFor(t, row.override, row.envMatch)
			if got, want := controller.Targets(labels, caNamespace, row.enabledByDefault), row.want == "yes"; got != want {
				t.Errorf("Targets(%v, %q, %v) = %v, want %v", labels, caNamespace, row.enabledByDefault, got, want)
			}
		})
	}
}

func TestTargetsLabelEdgeCases(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name             string
		labels           map[string]string
		enabledByDefault bool
		want             bool
	}{
		{name: "nil labels follow the default (true)", labels: nil, enabledByDefault: true, want: true},
		{name: "nil labels follow the default (false)", labels: nil, enabledByDefault: false, want: false},
		{name: "unrelated labels follow the default", labels: map[string]string{"team": "web"}, enabledByDefault: true, want: true},
		// An unparsable override counts as unset: the env label or the default decides.
		{name: "unparsable override, no env, default true", labels: map[string]string{controller.LabelOverride: "maybe"}, enabledByDefault: true, want: true},
		{name: "unparsable override, no env, default false", labels: map[string]string{controller.LabelOverride: "yes"}, enabledByDefault: false, want: false},
		{name: "unparsable override, env matches, default false", labels: map[string]string{controller.LabelOverride: "enabled", controller.LabelEnv: caNamespace}, enabledByDefault: false, want: true},
		{name: "unparsable override, env elsewhere, default true", labels: map[string]string{controller.LabelOverride: "disabled", controller.LabelEnv: "other"}, enabledByDefault: true, want: false},
		{name: "empty override counts as unset", labels: map[string]string{controller.LabelOverride: ""}, enabledByDefault: true, want: true},
		{name: "empty env names no CA namespace", labels: map[string]string{controller.LabelEnv: ""}, enabledByDefault: true, want: false},
		{name: "env match is exact", labels: map[string]string{controller.LabelEnv: "Istio-System"}, enabledByDefault: false, want: false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if got := controller.Targets(tc.labels, caNamespace, tc.enabledByDefault); got != tc.want {
				t.Errorf("Targets(%v, %q, %v) = %v, want %v", tc.labels, caNamespace, tc.enabledByDefault, got, tc.want)
			}
		})
	}
}

// fakeStore is a NamespaceLabels over a map; a namespace absent from the map is unknown.
type fakeStore struct {
	namespaces map[string]map[string]string
	err        error
	asked      []string
}

func (s *fakeStore) NamespaceLabels(_ context.Context, namespace string) (map[string]string, bool, error) {
	s.asked = append(s.asked, namespace)
	if s.err != nil {
		return nil, false, s.err
	}
	labels, ok := s.namespaces[namespace]
	return labels, ok, nil
}

func TestTargetingNilStore(t *testing.T) {
	t.Parallel()
	for _, enabled := range []bool{true, false} {
		t.Run(map[bool]string{true: "enabled by default", false: "disabled by default"}[enabled], func(t *testing.T) {
			t.Parallel()
			tg := controller.NewTargeting(controller.TargetingConfig{CANamespace: caNamespace, EnabledByDefault: enabled})
			for _, ns := range []string{"default", caNamespace, "prod"} {
				got, err := tg.Targets(t.Context(), ns)
				if err != nil {
					t.Fatal(err)
				}
				if got != enabled {
					t.Errorf("Targets(%q) = %v, want EnabledByDefault = %v", ns, got, enabled)
				}
			}
		})
	}
}

func TestTargetingWithStore(t *testing.T) {
	t.Parallel()
	namespaces := map[string]map[string]string{
		"served-by-env":      {controller.LabelEnv: caNamespace},
		"served-elsewhere":   {controller.LabelEnv: "other-ca"},
		"forced-on":          {controller.LabelOverride: "true", controller.LabelEnv: "other-ca"},
		"forced-off":         {controller.LabelOverride: "false", controller.LabelEnv: caNamespace},
		"no-labels":          {},
		"nil-labels":         nil,
		"unparsable-forced":  {controller.LabelOverride: "sure"},
		"unparsable-env-off": {controller.LabelOverride: "sure", controller.LabelEnv: "other-ca"},
	}
	tests := []struct {
		namespace        string
		enabledByDefault bool
		want             bool
	}{
		{"served-by-env", false, true},
		{"served-elsewhere", true, false},
		{"forced-on", false, true},
		{"forced-off", true, false},
		{"no-labels", true, true},
		{"no-labels", false, false},
		{"nil-labels", true, true},
		{"unparsable-forced", false, false},
		{"unparsable-forced", true, true},
		{"unparsable-env-off", true, false},
		{"unknown", true, true},
		{"unknown", false, false},
	}
	for _, tc := range tests {
		t.Run(tc.namespace+map[bool]string{true: "/default-on", false: "/default-off"}[tc.enabledByDefault], func(t *testing.T) {
			t.Parallel()
			store := &fakeStore{namespaces: namespaces}
			tg := controller.NewTargeting(controller.TargetingConfig{Store: store, CANamespace: caNamespace, EnabledByDefault: tc.enabledByDefault})
			got, err := tg.Targets(t.Context(), tc.namespace)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("Targets(%q) = %v, want %v", tc.namespace, got, tc.want)
			}
			if len(store.asked) != 1 || store.asked[0] != tc.namespace {
				t.Errorf("store asked about %q, want exactly [%q]", store.asked, tc.namespace)
			}
		})
	}
}

func TestTargetingStoreError(t *testing.T) {
	t.Parallel()
	errStore := errors.New("store unavailable")
	for _, enabled := range []bool{true, false} {
		t.Run(map[bool]string{true: "enabled by default", false: "disabled by default"}[enabled], func(t *testing.T) {
			t.Parallel()
			tg := controller.NewTargeting(controller.TargetingConfig{Store: &fakeStore{err: errStore}, CANamespace: caNamespace, EnabledByDefault: enabled})
			got, err := tg.Targets(t.Context(), "prod")
			if !errors.Is(err, errStore) {
				t.Fatalf("err = %v, want it to wrap the store's error", err)
			}
			if !strings.Contains(err.Error(), "prod") {
				t.Errorf("error %q does not name the namespace", err)
			}
			if got {
				t.Error("Targets reported true alongside an error")
			}
		})
	}
}
