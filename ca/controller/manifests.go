package controller

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1validation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/runtime"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/apimachinery/pkg/util/validation/field"
	yamlutil "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// ManifestsConfig configures Manifests.
type ManifestsConfig struct {
	Dir      string
	Debounce time.Duration // 0: filewatch.DefaultDebounce
	Clock    clock.Clock
	Logger   *slog.Logger
}

// Manifests is the local Store: the Namespace and ServiceAccount objects in the *.yaml, *.yml
// and *.json files of one directory (not its subdirectories), in Kubernetes' own format, several
// documents to a file, and v1 Lists too. Run watches the directory, so that edits take effect
// without a restart. A file or object that cannot be read is reported with its path (and
// document) and skipped: what it held before stays, so that a typo in a namespace labelled
// ca.istio.io/override=false cannot make it unlabelled, and served. Objects of other kinds are
// ignored. A ServiceAccount without a namespace is in "default", as kubectl would put it.
type Manifests struct {
	dir     string
	log     *slog.Logger
	watcher *filewatch.Watcher
	decoder *decoder
	ready   chan struct{}

	// files is what each file held at the last load; only New, then Run's goroutine, load.
	files map[string]*manifestFile
	view  atomic.Pointer[storeView] // readers take it without a lock

	mu      sync.Mutex
	changed chan struct{} // closed and replaced at every change of the view

	problems atomic.Pointer[ManifestProblems] // of the last load
}

// ManifestProblems counts what the last load of the directory had to skip: files it could not
// read or split, objects it could not decode or check, and objects defined twice.
type ManifestProblems struct {
	Files, Objects, Duplicates int
}

// Problems returns what the last load skipped, for the metrics an operator alerts on.
func (m *Manifests) Problems() ManifestProblems {
	if p := m.problems.Load(); p != nil {
		return *p
	}
	return ManifestProblems{}
}

// manifestFile is what one file yielded.
type manifestFile struct {
	sum     [sha256.Size]byte // of the bytes last parsed, so that an unchanged file is not re-reported
	objects []manifestObject
	// skipped counts the objects this file's last parse could not use; unreadable says the file
	// itself could not be read or split at the last load.
	skipped    int
	unreadable bool
}

type objectKey struct {
	kind      string // "Namespace" or "ServiceAccount"
	namespace string // of a ServiceAccount
	name      string
}

func (k objectKey) String() string {
	if k.namespace == "" {
		return k.kind + " " + k.name
	}
	return k.kind + " " + k.namespace + "/" + k.name
}

type manifestObject struct {
	key      objectKey
	labels   map[string]string // of a Namespace
	document int               // 1-based, where it was read
}

// storeView is one complete, immutable view of the directory.
type storeView struct {
	namespaces      map[string]Namespace
	serviceAccounts []ServiceAccount // sorted
}

// NewManifests reads dir once; call Run to keep following it. dir must exist.
func NewManifests(cfg ManifestsConfig) (*Manifests, error) {
	info, err := os.Stat(cfg.Dir)
	if err != nil {
		return nil, err
	}
	if !info.IsDir() {
		return nil, fmt.Errorf("%s is not a directory", cfg.Dir)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	w, err := filewatch.New(filewatch.Config{Paths: []string{cfg.Dir}, Debounce: cfg.Debounce, Clock: cfg.Clock, Logger: log})
	if err != nil {
		return nil, err
	}
	m := &Manifests{
		dir: filepath.Clean(cfg.Dir), log: log, watcher: w, decoder: newDecoder(), ready: make(chan struct{}),
		files: map[string]*manifestFile{}, changed: make(chan struct{}),
	}
	m.view.Store(&storeView{namespaces: map[string]Namespace{}})
	if _, err := m.load(); err != nil {
		return nil, err
	}
	m.logLoaded()
	return m, nil
}

// Run follows the directory until ctx ends.
func (m *Manifests) Run(ctx context.Context) error {
	// The watcher runs on a goroutine of its own so that this one can load once its watch is in
	// place; one slot, as a load reads the whole directory: changes during a load make one more.
	changes := make(chan struct{}, 1)
	done := make(chan error, 1)
	go func() {
		done <- m.watcher.Run(ctx, func([]string) {
			select {
			case changes <- struct{}{}:
			default:
			}
		})
	}()
	select {
	case <-m.watcher.Ready():
	case err := <-done:
		return err
	}
	m.reload() // what changed between New and the watch
	close(m.ready)
	for {
		select {
		case <-changes:
			m.reload()
		case err := <-done:
			return err
		}
	}
}

func (m *Manifests) reload() {
	changed, err := m.load()
	switch {
	case err != nil:
		m.log.Error("cannot read the manifests directory; what was loaded stays", logkey.Dir, m.dir, logkey.Error, err.Error())
	case changed:
		m.logLoaded()
	}
}

func (m *Manifests) logLoaded() {
	v := m.view.Load()
	m.log.Info("manifests loaded", logkey.Dir, m.dir, logkey.Namespaces, len(v.namespaces), logkey.ServiceAccounts, len(v.serviceAccounts))
}

// Ready is closed once Run watches the directory and has read it: a change made from then on is
// seen.
func (m *Manifests) Ready() <-chan struct{} { return m.ready }

// NamespaceLabels implements NamespaceStore.
func (m *Manifests) NamespaceLabels(_ context.Context, namespace string) (map[string]string, bool, error) {
	ns, ok := m.view.Load().namespaces[namespace]
	if !ok {
		return nil, false, nil
	}
	return maps.Clone(ns.Labels), true, nil
}

// Namespaces implements NamespaceStore.
func (m *Manifests) Namespaces(context.Context) ([]Namespace, error) {
	v := m.view.Load()
	out := make([]Namespace, 0, len(v.namespaces))
	for _, ns := range v.namespaces {
		out = append(out, Namespace{Name: ns.Name, Labels: maps.Clone(ns.Labels)})
	}
	slices.SortFunc(out, func(a, b Namespace) int { return cmp.Compare(a.Name, b.Name) })
	return out, nil
}

// ServiceAccounts implements Store.
func (m *Manifests) ServiceAccounts(_ context.Context, namespace string) ([]ServiceAccount, error) {
	var out []ServiceAccount
	for _, sa := range m.view.Load().serviceAccounts {
		if namespace == "" || sa.Namespace == namespace {
			out = append(out, sa)
		}
	}
	return out, nil
}

// Changed implements Store.
func (m *Manifests) Changed() <-chan struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.changed
}

// load reads the directory again and publishes the new view if it differs.
func (m *Manifests) load() (changed bool, err error) {
	entries, err := os.ReadDir(m.dir)
	if err != nil {
		return false, err
	}
	files := map[string]*manifestFile{}
	for _, e := range entries {
		name := e.Name()
		// Dot files: editors' temporaries, and Kubernetes' ..data of a mounted config map, whose
		// files appear again as links next to it.
		if strings.HasPrefix(name, ".") || !isManifestFile(name) {
			continue
		}
		path := filepath.Join(m.dir, name)
		if f := m.loadFile(path, m.files[path]); f != nil {
			files[path] = f
		}
	}
	m.files = files

	next, duplicates := m.merge()
	problems := ManifestProblems{Duplicates: duplicates}
	for _, f := range files {
		problems.Objects += f.skipped
		if f.unreadable {
			problems.Files++
		}
	}
	m.problems.Store(&problems)
	if prev := m.view.Swap(next); prev.equal(next) {
		return false, nil
	}
	m.mu.Lock()
	close(m.changed)
	m.changed = make(chan struct{})
	m.mu.Unlock()
	return true, nil
}

func isManifestFile(name string) bool {
	switch filepath.Ext(name) {
	case ".yaml", ".yml", ".json":
		return true
	}
	return false
}

// loadFile reads one file; prev is what it held at the last load, or nil.
func (m *Manifests) loadFile(path string, prev *manifestFile) *manifestFile {
	data, err := os.ReadFile(path)
	if err != nil {
		m.skippedFile(path, prev, err)
		if prev == nil {
			return &manifestFile{unreadable: true}
		}
		kept := *prev
		kept.unreadable, kept.sum = true, [sha256.Size]byte{} // parsed again once readable
		return &kept
	}
	sum := sha256.Sum256(data)
	if prev != nil && prev.sum == sum {
		return prev
	}
	docs, err := splitDocuments(path, data)
	if err != nil {
		m.skippedFile(path, prev, err)
		if prev == nil {
			return &manifestFile{sum: sum, unreadable: true}
		}
		return &manifestFile{sum: sum, objects: prev.objects, unreadable: true}
	}
	f := &manifestFile{sum: sum}
	other := map[string]int{}
	for i, doc := range docs {
		objects, problems := m.decoder.decode(doc, other)
		for j := range objects {
			objects[j].document = i + 1
		}
		f.objects = append(f.objects, objects...)
		f.skipped += len(problems)
		for _, p := range problems {
			attrs := []any{logkey.Path, path, logkey.Document, i + 1, logkey.Error, p.err.Error()}
			if p.item > 0 {
				attrs = append(attrs, logkey.Item, p.item)
			}
			if kept := previousVersion(prev, p.key); kept != nil {
				f.objects = append(f.objects, *kept)
				m.log.Warn("manifest object skipped; its previous version stays", append(attrs, logkey.Kept, kept.key.String())...)
				continue
			}
			m.log.Warn("manifest object skipped", attrs...)
		}
	}
	if len(other) > 0 {
		m.log.Debug("manifest objects of other kinds ignored", logkey.Path, path, logkey.Other, other)
	}
	return f
}

func (m *Manifests) skippedFile(path string, prev *manifestFile, err error) {
	if prev != nil && len(prev.objects) > 0 {
		m.log.Warn("manifest file skipped; what it held before stays", logkey.Path, path, logkey.Error, err.Error())
		return
	}
	m.log.Warn("manifest file skipped", logkey.Path, path, logkey.Error, err.Error())
}

// previousVersion returns what prev held for key, if anything.
func previousVersion(prev *manifestFile, key *objectKey) *manifestObject {
	if prev == nil || key == nil {
		return nil
	}
	for i := range prev.objects {
		if prev.objects[i].key == *key {
			return &prev.objects[i]
		}
	}
	return nil
}

// merge builds the view from every file, in name order; of two definitions of one object the
// first stays. It returns how many definitions it left out.
func (m *Manifests) merge() (v *storeView, duplicates int) {
	v = &storeView{namespaces: map[string]Namespace{}}
	seen := map[objectKey]string{}
	for _, path := range slices.Sorted(maps.Keys(m.files)) {
		for _, o := range m.files[path].objects {
			where := fmt.Sprintf("%s, document %d", path, o.document)
			if first, dup := seen[o.key]; dup {
				m.log.Warn("manifest object defined twice; the first stays", logkey.Object, o.key.String(), logkey.Path, where, logkey.Kept, first)
				duplicates++
				continue
			}
			seen[o.key] = where
			switch o.key.kind {
			case kindNamespace:
				v.namespaces[o.key.name] = Namespace{Name: o.key.name, Labels: o.labels}
			case kindServiceAccount:
				v.serviceAccounts = append(v.serviceAccounts, ServiceAccount{Namespace: o.key.namespace, Name: o.key.name})
			}
		}
	}
	slices.SortFunc(v.serviceAccounts, func(a, b ServiceAccount) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
	})
	return v, duplicates
}

func (v *storeView) equal(o *storeView) bool {
	return maps.EqualFunc(v.namespaces, o.namespaces, func(a, b Namespace) bool { return maps.Equal(a.Labels, b.Labels) }) &&
		slices.Equal(v.serviceAccounts, o.serviceAccounts)
}

// document is one object's text from a file, as JSON.
type document struct {
	json []byte
	// strictErr is a problem only YAML shows (a key given twice), found before the conversion
	// to JSON dropped it.
	strictErr error
}

// splitDocuments splits a file into its documents: "---"-separated YAML, or a stream of JSON
// values. An error means the file cannot be split at all.
func splitDocuments(path string, data []byte) ([]document, error) {
	var docs []document
	if filepath.Ext(path) == ".json" {
		dec := json.NewDecoder(bytes.NewReader(data))
		for {
			var raw json.RawMessage
			if err := dec.Decode(&raw); errors.Is(err, io.EOF) {
				return docs, nil
			} else if err != nil {
				return nil, fmt.Errorf("document %d: %w", len(docs)+1, err)
			}
			docs = append(docs, document{json: raw})
		}
	}
	r := yamlutil.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for {
		text, err := r.Read()
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("after document %d: %w", len(docs), err)
		}
		j, err := yaml.YAMLToJSON(text)
		if err != nil {
			docs = append(docs, document{strictErr: err}) // a document that is not YAML
			continue
		}
		if bytes.Equal(bytes.TrimSpace(j), []byte("null")) {
			continue // only comments, or an empty document between two separators
		}
		var strictErr error
		if _, err := yaml.YAMLToJSONStrict(text); err != nil {
			strictErr = err
		}
		docs = append(docs, document{json: j, strictErr: strictErr})
	}
}

const (
	kindNamespace      = "Namespace"
	kindServiceAccount = "ServiceAccount"
)

// decoder decodes objects with Kubernetes' own serializer and types, strictly: an unknown or
// repeated field is an error, as `kubectl apply` makes it.
type decoder struct {
	json runtime.Decoder
}

func newDecoder() *decoder {
	scheme := runtime.NewScheme()
	// Only the kinds the store reads: anything else is "not registered", and ignored undecoded.
	scheme.AddKnownTypes(corev1.SchemeGroupVersion,
		&corev1.Namespace{}, &corev1.NamespaceList{}, &corev1.ServiceAccount{}, &corev1.ServiceAccountList{}, &corev1.List{})
	return &decoder{json: kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, scheme, scheme, kjson.SerializerOptions{Strict: true})}
}

// problem is an object that could not be read. key names it when that much could be read; item
// is its 1-based place in a List, or 0.
type problem struct {
	key  *objectKey
	item int
	err  error
}

// decode reads the objects of one document, counting those of other kinds in other.
func (d *decoder) decode(doc document, other map[string]int) ([]manifestObject, []problem) {
	if doc.json == nil {
		return nil, []problem{{err: doc.strictErr}}
	}
	key := peekKey(doc.json)
	if doc.strictErr != nil {
		return nil, []problem{{key: key, err: doc.strictErr}}
	}
	obj, err := d.object(doc.json, other)
	if err != nil {
		return nil, []problem{{key: key, err: err}}
	}
	switch o := obj.(type) {
	case nil:
		return nil, nil
	case *corev1.List:
		var objects []manifestObject
		var problems []problem
		for i, item := range o.Items {
			key := peekKey(item.Raw)
			obj, err := d.object(item.Raw, other)
			if err == nil {
				if _, nested := obj.(*corev1.List); nested {
					err = errors.New("a List inside a List")
				}
			}
			var mo *manifestObject
			if err == nil && obj != nil {
				mo, err = fromObject(obj)
			}
			switch {
			case err != nil:
				problems = append(problems, problem{key: key, item: i + 1, err: err})
			case mo != nil:
				objects = append(objects, *mo)
			}
		}
		return objects, problems
	case *corev1.NamespaceList:
		return fromItems(o.Items, func(ns *corev1.Namespace) (*manifestObject, error) { return fromObject(ns) })
	case *corev1.ServiceAccountList:
		return fromItems(o.Items, func(sa *corev1.ServiceAccount) (*manifestObject, error) { return fromObject(sa) })
	}
	mo, err := fromObject(obj)
	if err != nil {
		return nil, []problem{{key: key, err: err}}
	}
	return []manifestObject{*mo}, nil
}

// object decodes one object; nil, nil for one of a kind the store does not read.
func (d *decoder) object(data []byte, other map[string]int) (runtime.Object, error) {
	obj, gvk, err := d.json.Decode(data, nil, nil)
	if gvk == nil {
		return nil, err // not even an object with a kind
	}
	switch gvk.Kind {
	case "":
		return nil, errors.New("no kind")
	case kindNamespace, kindServiceAccount, "List", "NamespaceList", "ServiceAccountList":
		if gvk.GroupVersion() != corev1.SchemeGroupVersion {
			return nil, fmt.Errorf("kind %s in apiVersion %q: want apiVersion v1", gvk.Kind, gvk.GroupVersion().String())
		}
	default:
		other[gvk.Kind]++
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return obj, nil
}

func fromItems[T any](items []T, from func(*T) (*manifestObject, error)) ([]manifestObject, []problem) {
	var objects []manifestObject
	var problems []problem
	for i := range items {
		mo, err := from(&items[i])
		if err != nil {
			problems = append(problems, problem{item: i + 1, err: err})
			continue
		}
		objects = append(objects, *mo)
	}
	return objects, problems
}

// fromObject checks a decoded object as the API server would, and keeps what the store needs.
func fromObject(obj runtime.Object) (*manifestObject, error) {
	switch o := obj.(type) {
	case *corev1.Namespace:
		if err := pki.ValidateNamespace(o.Name); err != nil {
			return nil, fmt.Errorf("metadata.name: %w", err)
		}
		if err := metav1validation.ValidateLabels(o.Labels, field.NewPath("metadata", "labels")).ToAggregate(); err != nil {
			return nil, fmt.Errorf("namespace %s: %w", o.Name, err)
		}
		return &manifestObject{key: objectKey{kind: kindNamespace, name: o.Name}, labels: maps.Clone(o.Labels)}, nil
	case *corev1.ServiceAccount:
		ns := cmp.Or(o.Namespace, "default")
		if err := pki.ValidateNamespace(ns); err != nil {
			return nil, fmt.Errorf("metadata.namespace: %w", err)
		}
		if err := pki.ValidateServiceAccount(o.Name); err != nil {
			return nil, fmt.Errorf("metadata.name: %w", err)
		}
		return &manifestObject{key: objectKey{kind: kindServiceAccount, namespace: ns, name: o.Name}}, nil
	}
	return nil, fmt.Errorf("unexpected object %T", obj)
}

// peekKey reads which object a document is meant to be, leniently, so that a malformed new
// version can be matched with the previous one; nil when even that cannot be read.
func peekKey(data []byte) *objectKey {
	var peek struct {
		Kind     string `json:"kind"`
		Metadata struct {
			Name      string `json:"name"`
			Namespace string `json:"namespace"`
		} `json:"metadata"`
	}
	if err := json.Unmarshal(data, &peek); err != nil || peek.Metadata.Name == "" {
		return nil
	}
	switch peek.Kind {
	case kindNamespace:
		return &objectKey{kind: kindNamespace, name: peek.Metadata.Name}
	case kindServiceAccount:
		return &objectKey{kind: kindServiceAccount, namespace: cmp.Or(peek.Metadata.Namespace, "default"), name: peek.Metadata.Name}
	}
	return nil
}
