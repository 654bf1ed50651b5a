package sds

import (
	"fmt"
	"sync/atomic"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// A rotation sends one secret to thousands of streams, each response the same but for its
// nonce. Each secret's response is encoded once, without the nonce (its body), and every stream
// is sent that body followed by its own nonce field: protobuf's encoding of a message is its
// fields' encodings one after the other, and the nonce is the last field set (field 5 of both
// response types; only control_plane, which is never set, and delta's removed_resources, empty
// here, come after it), so body+nonce is exactly what proto.Marshal gives for the whole message
// (TestEncodedResponses). The body is shared, never copied nor written to; grpc frames it
// straight from it.

// nonceField is the nonce's field number in DiscoveryResponse and DeltaDiscoveryResponse.
const nonceField protowire.Number = 5

// encodedResponse is a response as the codec sends it: the shared body, then the nonce.
type encodedResponse struct {
	body  []byte
	nonce string
}

// codec is grpc's protobuf codec, which also sends an encodedResponse as it stands. The server
// uses it for every message of every service it serves.
type codec struct{ proto encoding.CodecV2 }

func newCodec() codec { return codec{proto: encoding.GetCodecV2(grpcproto.Name)} }

func (c codec) Name() string { return grpcproto.Name }

func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	r, ok := v.(*encodedResponse)
	if !ok {
		return c.proto.Marshal(v)
	}
	nonce := protowire.AppendTag(make([]byte, 0, 2+len(r.nonce)), nonceField, protowire.BytesType)
	nonce = protowire.AppendString(nonce, r.nonce)
	// SliceBuffers are not pooled: freeing them is a no-op, so the shared body stays whole.
	return mem.BufferSlice{mem.SliceBuffer(r.body), mem.SliceBuffer(nonce)}, nil
}

func (c codec) Unmarshal(data mem.BufferSlice, v any) error { return c.proto.Unmarshal(data, v) }

// bodies are a secret's response bodies, encoded once per version: SotW's whole, delta's for the
// name it was last sent under (a delta resource carries the name the stream asked for, which a
// Resolve may map to a key under another).
type bodies struct {
	sotw  []byte
	delta atomic.Pointer[namedBody]
}

type namedBody struct {
	name string
	body []byte
}

// encodeSotW encodes the body of a SotW response of one resource at version.
func encodeSotW(resource *anypb.Any, version string) ([]byte, error) {
	body, err := proto.Marshal(&discovery.DiscoveryResponse{VersionInfo: version, Resources: []*anypb.Any{resource}, TypeUrl: SecretTypeURL})
	if err != nil {
		return nil, fmt.Errorf("encode a response: %w", err)
	}
	return body, nil
}

// deltaBody returns the body of a delta response of one resource, sent as name: the one encoded
// last when the name is the same (the usual case: every stream asks for "default"). It returns
// nil when the response cannot be encoded; the caller sends it the ordinary way, which fails
// the same and says why.
func (b *bodies) deltaBody(name, version string, resource *anypb.Any) []byte {
	if nb := b.delta.Load(); nb != nil && nb.name == name {
		return nb.body
	}
	body, err := proto.Marshal(&discovery.DeltaDiscoveryResponse{SystemVersionInfo: version, TypeUrl: SecretTypeURL,
		Resources: []*discovery.Resource{{Name: name, Version: version, Resource: resource}}})
	if err != nil {
		return nil
	}
	b.delta.Store(&namedBody{name: name, body: body})
	return body
}
