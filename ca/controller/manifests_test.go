package controller_test

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/testutil"
)

var _ controller.Store = (*controller.Manifests)(nil)

// manifests is a local store over a temp dir, its logs and its clock.
type manifests struct {
	dir   string
	store *controller.Manifests
	clock *testutil.FakeClock
	logs  *testutil.SyncBuffer
}

// newManifests builds a store over dir (the files already in it are read at once).
func newManifests(t *testing.T, dir string) *manifests {
	t.Helper()
	m := &manifests{dir: dir, clock: testutil.NewFakeClock(time.Now()), logs: &testutil.SyncBuffer{}}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("store logs:\n%s", m.logs.String())
		}
	})
	store, err := controller.NewManifests(controller.ManifestsConfig{Dir: dir, Clock: m.clock,
		Logger: slog.New(slog.NewJSONHandler(m.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	m.store = store
	return m
}

// run runs the store until the test ends, and returns once it watches the directory.
func (m *manifests) run(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.store.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	select {
	case <-m.store.Ready():
	case err := <-done:
		t.Fatalf("Run ended before watching: %v", err)
	}
}

// waitFor lets debounce intervals pass until cond holds of the store.
func (m *manifests) waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for {
		changed := m.store.Changed() // before the check: a change after it closes this channel
		if cond() {
			return
		}
		t.Logf("waiting for %s", what)
		testutil.Drive(t, m.clock, filewatch.DefaultDebounce, 0, changed)
	}
}

func (m *manifests) labels(t *testing.T, ns string) (map[string]string, bool) {
	t.Helper()
	labels, found, err := m.store.NamespaceLabels(t.Context(), ns)
	if err != nil {
		t.Fatal(err)
	}
	return labels, found
}

func (m *manifests) namespaces(t *testing.T) []string {
	t.Helper()
	nss, err := m.store.Namespaces(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, ns := range nss {
		names = append(names, ns.Name)
	}
	return names
}

func (m *manifests) serviceAccounts(t *testing.T, ns string) []string {
	t.Helper()
	sas, err := m.store.ServiceAccounts(t.Context(), ns)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, sa := range sas {
		names = append(names, sa.Namespace+"/"+sa.Name)
	}
	return names
}

// logged returns the store's log records whose message is msg.
func (m *manifests) logged(t *testing.T, msg string) []map[string]any {
	t.Helper()
	return m.logs.Records(t, msg)
}

// writeFile replaces a file at once, as an editor that saves by rename does, so that the store
// never reads it half-written.
func writeFile(t *testing.T, path, content string) {
	t.Helper()
	tmp := filepath.Join(filepath.Dir(path), ".tmp-"+filepath.Base(path))
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func namespaceYAML(name string, labels map[string]string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: %s\n", name)
	if len(labels) > 0 {
		b.WriteString("  labels:\n")
		for _, k := range slices.Sorted(maps.Keys(labels)) {
			fmt.Fprintf(&b, "    %s: %q\n", k, labels[k])
		}
	}
	return b.String()
}

// Kubernetes' own YAML and JSON as people keep it: several documents to a file, comments, a
// `kubectl get -o yaml` List, a JSON stream, objects of other kinds (ignored), and files the
// store does not read (other extensions, dot files, subdirectories).
func TestManifestsReadsNamespacesAndServiceAccounts(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "nested"), 0o750); err != nil {
		t.Fatal(err)
	}
	testutil.WriteFiles(t, dir, map[string][]byte{
		"mesh.yaml": []byte(`# The mesh's namespaces.
apiVersion: v1
kind: Namespace
metadata:
  name: web
  labels:
    ca.istio.io/env: istio-system
    team: frontend
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  namespace: web
spec:
  replicas: 1
---
# only a comment
---
apiVersion: v1
kind: ServiceAccount
metadata:
  name: frontend
  namespace: web
---
apiVersion: v1
kind: ServiceAccount
metadata:
  name: builder
`),
		"exported.yml": []byte(`apiVersion: v1
kind: List
metadata:
  resourceVersion: ""
items:
- apiVersion: v1
  kind: Namespace
  metadata:
    name: batch
    labels:
      ca.istio.io/override: "false"
      kubernetes.io/metadata.name: batch
  spec:
    finalizers: [kubernetes]
  status:
    phase: Active
- apiVersion: v1
  kind: ConfigMap
  metadata:
    name: settings
    namespace: batch
`),
		"more.json": []byte(`{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "api"}}
{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "server", "namespace": "api"}}
`),
		"notes.txt":            []byte(namespaceYAML("from-txt", nil)),
		".hidden.yaml":         []byte(namespaceYAML("from-dotfile", nil)),
		"nested/deeper.yaml":   []byte(namespaceYAML("from-subdir", nil)),
		"namespaces-list.yaml": []byte("apiVersion: v1\nkind: NamespaceList\nitems:\n- metadata:\n    name: tools\n"),
	})
	m := newManifests(t, dir)

	if got, want := m.namespaces(t), []string{"api", "batch", "tools", "web"}; !slices.Equal(got, want) {
		t.Fatalf("namespaces %v, want %v", got, want)
	}
	labels, found := m.labels(t, "web")
	if !found || !maps.Equal(labels, map[string]string{"ca.istio.io/env": "istio-system", "team": "frontend"}) {
		t.Fatalf("web: %v %v", labels, found)
	}
	if labels, found := m.labels(t, "batch"); !found || labels["ca.istio.io/override"] != "false" {
		t.Fatalf("batch (from a List): %v %v", labels, found)
	}
	if labels, found := m.labels(t, "api"); !found || len(labels) != 0 {
		t.Fatalf("api (from JSON): %v %v", labels, found)
	}
	if _, found := m.labels(t, "unknown"); found {
		t.Fatal("a namespace in no manifest is found")
	}
	// A service account without a namespace is in "default", as kubectl would put it.
	if got, want := m.serviceAccounts(t, ""), []string{"api/server", "default/builder", "web/frontend"}; !slices.Equal(got, want) {
		t.Fatalf("service accounts %v, want %v", got, want)
	}
	if got, want := m.serviceAccounts(t, "web"), []string{"web/frontend"}; !slices.Equal(got, want) {
		t.Fatalf("service accounts of web %v, want %v", got, want)
	}
	if got := m.logged(t, "manifest object skipped"); len(got) != 0 {
		t.Fatalf("objects of other kinds were reported as malformed: %v", got)
	}

	// What a reader gets is its own.
	labels["ca.istio.io/env"] = "changed"
	if again, _ := m.labels(t, "web"); again["ca.istio.io/env"] != "istio-system" {
		t.Fatal("a reader changed the store's labels")
	}
}

// A malformed file or object is reported with its path and document, and skipped; the other
// objects, of the same file and of others, stay.
func TestManifestsMalformedObjectsAreSkipped(t *testing.T) {
	t.Parallel()
	good := namespaceYAML("good", map[string]string{"ca.istio.io/override": "true"})
	tests := []struct {
		name    string
		file    string
		content string
		doc     float64 // the document reported; 0 for the whole file
		want    string  // in the error
		keeps   []string
	}{
		{"unknown field", "a.yaml", good + "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: bad\n  lables:\n    ca.istio.io/override: \"false\"\n", 2, `unknown field "metadata.lables"`, []string{"good"}},
		{"key given twice", "a.yaml", "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: bad\n  labels: {a: b}\n  labels: {c: d}\n---\n" + good, 1, `"labels" already set`, []string{"good"}},
		{"not YAML", "a.yaml", good + "---\nkind: [Namespace\n", 2, "yaml", []string{"good"}},
		{"wrong apiVersion", "a.yaml", "apiVersion: apps/v1\nkind: Namespace\nmetadata:\n  name: bad\n---\n" + good, 1, "want apiVersion v1", []string{"good"}},
		{"no kind", "a.yaml", "apiVersion: v1\nmetadata:\n  name: bad\n---\n" + good, 1, "no kind", []string{"good"}},
		{"bad namespace name", "a.yaml", namespaceYAML("Bad_Name", nil) + "---\n" + good, 1, "metadata.name", []string{"good"}},
		{"bad label value", "a.yaml", good + "---\n" + namespaceYAML("bad", map[string]string{"ca.istio.io/override": "not a label value!"}), 2, "metadata.labels", []string{"good"}},
		{"labels of the wrong type", "a.yaml", good + "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: bad\n  labels: [a, b]\n", 2, "cannot unmarshal", []string{"good"}},
		{"bad service account name", "a.yaml", good + "---\napiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: UPPER\n  namespace: good\n", 2, "service account", []string{"good"}},
		{"bad List item", "a.yaml", "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Namespace\n  metadata:\n    name: good\n    labels: {ca.istio.io/override: \"true\"}\n- apiVersion: v1\n  kind: Namespace\n  metadata:\n    name: bad\n    lables: {}\n", 1, `unknown field`, []string{"good"}},
		{"broken JSON stream", "a.json", `{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bad"}} {"apiVersion": `, 0, "document 2", nil},
		{"bad document separator", "a.yaml", "--- !!map\n" + good, 0, "invalid Yaml document separator", nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			testutil.WriteFiles(t, dir, map[string][]byte{
				tc.file:      []byte(tc.content),
				"other.yaml": []byte(namespaceYAML("other", nil)),
			})
			m := newManifests(t, dir)
			if got, want := m.namespaces(t), append(slices.Clone(tc.keeps), "other"); !slices.Equal(got, want) {
				t.Fatalf("namespaces %v, want %v", got, want)
			}
			if labels, _ := m.labels(t, "good"); tc.keeps != nil && labels["ca.istio.io/override"] != "true" {
				t.Fatalf("good: labels %v", labels)
			}
			msg := "manifest object skipped"
			if tc.doc == 0 {
				msg = "manifest file skipped"
			}
			recs := m.logged(t, msg)
			if len(recs) != 1 {
				t.Fatalf("%d %q reports, want 1:\n%s", len(recs), msg, m.logs.String())
			}
			rec := recs[0]
			if rec["path"] != filepath.Join(dir, tc.file) || !strings.Contains(fmt.Sprint(rec["error"]), tc.want) {
				t.Fatalf("report %v: want path %s and an error naming %q", rec, filepath.Join(dir, tc.file), tc.want)
			}
			if tc.doc != 0 && rec["document"] != tc.doc {
				t.Fatalf("report %v: want document %v", rec, tc.doc)
			}
			want := controller.ManifestProblems{Objects: 1}
			if tc.doc == 0 {
				want = controller.ManifestProblems{Files: 1}
			}
			if got := m.store.Problems(); got != want {
				t.Fatalf("Problems() = %+v, want %+v", got, want)
			}
		})
	}
}

func TestManifestsDirMustExist(t *testing.T) {
	t.Parallel()
	missing := filepath.Join(t.TempDir(), "missing")
	if _, err := controller.NewManifests(controller.ManifestsConfig{Dir: missing}); err == nil || !strings.Contains(err.Error(), missing) {
		t.Fatalf("error %v, want one naming %s", err, missing)
	}
	file := filepath.Join(t.TempDir(), "ns.yaml")
	writeFile(t, file, namespaceYAML("a", nil))
	if _, err := controller.NewManifests(controller.ManifestsConfig{Dir: file}); err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Fatalf("error %v, want a file refused as not a directory", err)
	}
}

// Edits take effect without a restart: new files, changed labels, removed files. A malformed
// edit changes nothing: what the file held before stays, so a typo cannot make a namespace that
// was kept out unlabelled, and served by default.
func TestManifestsFollowEdits(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	prod := filepath.Join(dir, "prod.yaml")
	writeFile(t, prod, namespaceYAML("prod", map[string]string{"ca.istio.io/override": "false"}))
	m := newManifests(t, dir)
	m.run(t)

	writeFile(t, filepath.Join(dir, "web.yaml"), namespaceYAML("web", nil)+"---\napiVersion: v1\nkind: ServiceAccount\nmetadata: {name: frontend, namespace: web}\n")
	m.waitFor(t, "a new file", func() bool { _, found := m.labels(t, "web"); return found })
	if got := m.serviceAccounts(t, "web"); !slices.Equal(got, []string{"web/frontend"}) {
		t.Fatalf("service accounts of web %v", got)
	}

	writeFile(t, filepath.Join(dir, "web.yaml"), namespaceYAML("web", map[string]string{"ca.istio.io/env": "istio-system"}))
	m.waitFor(t, "a relabelled namespace", func() bool { l, _ := m.labels(t, "web"); return l["ca.istio.io/env"] == "istio-system" })
	if got := m.serviceAccounts(t, ""); len(got) != 0 {
		t.Fatalf("service accounts %v after their document was removed", got)
	}

	// A typo in prod's labels, then a marker: once the marker is seen, the typo has been read.
	writeFile(t, prod, "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: prod\n  lables:\n    ca.istio.io/override: \"false\"\n")
	writeFile(t, filepath.Join(dir, "marker.yaml"), namespaceYAML("marker-1", nil))
	m.waitFor(t, "the first marker", func() bool { _, found := m.labels(t, "marker-1"); return found })
	if labels, found := m.labels(t, "prod"); !found || labels["ca.istio.io/override"] != "false" {
		t.Fatalf("after a malformed edit prod has labels %v (found %v), want its previous ca.istio.io/override=false", labels, found)
	}
	if recs := m.logged(t, "manifest object skipped; its previous version stays"); len(recs) != 1 || recs[0]["path"] != prod {
		t.Fatalf("reports of the malformed edit: %v", recs)
	}

	// The same for a file that cannot be split into documents at all.
	writeFile(t, prod, "--- !!oops\n"+namespaceYAML("prod", nil))
	writeFile(t, filepath.Join(dir, "marker.yaml"), namespaceYAML("marker-2", nil))
	m.waitFor(t, "the second marker", func() bool { _, found := m.labels(t, "marker-2"); return found })
	if labels, _ := m.labels(t, "prod"); labels["ca.istio.io/override"] != "false" {
		t.Fatalf("after a broken file prod has labels %v, want its previous ca.istio.io/override=false", labels)
	}
	if recs := m.logged(t, "manifest file skipped; what it held before stays"); len(recs) != 1 || recs[0]["path"] != prod {
		t.Fatalf("reports of the broken file: %v", recs)
	}

	// Fixed, then removed.
	writeFile(t, prod, namespaceYAML("prod", map[string]string{"ca.istio.io/override": "true"}))
	m.waitFor(t, "the fixed file", func() bool { l, _ := m.labels(t, "prod"); return l["ca.istio.io/override"] == "true" })
	if err := os.Remove(prod); err != nil {
		t.Fatal(err)
	}
	m.waitFor(t, "the removed file", func() bool { _, found := m.labels(t, "prod"); return !found })
	if got, want := m.namespaces(t), []string{"marker-2", "web"}; !slices.Equal(got, want) {
		t.Fatalf("namespaces %v, want %v", got, want)
	}
}

// The directory may be a mounted config map: its files are links through ..data, swapped at once.
func TestManifestsFromAConfigMapVolume(t *testing.T) {
	t.Parallel()
	vol := testutil.NewSecretVolume(t, filepath.Join(t.TempDir(), "manifests"))
	vol.Update(map[string][]byte{"namespaces.yaml": []byte(namespaceYAML("prod", map[string]string{"ca.istio.io/override": "false"}))})
	m := newManifests(t, vol.Dir)
	m.run(t)
	if got := m.namespaces(t); !slices.Equal(got, []string{"prod"}) {
		t.Fatalf("namespaces %v, want [prod] (each once)", got)
	}
	for i := range 3 { // the second swap is where watchers have broken
		ns := fmt.Sprintf("gen-%d", i)
		vol.Update(map[string][]byte{"namespaces.yaml": []byte(namespaceYAML(ns, nil))})
		m.waitFor(t, ns, func() bool { return slices.Equal(m.namespaces(t), []string{ns}) })
	}
}

// An object defined in two files is taken from the first, by file name, and reported.
func TestManifestsDuplicateObjects(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	testutil.WriteFiles(t, dir, map[string][]byte{
		"a.yaml": []byte(namespaceYAML("prod", map[string]string{"ca.istio.io/override": "false"})),
		"b.yaml": []byte(namespaceYAML("prod", map[string]string{"ca.istio.io/override": "true"})),
	})
	m := newManifests(t, dir)
	if labels, _ := m.labels(t, "prod"); labels["ca.istio.io/override"] != "false" {
		t.Fatalf("prod: %v, want a.yaml's labels", labels)
	}
	recs := m.logged(t, "manifest object defined twice; the first stays")
	if len(recs) != 1 || !strings.Contains(fmt.Sprint(recs[0]["path"]), "b.yaml") || !strings.Contains(fmt.Sprint(recs[0]["kept"]), "a.yaml") {
		t.Fatalf("reports: %v", recs)
	}
	if got := m.store.Problems(); got != (controller.ManifestProblems{Duplicates: 1}) {
		t.Fatalf("Problems() = %+v, want one duplicate", got)
	}
}

// Readers may ask while the store reloads (run with -race).
func TestManifestsConcurrentReads(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	m := newManifests(t, dir)
	m.run(t)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if labels, found, _ := m.store.NamespaceLabels(context.Background(), "ns"); found {
					labels["x"] = "mine" // a reader's copy
				}
				_, _ = m.store.Namespaces(context.Background())
				_, _ = m.store.ServiceAccounts(context.Background(), "")
			}
		})
	}
	for i := range 5 {
		writeFile(t, filepath.Join(dir, "ns.yaml"), namespaceYAML("ns", map[string]string{"gen": fmt.Sprint(i)}))
		m.waitFor(t, fmt.Sprint("generation ", i), func() bool { l, _ := m.labels(t, "ns"); return l["gen"] == fmt.Sprint(i) })
	}
	close(stop)
	wg.Wait()
}

// Two CA instances over one store split the namespaces exactly as the labels say: for every
// combination of labels, and both defaults, each namespace is served by the instances the truth
// table names, and one named by ca.istio.io/env by that one alone.
func TestInstancesSplitNamespaces(t *testing.T) {
	t.Parallel()
	const a, b = "istio-system", "istio-canary"
	overrides := map[string]string{"true": "true", "false": "false", "unset": "", "invalid": "yes"}
	envs := map[string]string{"a": a, "b": b, "elsewhere": "third-ca", "unset": ""}
	var files strings.Builder
	for oName, o := range overrides {
		for eName, e := range envs {
			labels := map[string]string{}
			if o != "" {
				labels["ca.istio.io/override"] = o
			}
			if e != "" {
				labels["ca.istio.io/env"] = e
			}
			fmt.Fprintf(&files, "%s---\n", namespaceYAML("ns-"+oName+"-"+eName, labels))
		}
	}
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "namespaces.yaml"), files.String())
	m := newManifests(t, dir)
	if got := len(m.namespaces(t)); got != len(overrides)*len(envs) {
		t.Fatalf("%d namespaces in the store, want %d", got, len(overrides)*len(envs))
	}

	for _, enabled := range []bool{true, false} {
		t.Run(fmt.Sprintf("enabled by default %v", enabled), func(t *testing.T) {
			t.Parallel()
			instances := map[string]*controller.Targeting{
				a: controller.NewTargeting(controller.TargetingConfig{Store: m.store, CANamespace: a, EnabledByDefault: enabled}),
				b: controller.NewTargeting(controller.TargetingConfig{Store: m.store, CANamespace: b, EnabledByDefault: enabled}),
			}
			for _, ns := range append(m.namespaces(t), "not-in-store") {
				var servedBy []string
				for _, name := range []string{a, b} {
					served, _, err := instances[name].Targets(t.Context(), ns)
					if err != nil {
						t.Fatal(err)
					}
					if served {
						servedBy = append(servedBy, name)
					}
				}
				var want []string
				switch {
				case strings.HasPrefix(ns, "ns-true-"):
					want = []string{a, b}
				case strings.HasPrefix(ns, "ns-false-"):
				case strings.HasSuffix(ns, "-a"):
					want = []string{a}
				case strings.HasSuffix(ns, "-b"):
					want = []string{b}
				case strings.HasSuffix(ns, "-elsewhere"):
				case enabled: // unset (or invalid) override, no env label, or not in the store
					want = []string{a, b}
				}
				if !slices.Equal(servedBy, want) {
					t.Errorf("%s is served by %v, want %v", ns, servedBy, want)
				}
			}
		})
	}
}
