package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"sigs.k8s.io/yaml"
)

// loadBootstrap reads the bootstrap as Envoy does: JSON, or YAML for a .yaml or .yml file, into
// Envoy's own proto, then checks it with the proto's constraints and with the references between
// its parts that Envoy checks at start.
// --config-yaml, when given, is merged over the file as protobuf merges messages (repeated
// fields appended), as Envoy does.
func loadBootstrap(path, overlay string, allowUnknown bool) (*bootstrapv3.Bootstrap, error) {
	if path == "" && overlay == "" {
		return nil, errors.New("at least one of --config-path or --config-yaml should be non-empty")
	}
	b := &bootstrapv3.Bootstrap{}
	if path != "" {
		raw, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("unable to read file: %w", err)
		}
		switch strings.ToLower(filepath.Ext(path)) {
		case ".yaml", ".yml":
			if raw, err = yaml.YAMLToJSON(raw); err != nil {
				return nil, fmt.Errorf("unable to convert YAML as JSON: %w", err)
			}
		}
		if err := (protojson.UnmarshalOptions{DiscardUnknown: allowUnknown}).Unmarshal(raw, b); err != nil {
			return nil, fmt.Errorf("unable to parse JSON as proto: %w", err)
		}
	}
	if overlay != "" {
		raw, err := yaml.YAMLToJSON([]byte(overlay))
		if err != nil {
			return nil, fmt.Errorf("--config-yaml: unable to convert YAML as JSON: %w", err)
		}
		over := &bootstrapv3.Bootstrap{}
		if err := (protojson.UnmarshalOptions{DiscardUnknown: allowUnknown}).Unmarshal(raw, over); err != nil {
			return nil, fmt.Errorf("--config-yaml: unable to parse JSON as proto: %w", err)
		}
		proto.Merge(b, over)
	}
	if err := b.ValidateAll(); err != nil {
		return nil, fmt.Errorf("proto constraint validation failed (%w)", err)
	}
	if ads := b.GetDynamicResources().GetAdsConfig(); ads != nil {
		if _, err := apiTarget(b, ads); err != nil {
			return nil, err
		}
	}
	return b, nil
}

// node is what the stand-in says of itself on its xDS streams: the bootstrap's node, with the
// command line's --service-node and --service-cluster over it, as Envoy has it.
func node(b *bootstrapv3.Bootstrap, o *options) *corev3.Node {
	n := proto.Clone(b.GetNode()).(*corev3.Node)
	if n == nil {
		n = &corev3.Node{}
	}
	if o.serviceNode != "" {
		n.Id = o.serviceNode
	}
	if o.serviceCluster != "" {
		n.Cluster = o.serviceCluster
	}
	n.UserAgentName = "envoy"
	n.UserAgentVersionType = &corev3.Node_UserAgentVersion{UserAgentVersion: version}
	return n
}

// apiTarget is the gRPC target for an API config source: the first gRPC service's Envoy cluster,
// which must be a static cluster with one endpoint (a pipe or a socket address), or a Google gRPC
// target URI.
func apiTarget(b *bootstrapv3.Bootstrap, src *corev3.ApiConfigSource) (string, error) {
	switch src.GetApiType() {
	case corev3.ApiConfigSource_GRPC, corev3.ApiConfigSource_AGGREGATED_GRPC, corev3.ApiConfigSource_DELTA_GRPC, corev3.ApiConfigSource_AGGREGATED_DELTA_GRPC:
	default:
		return "", fmt.Errorf("the stand-in takes only gRPC config sources, not %s", src.GetApiType())
	}
	svcs := src.GetGrpcServices()
	if len(svcs) != 1 {
		return "", fmt.Errorf("api_config_source must have exactly one gRPC service, has %d", len(svcs))
	}
	if g := svcs[0].GetGoogleGrpc(); g != nil {
		return g.GetTargetUri(), nil
	}
	name := svcs[0].GetEnvoyGrpc().GetClusterName()
	return clusterTarget(b, name)
}

func clusterTarget(b *bootstrapv3.Bootstrap, name string) (string, error) {
	for _, c := range b.GetStaticResources().GetClusters() {
		if c.GetName() != name {
			continue
		}
		if c.GetType() == clusterv3.Cluster_EDS {
			return "", fmt.Errorf("envoy.config.core.v3.ApiConfigSource must have a statically defined non-EDS cluster: '%s' is EDS", name)
		}
		for _, lle := range c.GetLoadAssignment().GetEndpoints() {
			for _, le := range lle.GetLbEndpoints() {
				addr := le.GetEndpoint().GetAddress()
				if p := addr.GetPipe(); p != nil {
					return "unix://" + p.GetPath(), nil
				}
				if sa := addr.GetSocketAddress(); sa != nil {
					return "passthrough:///" + net.JoinHostPort(sa.GetAddress(), strconv.FormatUint(uint64(sa.GetPortValue()), 10)), nil
				}
			}
		}
		return "", fmt.Errorf("static cluster '%s' has no endpoint address", name)
	}
	return "", fmt.Errorf("envoy.config.core.v3.ApiConfigSource must have a statically defined non-EDS cluster: '%s' does not exist, was added via api, or is an EDS cluster", name)
}

// isDelta tells whether a config source asks for incremental xDS.
func isDelta(src *corev3.ApiConfigSource) bool {
	return src.GetApiType() == corev3.ApiConfigSource_DELTA_GRPC || src.GetApiType() == corev3.ApiConfigSource_AGGREGATED_DELTA_GRPC
}
