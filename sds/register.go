package sds

import (
	"context"

	"google.golang.org/grpc"
)

// The server is a grpc.ServiceRegistrar, so that another service a local client needs (the
// SPIFFE Workload API) is served on the same socket, behind the same bounds.
var _ grpc.ServiceRegistrar = (*Server)(nil)

// RegisterService registers another service on the SDS socket; call it before Run. Its
// connections are SDS's (counted, capped, their peer named) and each of its calls and streams is
// admitted as an SDS stream is, refused with ResourceExhausted past MaxStreams, counted and
// logged under too_many_streams with the method as its protocol. A registration after Run has
// begun is a programming error, as it is for grpc.Server, and panics.
func (s *Server) RegisterService(desc *grpc.ServiceDesc, impl any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started {
		panic("sds: RegisterService of " + desc.ServiceName + " after Run")
	}
	s.services = append(s.services, registeredService{desc: s.admitted(desc), impl: impl})
}

// admitted returns desc with each handler admitted through the server's gate and released when
// it returns.
func (s *Server) admitted(desc *grpc.ServiceDesc) *grpc.ServiceDesc {
	wrapped := *desc
	wrapped.Methods = make([]grpc.MethodDesc, len(desc.Methods))
	for i, m := range desc.Methods {
		protocol, handler := desc.ServiceName+"/"+m.MethodName, m.Handler
		m.Handler = func(srv any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
			if err := s.admit(ctx, protocol); err != nil {
				return nil, err
			}
			defer s.release()
			return handler(srv, ctx, dec, icpt)
		}
		wrapped.Methods[i] = m
	}
	wrapped.Streams = make([]grpc.StreamDesc, len(desc.Streams))
	for i, st := range desc.Streams {
		protocol, handler := desc.ServiceName+"/"+st.StreamName, st.Handler
		st.Handler = func(srv any, stream grpc.ServerStream) error {
			if err := s.admit(stream.Context(), protocol); err != nil {
				return err
			}
			defer s.release()
			return handler(srv, stream)
		}
		wrapped.Streams[i] = st
	}
	return &wrapped
}
