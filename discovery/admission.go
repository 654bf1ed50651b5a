package discovery

import (
	"context"
	"errors"
	"io"
	"slices"
	"sync"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/logkey"
)

// Bounds of what one client can make the discovery server hold. None is reached by a real
// sidecar or gateway.
const (
	// DefaultMaxStreams bounds the streams open at once over every client: one per proxy (and
	// one per agent's debug endpoint) connected to this replica. An idle stream costs the CA
	// about 38 kB and 2 goroutines (BenchmarkIdleXDSStreams), so the cap bounds them at about
	// 400 MB. A mesh with more proxies runs several CA replicas, as it would several istiods.
	DefaultMaxStreams = 10000
	// DefaultMaxStreamsPerCredential bounds the streams of one credential: Envoy opens one ADS
	// stream per connection to its control plane, and pilot-agent and meshid's agent one more
	// for their debug endpoint; a hundred leaves room for restarts whose old streams have not
	// ended yet.
	DefaultMaxStreamsPerCredential = 100
	// MaxNodeSize bounds the node a request carries: Envoy's is a few kB (its metadata, the
	// extensions it was built with), pilot-agent's a few kB more.
	MaxNodeSize = 512 << 10
	// MaxAnswerSize is the largest message the server sends: a configuration file whose answer
	// for one type would pass it, less answerMargin, is refused, and syncz answers are cut to it.
	MaxAnswerSize = 4 << 20
	// answerMargin is left under MaxAnswerSize for what an answer holds besides its resources
	// (version, type URL, nonce).
	answerMargin = 64 << 10
	// maxSynczNodes bounds the nodes one syncz answer lists.
	maxSynczNodes = 1000
	// maxDebugAnswers bounds the debug answers built at once, over every stream: each can be as
	// large as MaxAnswerSize while it is built.
	maxDebugAnswers = 4
)

// Refusal reasons, the reason label of meshid_discovery_refusals_total.
const (
	reasonUnknownType         = "unknown_type"
	reasonIstioAgentType      = "istio_agent_type"
	reasonNodeTooLarge        = "node_too_large"
	reasonTooManyStreams      = "too_many_streams"
	reasonTooManyByCredential = "too_many_streams_per_credential"
)

const (
	protocolSotW  = "sotw"
	protocolDelta = "delta"
	// codeDropped counts a request ignored while its stream goes on.
	codeDropped = "dropped"
)

// envoyTypes are the types go-control-plane's cache knows: those the server answers from its
// snapshots.
func envoyTypes() []resource.Type {
	var out []resource.Type
	for t := types.ResponseType(0); t < types.UnknownType; t++ {
		if typeURL, err := cache.GetResponseTypeURL(t); err == nil {
			out = append(out, typeURL)
		}
	}
	return out
}

func isEnvoyType(typeURL string) bool { return cache.GetResponseType(typeURL) != types.UnknownType }

// istioAgentTypes are what Istio's agent asks istiod for on Envoy's own stream, besides Envoy's
// types: its DNS proxy's name table (ISTIO_META_DNS_CAPTURE), its health reports of a
// WorkloadEntry, its dynamic proxy configuration. They are not served here, and dropped rather
// than refused, so that the Envoy stream pilot-agent sends them on goes on, as it did when every
// type was accepted and these were never answered.
func istioAgentTypes() []string {
	return []string{
		"type.googleapis.com/istio.networking.nds.v1.NameTable",
		"type.googleapis.com/istio.v1.HealthInformation",
		"type.googleapis.com/istio.mesh.v1alpha1.ProxyConfig",
	}
}

// errDropped is check's answer for a request dropped while its stream goes on.
var errDropped = errors.New("request dropped")

// stream is an admitted stream: who opened it, which it was authorized as. It does not change.
type stream struct {
	caller Caller
	peer   string
	// ctx is the stream's own context, its credential in it: the caller is authorized again
	// with it at each request.
	ctx context.Context
}

// streamKey carries a stream's *stream in its context, from admittedADS to the callbacks.
type streamKey struct{}

// admittedADS admits each stream (authorizes its caller, counts it against the caps), checks
// each request before go-control-plane's server sees it, and answers istio.io/debug requests on
// state-of-the-world streams itself.
type admittedADS struct {
	discoveryv3.UnimplementedAggregatedDiscoveryServiceServer
	s *Server
}

func (a admittedADS) StreamAggregatedResources(grpcStream discoveryv3.AggregatedDiscoveryService_StreamAggregatedResourcesServer) error {
	st, err := a.s.admit(grpcStream.Context())
	if err != nil {
		return err
	}
	defer a.s.gate.Release(st.caller.Credential)
	d := &sotwStream{AggregatedDiscoveryService_StreamAggregatedResourcesServer: grpcStream, s: a.s, st: st,
		ctx: context.WithValue(grpcStream.Context(), streamKey{}, st)}
	err = a.s.xds.StreamAggregatedResources(d)
	// go-control-plane takes any receive error for the client's end of the stream: the reason
	// a request ended it is returned here instead.
	if d.err != nil {
		return d.err
	}
	return err
}

func (a admittedADS) DeltaAggregatedResources(grpcStream discoveryv3.AggregatedDiscoveryService_DeltaAggregatedResourcesServer) error {
	st, err := a.s.admit(grpcStream.Context())
	if err != nil {
		return err
	}
	defer a.s.gate.Release(st.caller.Credential)
	d := &deltaStream{AggregatedDiscoveryService_DeltaAggregatedResourcesServer: grpcStream, s: a.s, st: st,
		ctx: context.WithValue(grpcStream.Context(), streamKey{}, st)}
	err = a.s.xds.DeltaAggregatedResources(d)
	if d.err != nil {
		return d.err
	}
	return err
}

// admit authorizes a new stream's caller and counts the stream in, overall and under its
// credential. The caller releases it with gate.Release(caller.Credential).
func (s *Server) admit(ctx context.Context) (*stream, error) {
	caller, err := s.authorize(ctx)
	if err != nil {
		return nil, err
	}
	st := &stream{caller: caller, peer: peerOf(ctx), ctx: ctx}
	if err := s.gate.Admit(caller.Credential); err != nil {
		reason := reasonTooManyStreams
		if errors.Is(err, admission.ErrTooManyForKey) {
			reason = reasonTooManyByCredential
		}
		return nil, s.refuse(st, reason, "", status.Errorf(codes.ResourceExhausted, "discovery: %v", err))
	}
	return st, nil
}

// authorize asks the authorizer about the caller of ctx; its refusal is a status.
func (s *Server) authorize(ctx context.Context) (Caller, error) {
	caller, err := s.cfg.Authorizer.Authorize(ctx)
	if err != nil {
		return Caller{}, asStatus(err)
	}
	return caller, nil
}

// asStatus is an authorizer's refusal as a status: Unauthenticated when it is not one already.
func asStatus(err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Error(codes.Unauthenticated, err.Error())
}

// check refuses a request the server does not serve: a node over MaxNodeSize, or a type it does
// not answer (debug types only on SotW streams). The error ends the stream, but errDropped: the
// request of one of Istio's agent's own types is dropped, counted, and the stream goes on. The caller is
// authorized again later, on the stream's own goroutine (onRequest), or before a debug answer.
func (s *Server) check(st *stream, protocol, typeURL string, node *corev3.Node) error {
	// Only a node the client sent: go-control-plane fills in the first one itself, and that one
	// is measured once.
	if node != nil {
		if size := proto.Size(node); size > MaxNodeSize {
			return s.refuse(st, reasonNodeTooLarge, typeURL,
				status.Errorf(codes.InvalidArgument, "the node is %d bytes, over the limit of %d", size, MaxNodeSize))
		}
	}
	switch {
	case isEnvoyType(typeURL):
	case slices.Contains(istioAgentTypes(), typeURL):
		_ = s.refuse(st, reasonIstioAgentType, typeURL, nil) // counted and logged; the stream goes on
		return errDropped
	case protocol == protocolSotW && (typeURL == DebugSyncz || typeURL == DebugConfigDump):
	case protocol == protocolSotW && isDebugType(typeURL):
		return s.refuse(st, reasonUnknownType, typeURL, status.Errorf(codes.InvalidArgument, "unknown debug type %q: want %s or %s",
			logkey.Untrusted(typeURL), DebugSyncz, DebugConfigDump))
	case isDebugType(typeURL):
		return s.refuse(st, reasonUnknownType, typeURL, status.Errorf(codes.InvalidArgument,
			"%q: debug types are answered on state-of-the-world streams only", logkey.Untrusted(typeURL)))
	default:
		return s.refuse(st, reasonUnknownType, typeURL, status.Errorf(codes.InvalidArgument,
			"type %q is not served: want an Envoy xDS type, %s or %s", logkey.Untrusted(typeURL), DebugSyncz, DebugConfigDump))
	}
	return nil
}

// refuse counts a refusal and logs it, each reason at most admission's burst at once then once
// a second, and returns err, a status; nil for a request dropped while its stream goes on
// (counted with the code "dropped").
func (s *Server) refuse(st *stream, reason, typeURL string, err error) error {
	code := codeDropped
	if err != nil {
		code = status.Code(err).String()
	}
	s.refusals.WithLabelValues(reason, code).Inc()
	logged, dropped := s.logs.Allow(reason)
	if !logged {
		return err
	}
	attrs := []any{logkey.Reason, reason, logkey.Code, code, logkey.Peer, st.peer, logkey.Identity, st.caller.Identity.String()}
	if err != nil {
		attrs = append(attrs, logkey.Error, status.Convert(err).Message())
	}
	if typeURL != "" {
		attrs = append(attrs, logkey.TypeURL, logkey.Untrusted(typeURL))
	}
	if dropped > 0 {
		attrs = append(attrs, logkey.Dropped, dropped)
	}
	s.log.Warn("discovery request refused", attrs...)
	return err
}

// peerOf names a stream's peer: its process on a Unix socket, else its address.
func peerOf(ctx context.Context) string {
	if who := admission.Peer(ctx); who != "" {
		return who
	}
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		return p.Addr.String()
	}
	return ""
}

// sotwStream checks each request of a state-of-the-world stream, and answers the debug ones;
// its sends are serialised with the server's, which come from another goroutine.
type sotwStream struct {
	discoveryv3.AggregatedDiscoveryService_StreamAggregatedResourcesServer
	s   *Server
	st  *stream
	ctx context.Context // the stream's, carrying st
	mu  sync.Mutex
	err error // why a request ended the stream; read once the server has returned
}

func (d *sotwStream) Context() context.Context { return d.ctx }

func (d *sotwStream) Send(resp *discoveryv3.DiscoveryResponse) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.AggregatedDiscoveryService_StreamAggregatedResourcesServer.Send(resp)
}

func (d *sotwStream) Recv() (*discoveryv3.DiscoveryRequest, error) {
	for {
		req, err := d.AggregatedDiscoveryService_StreamAggregatedResourcesServer.Recv()
		if err != nil {
			return nil, err
		}
		if err := d.s.check(d.st, protocolSotW, req.GetTypeUrl(), req.GetNode()); errors.Is(err, errDropped) {
			continue
		} else if err != nil {
			d.err = err
			return nil, io.EOF
		}
		if !isDebugType(req.GetTypeUrl()) {
			return req, nil
		}
		// Authorized here, as go-control-plane's callbacks never see a debug request.
		if _, err := d.s.authorize(d.ctx); err != nil {
			d.err = err
			return nil, io.EOF
		}
		resp, err := d.s.debug(d.ctx, d.st, req)
		if err != nil {
			d.err = err
			return nil, io.EOF
		}
		if err := d.Send(resp); err != nil {
			return nil, err
		}
	}
}

// deltaStream checks each request of a delta stream.
type deltaStream struct {
	discoveryv3.AggregatedDiscoveryService_DeltaAggregatedResourcesServer
	s   *Server
	st  *stream
	ctx context.Context // the stream's, carrying st
	err error           // why a request ended the stream; read once the server has returned
}

func (d *deltaStream) Context() context.Context { return d.ctx }

func (d *deltaStream) Recv() (*discoveryv3.DeltaDiscoveryRequest, error) {
	for {
		req, err := d.AggregatedDiscoveryService_DeltaAggregatedResourcesServer.Recv()
		if err != nil {
			return nil, err
		}
		if err := d.s.check(d.st, protocolDelta, req.GetTypeUrl(), req.GetNode()); errors.Is(err, errDropped) {
			continue
		} else if err != nil {
			d.err = err
			return nil, io.EOF
		}
		return req, nil
	}
}
