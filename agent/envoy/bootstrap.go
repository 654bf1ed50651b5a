// Package envoy is what the agent knows of Envoy: the bootstrap it gives Envoy, built from
// go-control-plane's types and checked with ValidateAll before anyone reads it.
package envoy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	upstreamhttpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
	"sigs.k8s.io/yaml"
)

// Names of the static clusters and the listener of the bootstrap, as Istio's bootstrap names
// them: the xDS server's configuration refers to sds-grpc by name.
const (
	SDSClusterName    = "sds-grpc"
	XDSClusterName    = "xds-grpc"
	StatsClusterName  = "prometheus_stats"
	StatsListenerName = "prometheus_stats"
	// StatsPath is what the stats listener serves, from Envoy's admin.
	StatsPath = "/stats/prometheus"
)

// Node metadata keys set from the workload's identity, as Istio's agent sets them. NAME is
// today's name of the pod's name; POD_NAME, its older name, is kept for filters that read it.
const (
	MetaNamespace      = "NAMESPACE"
	MetaName           = "NAME"
	MetaPodName        = "POD_NAME"
	MetaInstanceIPs    = "INSTANCE_IPS"
	MetaServiceAccount = "SERVICE_ACCOUNT"
	MetaClusterID      = "CLUSTER_ID"
)

// ClusterDomain is the DNS domain of the node's id: Kubernetes' default, as Istio's sidecars use.
const ClusterDomain = "cluster.local"

// connectTimeout is the static clusters' connect timeout: each leads to a local socket.
const connectTimeout = time.Second

// Node is the node Envoy presents to its xDS and SDS servers.
type Node struct {
	ID, Cluster string
	Metadata    map[string]string
}

// Workload is what a sidecar's node is derived from; SidecarNode derives it.
type Workload struct {
	InstanceIP     string // the pod's IP
	PodName        string
	Namespace      string
	ServiceAccount string
	ClusterID      string // ISTIO_META_CLUSTER_ID; empty: not set
	// Meta are the ISTIO_META_<KEY>=v variables, as KEY: v. The identity's own keys win over them.
	Meta map[string]string
}

// SidecarNode returns the node of a sidecar as Istio's agent derives it: the id
// sidecar~<ip>~<pod>.<namespace>~<namespace>.svc.cluster.local, the metadata NAMESPACE, NAME
// and POD_NAME, INSTANCE_IPS, SERVICE_ACCOUNT, CLUSTER_ID (when set) over every ISTIO_META_*
// variable; and the cluster <service-account>.<namespace>, the identity the workload's
// certificate carries, where Istio takes the app label (which the agent does not know).
func SidecarNode(w Workload) Node {
	meta := maps.Clone(w.Meta)
	if meta == nil {
		meta = map[string]string{}
	}
	meta[MetaNamespace] = w.Namespace
	meta[MetaName] = w.PodName
	meta[MetaPodName] = w.PodName
	meta[MetaInstanceIPs] = w.InstanceIP
	meta[MetaServiceAccount] = w.ServiceAccount
	if w.ClusterID != "" {
		meta[MetaClusterID] = w.ClusterID
	}
	return Node{
		ID:       "sidecar~" + w.InstanceIP + "~" + w.PodName + "." + w.Namespace + "~" + w.Namespace + ".svc." + ClusterDomain,
		Cluster:  w.ServiceAccount + "." + w.Namespace,
		Metadata: meta,
	}
}

// BootstrapConfig is what a bootstrap is made of.
type BootstrapConfig struct {
	Node Node
	// SDSSocket is the absolute path of the agent's SDS socket; XDSSocket its xDS socket, empty
	// when the agent proxies no xDS: the bootstrap then has no ADS and no xds-grpc cluster.
	SDSSocket string
	XDSSocket string
	// AdminPort is Envoy's admin port on 127.0.0.1 (Istio's 15000); PrometheusPort, when not 0,
	// the port of a listener on 0.0.0.0 that serves /stats/prometheus from the admin (Istio's
	// 15090).
	AdminPort      int
	PrometheusPort int
	// Override, when not empty, is a Bootstrap in JSON or YAML merged over the one built, as
	// Istio's ISTIO_BOOTSTRAP_OVERRIDE is; OverridePath names it in errors.
	Override     []byte
	OverridePath string
}

// ErrOverride marks a bootstrap refused because of its override: the override does not parse,
// or the bootstrap merged with it fails validation.
var ErrOverride = errors.New("invalid bootstrap override")

// Bootstrap builds the bootstrap of cfg, merges cfg.Override over it with proto.Merge (a scalar
// the override sets replaces the built one, a repeated field is appended to, a message is merged
// field by field: Istio's semantics), and checks the result with ValidateAll.
func Bootstrap(cfg BootstrapConfig) (*bootstrapv3.Bootstrap, error) {
	if err := checkBootstrapConfig(cfg); err != nil {
		return nil, err
	}
	b, err := buildBootstrap(cfg)
	if err != nil {
		return nil, err
	}
	// What is built alone must be valid: a failure here is this package's, not the user's.
	if err := validate(b); err != nil {
		return nil, fmt.Errorf("the built bootstrap is invalid: %w", err)
	}
	if len(cfg.Override) == 0 {
		return b, nil
	}
	override, err := parseOverride(cfg.Override)
	if err != nil {
		return nil, overrideError{path: cfg.OverridePath, err: err}
	}
	proto.Merge(b, override)
	if err := validate(b); err != nil {
		return nil, overrideError{path: cfg.OverridePath, err: fmt.Errorf("merged over the bootstrap: %w", err)}
	}
	return b, nil
}

// overrideError is a refused override, naming its file; it wraps ErrOverride.
type overrideError struct {
	path string
	err  error
}

func (e overrideError) Error() string {
	return fmt.Sprintf("%s %s: %s", ErrOverride, e.path, e.err)
}

func (e overrideError) Unwrap() []error { return []error{ErrOverride, e.err} }

// validate checks b with ValidateAll, and the content of each of its Any fields (typed_config
// and the like) with its own type's, since ValidateAll does not look into an Any.
func validate(b *bootstrapv3.Bootstrap) error {
	if err := b.ValidateAll(); err != nil {
		return err
	}
	return validateFields(b.ProtoReflect(), "Bootstrap")
}

// validator is what go-control-plane's generated messages have.
type validator interface{ ValidateAll() error }

// validateFields checks every Any reachable from m; path names m in errors, with the fields'
// names as the file spells them.
func validateFields(m protoreflect.Message, path string) error {
	var errs []error
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		name := path + "." + string(fd.Name())
		switch {
		case fd.IsMap():
			if fd.MapValue().Message() == nil {
				return true
			}
			v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
				errs = append(errs, validateMessage(mv.Message(), fmt.Sprintf("%s[%q]", name, k.String())))
				return true
			})
		case fd.IsList():
			if fd.Message() == nil {
				return true
			}
			for i := range v.List().Len() {
				errs = append(errs, validateMessage(v.List().Get(i).Message(), fmt.Sprintf("%s[%d]", name, i)))
			}
		case fd.Message() != nil:
			errs = append(errs, validateMessage(v.Message(), name))
		}
		return true
	})
	return errors.Join(errs...)
}

func validateMessage(m protoreflect.Message, path string) error {
	a, ok := m.Interface().(*anypb.Any)
	if !ok {
		return validateFields(m, path)
	}
	inner, err := a.UnmarshalNew()
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	path += "(" + string(inner.ProtoReflect().Descriptor().FullName()) + ")"
	if v, ok := inner.(validator); ok {
		if err := v.ValidateAll(); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
	}
	return validateFields(inner.ProtoReflect(), path)
}

func checkBootstrapConfig(cfg BootstrapConfig) error {
	var errs []error
	if !filepath.IsAbs(cfg.SDSSocket) {
		errs = append(errs, fmt.Errorf("the SDS socket %q is not an absolute path", cfg.SDSSocket))
	}
	if cfg.XDSSocket != "" && !filepath.IsAbs(cfg.XDSSocket) {
		errs = append(errs, fmt.Errorf("the XDS socket %q is not an absolute path", cfg.XDSSocket))
	}
	if cfg.AdminPort <= 0 || cfg.AdminPort > 65535 {
		errs = append(errs, fmt.Errorf("admin port %d: want 1-65535", cfg.AdminPort))
	}
	if cfg.PrometheusPort < 0 || cfg.PrometheusPort > 65535 {
		errs = append(errs, fmt.Errorf("stats (Prometheus) port %d: want 0 (none) or 1-65535", cfg.PrometheusPort))
	}
	return errors.Join(errs...)
}

// parseOverride reads a Bootstrap from JSON or YAML (read as JSON), refusing unknown fields.
// Its typed_config and other Any fields can name only the types linked in this binary: those
// the bootstrap itself uses, and the ones they are made of.
func parseOverride(data []byte) (*bootstrapv3.Bootstrap, error) {
	jsonData := data
	yamlForm := !json.Valid(data)
	if yamlForm {
		var err error
		if jsonData, err = yaml.YAMLToJSON(data); err != nil {
			return nil, fmt.Errorf("neither JSON nor YAML: %w", err)
		}
	}
	var b bootstrapv3.Bootstrap
	if err := (protojson.UnmarshalOptions{}).Unmarshal(jsonData, &b); err != nil {
		if yamlForm {
			// protojson's positions are in the JSON the YAML was turned into.
			return nil, fmt.Errorf("%w (its line:column is in the file turned into JSON)", err)
		}
		return nil, err
	}
	return &b, nil
}

func buildBootstrap(cfg BootstrapConfig) (*bootstrapv3.Bootstrap, error) {
	meta, err := metadataStruct(cfg.Node.Metadata)
	if err != nil {
		return nil, err
	}
	h2, err := http2Options()
	if err != nil {
		return nil, err
	}
	b := &bootstrapv3.Bootstrap{
		Node: &corev3.Node{Id: cfg.Node.ID, Cluster: cfg.Node.Cluster, Metadata: meta},
		Admin: &bootstrapv3.Admin{
			Address: socketAddress("127.0.0.1", cfg.AdminPort),
		},
		StaticResources: &bootstrapv3.Bootstrap_StaticResources{
			Clusters: []*clusterv3.Cluster{pipeCluster(SDSClusterName, cfg.SDSSocket, h2)},
		},
	}
	if cfg.XDSSocket != "" {
		b.StaticResources.Clusters = append(b.StaticResources.Clusters, pipeCluster(XDSClusterName, cfg.XDSSocket, h2))
		ads := &corev3.ConfigSource{
			ConfigSourceSpecifier: &corev3.ConfigSource_Ads{Ads: &corev3.AggregatedConfigSource{}},
			ResourceApiVersion:    corev3.ApiVersion_V3,
		}
		b.DynamicResources = &bootstrapv3.Bootstrap_DynamicResources{
			AdsConfig: &corev3.ApiConfigSource{
				ApiType:             corev3.ApiConfigSource_GRPC,
				TransportApiVersion: corev3.ApiVersion_V3,
				GrpcServices: []*corev3.GrpcService{{
					TargetSpecifier: &corev3.GrpcService_EnvoyGrpc_{EnvoyGrpc: &corev3.GrpcService_EnvoyGrpc{ClusterName: XDSClusterName}},
				}},
				SetNodeOnFirstMessageOnly: true,
			},
			CdsConfig: ads,
			LdsConfig: proto.Clone(ads).(*corev3.ConfigSource),
		}
	}
	if cfg.PrometheusPort > 0 {
		listener, err := statsListener(cfg.PrometheusPort)
		if err != nil {
			return nil, err
		}
		b.StaticResources.Clusters = append(b.StaticResources.Clusters, &clusterv3.Cluster{
			Name:                 StatsClusterName,
			ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_STATIC},
			ConnectTimeout:       durationpb.New(connectTimeout),
			LoadAssignment:       loadAssignment(StatsClusterName, socketAddress("127.0.0.1", cfg.AdminPort)),
		})
		b.StaticResources.Listeners = append(b.StaticResources.Listeners, listener)
	}
	return b, nil
}

// metadataStruct is the node's metadata as Envoy takes it: a Struct of strings.
func metadataStruct(meta map[string]string) (*structpb.Struct, error) {
	fields := make(map[string]any, len(meta))
	for k, v := range meta {
		fields[k] = v
	}
	s, err := structpb.NewStruct(fields)
	if err != nil {
		return nil, fmt.Errorf("node metadata: %w", err)
	}
	return s, nil
}

// http2Options are the typed_extension_protocol_options that make a cluster speak HTTP/2, as
// gRPC needs.
func http2Options() (map[string]*anypb.Any, error) {
	opts, err := anypb.New(&upstreamhttpv3.HttpProtocolOptions{
		UpstreamProtocolOptions: &upstreamhttpv3.HttpProtocolOptions_ExplicitHttpConfig_{
			ExplicitHttpConfig: &upstreamhttpv3.HttpProtocolOptions_ExplicitHttpConfig{
				ProtocolConfig: &upstreamhttpv3.HttpProtocolOptions_ExplicitHttpConfig_Http2ProtocolOptions{
					Http2ProtocolOptions: &corev3.Http2ProtocolOptions{},
				},
			},
		},
	})
	if err != nil {
		return nil, fmt.Errorf("HTTP/2 protocol options: %w", err)
	}
	return map[string]*anypb.Any{"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": opts}, nil
}

// pipeCluster is a static gRPC cluster on the Unix socket at path.
func pipeCluster(name, path string, h2 map[string]*anypb.Any) *clusterv3.Cluster {
	return &clusterv3.Cluster{
		Name:                 name,
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_STATIC},
		ConnectTimeout:       durationpb.New(connectTimeout),
		LoadAssignment: loadAssignment(name, &corev3.Address{
			Address: &corev3.Address_Pipe{Pipe: &corev3.Pipe{Path: path}},
		}),
		// Each cluster its own copy: a later proto.Merge must not change both through one map.
		TypedExtensionProtocolOptions: cloneAnys(h2),
	}
}

func cloneAnys(m map[string]*anypb.Any) map[string]*anypb.Any {
	out := make(map[string]*anypb.Any, len(m))
	for k, v := range m {
		out[k] = proto.Clone(v).(*anypb.Any)
	}
	return out
}

func loadAssignment(cluster string, addr *corev3.Address) *endpointv3.ClusterLoadAssignment {
	return &endpointv3.ClusterLoadAssignment{
		ClusterName: cluster,
		Endpoints: []*endpointv3.LocalityLbEndpoints{{
			LbEndpoints: []*endpointv3.LbEndpoint{{
				HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{Address: addr}},
			}},
		}},
	}
}

func socketAddress(host string, port int) *corev3.Address {
	return &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
		Address:       host,
		PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: uint32(port)}, //nolint:gosec // checked to be 0-65535
	}}}
}

// statsListener serves /stats/prometheus on 0.0.0.0:port from the admin, as Istio's bootstrap
// does: Prometheus scrapes the pod's IP, and the admin stays on loopback.
func statsListener(port int) (*listenerv3.Listener, error) {
	routerAny, err := anypb.New(&routerv3.Router{})
	if err != nil {
		return nil, fmt.Errorf("stats listener's router: %w", err)
	}
	hcm := &hcmv3.HttpConnectionManager{
		CodecType:  hcmv3.HttpConnectionManager_AUTO,
		StatPrefix: "stats",
		RouteSpecifier: &hcmv3.HttpConnectionManager_RouteConfig{RouteConfig: &routev3.RouteConfiguration{
			VirtualHosts: []*routev3.VirtualHost{{
				Name:    "backend",
				Domains: []string{"*"},
				Routes: []*routev3.Route{{
					Match: &routev3.RouteMatch{PathSpecifier: &routev3.RouteMatch_Prefix{Prefix: StatsPath}},
					Action: &routev3.Route_Route{Route: &routev3.RouteAction{
						ClusterSpecifier: &routev3.RouteAction_Cluster{Cluster: StatsClusterName},
					}},
				}},
			}},
		}},
		HttpFilters: []*hcmv3.HttpFilter{{
			Name:       "envoy.filters.http.router",
			ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: routerAny},
		}},
	}
	hcmAny, err := anypb.New(hcm)
	if err != nil {
		return nil, fmt.Errorf("stats listener's connection manager: %w", err)
	}
	return &listenerv3.Listener{
		Name:    StatsListenerName,
		Address: socketAddress("0.0.0.0", port),
		FilterChains: []*listenerv3.FilterChain{{
			Filters: []*listenerv3.Filter{{
				Name:       "envoy.filters.network.http_connection_manager",
				ConfigType: &listenerv3.Filter_TypedConfig{TypedConfig: hcmAny},
			}},
		}},
	}, nil
}

// MarshalBootstrap returns b as indented JSON, the same bytes for the same bootstrap: protojson
// orders fields and map keys but varies its whitespace on purpose, so it is indented again here.
func MarshalBootstrap(b *bootstrapv3.Bootstrap) ([]byte, error) {
	data, err := protojson.Marshal(b)
	if err != nil {
		return nil, fmt.Errorf("marshal bootstrap: %w", err)
	}
	var compact, out bytes.Buffer
	if err := json.Compact(&compact, data); err != nil {
		return nil, fmt.Errorf("compact bootstrap: %w", err)
	}
	if err := json.Indent(&out, compact.Bytes(), "", "  "); err != nil {
		return nil, fmt.Errorf("indent bootstrap: %w", err)
	}
	out.WriteByte('\n')
	return out.Bytes(), nil
}
