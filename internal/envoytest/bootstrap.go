package envoytest

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	upstreamhttpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
)

// Cluster names of the bootstrap NewBootstrap writes, as Istio's.
const (
	ADSCluster = "xds-grpc"
	SDSCluster = "sds-grpc"
)

// NewBootstrap is a bootstrap as an agent writes one: admin on 127.0.0.1:0, ADS over the
// xds-grpc cluster on adsSocket, and an sds-grpc cluster on sdsSocket for the secrets that
// listeners and clusters name. Tests change what they need in it.
func NewBootstrap(tb testing.TB, nodeID, adsSocket, sdsSocket string) *bootstrapv3.Bootstrap {
	tb.Helper()
	return &bootstrapv3.Bootstrap{
		Node: &corev3.Node{Id: nodeID, Cluster: "standin"},
		Admin: &bootstrapv3.Admin{Address: &corev3.Address{Address: &corev3.Address_SocketAddress{
			SocketAddress: &corev3.SocketAddress{Address: "127.0.0.1", PortSpecifier: &corev3.SocketAddress_PortValue{}},
		}}},
		StaticResources: &bootstrapv3.Bootstrap_StaticResources{Clusters: []*clusterv3.Cluster{
			PipeCluster(tb, ADSCluster, adsSocket), PipeCluster(tb, SDSCluster, sdsSocket),
		}},
		DynamicResources: &bootstrapv3.Bootstrap_DynamicResources{
			AdsConfig: GRPCSource(ADSCluster),
			CdsConfig: &corev3.ConfigSource{ResourceApiVersion: corev3.ApiVersion_V3, ConfigSourceSpecifier: &corev3.ConfigSource_Ads{Ads: &corev3.AggregatedConfigSource{}}},
			LdsConfig: &corev3.ConfigSource{ResourceApiVersion: corev3.ApiVersion_V3, ConfigSourceSpecifier: &corev3.ConfigSource_Ads{Ads: &corev3.AggregatedConfigSource{}}},
		},
	}
}

// GRPCSource is a gRPC API config source on an Envoy cluster, as ads_config or an sds_config's
// api_config_source.
func GRPCSource(cluster string) *corev3.ApiConfigSource {
	return &corev3.ApiConfigSource{
		ApiType:             corev3.ApiConfigSource_GRPC,
		TransportApiVersion: corev3.ApiVersion_V3,
		GrpcServices: []*corev3.GrpcService{{TargetSpecifier: &corev3.GrpcService_EnvoyGrpc_{
			EnvoyGrpc: &corev3.GrpcService_EnvoyGrpc{ClusterName: cluster},
		}}},
	}
}

// PipeCluster is a static HTTP/2 cluster with one endpoint, the Unix socket at path.
func PipeCluster(tb testing.TB, name, path string) *clusterv3.Cluster {
	tb.Helper()
	h2, err := anypb.New(&upstreamhttpv3.HttpProtocolOptions{
		UpstreamProtocolOptions: &upstreamhttpv3.HttpProtocolOptions_ExplicitHttpConfig_{ExplicitHttpConfig: &upstreamhttpv3.HttpProtocolOptions_ExplicitHttpConfig{
			ProtocolConfig: &upstreamhttpv3.HttpProtocolOptions_ExplicitHttpConfig_Http2ProtocolOptions{Http2ProtocolOptions: &corev3.Http2ProtocolOptions{}},
		}},
	})
	if err != nil {
		tb.Fatal(err)
	}
	return &clusterv3.Cluster{
		Name:                          name,
		ClusterDiscoveryType:          &clusterv3.Cluster_Type{Type: clusterv3.Cluster_STATIC},
		ConnectTimeout:                durationpb.New(time.Second),
		TypedExtensionProtocolOptions: map[string]*anypb.Any{"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": h2},
		LoadAssignment: &endpointv3.ClusterLoadAssignment{
			ClusterName: name,
			Endpoints: []*endpointv3.LocalityLbEndpoints{{LbEndpoints: []*endpointv3.LbEndpoint{{
				HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{Address: &corev3.Address{
					Address: &corev3.Address_Pipe{Pipe: &corev3.Pipe{Path: path}},
				}}},
			}}}},
		},
	}
}

// WriteBootstrap writes b as JSON in a directory of the test and returns its path.
func WriteBootstrap(tb testing.TB, b *bootstrapv3.Bootstrap) string {
	tb.Helper()
	raw, err := protojson.Marshal(b)
	if err != nil {
		tb.Fatal(err)
	}
	path := filepath.Join(tb.TempDir(), "envoy.json")
	if err := os.WriteFile(path, raw, 0o600); err != nil {
		tb.Fatal(err)
	}
	return path
}
