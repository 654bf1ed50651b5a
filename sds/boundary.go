package sds

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/admission"
)

// Bounds of what clients on the socket can make the server hold. Envoy opens one SDS stream per
// secret name it uses (default, ROOTCA, each file-cert: and file-root:), on one connection: a
// sidecar a handful, a gateway one more per file-mounted certificate. A stream costs about 17 kB
// (BenchmarkStreams: 10,000 took 171 MB).
const (
	DefaultMaxStreams              = 1000
	DefaultMaxStreamsPerConnection = 100

	// maxRequestSize bounds one request: an SDS request is a node and a few names.
	maxRequestSize = 1 << 20
)

// grpcOptions are the server's transport bounds and its admission of connections. Stop
// waits for the handlers, as GracefulStop does: Run returns after the last (grpc's Stop alone
// returns while they may still run).
func (s *Server) grpcOptions() []grpc.ServerOption {
	refused := func(who string, _ error) {
		_ = s.refuse(refusal{peer: who, reason: reasonTooManyConnections, code: codeClosed})
	}
	opts := admission.LocalServerOptions(s.gate, s.cfg.MaxStreamsPerConnection, maxRequestSize, refused)
	if wrap := s.cfg.Credentials; wrap != nil {
		// The last grpc.Creds wins: the same admission, wrapped.
		opts = append(opts, grpc.Creds(wrap(admission.UnixPeerCredentials(s.gate, refused))))
	}
	if s.cfg.StreamInterceptor != nil {
		opts = append(opts, grpc.ChainStreamInterceptor(s.cfg.StreamInterceptor))
	}
	// The codec sends a rotation's responses from the body encoded once (encoded.go).
	return append(opts, grpc.WaitForHandlers(true), grpc.ForceServerCodecV2(newCodec()))
}

// admit lets a stream or a fetch in while fewer than MaxStreams streams and calls are open; the
// handler calls release when it ends. It is called by the handlers rather than an interceptor: a
// wrapper's frame under every blocked Recv cost each stream 4 kB of stack (BenchmarkStreams).
func (s *Server) admit(ctx context.Context, protocol string) error {
	if err := s.gate.Admit(""); err != nil {
		return s.refuse(refusal{protocol: protocol, peer: admission.Peer(ctx), reason: reasonTooManyStreams,
			err: status.Errorf(codes.ResourceExhausted, "the SDS server has %d streams open, its limit", s.cfg.MaxStreams)})
	}
	return nil
}

func (s *Server) release() { s.gate.Release("") }
