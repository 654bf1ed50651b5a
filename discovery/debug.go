package discovery

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	statusv3 "github.com/envoyproxy/go-control-plane/envoy/service/status/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshid/meshid/internal/logkey"
)

// Istio's debug types, asked for on an ADS stream like any other. Each answer is one resource,
// a google.protobuf.Value holding the JSON of Envoy's type (a ClientConfig per node for syncz,
// the admin ConfigDump for config_dump).
const (
	debugPrefix     = "istio.io/debug/"
	DebugSyncz      = debugPrefix + "syncz"
	DebugConfigDump = debugPrefix + "config_dump"
)

// syncState is what one stream was sent and what it acknowledged, by type.
type syncState struct {
	namespace string
	node      nodeInfo
	sent      map[string]sentVersion
	acked     map[string]string // the version last ACKed
	nacked    map[string]string // the error of the last NACK, until the next ACK
}

type sentVersion struct{ version, nonce string }

// syncTracker follows every stream's sync state for syncz.
type syncTracker struct {
	mu      sync.Mutex
	streams map[int64]*syncState
}

func (t *syncTracker) open(id int64, namespace string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.streams[id] = &syncState{namespace: namespace, sent: map[string]sentVersion{}, acked: map[string]string{}, nacked: map[string]string{}}
}

func (t *syncTracker) close(id int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.streams, id)
}

func (t *syncTracker) sentResponse(id int64, typeURL, version, nonce string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if st, ok := t.streams[id]; ok {
		st.sent[typeURL] = sentVersion{version, nonce}
	}
}

// request records the node, when the request has one, and an ACK or NACK of the response the
// request names. It returns what it holds of the stream's node: the node of this request or of
// an earlier one.
func (t *syncTracker) request(id int64, node *corev3.Node, typeURL, version, nonce string, nack *rpcstatus.Status) nodeInfo {
	// Copied before the lock: the node is the client's, read on the stream's own goroutine.
	var info nodeInfo
	if node != nil {
		info = nodeInfoOf(node)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	st, ok := t.streams[id]
	if !ok {
		return info
	}
	if node != nil {
		st.node = info
	}
	info = st.node
	if nonce == "" || st.sent[typeURL].nonce != nonce {
		return info
	}
	if nack != nil {
		st.nacked[typeURL] = nack.GetMessage()
		return info
	}
	if version == "" { // delta acknowledges a nonce, not a version
		version = st.sent[typeURL].version
	}
	delete(st.nacked, typeURL)
	st.acked[typeURL] = version
	return info
}

// clients reports the streams of namespace: a caller sees only its own namespace's nodes.
func (t *syncTracker) clients(namespace string) []*statusv3.ClientConfig {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []*statusv3.ClientConfig
	for _, st := range t.streams {
		if st.namespace != namespace {
			continue
		}
		cc := &statusv3.ClientConfig{Node: st.node.node()}
		for _, typeURL := range slices.Sorted(maps.Keys(st.sent)) {
			state := statusv3.ConfigStatus_STALE
			switch {
			case st.nacked[typeURL] != "":
				state = statusv3.ConfigStatus_ERROR
			case st.acked[typeURL] == st.sent[typeURL].version:
				state = statusv3.ConfigStatus_SYNCED
			}
			cc.GenericXdsConfigs = append(cc.GenericXdsConfigs, &statusv3.ClientConfig_GenericXdsConfig{
				TypeUrl: typeURL, VersionInfo: st.acked[typeURL], ConfigStatus: state,
			})
		}
		out = append(out, cc)
	}
	slices.SortFunc(out, func(a, b *statusv3.ClientConfig) int {
		return strings.Compare(a.GetNode().GetId(), b.GetNode().GetId())
	})
	return out
}

func isDebugType(typeURL string) bool { return strings.HasPrefix(typeURL, debugPrefix) }

// debug answers one debug request, syncz or config_dump (check has refused the others), for the
// caller's namespace. At most maxDebugAnswers are built at once over every stream; a request
// waits for its turn as long as its stream lasts.
func (s *Server) debug(ctx context.Context, st *stream, req *discoveryv3.DiscoveryRequest) (*discoveryv3.DiscoveryResponse, error) {
	if err := s.debugSlots.Acquire(ctx, 1); err != nil {
		return nil, status.FromContextError(err).Err()
	}
	defer s.debugSlots.Release(1)
	ns := st.caller.Identity.Namespace
	resp := &discoveryv3.DiscoveryResponse{TypeUrl: req.GetTypeUrl(), Nonce: strconv.FormatUint(s.debugNonce.Add(1), 10)}
	switch req.GetTypeUrl() {
	case DebugSyncz:
		resources, err := synczAnswer(s.sync.clients(ns))
		if err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		resp.Resources = resources
	case DebugConfigDump:
		s.mu.Lock()
		set, version := s.current.For(ns)
		s.mu.Unlock()
		a, err := renderedConfigDump(set, version)
		if err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		resp.Resources = []*anypb.Any{a}
	default:
		return nil, status.Errorf(codes.InvalidArgument, "unknown debug type %q: want %s or %s",
			logkey.Untrusted(req.GetTypeUrl()), DebugSyncz, DebugConfigDump)
	}
	return resp, nil
}

// synczAnswer renders the nodes of a syncz answer, in their order, as long as the answer stays
// within maxSynczNodes and MaxAnswerSize; when it cuts, a last ClientConfig says how many nodes
// were left out.
func synczAnswer(clients []*statusv3.ClientConfig) ([]*anypb.Any, error) {
	var out []*anypb.Any
	size := 0
	for i, cc := range clients {
		var a *anypb.Any
		if i < maxSynczNodes {
			var err error
			if a, err = rendered(cc); err != nil {
				return nil, err
			}
		}
		// The margin holds the last resource, of a few dozen bytes.
		if a == nil || size+resourceSize(a) > MaxAnswerSize-answerMargin {
			left, err := rendered(leftOut(len(clients) - i))
			if err != nil {
				return nil, err
			}
			return append(out, left), nil
		}
		size += resourceSize(a)
		out = append(out, a)
	}
	return out, nil
}

// LeftOutNodeID is the id of the last node of a syncz answer that was cut; its metadata field
// LeftOutMetadataKey holds how many nodes were left out.
const (
	LeftOutNodeID      = "meshid.io/nodes-left-out"
	LeftOutMetadataKey = "nodes_left_out"
)

func leftOut(n int) *statusv3.ClientConfig {
	return &statusv3.ClientConfig{Node: &corev3.Node{Id: LeftOutNodeID, Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
		LeftOutMetadataKey: structpb.NewNumberValue(float64(n)),
	}}}}
}

// resourceSize is what a resource adds to a DiscoveryResponse: its tag, its length and the Any.
func resourceSize(a *anypb.Any) int {
	return protowire.SizeTag(1) + protowire.SizeBytes(proto.Size(a))
}

// renderedConfigDump is the config_dump answer's one resource for a set.
func renderedConfigDump(set map[resource.Type][]types.Resource, version string) (*anypb.Any, error) {
	dump, err := configDump(set, version)
	if err != nil {
		return nil, err
	}
	return rendered(dump)
}

// rendered is m as JSON in a google.protobuf.Value: debug answers are for people, and the agent
// that shows them (the slim one links neither Envoy's admin types nor the extensions a
// configuration names) knows that type whatever it links. This binary links them all.
func rendered(m proto.Message) (*anypb.Any, error) {
	data, err := protojson.Marshal(m)
	if err != nil {
		return nil, err
	}
	v := &structpb.Value{}
	if err := protojson.Unmarshal(data, v); err != nil {
		return nil, err
	}
	return anypb.New(v)
}

// configDump is the namespace's snapshot as Envoy's admin config dump shows it.
func configDump(set map[resource.Type][]types.Resource, version string) (*adminv3.ConfigDump, error) {
	anyOf := func(r types.Resource) (*anypb.Any, error) { return anypb.New(r) }
	clusters := &adminv3.ClustersConfigDump{VersionInfo: version}
	for _, r := range set[resource.ClusterType] {
		a, err := anyOf(r)
		if err != nil {
			return nil, err
		}
		clusters.DynamicActiveClusters = append(clusters.DynamicActiveClusters, &adminv3.ClustersConfigDump_DynamicCluster{VersionInfo: version, Cluster: a})
	}
	listeners := &adminv3.ListenersConfigDump{VersionInfo: version}
	for _, r := range set[resource.ListenerType] {
		a, err := anyOf(r)
		if err != nil {
			return nil, err
		}
		listeners.DynamicListeners = append(listeners.DynamicListeners, &adminv3.ListenersConfigDump_DynamicListener{
			Name: resourceName(r), ActiveState: &adminv3.ListenersConfigDump_DynamicListenerState{VersionInfo: version, Listener: a},
		})
	}
	routes := &adminv3.RoutesConfigDump{}
	for _, r := range set[resource.RouteType] {
		a, err := anyOf(r)
		if err != nil {
			return nil, err
		}
		routes.DynamicRouteConfigs = append(routes.DynamicRouteConfigs, &adminv3.RoutesConfigDump_DynamicRouteConfig{VersionInfo: version, RouteConfig: a})
	}
	endpoints := &adminv3.EndpointsConfigDump{}
	for _, r := range set[resource.EndpointType] {
		a, err := anyOf(r)
		if err != nil {
			return nil, err
		}
		endpoints.DynamicEndpointConfigs = append(endpoints.DynamicEndpointConfigs, &adminv3.EndpointsConfigDump_DynamicEndpointConfig{VersionInfo: version, EndpointConfig: a})
	}
	dump := &adminv3.ConfigDump{}
	for _, part := range []proto.Message{listeners, clusters, routes, endpoints} {
		a, err := anypb.New(part)
		if err != nil {
			return nil, fmt.Errorf("config dump: %w", err)
		}
		dump.Configs = append(dump.Configs, a)
	}
	return dump, nil
}
