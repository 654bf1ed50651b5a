package discovery

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/semaphore"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// NamespaceMetadataKey is the node metadata field the server stamps with the namespace a
// client authenticated as, overwriting whatever the client declared: it picks the snapshot.
const NamespaceMetadataKey = "meshid.io/authenticated-namespace"

// Caller is a client as the CA sees its credential.
type Caller struct {
	// Identity is the client's SPIFFE ID; its namespace picks the client's snapshot.
	Identity pki.SPIFFEID
	// Method names how the client proved its identity ("jwt", "mtls", "tokenreview").
	Method string
	// Credential is a fingerprint of the credential the client presented, never the credential.
	Credential string
}

// Authorizer tells who a client is, from its credential (a service-account JWT or a workload
// certificate), and whether the CA serves its namespace. A refusal is returned as a gRPC status,
// already logged and counted by the authorizer.
type Authorizer interface {
	// Authorize authenticates the caller of ctx and checks that its namespace is served: when a
	// stream opens, and before each debug answer.
	Authorize(ctx context.Context) (Caller, error)
	// Serves checks again that caller's namespace is served: at every request, so that a
	// namespace no longer served is refused at its stream's next request. The credential itself
	// is shown again when the connection reaches its maximum age.
	Serves(ctx context.Context, caller Caller) error
}

// ServerConfig configures a Server.
type ServerConfig struct {
	// ConfigPath is the --xds-config file, watched and reloaded; empty: there is none, nothing
	// is watched, and Initial (else EmptyConfig) is served for good.
	ConfigPath string
	// Initial is the configuration LoadConfig read from ConfigPath, for a caller that checks
	// the file before it builds the server; nil: NewServer loads it, or without a file takes
	// EmptyConfig.
	Initial    *Config
	Authorizer Authorizer
	// MaxStreams bounds the streams open at once (default DefaultMaxStreams), and
	// MaxStreamsPerCredential those of one credential (default DefaultMaxStreamsPerCredential);
	// past either a stream is refused with ResourceExhausted.
	MaxStreams              int
	MaxStreamsPerCredential int
	Debounce                time.Duration // of the file watch; zero: filewatch's default
	Clock                   clock.Clock
	Logger                  *slog.Logger
	Registerer              prometheus.Registerer // optional
	// OnReload, when set, is told of every reload after the fact: nil, or why the file was not
	// put in service.
	OnReload func(error)
}

// Server serves Envoy's aggregated discovery service from the configuration file, or without
// one from EmptyConfig: each client gets the snapshot of the namespace it authenticated as,
// pushed again when the file changes.
type Server struct {
	cfg     ServerConfig
	log     *slog.Logger
	cache   cache.SnapshotCache
	xds     serverv3.Server
	stop    context.CancelFunc // ends the open streams
	watcher *filewatch.Watcher // nil without a file

	mu         sync.Mutex
	current    *Config
	namespaces map[string]bool   // with a snapshot: configured or connected
	streams    map[int64]*stream // open stream → who opened it

	sync       *syncTracker
	debugNonce atomic.Uint64
	// debugSlots bounds the debug answers being built at once, over every stream.
	debugSlots *semaphore.Weighted

	gate *admission.Gate
	logs *admission.LogLimiter

	reloads  *prometheus.CounterVec
	refusals *prometheus.CounterVec
	open     prometheus.Gauge
}

// NewServer loads the configuration; an invalid one fails the start. It starts no goroutine.
func NewServer(cfg ServerConfig) (*Server, error) {
	if cfg.Authorizer == nil {
		return nil, errors.New("discovery server: no authorizer")
	}
	if cfg.MaxStreams < 0 || cfg.MaxStreamsPerCredential < 0 {
		return nil, fmt.Errorf("discovery stream limits must be positive, not %d and %d per credential", cfg.MaxStreams, cfg.MaxStreamsPerCredential)
	}
	if cfg.MaxStreams == 0 {
		cfg.MaxStreams = DefaultMaxStreams
	}
	if cfg.MaxStreamsPerCredential == 0 {
		cfg.MaxStreamsPerCredential = DefaultMaxStreamsPerCredential
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	current := cfg.Initial
	switch {
	case current != nil:
	case cfg.ConfigPath == "":
		current = EmptyConfig()
	default:
		var err error
		if current, err = LoadConfig(cfg.ConfigPath); err != nil {
			return nil, err
		}
	}
	gate, err := admission.NewGate(admission.Limits{Streams: cfg.MaxStreams, StreamsPerKey: cfg.MaxStreamsPerCredential})
	if err != nil {
		return nil, err
	}
	var w *filewatch.Watcher
	if cfg.ConfigPath != "" {
		if w, err = filewatch.New(filewatch.Config{Paths: []string{cfg.ConfigPath}, Debounce: cfg.Debounce, Clock: cfg.Clock, Logger: log}); err != nil {
			return nil, err
		}
	}
	ctx, stop := context.WithCancel(context.Background())
	s := &Server{
		cfg: cfg, log: log, stop: stop, watcher: w, current: current,
		namespaces: map[string]bool{}, streams: map[int64]*stream{}, sync: &syncTracker{streams: map[int64]*syncState{}},
		debugSlots: semaphore.NewWeighted(maxDebugAnswers),
		gate:       gate,
		logs:       admission.NewLogLimiter(cfg.Clock),
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshid_discovery_config_reloads_total",
			Help: "Loads of --xds-config after a change, by outcome: loaded, unchanged, or invalid (the last good one keeps serving).",
		}, []string{"outcome"}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshid_discovery_refusals_total",
			Help: "Discovery streams and requests refused, by reason and the gRPC code the stream ended with. Refusals of the credential or the namespace are counted in meshid_ca_requests_refused_total.",
		}, []string{"reason", "code"}),
		open: prometheus.NewGauge(prometheus.GaugeOpts{Name: "meshid_discovery_streams", Help: "Open xDS streams."}),
	}
	s.cache = cache.NewSnapshotCache(true, nodeNamespace{}, nil)
	s.xds = serverv3.NewServer(ctx, s.cache, serverv3.CallbackFuncs{
		StreamOpenFunc:        s.opened,
		DeltaStreamOpenFunc:   s.opened,
		StreamClosedFunc:      s.closed,
		DeltaStreamClosedFunc: s.closed,
		StreamRequestFunc: func(id int64, req *discoveryv3.DiscoveryRequest) error {
			return s.onRequest(id, &req.Node, req.GetTypeUrl(), req.GetVersionInfo(), req.GetResponseNonce(), req.GetErrorDetail())
		},
		StreamDeltaRequestFunc: func(id int64, req *discoveryv3.DeltaDiscoveryRequest) error {
			return s.onRequest(id, &req.Node, req.GetTypeUrl(), "", req.GetResponseNonce(), req.GetErrorDetail())
		},
		StreamResponseFunc: func(_ context.Context, id int64, _ *discoveryv3.DiscoveryRequest, resp *discoveryv3.DiscoveryResponse) {
			s.sync.sentResponse(id, resp.GetTypeUrl(), resp.GetVersionInfo(), resp.GetNonce())
		},
		StreamDeltaResponseFunc: func(id int64, _ *discoveryv3.DeltaDiscoveryRequest, resp *discoveryv3.DeltaDiscoveryResponse) {
			s.sync.sentResponse(id, resp.GetTypeUrl(), resp.GetSystemVersionInfo(), resp.GetNonce())
		},
	})
	for _, ns := range current.Namespaces() {
		s.namespaces[ns] = true
	}
	if err := s.publish(current); err != nil {
		return nil, err
	}
	if cfg.Registerer != nil {
		for _, c := range []prometheus.Collector{s.reloads, s.refusals, s.open} {
			if err := cfg.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("discovery metrics: %w", err)
			}
		}
	}
	return s, nil
}

// Register serves the aggregated discovery service on g.
func (s *Server) Register(g *grpc.Server) {
	discoveryv3.RegisterAggregatedDiscoveryServiceServer(g, admittedADS{s: s})
}

// Ready is closed once the file is watched: an edit from then on is reloaded. Without a file it
// is closed from the start.
func (s *Server) Ready() <-chan struct{} {
	if s.watcher == nil {
		return closedChannel()
	}
	return s.watcher.Ready()
}

func closedChannel() <-chan struct{} {
	ch := make(chan struct{})
	close(ch)
	return ch
}

// Run reloads the configuration when its file changes, until ctx ends; then it ends the open
// streams. Without a file there is nothing to reload: it waits for ctx.
func (s *Server) Run(ctx context.Context) error {
	defer s.stop()
	if s.watcher == nil {
		<-ctx.Done()
		return nil
	}
	return s.watcher.Run(ctx, func([]string) { s.reload() })
}

// LoadConfig reads and checks the --xds-config file at path.
func LoadConfig(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--xds-config: %w", err)
	}
	cfg, err := ParseConfig(data)
	if err != nil {
		return nil, fmt.Errorf("--xds-config %s: %w", path, err)
	}
	return cfg, nil
}

// reload puts a changed, valid file in service; an invalid one is reported and the last good
// configuration keeps serving.
func (s *Server) reload() {
	err := s.reloadOnce()
	if s.cfg.OnReload != nil {
		s.cfg.OnReload(err)
	}
}

func (s *Server) reloadOnce() error {
	next, err := LoadConfig(s.cfg.ConfigPath)
	if err != nil {
		s.reloads.WithLabelValues("invalid").Inc()
		s.log.Error("the discovery configuration is not valid; the last good one keeps serving", logkey.Error, err.Error())
		return err
	}
	s.mu.Lock()
	for _, ns := range next.Namespaces() {
		s.namespaces[ns] = true
	}
	s.mu.Unlock()
	if err := s.publish(next); err != nil {
		s.reloads.WithLabelValues("invalid").Inc()
		s.log.Error("the discovery configuration cannot be served; the last good one keeps serving", logkey.Error, err.Error())
		return err
	}
	s.reloads.WithLabelValues("loaded").Inc()
	s.log.Info("discovery configuration loaded", logkey.Path, s.cfg.ConfigPath, logkey.Version, next.defaults.version,
		logkey.Namespaces, len(next.namespaces))
	return nil
}

// publish sets the snapshot of every namespace with one; a namespace whose set did not change
// keeps its version, so its clients get no push.
func (s *Server) publish(cfg *Config) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for ns := range s.namespaces {
		if err := s.setSnapshot(cfg, ns); err != nil {
			return err
		}
	}
	s.current = cfg
	return nil
}

func (s *Server) setSnapshot(cfg *Config, namespace string) error {
	set, version := cfg.For(namespace)
	// Every type the cache knows is in the snapshot, empty where the file has none: a type
	// missing from a snapshot is never answered, and Envoy waits for the answers of the types
	// its bootstrap names before it serves.
	all := make(map[resource.Type][]types.Resource, int(types.UnknownType))
	for _, typeURL := range envoyTypes() {
		all[typeURL] = set[typeURL]
		if all[typeURL] == nil {
			all[typeURL] = []types.Resource{}
		}
	}
	snap, err := cache.NewSnapshot(version, all)
	if err != nil {
		return err
	}
	return s.cache.SetSnapshot(context.Background(), namespace, snap)
}

// opened makes sure the namespace of a stream, admitted by admittedADS, has a snapshot before
// its first request is answered.
func (s *Server) opened(ctx context.Context, id int64, _ string) error {
	st, ok := ctx.Value(streamKey{}).(*stream)
	if !ok {
		return status.Error(codes.Internal, "discovery stream opened without admission")
	}
	ns := st.caller.Identity.Namespace
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.namespaces[ns] {
		if err := s.setSnapshot(s.current, ns); err != nil {
			return status.Errorf(codes.Internal, "snapshot for namespace %s: %v", ns, err)
		}
		s.namespaces[ns] = true
	}
	s.streams[id] = st
	s.sync.open(id, ns)
	s.open.Inc()
	return nil
}

func (s *Server) closed(id int64, _ *corev3.Node) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.streams[id]; ok {
		delete(s.streams, id)
		s.sync.close(id)
		s.open.Dec()
	}
}

// onRequest is go-control-plane's request callback, run on the stream's own goroutine before the
// request reaches the cache. It checks that the caller's namespace is still served, so that a
// namespace no longer served is refused at its stream's next request (the authorizer logs and
// counts that; the credential itself is checked again when the connection reaches its maximum
// age, not at every request, which would verify a token per ACK); records
// the request for syncz; and replaces the request's node with a new one: the stream's node as
// the tracker holds it, with the stream's authenticated namespace in its metadata, whatever the
// client declared, for the cache to pick a snapshot by.
//
// The client's node is never written: go-control-plane keeps the node a SotW stream sent first
// and puts it into every later request that has none, so a write into it would be a write into
// a node that other requests, and syncz, read under other locks.
//
// Checking here rather than where requests are received keeps the receiving goroutine, which
// every idle stream has, from growing its stack.
func (s *Server) onRequest(id int64, node **corev3.Node, typeURL, version, nonce string, nack *rpcstatus.Status) error {
	s.mu.Lock()
	st, ok := s.streams[id]
	s.mu.Unlock()
	if !ok {
		return status.Error(codes.Unauthenticated, "stream not authenticated")
	}
	if err := s.cfg.Authorizer.Serves(st.ctx, st.caller); err != nil {
		return asStatus(err)
	}
	info := s.sync.request(id, *node, typeURL, version, nonce, nack)
	n := info.node()
	n.Metadata = &structpb.Struct{Fields: map[string]*structpb.Value{NamespaceMetadataKey: structpb.NewStringValue(st.caller.Identity.Namespace)}}
	*node = n
	return nil
}

// nodeInfo is what the server keeps of a stream's node: what syncz shows, copied from the
// client's node, which the server never holds on to.
type nodeInfo struct {
	id, cluster           string
	region, zone, subZone string
	hasLocality           bool
}

func nodeInfoOf(n *corev3.Node) nodeInfo {
	l := n.GetLocality()
	return nodeInfo{id: n.GetId(), cluster: n.GetCluster(),
		region: l.GetRegion(), zone: l.GetZone(), subZone: l.GetSubZone(), hasLocality: l != nil}
}

// node returns a new node of the id, cluster and locality info holds.
func (i nodeInfo) node() *corev3.Node {
	n := &corev3.Node{Id: i.id, Cluster: i.cluster}
	if i.hasLocality {
		n.Locality = &corev3.Locality{Region: i.region, Zone: i.zone, SubZone: i.subZone}
	}
	return n
}

// nodeNamespace keys the snapshot cache by the stamped namespace.
type nodeNamespace struct{}

func (nodeNamespace) ID(node *corev3.Node) string {
	return node.GetMetadata().GetFields()[NamespaceMetadataKey].GetStringValue()
}
