package discovery_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"testing"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cache "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/meshid/meshid/discovery"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// FuzzParseConfig feeds arbitrary bytes to ParseConfig, as an operator's --xds-config. A refusal
// is an error with a message and no config. An accepted config serves, for any namespace, a set
// that holds every type, only resources that pass their own ValidateAll, no two of a type under
// one name, and a version of 16 hex digits; parsing the same bytes again gives the same
// versions; and a set written back as JSON (as the debug endpoint renders resources) parses to
// the same version, so the version follows the content and not how the file spells it.
func FuzzParseConfig(f *testing.F) {
	for _, seed := range configSeeds(f) {
		f.Add(seed)
	}
	f.Add([]byte(`{"clusters": [{"name": "a", "connect_timeout": "1s"}], "namespaces": {"prod": {}}}`))
	f.Add([]byte("namespaces: {prod: {}, dev: {clusters: [{name: x}]}}"))

	f.Fuzz(func(t *testing.T, data []byte) {
		cfg, err := discovery.ParseConfig(data)
		if err != nil {
			if cfg != nil || err.Error() == "" {
				t.Fatalf("refused with %q, and a config %v", err, cfg)
			}
			return
		}
		namespaces := cfg.Namespaces()
		if !slices.IsSorted(namespaces) {
			t.Errorf("Namespaces() = %q, not sorted", namespaces)
		}
		// A namespace without a set of its own gets the default one.
		other := "meshid-fuzz-unlisted"
		for slices.Contains(namespaces, other) {
			other += "x"
		}
		for _, ns := range append([]string{other, ""}, namespaces...) {
			if ns != other && ns != "" {
				if err := pki.ValidateNamespace(ns); err != nil {
					t.Errorf("accepted the namespace %q: %v", ns, err)
				}
			}
			set, version := cfg.For(ns)
			checkSet(t, ns, set, version)
		}
		_, defaultVersion := cfg.For(other)
		if _, v := cfg.For(""); v != defaultVersion {
			t.Errorf("namespace \"\" got version %s, the default set is %s", v, defaultVersion)
		}

		again, err := discovery.ParseConfig(data)
		if err != nil {
			t.Fatalf("accepted once, refused the second time: %v", err)
		}
		if !slices.Equal(again.Namespaces(), namespaces) {
			t.Fatalf("namespaces %q, then %q", namespaces, again.Namespaces())
		}
		for _, ns := range append([]string{other}, namespaces...) {
			set, version := cfg.For(ns)
			if _, v := again.For(ns); v != version {
				t.Errorf("namespace %q: version %s, then %s from the same bytes", ns, version, v)
			}
			rewritten := rewrite(t, set)
			re, err := discovery.ParseConfig(rewritten)
			if err != nil {
				t.Fatalf("namespace %q's set, written back as JSON, is refused: %v\n%s", ns, err, rewritten)
			}
			if _, v := re.For(other); v != version {
				t.Errorf("namespace %q's set has version %s, written back as JSON %s:\n%s", ns, version, v, rewritten)
			}
		}
	})
}

var versionPattern = regexp.MustCompile(`^[0-9a-f]{16}$`)

func checkSet(t *testing.T, ns string, set map[resource.Type][]types.Resource, version string) {
	t.Helper()
	if !versionPattern.MatchString(version) {
		t.Errorf("namespace %q: version %q, want 16 hex digits", ns, version)
	}
	for _, typ := range []resource.Type{resource.ListenerType, resource.ClusterType, resource.RouteType, resource.EndpointType} {
		resources, ok := set[typ]
		if !ok || resources == nil {
			t.Errorf("namespace %q: no %s in the set (an absent type is never answered)", ns, typ)
		}
		names := map[string]bool{}
		for i, r := range resources {
			v, ok := r.(interface{ ValidateAll() error })
			if !ok {
				t.Fatalf("namespace %q: %s %d is a %T, which cannot validate", ns, typ, i, r)
			}
			if err := v.ValidateAll(); err != nil {
				t.Errorf("namespace %q: %s %d is invalid: %v", ns, typ, i, err)
			}
			name := cache.GetResourceName(r)
			if names[name] {
				t.Errorf("namespace %q: two %s named %q", ns, typ, name)
			}
			names[name] = true
		}
	}
	if len(set) != 4 {
		t.Errorf("namespace %q: %d types in the set, want 4", ns, len(set))
	}
}

// rewrite writes set back as a config of JSON, each resource as protojson renders it.
func rewrite(t *testing.T, set map[resource.Type][]types.Resource) []byte {
	t.Helper()
	sections := map[string][]json.RawMessage{}
	for key, typ := range map[string]resource.Type{
		"listeners": resource.ListenerType, "clusters": resource.ClusterType,
		"routes": resource.RouteType, "endpoints": resource.EndpointType,
	} {
		for _, r := range set[typ] {
			data, err := protojson.Marshal(proto.Message(r))
			if err != nil {
				t.Fatalf("an accepted %s does not render as JSON: %v", typ, err)
			}
			sections[key] = append(sections[key], data)
		}
	}
	out, err := json.Marshal(sections)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// configSeeds are the configurations the repository holds: the compose demo's, and every string
// literal of the discovery and e2e tests that names a section.
func configSeeds(f *testing.F) [][]byte {
	f.Helper()
	data, err := os.ReadFile(filepath.Join("..", "deploy", "compose", "xds.yaml"))
	if err != nil {
		f.Fatal(err)
	}
	seeds := [][]byte{data}
	files, err := filepath.Glob("*_test.go")
	if err != nil {
		f.Fatal(err)
	}
	var sections []string
	for _, section := range []string{"listeners", "clusters", "routes", "endpoints", "namespaces"} {
		sections = append(sections, section+":", `"`+section+`"`)
	}
	for _, path := range append(files, filepath.Join("..", "e2e", "e2e_test.go")) {
		for _, s := range testutil.StringLiterals(f, path, sections...) {
			seeds = append(seeds, []byte(s))
		}
	}
	if len(seeds) < 5 {
		f.Fatalf("only %d seed configurations found", len(seeds))
	}
	return seeds
}
