package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const targetsManifests = `apiVersion: v1
kind: Namespace
metadata:
  name: web
  labels: {ca.istio.io/env: istio-system}
---
apiVersion: v1
kind: Namespace
metadata:
  name: prod
  labels: {ca.istio.io/override: "false"}
---
apiVersion: v1
kind: Namespace
metadata:
  name: canary
  labels: {ca.istio.io/env: istio-canary, team: web}
`

func manifestsDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "namespaces.yaml"), []byte(targetsManifests), 0o600); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestCAManifestsFlag(t *testing.T) {
	t.Parallel()
	cfg, _, _, err := execute(t, "ca", "--state-dir", "/s", "--manifests", "/etc/meshid/manifests")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Manifests != "/etc/meshid/manifests" {
		t.Fatalf("Manifests = %q", cfg.Manifests)
	}
	_, help, _, err := execute(t, "ca", "--help")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"--manifests", "not its subdirectories", "watched", "targets"} {
		if !strings.Contains(help, want) {
			t.Errorf("meshid ca --help does not mention %q", want)
		}
	}
}

// The table: one line per namespace, its two labels, the decision and its row, then the rule for
// every other namespace.
func TestCATargetsTable(t *testing.T) {
	t.Parallel()
	_, out, _, err := execute(t, "ca", "targets", "--manifests", manifestsDir(t))
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	want := [][]string{
		{"NAMESPACE", "ca.istio.io/override", "ca.istio.io/env", "SERVED", "ROW", "RULE"},
		{"canary", "-", `"istio-canary"`, "no", "15", "names another CA instance's namespace"},
		{"prod", `"false"`, "-", "no", "11", "no CA instance serves it"},
		{"web", "-", `"istio-system"`, "yes", "13", "names this CA instance's namespace"},
		{"(any other)", "-", "-", "yes", "17", "--enable-namespaces-by-default=true"},
		{"--ca-namespace=istio-system", "--enable-namespaces-by-default=true"},
	}
	if len(lines) != len(want) {
		t.Fatalf("%d lines, want %d:\n%s", len(lines), len(want), out)
	}
	for i, words := range want {
		for _, w := range words {
			if !strings.Contains(lines[i], w) {
				t.Errorf("line %d %q lacks %q", i+1, lines[i], w)
			}
		}
	}

	// Another instance, by its flags.
	_, out, _, err = execute(t, "ca", "targets", "--manifests", manifestsDir(t), "--ca-namespace", "istio-canary", "--enable-namespaces-by-default=false")
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]string{}
	for line := range strings.Lines(out) {
		f := strings.Fields(line)
		if len(f) >= 5 {
			rows[f[0]] = strings.Join(f[1:5], " ")
		}
	}
	for ns, want := range map[string]string{"canary": `- "istio-canary" yes 14`, "web": `- "istio-system" no 16`, "prod": `"false" - no 12`, "(any": `other) - - no`} {
		if rows[ns] != want {
			t.Errorf("%s: %q, want %q:\n%s", ns, rows[ns], want, out)
		}
	}
}

func TestCATargetsJSON(t *testing.T) {
	t.Parallel()
	_, out, _, err := execute(t, "ca", "targets", "--manifests", manifestsDir(t), "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	type decision struct {
		Served   bool   `json:"served"`
		Row      int    `json:"row"`
		Override string `json:"override"`
		EnvMatch string `json:"env_match"`
		Rule     string `json:"rule"`
	}
	var got struct {
		CANamespace      string `json:"ca_namespace"`
		EnabledByDefault bool   `json:"enable_namespaces_by_default"`
		Namespaces       []struct {
			Name   string            `json:"name"`
			Labels map[string]string `json:"labels"`
			decision
		} `json:"namespaces"`
		Others decision `json:"other_namespaces"`
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, out)
	}
	if got.CANamespace != "istio-system" || !got.EnabledByDefault || len(got.Namespaces) != 3 {
		t.Fatalf("report %+v", got)
	}
	canary, prod, web := got.Namespaces[0], got.Namespaces[1], got.Namespaces[2]
	if canary.Name != "canary" || canary.Served || canary.Row != 15 || canary.EnvMatch != "no" || canary.Override != "unset" ||
		len(canary.Labels) != 1 || canary.Labels["ca.istio.io/env"] != "istio-canary" {
		t.Errorf("canary: %+v (only the targeting labels are shown)", canary)
	}
	if prod.Name != "prod" || prod.Served || prod.Row != 11 || prod.Override != "false" || !strings.Contains(prod.Rule, "no CA instance") {
		t.Errorf("prod: %+v", prod)
	}
	if web.Name != "web" || !web.Served || web.Row != 13 || web.EnvMatch != "yes" {
		t.Errorf("web: %+v", web)
	}
	if !got.Others.Served || got.Others.Row != 17 {
		t.Errorf("other namespaces: %+v", got.Others)
	}

	// No manifests: no namespace is known, and the others' rule is still there.
	_, out, _, err = execute(t, "ca", "targets", "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, `"namespaces": []`) || !strings.Contains(out, `"row": 17`) {
		t.Errorf("without manifests:\n%s", out)
	}
}

func TestCATargetsRefusesBadInput(t *testing.T) {
	t.Parallel()
	missing := filepath.Join(t.TempDir(), "missing")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-o", "yaml"}, `-o "yaml": want table or json`},
		{[]string{"--ca-namespace", "Istio_System"}, "--ca-namespace"},
		{[]string{"--manifests", missing}, "--manifests"},
		{[]string{"extra"}, "unknown command"},
	} {
		_, _, _, err := execute(t, append([]string{"ca", "targets"}, tc.args...)...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ca targets %v: %v, want an error naming %q", tc.args, err, tc.want)
		}
	}
}
