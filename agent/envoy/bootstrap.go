package envoy

// The bootstrap is written from the small structs below, not from go-control-plane's types:
// those, with their validation code, would add 6 MB to every sidecar's binary and 5 MB to its
// memory. What it writes is what protojson writes for the same Bootstrap (field names, order,
// escapes), and its tests check it with Envoy's types (bootstrapcheck).

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strconv"
	"unicode/utf8"
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

// connectTimeout is the static clusters' connect timeout, as protojson writes a Duration: each
// leads to a local socket.
const connectTimeout = "1s"

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
}

// ErrOverride marks a bootstrap refused because of its override (ISTIO_BOOTSTRAP_OVERRIDE): the
// override does not parse, or the bootstrap merged with it fails Envoy's validation. The checks
// that merge an override (bootstrapcheck.Merge) wrap it, so that the agent tells the user's
// mistake from its own.
var ErrOverride = errors.New("invalid bootstrap override")

// Bootstrap returns the bootstrap of cfg as indented JSON, the same bytes for the same cfg, as
// protojson writes Envoy's Bootstrap: Envoy reads it with -c.
func Bootstrap(cfg BootstrapConfig) ([]byte, error) {
	if err := checkBootstrapConfig(cfg); err != nil {
		return nil, err
	}
	var out bytes.Buffer
	enc := json.NewEncoder(&out)
	// protojson escapes no HTML characters; text escapes the rest as protojson does.
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(buildBootstrap(cfg)); err != nil {
		return nil, fmt.Errorf("marshal bootstrap: %w", err)
	}
	return out.Bytes(), nil
}

func checkBootstrapConfig(cfg BootstrapConfig) error {
	var errs []error
	if !filepath.IsAbs(cfg.SDSSocket) {
		errs = append(errs, fmt.Errorf("the SDS socket %q is not an absolute path", cfg.SDSSocket))
	}
	if cfg.XDSSocket != "" && !filepath.IsAbs(cfg.XDSSocket) {
		errs = append(errs, fmt.Errorf("the XDS socket %q is not an absolute path", cfg.XDSSocket))
	}
	switch {
	case cfg.AdminPort < 0 || cfg.AdminPort > 65535:
		errs = append(errs, fmt.Errorf("admin port %d: want 1-65535, or 0 for one the kernel chooses", cfg.AdminPort))
	case cfg.AdminPort == 0 && cfg.PrometheusPort != 0:
		errs = append(errs, errors.New("the stats listener forwards to the admin's port: with admin port 0 (the kernel's choice), the stats port must be 0 (none)"))
	}
	if cfg.PrometheusPort < 0 || cfg.PrometheusPort > 65535 {
		errs = append(errs, fmt.Errorf("stats (Prometheus) port %d: want 0 (none) or 1-65535", cfg.PrometheusPort))
	}
	// A proto string is UTF-8: Envoy refuses a bootstrap with any other.
	for what, s := range map[string]string{"node id": cfg.Node.ID, "node cluster": cfg.Node.Cluster,
		"SDS socket": cfg.SDSSocket, "XDS socket": cfg.XDSSocket} {
		if !utf8.ValidString(s) {
			errs = append(errs, fmt.Errorf("the %s %q is not UTF-8", what, s))
		}
	}
	for _, k := range slices.Sorted(maps.Keys(cfg.Node.Metadata)) {
		if !utf8.ValidString(k) || !utf8.ValidString(cfg.Node.Metadata[k]) {
			errs = append(errs, fmt.Errorf("node metadata %q: %q is not UTF-8", k, cfg.Node.Metadata[k]))
		}
	}
	return errors.Join(errs...)
}

// The JSON of the part of Envoy's Bootstrap that the agent writes. Fields are in the proto's
// declaration order, named as protojson names them, and left out where protojson leaves them out.
type (
	bootstrapJSON struct {
		Node             nodeJSON              `json:"node"`
		StaticResources  staticResourcesJSON   `json:"staticResources"`
		DynamicResources *dynamicResourcesJSON `json:"dynamicResources,omitempty"`
		Admin            adminJSON             `json:"admin"`
	}
	nodeJSON struct {
		ID       text     `json:"id,omitempty"`
		Cluster  text     `json:"cluster,omitempty"`
		Metadata metadata `json:"metadata"`
	}
	staticResourcesJSON struct {
		Listeners []listenerJSON `json:"listeners,omitempty"`
		Clusters  []clusterJSON  `json:"clusters"`
	}
	clusterJSON struct {
		Name           text               `json:"name"`
		Type           string             `json:"type"`
		ConnectTimeout string             `json:"connectTimeout"`
		LoadAssignment loadAssignmentJSON `json:"loadAssignment"`
		// TypedExtensionProtocolOptions: by extension name.
		TypedExtensionProtocolOptions map[string]protocolOptionsJSON `json:"typedExtensionProtocolOptions,omitempty"`
	}
	loadAssignmentJSON struct {
		ClusterName text                `json:"clusterName"`
		Endpoints   []localityEndpoints `json:"endpoints"`
	}
	localityEndpoints struct {
		LbEndpoints []lbEndpointJSON `json:"lbEndpoints"`
	}
	lbEndpointJSON struct {
		Endpoint struct {
			Address addressJSON `json:"address"`
		} `json:"endpoint"`
	}
	addressJSON struct {
		SocketAddress *socketAddressJSON `json:"socketAddress,omitempty"`
		Pipe          *pipeJSON          `json:"pipe,omitempty"`
	}
	socketAddressJSON struct {
		Address   string `json:"address"`
		PortValue int    `json:"portValue"` // a oneof member: protojson writes it, 0 too
	}
	pipeJSON struct {
		Path text `json:"path"`
	}
	// protocolOptionsJSON is an Any of envoy.extensions.upstreams.http.v3.HttpProtocolOptions
	// that asks for HTTP/2.
	protocolOptionsJSON struct {
		Type               string `json:"@type"`
		ExplicitHTTPConfig struct {
			HTTP2ProtocolOptions struct{} `json:"http2ProtocolOptions"`
		} `json:"explicitHttpConfig"`
	}
	dynamicResourcesJSON struct {
		LdsConfig configSourceJSON    `json:"ldsConfig"`
		CdsConfig configSourceJSON    `json:"cdsConfig"`
		AdsConfig apiConfigSourceJSON `json:"adsConfig"`
	}
	configSourceJSON struct {
		Ads                struct{} `json:"ads"`
		ResourceAPIVersion string   `json:"resourceApiVersion"`
	}
	apiConfigSourceJSON struct {
		APIType                   string            `json:"apiType"`
		TransportAPIVersion       string            `json:"transportApiVersion"`
		GrpcServices              []grpcServiceJSON `json:"grpcServices"`
		SetNodeOnFirstMessageOnly bool              `json:"setNodeOnFirstMessageOnly"`
	}
	grpcServiceJSON struct {
		EnvoyGrpc struct {
			ClusterName string `json:"clusterName"`
		} `json:"envoyGrpc"`
	}
	adminJSON struct {
		Address addressJSON `json:"address"`
	}
	listenerJSON struct {
		Name         string            `json:"name"`
		Address      addressJSON       `json:"address"`
		FilterChains []filterChainJSON `json:"filterChains"`
	}
	filterChainJSON struct {
		Filters []filterJSON `json:"filters"`
	}
	filterJSON struct {
		Name        string  `json:"name"`
		TypedConfig hcmJSON `json:"typedConfig"`
	}
	// hcmJSON is an Any of the HTTP connection manager: codec_type AUTO is its default, which
	// protojson leaves out.
	hcmJSON struct {
		Type        string           `json:"@type"`
		StatPrefix  string           `json:"statPrefix"`
		RouteConfig routeConfigJSON  `json:"routeConfig"`
		HTTPFilters []httpFilterJSON `json:"httpFilters"`
	}
	routeConfigJSON struct {
		VirtualHosts []virtualHostJSON `json:"virtualHosts"`
	}
	virtualHostJSON struct {
		Name    string      `json:"name"`
		Domains []string    `json:"domains"`
		Routes  []routeJSON `json:"routes"`
	}
	routeJSON struct {
		Match struct {
			Prefix string `json:"prefix"`
		} `json:"match"`
		Route struct {
			Cluster string `json:"cluster"`
		} `json:"route"`
	}
	httpFilterJSON struct {
		Name        string `json:"name"`
		TypedConfig struct {
			Type string `json:"@type"`
		} `json:"typedConfig"`
	}
)

// Type URLs and enum values as protojson writes them.
const (
	typeURLPrefix          = "type.googleapis.com/"
	httpProtocolOptionsKey = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
	hcmType                = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
	routerType             = "envoy.extensions.filters.http.router.v3.Router"
	clusterStatic          = "STATIC"
	apiVersionV3           = "V3"
	apiTypeGRPC            = "GRPC"
)

func buildBootstrap(cfg BootstrapConfig) bootstrapJSON {
	b := bootstrapJSON{
		Node:  nodeJSON{ID: text(cfg.Node.ID), Cluster: text(cfg.Node.Cluster), Metadata: metadata(cfg.Node.Metadata)},
		Admin: adminJSON{Address: socketAddress("127.0.0.1", cfg.AdminPort)},
		StaticResources: staticResourcesJSON{
			Clusters: []clusterJSON{pipeCluster(SDSClusterName, cfg.SDSSocket)},
		},
	}
	if cfg.XDSSocket != "" {
		b.StaticResources.Clusters = append(b.StaticResources.Clusters, pipeCluster(XDSClusterName, cfg.XDSSocket))
		ads := configSourceJSON{ResourceAPIVersion: apiVersionV3}
		grpc := grpcServiceJSON{}
		grpc.EnvoyGrpc.ClusterName = XDSClusterName
		b.DynamicResources = &dynamicResourcesJSON{
			LdsConfig: ads,
			CdsConfig: ads,
			AdsConfig: apiConfigSourceJSON{
				APIType:                   apiTypeGRPC,
				TransportAPIVersion:       apiVersionV3,
				GrpcServices:              []grpcServiceJSON{grpc},
				SetNodeOnFirstMessageOnly: true,
			},
		}
	}
	if cfg.PrometheusPort > 0 {
		b.StaticResources.Clusters = append(b.StaticResources.Clusters, clusterJSON{
			Name:           StatsClusterName,
			Type:           clusterStatic,
			ConnectTimeout: connectTimeout,
			LoadAssignment: loadAssignment(StatsClusterName, socketAddress("127.0.0.1", cfg.AdminPort)),
		})
		b.StaticResources.Listeners = append(b.StaticResources.Listeners, statsListener(cfg.PrometheusPort))
	}
	return b
}

// pipeCluster is a static gRPC cluster on the Unix socket at path: it speaks HTTP/2, as gRPC
// needs.
func pipeCluster(name, path string) clusterJSON {
	h2 := protocolOptionsJSON{Type: typeURLPrefix + httpProtocolOptionsKey}
	return clusterJSON{
		Name:                          text(name),
		Type:                          clusterStatic,
		ConnectTimeout:                connectTimeout,
		LoadAssignment:                loadAssignment(name, addressJSON{Pipe: &pipeJSON{Path: text(path)}}),
		TypedExtensionProtocolOptions: map[string]protocolOptionsJSON{httpProtocolOptionsKey: h2},
	}
}

func loadAssignment(cluster string, addr addressJSON) loadAssignmentJSON {
	var ep lbEndpointJSON
	ep.Endpoint.Address = addr
	return loadAssignmentJSON{
		ClusterName: text(cluster),
		Endpoints:   []localityEndpoints{{LbEndpoints: []lbEndpointJSON{ep}}},
	}
}

func socketAddress(host string, port int) addressJSON {
	return addressJSON{SocketAddress: &socketAddressJSON{Address: host, PortValue: port}}
}

// statsListener serves /stats/prometheus on 0.0.0.0:port from the admin, as Istio's bootstrap
// does: Prometheus scrapes the pod's IP, and the admin stays on loopback.
func statsListener(port int) listenerJSON {
	var route routeJSON
	route.Match.Prefix = StatsPath
	route.Route.Cluster = StatsClusterName
	router := httpFilterJSON{Name: "envoy.filters.http.router"}
	router.TypedConfig.Type = typeURLPrefix + routerType
	hcm := hcmJSON{
		Type:       typeURLPrefix + hcmType,
		StatPrefix: "stats",
		RouteConfig: routeConfigJSON{VirtualHosts: []virtualHostJSON{{
			Name: "backend", Domains: []string{"*"}, Routes: []routeJSON{route},
		}}},
		HTTPFilters: []httpFilterJSON{router},
	}
	return listenerJSON{
		Name:    StatsListenerName,
		Address: socketAddress("0.0.0.0", port),
		FilterChains: []filterChainJSON{{Filters: []filterJSON{{
			Name: "envoy.filters.network.http_connection_manager", TypedConfig: hcm,
		}}}},
	}
}

// text is a string of the workload's (a path, a pod's name), written as protojson writes it:
// encoding/json would escape U+2028 and U+2029, which protojson leaves.
type text string

func (s text) MarshalJSON() ([]byte, error) { return appendText(nil, string(s)), nil }

// metadata is the node's metadata, a Struct of strings, with its keys in order.
type metadata map[string]string

func (m metadata) MarshalJSON() ([]byte, error) {
	out := []byte{'{'}
	for i, k := range slices.Sorted(maps.Keys(m)) {
		if i > 0 {
			out = append(out, ',')
		}
		out = append(appendText(out, k), ':')
		out = appendText(out, m[k])
	}
	return append(out, '}'), nil
}

// appendText appends s, UTF-8 (checkBootstrapConfig), as a JSON string escaped as protojson
// escapes: the quote, the backslash and the control characters, nothing else.
func appendText(out []byte, s string) []byte {
	out = append(out, '"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			out = append(out, '\\', byte(r))
		case r >= ' ':
			out = utf8.AppendRune(out, r)
		case r == '\b':
			out = append(out, `\b`...)
		case r == '\f':
			out = append(out, `\f`...)
		case r == '\n':
			out = append(out, `\n`...)
		case r == '\r':
			out = append(out, `\r`...)
		case r == '\t':
			out = append(out, `\t`...)
		default:
			out = append(out, `\u00`...)
			if r < 0x10 {
				out = append(out, '0')
			}
			out = strconv.AppendInt(out, int64(r), 16)
		}
	}
	return append(out, '"')
}
