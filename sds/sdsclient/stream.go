package sdsclient

import (
	"fmt"
	"maps"
	"slices"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	secretservice "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"
)

// Response is one response as Envoy reads it.
type Response struct {
	Version string // version_info (SotW) or system_version_info (delta)
	Nonce   string
	Secrets map[string]*tlsv3.Secret
	// Versions are the per-resource versions (delta only).
	Versions map[string]string
}

// Names returns the names of the secrets received, sorted.
func (r Response) Names() []string { return slices.Sorted(maps.Keys(r.Secrets)) }

// requests is what both kinds of stream keep of what they sent: the node goes on the first
// request only.
type requests struct {
	node *core.Node
	sent bool
}

// stamp fills in the type of a request about to go out, unless it has one, and notes that a
// request went out.
func (r *requests) stamp(typeURL *string) {
	if *typeURL == "" {
		*typeURL = TypeURL
	}
	r.sent = true
}

// firstNode is the node when no request went out yet, else nil.
func (r *requests) firstNode() *core.Node {
	if r.sent {
		return nil
	}
	return r.node
}

// Stream is a StreamSecrets (state of the world) stream. Its methods are not for concurrent use,
// except that one goroutine may send while another receives, as with any gRPC stream.
type Stream struct {
	requests
	// Raw is the generated stream, for what this type does not do.
	Raw secretservice.SecretDiscoveryService_StreamSecretsClient
}

// Send sends req as it is, filling in the type when it has none.
func (s *Stream) Send(req *discovery.DiscoveryRequest) error {
	s.stamp(&req.TypeUrl)
	return s.Raw.Send(req)
}

// Subscribe asks for names (replacing what the stream asked for before), with the node when it
// is the stream's first request.
func (s *Stream) Subscribe(names ...string) error {
	return s.Send(&discovery.DiscoveryRequest{Node: s.firstNode(), ResourceNames: names})
}

// Ack accepts r and (re)states the names, without the node, as Envoy does.
func (s *Stream) Ack(r Response, names ...string) error {
	return s.Send(&discovery.DiscoveryRequest{VersionInfo: r.Version, ResponseNonce: r.Nonce, ResourceNames: names})
}

// Nack rejects r, naming the last version accepted and why.
func (s *Stream) Nack(r Response, accepted, detail string, names ...string) error {
	return s.Send(&discovery.DiscoveryRequest{
		VersionInfo: accepted, ResponseNonce: r.Nonce, ResourceNames: names,
		ErrorDetail: &rpcstatus.Status{Code: int32(codes.InvalidArgument), Message: detail},
	})
}

// Recv returns the next response and its secrets. A response Envoy would reject (another type,
// no nonce, a resource that is not a secret) is an error that wraps ErrProtocol; the stream's
// end is gRPC's error.
func (s *Stream) Recv() (Response, error) {
	resp, err := s.Raw.Recv()
	if err != nil {
		return Response{}, err
	}
	secrets, err := parseResponse(resp.GetTypeUrl(), resp.GetNonce(), nil, resp.GetResources())
	if err != nil {
		return Response{}, err
	}
	return Response{Version: resp.GetVersionInfo(), Nonce: resp.GetNonce(), Secrets: secrets}, nil
}

// RecvAll receives responses, acknowledging each, until every name has come; it returns the last
// response (not acknowledged) and the latest secret of each name.
func (s *Stream) RecvAll(names ...string) (last Response, got map[string]*tlsv3.Secret, err error) {
	got = map[string]*tlsv3.Secret{}
	for {
		if last, err = s.Recv(); err != nil {
			return last, got, err
		}
		maps.Copy(got, last.Secrets)
		if hasAll(got, names) {
			return last, got, nil
		}
		if err := s.Ack(last, names...); err != nil {
			return last, got, err
		}
	}
}

// Collect is RecvAll that acknowledges the last response too.
func (s *Stream) Collect(names ...string) (map[string]*tlsv3.Secret, error) {
	last, got, err := s.RecvAll(names...)
	if err != nil {
		return nil, err
	}
	return got, s.Ack(last, names...)
}

// Follow hands each response to fn and then acknowledges it, restating names, until the stream
// ends or fn returns an error; it returns what ended it. Subscribe first.
func (s *Stream) Follow(names []string, fn func(Response) error) error {
	for {
		r, err := s.Recv()
		if err != nil {
			return err
		}
		if err := fn(r); err != nil {
			return err
		}
		if err := s.Ack(r, names...); err != nil {
			return err
		}
	}
}

// CloseSend ends the client's side of the stream, as Envoy does when it lets a stream go.
func (s *Stream) CloseSend() error { return s.Raw.CloseSend() }

// RecvErr waits for the stream to end and returns its status; a response instead is an error.
func (s *Stream) RecvErr() (*status.Status, error) {
	resp, err := s.Raw.Recv()
	return ended(err, len(resp.GetResources()))
}

// ended is the status of a stream's end, or an error when a response of n resources came.
func ended(err error, n int) (*status.Status, error) {
	if err == nil {
		return nil, fmt.Errorf("got a response (%d resources), want the stream to end", n)
	}
	return status.Convert(err), nil
}

// DeltaStream is a DeltaSecrets stream, used as Stream is.
type DeltaStream struct {
	requests
	// Raw is the generated stream, for what this type does not do.
	Raw secretservice.SecretDiscoveryService_DeltaSecretsClient
}

// Send sends req as it is, filling in the type when it has none.
func (d *DeltaStream) Send(req *discovery.DeltaDiscoveryRequest) error {
	d.stamp(&req.TypeUrl)
	return d.Raw.Send(req)
}

// Subscribe adds names to the subscription, with the node when it is the stream's first request.
func (d *DeltaStream) Subscribe(names ...string) error {
	return d.Send(&discovery.DeltaDiscoveryRequest{Node: d.firstNode(), ResourceNamesSubscribe: names})
}

// Ack accepts r, without the node.
func (d *DeltaStream) Ack(r Response) error {
	return d.Send(&discovery.DeltaDiscoveryRequest{ResponseNonce: r.Nonce})
}

// Nack rejects r with a reason, without the node.
func (d *DeltaStream) Nack(r Response, detail string) error {
	return d.Send(&discovery.DeltaDiscoveryRequest{ResponseNonce: r.Nonce, ErrorDetail: status.New(codes.InvalidArgument, detail).Proto()})
}

// Update changes the subscription, answering r (Envoy sends the latest nonce with it).
func (d *DeltaStream) Update(r Response, subscribe, unsubscribe []string) error {
	return d.Send(&discovery.DeltaDiscoveryRequest{ResponseNonce: r.Nonce, ResourceNamesSubscribe: subscribe, ResourceNamesUnsubscribe: unsubscribe})
}

// CloseSend ends the client's side of the stream.
func (d *DeltaStream) CloseSend() error { return d.Raw.CloseSend() }

// Recv returns the next response, its secrets and their versions. A response Envoy would reject
// (another type, no nonce, a resource without a name or version, or whose secret has another
// name) is an error that wraps ErrProtocol.
func (d *DeltaStream) Recv() (Response, error) {
	resp, err := d.Raw.Recv()
	if err != nil {
		return Response{}, err
	}
	secrets, err := parseResponse(resp.GetTypeUrl(), resp.GetNonce(), resp.GetResources(), nil)
	if err != nil {
		return Response{}, err
	}
	r := Response{Version: resp.GetSystemVersionInfo(), Nonce: resp.GetNonce(), Secrets: secrets, Versions: map[string]string{}}
	for _, res := range resp.GetResources() {
		if res.GetName() == "" || res.GetVersion() == "" {
			return Response{}, protocolErrorf("delta resource without a name or version: %v", res)
		}
		if r.Secrets[res.GetName()] == nil {
			return Response{}, protocolErrorf("delta resource %q holds a secret of another name", res.GetName())
		}
		r.Versions[res.GetName()] = res.GetVersion()
	}
	return r, nil
}

// RecvAll receives responses, acknowledging each, until every name has come; the last one is not
// acknowledged. It returns the latest version and secret of each name.
func (d *DeltaStream) RecvAll(names ...string) (last Response, versions map[string]string, got map[string]*tlsv3.Secret, err error) {
	versions, got = map[string]string{}, map[string]*tlsv3.Secret{}
	for {
		if last, err = d.Recv(); err != nil {
			return last, versions, got, err
		}
		maps.Copy(got, last.Secrets)
		maps.Copy(versions, last.Versions)
		if hasAll(got, names) {
			return last, versions, got, nil
		}
		if err := d.Ack(last); err != nil {
			return last, versions, got, err
		}
	}
}

// RecvErr waits for the stream to end and returns its status; a response instead is an error.
func (d *DeltaStream) RecvErr() (*status.Status, error) {
	resp, err := d.Raw.Recv()
	return ended(err, len(resp.GetResources()))
}

// parseResponse checks a response's type and nonce, then reads its secrets.
func parseResponse(typeURL, nonce string, resources []*discovery.Resource, anys []*anypb.Any) (map[string]*tlsv3.Secret, error) {
	if typeURL != TypeURL {
		return nil, protocolErrorf("response of type %s", typeURL)
	}
	if nonce == "" {
		return nil, protocolErrorf("response without a nonce")
	}
	return Parse(resources, anys)
}

// Parse reads the secrets of a response: delta resources, or SotW ones (anys). A resource of
// another type, one that does not decode, or a secret twice in one response is an error that
// wraps ErrProtocol.
func Parse(resources []*discovery.Resource, anys []*anypb.Any) (map[string]*tlsv3.Secret, error) {
	out := make(map[string]*tlsv3.Secret, len(resources)+len(anys))
	all := slices.Clip(anys) // appending must not write into the caller's array
	for _, r := range resources {
		all = append(all, r.GetResource())
	}
	for _, a := range all {
		if a.GetTypeUrl() != TypeURL {
			return nil, protocolErrorf("resource of type %s", a.GetTypeUrl())
		}
		s := &tlsv3.Secret{}
		if err := a.UnmarshalTo(s); err != nil {
			return nil, protocolErrorf("an unreadable secret: %w", err)
		}
		if _, dup := out[s.GetName()]; dup {
			return nil, protocolErrorf("secret %s twice in one response", s.GetName())
		}
		out[s.GetName()] = s
	}
	return out, nil
}
