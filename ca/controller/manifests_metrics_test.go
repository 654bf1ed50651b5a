package controller_test

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/meshid/meshid/ca/controller"
)

// What a load skipped is exported by kind, read at each scrape.
func TestRegisterManifestProblems(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "bad.yaml"), []byte("kind: Namespace\nmetadata: {name: Not_Valid}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	m := newManifests(t, dir)
	reg := prometheus.NewPedanticRegistry()
	if err := controller.RegisterManifestProblems(reg, m.store); err != nil {
		t.Fatal(err)
	}
	p := m.store.Problems()
	want := strings.NewReplacer("F", strconv.Itoa(p.Files), "O", strconv.Itoa(p.Objects), "D", strconv.Itoa(p.Duplicates)).Replace(`
# HELP meshid_ca_manifest_problems What the last load of --manifests skipped: unreadable files, objects that could not be used, objects defined twice.
# TYPE meshid_ca_manifest_problems gauge
meshid_ca_manifest_problems{kind="duplicate"} D
meshid_ca_manifest_problems{kind="file"} F
meshid_ca_manifest_problems{kind="object"} O
`)
	if p.Objects == 0 {
		t.Fatalf("Problems() = %+v, want the bad object counted", p)
	}
	if err := promtest.GatherAndCompare(reg, strings.NewReader(want), "meshid_ca_manifest_problems"); err != nil {
		t.Fatal(err)
	}
	if err := controller.RegisterManifestProblems(reg, m.store); err == nil {
		t.Fatal("registered twice without an error")
	}
}
