package controller_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/internal/testutil"
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

type truthRow struct {
	override, envMatch, enabledByDefault, created string
}

// truthTable reads seed 000's table, as the seed prints it: a header line, then one line per
// row of four words.
func truthTable(t *testing.T) []truthRow {
	t.Helper()
	data, err := os.ReadFile("testdata/truth-table.txt")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(data)), "\n")
	if !strings.HasPrefix(lines[0], "ca.istio.io/override value ca.istio.io/env match enableNamespacesByDefault") {
		t.Fatalf("the fixture does not start with the seed's header: %q", lines[0])
	}
	var rows []truthRow
	for _, line := range lines[1:] {
		f := strings.Fields(line)
		if len(f) != 4 {
			t.Fatalf("row %q: want 4 columns", line)
		}
		rows = append(rows, truthRow{f[0], f[1], f[2], f[3]})
	}
	return rows
}

// TestTargetsTruthTable is seed 000's table, row for row: the decision, and the row it names.
func TestTargetsTruthTable(t *testing.T) {
	t.Parallel()
	table := truthTable(t)
	if len(table) != 18 {
		t.Fatalf("truth table has %d rows, want 18", len(table))
	}
	for i, row := range table {
		name := fmt.Sprintf("row %d: override=%s/env=%s/default=%s", i+1, row.override, row.envMatch, row.enabledByDefault)
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			labels := labelsFor(t, row.override, row.envMatch)
			enabled := row.enabledByDefault == "true"
			d := controller.Decide(labels, caNamespace, enabled)
			if got, want := d.Served, row.created == "yes"; got != want {
				t.Errorf("Decide(%v, %q, %v).Served = %v, want %v", labels, caNamespace, enabled, got, want)
			}
			if d.Row != i+1 || d.Override != row.override || d.EnvMatch != row.envMatch || d.EnabledByDefault != enabled {
				t.Errorf("decision %+v, want row %d (%s, %s, %s)", d, i+1, row.override, row.envMatch, row.enabledByDefault)
			}
			if d.Rule == "" {
				t.Error("the decision names no rule")
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
		wantRow          int
	}{
		{name: "nil labels follow the default (true)", labels: nil, enabledByDefault: true, want: true, wantRow: 17},
		{name: "nil labels follow the default (false)", labels: nil, enabledByDefault: false, want: false, wantRow: 18},
		{name: "unrelated labels follow the default", labels: map[string]string{"team": "web"}, enabledByDefault: true, want: true, wantRow: 17},
		// An unparsable override counts as unset: the env label or the default decides.
		{name: "unparsable override, no env, default true", labels: map[string]string{controller.LabelOverride: "maybe"}, enabledByDefault: true, want: true, wantRow: 17},
		{name: "unparsable override, no env, default false", labels: map[string]string{controller.LabelOverride: "yes"}, enabledByDefault: false, want: false, wantRow: 18},
		{name: "unparsable override, env matches, default false", labels: map[string]string{controller.LabelOverride: "enabled", controller.LabelEnv: caNamespace}, enabledByDefault: false, want: true, wantRow: 14},
		{name: "unparsable override, env elsewhere, default true", labels: map[string]string{controller.LabelOverride: "disabled", controller.LabelEnv: "other"}, enabledByDefault: true, want: false, wantRow: 15},
		{name: "empty override counts as unset", labels: map[string]string{controller.LabelOverride: ""}, enabledByDefault: true, want: true, wantRow: 17},
		{name: "empty env names no CA namespace", labels: map[string]string{controller.LabelEnv: ""}, enabledByDefault: true, want: false, wantRow: 15},
		{name: "env match is exact", labels: map[string]string{controller.LabelEnv: "Istio-System"}, enabledByDefault: false, want: false, wantRow: 16},
		// Only "true" and "false" are booleans here, though strconv.ParseBool takes these too.
		{name: "override 1 counts as unset", labels: map[string]string{controller.LabelOverride: "1"}, enabledByDefault: false, want: false, wantRow: 18},
		{name: "override T counts as unset", labels: map[string]string{controller.LabelOverride: "T"}, enabledByDefault: false, want: false, wantRow: 18},
		{name: "override TRUE counts as unset", labels: map[string]string{controller.LabelOverride: "TRUE"}, enabledByDefault: false, want: false, wantRow: 18},
		{name: "override False counts as unset", labels: map[string]string{controller.LabelOverride: "False"}, enabledByDefault: true, want: true, wantRow: 17},
		{name: "override 0 counts as unset", labels: map[string]string{controller.LabelOverride: "0", controller.LabelEnv: caNamespace}, enabledByDefault: true, want: true, wantRow: 13},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			d := controller.Decide(tc.labels, caNamespace, tc.enabledByDefault)
			if d.Served != tc.want || d.Row != tc.wantRow {
				t.Errorf("Decide(%v, %q, %v) = served %v row %d, want %v row %d", tc.labels, caNamespace, tc.enabledByDefault, d.Served, d.Row, tc.want, tc.wantRow)
			}
			if v, set := tc.labels[controller.LabelOverride]; set && v != "true" && v != "false" {
				if d.Override != "unset" || !d.InvalidOverride || d.OverrideValue != v || !strings.Contains(d.Rule, "neither true nor false") {
					t.Errorf("decision %+v: want the override %q counted as unset, and said so", d, v)
				}
			}
		})
	}
}

// fakeStore is a NamespaceStore over a map; a namespace absent from the map is unknown.
type fakeStore struct {
	mu         sync.Mutex
	namespaces map[string]map[string]string
	err        error
	asked      []string
}

func (s *fakeStore) NamespaceLabels(_ context.Context, namespace string) (map[string]string, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.asked = append(s.asked, namespace)
	if s.err != nil {
		return nil, false, s.err
	}
	labels, ok := s.namespaces[namespace]
	return labels, ok, nil
}

func (s *fakeStore) Namespaces(context.Context) ([]controller.Namespace, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return nil, s.err
	}
	var out []controller.Namespace
	for name, labels := range s.namespaces {
		out = append(out, controller.Namespace{Name: name, Labels: labels})
	}
	return out, nil
}

func (s *fakeStore) set(namespace string, labels map[string]string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.namespaces[namespace] = labels
}

func TestTargetingNilStore(t *testing.T) {
	t.Parallel()
	for _, enabled := range []bool{true, false} {
		t.Run(map[bool]string{true: "enabled by default", false: "disabled by default"}[enabled], func(t *testing.T) {
			t.Parallel()
			tg := controller.NewTargeting(controller.TargetingConfig{CANamespace: caNamespace, EnabledByDefault: enabled})
			for _, ns := range []string{"default", caNamespace, "prod"} {
				got, _, err := tg.Targets(t.Context(), ns)
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
		why              []string // what the refusal's explanation names
	}{
		{"served-by-env", false, true, nil},
		{"served-elsewhere", true, false, []string{"served-elsewhere", `ca.istio.io/env="other-ca"`, "ca.istio.io/override unset", "row 15", "another CA instance"}},
		{"forced-on", false, true, nil},
		{"forced-off", true, false, []string{"forced-off", `ca.istio.io/override="false"`, `ca.istio.io/env="istio-system"`, "row 7", "no CA instance serves it"}},
		{"no-labels", true, true, nil},
		{"no-labels", false, false, []string{"no-labels", "row 18", "--enable-namespaces-by-default=false"}},
		{"nil-labels", true, true, nil},
		{"unparsable-forced", false, false, []string{`ca.istio.io/override="sure"`, "row 18", "neither true nor false"}},
		{"unparsable-forced", true, true, nil},
		{"unparsable-env-off", true, false, []string{"row 15", "neither true nor false"}},
		{"unknown", true, true, nil},
		{"unknown", false, false, []string{"unknown", "unknown to the store", "row 18"}},
	}
	for _, tc := range tests {
		t.Run(tc.namespace+map[bool]string{true: "/default-on", false: "/default-off"}[tc.enabledByDefault], func(t *testing.T) {
			t.Parallel()
			store := &fakeStore{namespaces: namespaces}
			tg := controller.NewTargeting(controller.TargetingConfig{Store: store, CANamespace: caNamespace, EnabledByDefault: tc.enabledByDefault})
			got, why, err := tg.Targets(t.Context(), tc.namespace)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("Targets(%q) = %v, want %v", tc.namespace, got, tc.want)
			}
			for _, want := range tc.why {
				if !strings.Contains(why, want) {
					t.Errorf("why %q does not name %q", why, want)
				}
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
			got, _, err := tg.Targets(t.Context(), "prod")
			if !errors.Is(err, errStore) {
				t.Fatalf("err = %v, want it to wrap the store's error", err)
			}
			if !strings.Contains(err.Error(), "prod") {
				t.Errorf("error %q does not name the namespace", err)
			}
			if got {
				t.Error("Targets reported true alongside an error")
			}
			if _, err := tg.Decisions(t.Context()); !errors.Is(err, errStore) {
				t.Errorf("Decisions: %v, want the store's error", err)
			}
		})
	}
}

// An override that is neither true nor false is warned about once per namespace (and again when
// it changes to another such value), not at every request.
func TestInvalidOverrideWarnedOncePerNamespace(t *testing.T) {
	t.Parallel()
	var logs testutil.SyncBuffer
	store := &fakeStore{namespaces: map[string]map[string]string{
		"web": {controller.LabelOverride: "True"},
		"api": {controller.LabelOverride: "no"},
		"ok":  {controller.LabelOverride: "false"},
	}}
	tg := controller.NewTargeting(controller.TargetingConfig{Store: store, CANamespace: caNamespace, EnabledByDefault: true,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	ask := func(ns string) {
		t.Helper()
		if _, _, err := tg.Targets(t.Context(), ns); err != nil {
			t.Fatal(err)
		}
	}
	warnings := func(ns string) int {
		return strings.Count(logs.String(), "namespace="+ns+" ")
	}
	for range 3 {
		ask("web")
		ask("api")
		ask("ok")
	}
	if _, err := tg.Decisions(t.Context()); err != nil {
		t.Fatal(err)
	}
	if warnings("web") != 1 || warnings("api") != 1 || warnings("ok") != 0 {
		t.Fatalf("warnings web=%d api=%d ok=%d, want 1, 1, 0:\n%s", warnings("web"), warnings("api"), warnings("ok"), logs.String())
	}
	if !strings.Contains(logs.String(), `value=True`) || !strings.Contains(logs.String(), "label="+controller.LabelOverride) {
		t.Fatalf("the warning does not name the label and its value:\n%s", logs.String())
	}
	store.set("web", map[string]string{controller.LabelOverride: "yes"})
	ask("web")
	ask("web")
	if warnings("web") != 2 {
		t.Fatalf("a new invalid value was warned about %d times in all, want 2:\n%s", warnings("web"), logs.String())
	}
}
