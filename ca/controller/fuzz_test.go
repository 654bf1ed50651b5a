package controller

import (
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"testing"

	metav1validation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"

	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// FuzzManifestFile feeds arbitrary contents, as YAML or JSON, to what the manifests store reads
// of one file of --manifests, first with nothing loaded from that file before, then again after
// an earlier version of it (prev). Every object kept must be a Namespace or ServiceAccount that
// the API server would accept: DNS-1123 names, valid labels. Every skipped object and file is
// logged with the path and a reason. A file that cannot be split yields none of its new
// objects: exactly what it held before. What an earlier version adds is only its own objects,
// of names whose new definition was skipped. The same bytes read twice give the same objects.
func FuzzManifestFile(f *testing.F) {
	for _, path := range []string{
		filepath.Join("..", "..", "deploy", "compose", "manifests", "namespaces.yaml"),
		filepath.Join("..", "..", "deploy", "kubernetes", "00-namespace.yaml"),
	} {
		data, err := os.ReadFile(path)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(false, data, []byte(nil))
	}
	literals := testutil.StringLiterals(f, "manifests_test.go", "kind:", `"kind"`)
	if len(literals) < 5 {
		f.Fatalf("only %d manifests in manifests_test.go", len(literals))
	}
	const good = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: good\n  labels: {ca.istio.io/override: \"false\"}\n"
	for _, s := range literals {
		f.Add(s[0] == '{', []byte(s), []byte(good))
	}
	f.Add(false, []byte(good+"---\nkind: [Namespace\n"), []byte(good))
	f.Add(false, []byte("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: good\n  lables: {}\n"), []byte(good))
	f.Add(true, []byte(`{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "good"}} {"apiVersion": `), []byte(`{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "good"}}`))

	// One directory and decoder for the run: a worker runs its inputs one at a time.
	dir, dec := f.TempDir(), newDecoder()
	f.Fuzz(func(t *testing.T, asJSON bool, data, prevData []byte) {
		name := "manifests.yaml"
		if asJSON {
			name = "manifests.json"
		}
		path := filepath.Join(dir, name)
		read := func(data []byte, prev *manifestFile) (*manifestFile, *testutil.SyncBuffer) {
			if err := os.WriteFile(path, data, 0o600); err != nil {
				t.Fatal(err)
			}
			logs := &testutil.SyncBuffer{}
			m := &Manifests{log: slog.New(slog.NewJSONHandler(logs, nil)), decoder: dec}
			mf := m.loadFile(path, prev)
			if mf == nil {
				t.Fatal("loadFile returned nothing")
			}
			return mf, logs
		}

		got, logs := read(data, nil)
		checkManifestFile(t, path, got, nil, logs)
		again, _ := read(data, nil)
		if !slices.EqualFunc(got.objects, again.objects, sameObject) || got.skipped != again.skipped || got.unreadable != again.unreadable {
			t.Fatalf("the same bytes read twice: %+v, then %+v", got, again)
		}

		if slices.Equal(data, prevData) {
			return // an unchanged file is not read again
		}
		prev, _ := read(prevData, nil)
		after, logs := read(data, prev)
		checkManifestFile(t, path, after, prev, logs)
		if after.unreadable != got.unreadable || after.skipped != got.skipped {
			t.Fatalf("with an earlier version: unreadable %v, %d skipped; without: %v, %d", after.unreadable, after.skipped, got.unreadable, got.skipped)
		}
		if got.unreadable {
			return
		}
		// The file's own objects, in order, and among them, for some of its skipped ones, the
		// earlier version's.
		i := 0
		for _, o := range after.objects {
			if i < len(got.objects) && sameObject(got.objects[i], o) {
				i++
				continue
			}
			if !slices.ContainsFunc(prev.objects, func(p manifestObject) bool { return sameObject(p, o) }) {
				t.Fatalf("after an earlier version, %s is neither the file's nor the earlier version's", o.key)
			}
		}
		if i != len(got.objects) {
			t.Fatalf("after an earlier version, %d of the file's %d objects kept", i, len(got.objects))
		}
		if kept := len(after.objects) - len(got.objects); kept > after.skipped {
			t.Fatalf("%d objects of the earlier version kept for %d skipped", kept, after.skipped)
		}
	})
}

// checkManifestFile checks what loadFile made of the file at path, after prev (or nil).
func checkManifestFile(t *testing.T, path string, mf, prev *manifestFile, logs *testutil.SyncBuffer) {
	t.Helper()
	fileSkips := append(logs.Records(t, "manifest file skipped"), logs.Records(t, "manifest file skipped; what it held before stays")...)
	objectSkips := append(logs.Records(t, "manifest object skipped"), logs.Records(t, "manifest object skipped; its previous version stays")...)
	for _, rec := range append(fileSkips, objectSkips...) {
		if rec[logkey.Path] != path || rec[logkey.Error] == nil || rec[logkey.Error] == "" {
			t.Errorf("a skip logged without the path or the reason: %v", rec)
		}
	}
	if mf.unreadable {
		if len(fileSkips) != 1 || len(objectSkips) != 0 || mf.skipped != 0 {
			t.Fatalf("an unreadable file logged %d file skips, %d object skips, counted %d", len(fileSkips), len(objectSkips), mf.skipped)
		}
		var before []manifestObject
		if prev != nil {
			before = prev.objects
		}
		if !slices.EqualFunc(mf.objects, before, sameObject) {
			t.Fatalf("an unreadable file yielded %d objects; it held %d before", len(mf.objects), len(before))
		}
		return
	}
	if len(fileSkips) != 0 || len(objectSkips) != mf.skipped {
		t.Fatalf("%d file skips and %d object skips logged, %d objects counted as skipped", len(fileSkips), len(objectSkips), mf.skipped)
	}
	for _, rec := range objectSkips {
		if doc, ok := rec[logkey.Document].(float64); !ok || doc < 1 {
			t.Errorf("an object skip logged without its document: %v", rec)
		}
	}
	for _, o := range mf.objects {
		if o.document < 1 {
			t.Errorf("%s from document %d", o.key, o.document)
		}
		switch o.key.kind {
		case kindNamespace:
			if err := pki.ValidateNamespace(o.key.name); err != nil || o.key.namespace != "" {
				t.Errorf("kept %s: %v", o.key, err)
			}
			if err := metav1validation.ValidateLabels(o.labels, field.NewPath("labels")).ToAggregate(); err != nil {
				t.Errorf("kept %s with labels %v: %v", o.key, o.labels, err)
			}
		case kindServiceAccount:
			if err := pki.ValidateNamespace(o.key.namespace); err != nil {
				t.Errorf("kept %s: %v", o.key, err)
			}
			if err := pki.ValidateServiceAccount(o.key.name); err != nil || o.labels != nil {
				t.Errorf("kept %s (labels %v): %v", o.key, o.labels, err)
			}
		default:
			t.Errorf("kept an object of kind %q", o.key.kind)
		}
	}
}

func sameObject(a, b manifestObject) bool {
	return a.key == b.key && a.document == b.document && maps.Equal(a.labels, b.labels)
}
