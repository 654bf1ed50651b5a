// Package discovery is the xDS discovery server `meshid ca` serves on its gRPC port, as istiod
// does: go-control-plane's snapshot cache fed from the --xds-config file (without one, from
// EmptyConfig), one snapshot for each namespace a client authenticates as.
package discovery

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"maps"
	"slices"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"sigs.k8s.io/yaml"

	// The extensions a configuration commonly names in typed_config: registered so that they
	// decode and validate.
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/file/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/stream/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/rbac/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/listener/tls_inspector/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/rbac/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/tcp_proxy/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"

	"github.com/meshid/meshid/internal/pki"
)

// resourceKinds are the sections of the file: Envoy bootstrap's static_resources names for
// listeners and clusters, and the routes and endpoints a discovery server adds.
type resourceKind struct {
	key     string
	typeURL resource.Type
	newMsg  func() proto.Message
}

func resourceKinds() []resourceKind {
	return []resourceKind{
		{"listeners", resource.ListenerType, func() proto.Message { return &listenerv3.Listener{} }},
		{"clusters", resource.ClusterType, func() proto.Message { return &clusterv3.Cluster{} }},
		{"routes", resource.RouteType, func() proto.Message { return &routev3.RouteConfiguration{} }},
		{"endpoints", resource.EndpointType, func() proto.Message { return &endpointv3.ClusterLoadAssignment{} }},
	}
}

// resources is one set of resources by type URL, and a version that changes with its content.
type resources struct {
	byType  map[resource.Type][]types.Resource
	version string
}

// Config is a parsed --xds-config: the set every node gets, and the sets that replace it for the
// nodes of some namespaces.
type Config struct {
	defaults   resources
	namespaces map[string]resources
}

// EmptyConfig is the configuration served without a file: every type, with no resource, under
// the version an empty file has. Envoy ACKs it and runs with no listeners and no clusters.
func EmptyConfig() *Config {
	r := resources{byType: map[resource.Type][]types.Resource{}, version: contentVersion(sha256.New())}
	for _, kind := range resourceKinds() {
		r.byType[kind.typeURL] = []types.Resource{}
	}
	return &Config{defaults: r, namespaces: map[string]resources{}}
}

// contentVersion is the version of a set whose content digest has hashed.
func contentVersion(digest hash.Hash) string { return hex.EncodeToString(digest.Sum(nil))[:16] }

// For returns the set for the nodes of namespace.
func (c *Config) For(namespace string) (map[resource.Type][]types.Resource, string) {
	r, ok := c.namespaces[namespace]
	if !ok {
		r = c.defaults
	}
	return r.byType, r.version
}

// Namespaces lists the namespaces with a set of their own, sorted.
func (c *Config) Namespaces() []string { return slices.Sorted(maps.Keys(c.namespaces)) }

// ParseConfig decodes a configuration (YAML or JSON) and validates every resource with its own
// ValidateAll. Errors name the section, the index and the resource's name.
func ParseConfig(data []byte) (*Config, error) {
	jsonData, err := yaml.YAMLToJSON(data)
	if err != nil {
		return nil, fmt.Errorf("not YAML or JSON: %w", err)
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(jsonData, &top); err != nil {
		return nil, fmt.Errorf("want a mapping of listeners, clusters, routes, endpoints and namespaces: %w", err)
	}
	var nsSections map[string]json.RawMessage
	if raw, ok := top["namespaces"]; ok {
		delete(top, "namespaces")
		if err := json.Unmarshal(raw, &nsSections); err != nil {
			return nil, fmt.Errorf("namespaces: want a mapping of namespace to resources: %w", err)
		}
	}
	cfg := &Config{namespaces: map[string]resources{}}
	if cfg.defaults, err = parseResources(top, "", "the top-level set (every namespace without its own)"); err != nil {
		return nil, err
	}
	for ns, raw := range nsSections {
		if err := pki.ValidateNamespace(ns); err != nil {
			return nil, fmt.Errorf("namespaces: %w", err)
		}
		var section map[string]json.RawMessage
		if err := json.Unmarshal(raw, &section); err != nil {
			return nil, fmt.Errorf("namespaces.%s: want a mapping of listeners, clusters, routes and endpoints: %w", ns, err)
		}
		if cfg.namespaces[ns], err = parseResources(section, "namespaces."+ns+".", "namespace "+ns); err != nil {
			return nil, err
		}
	}
	return cfg, nil
}

// parseResources decodes and checks one set, the namespace's named by where, and refuses it when
// one of its answers would pass the size an answer may have.
func parseResources(sections map[string]json.RawMessage, prefix, where string) (resources, error) {
	known := map[string]bool{}
	r := resources{byType: map[resource.Type][]types.Resource{}}
	digest := sha256.New()
	answers := map[resource.Type]int{} // the size of each type's answer
	for _, kind := range resourceKinds() {
		known[kind.key] = true
		// Every type is in the set, empty or not: a type missing from a snapshot is never
		// answered, and Envoy waits for its first LDS and CDS answers before it serves.
		r.byType[kind.typeURL] = []types.Resource{}
		raw, ok := sections[kind.key]
		if !ok {
			continue
		}
		var items []json.RawMessage
		if err := json.Unmarshal(raw, &items); err != nil {
			return resources{}, fmt.Errorf("%s%s: want a list: %w", prefix, kind.key, err)
		}
		names := map[string]bool{}
		for i, item := range items {
			msg := kind.newMsg()
			if err := protojson.Unmarshal(item, msg); err != nil {
				return resources{}, fmt.Errorf("%s%s[%d]: %w", prefix, kind.key, i, err)
			}
			name := resourceName(msg)
			if err := validate(msg); err != nil {
				return resources{}, fmt.Errorf("%s%s[%d] %q: %w", prefix, kind.key, i, name, err)
			}
			if names[name] {
				return resources{}, fmt.Errorf("%s%s[%d]: a second resource named %q", prefix, kind.key, i, name)
			}
			names[name] = true
			r.byType[kind.typeURL] = append(r.byType[kind.typeURL], msg)
			wire, err := proto.MarshalOptions{Deterministic: true}.Marshal(msg)
			if err != nil {
				return resources{}, err
			}
			_, _ = fmt.Fprintf(digest, "%s %d\n", kind.typeURL, len(wire)) // a hash never fails a write
			digest.Write(wire)
			answers[kind.typeURL] += resourceEntrySize(kind.typeURL, len(wire))
		}
	}
	for key := range sections {
		if !known[key] {
			return resources{}, fmt.Errorf("%s%s: unknown section; want listeners, clusters, routes, endpoints or namespaces", prefix, key)
		}
	}
	r.version = contentVersion(digest)
	for _, kind := range resourceKinds() {
		if err := checkAnswerSize(where, kind.typeURL, answers[kind.typeURL]); err != nil {
			return resources{}, err
		}
	}
	// config_dump holds every type at once, as JSON.
	dump, err := renderedConfigDump(r.byType, r.version)
	if err != nil {
		return resources{}, err
	}
	if err := checkAnswerSize(where, DebugConfigDump, resourceSize(dump)); err != nil {
		return resources{}, err
	}
	return r, nil
}

// checkAnswerSize refuses an answer whose resources take size bytes when it would pass
// MaxAnswerSize less answerMargin: the server would fail to send it.
func checkAnswerSize(where, typeURL string, size int) error {
	if limit := MaxAnswerSize - answerMargin; size > limit {
		return fmt.Errorf("%s: the answer of type %s would be %d bytes, over the %d bytes an answer may have (%d MiB less a margin)",
			where, typeURL, size, limit, MaxAnswerSize>>20)
	}
	return nil
}

// resourceEntrySize is what a resource whose wire form is n bytes adds to an answer of typeURL:
// the Any that wraps it (its type URL and value), the Any's length and its tag.
func resourceEntrySize(typeURL string, n int) int {
	wrapped := protowire.SizeTag(1) + protowire.SizeBytes(len(typeURL)) + protowire.SizeTag(2) + protowire.SizeBytes(n)
	return protowire.SizeTag(2) + protowire.SizeBytes(wrapped)
}

func resourceName(msg proto.Message) string {
	if named, ok := msg.(interface{ GetName() string }); ok {
		return named.GetName()
	}
	if cla, ok := msg.(*endpointv3.ClusterLoadAssignment); ok {
		return cla.GetClusterName()
	}
	return ""
}

func validate(msg proto.Message) error {
	v, ok := msg.(interface{ ValidateAll() error })
	if !ok {
		return errors.New("no validation for this type")
	}
	return v.ValidateAll()
}
