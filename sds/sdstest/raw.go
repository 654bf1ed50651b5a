package sdstest

import (
	"fmt"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

// RawMessage is a response as it came on the wire, for clients that compare bytes rather than
// decode: a rotation's benchmark must not measure its own parsing.
type RawMessage []byte

// RawCodec (grpc.ForceCodecV2) encodes requests with protobuf and keeps responses as bytes.
type RawCodec struct{}

func (RawCodec) Name() string { return "proto" }

func (RawCodec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("cannot encode %T", v)
	}
	data, err := proto.Marshal(m)
	if err != nil {
		return nil, err
	}
	return mem.BufferSlice{mem.SliceBuffer(data)}, nil
}

func (RawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	raw, ok := v.(*RawMessage)
	if !ok {
		return fmt.Errorf("cannot decode into %T", v)
	}
	*raw = data.Materialize() // a copy: data is freed on return
	return nil
}
