package sds

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
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
	// maxHeaderListSize bounds a stream's headers (gRPC's default is 16 MiB); Envoy's are a
	// few hundred bytes.
	maxHeaderListSize = 64 << 10
	// keepaliveMinTime is the shortest interval between a client's pings before the server
	// sends it away; Envoy's HTTP/2 keepalive, when configured, pings far less often.
	keepaliveMinTime = 5 * time.Second
)

// grpcOptions are the server's transport bounds and its admission of connections and streams.
func (s *Server) grpcOptions() []grpc.ServerOption {
	perConnection := uint32(math.MaxUint32)
	if n := s.cfg.MaxStreamsPerConnection; n >= 0 && uint64(n) < math.MaxUint32 { // New refuses a negative one
		perConnection = uint32(n)
	}
	return []grpc.ServerOption{
		grpc.Creds(&peerCredentials{admit: s.admitConnection}),
		grpc.MaxRecvMsgSize(maxRequestSize),
		grpc.MaxHeaderListSize(maxHeaderListSize),
		// Enforced by the transport: the client is told, and gRPC clients and Envoy (nghttp2)
		// hold further streams back until one ends; what a client sends anyway is reset
		// (REFUSED_STREAM) before any handler runs.
		grpc.MaxConcurrentStreams(perConnection),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: keepaliveMinTime, PermitWithoutStream: true}),
	}
}

// admit lets a stream or a fetch in while fewer than MaxStreams streams and calls are open; the
// handler calls release when it ends. It is called by the handlers rather than an interceptor: a
// wrapper's frame under every blocked Recv cost each stream 4 kB of stack (BenchmarkStreams). A
// request over MaxRecvMsgSize is refused by the transport (ResourceExhausted) without a count, as
// a stream past the per-connection limit is.
func (s *Server) admit(ctx context.Context, protocol string) error {
	s.mu.Lock()
	ok := s.calls < s.cfg.MaxStreams
	if ok {
		s.calls++
	}
	s.mu.Unlock()
	if ok {
		return nil
	}
	return s.refuse(refusal{protocol: protocol, peer: peerOf(ctx), reason: reasonTooManyStreams,
		err: status.Errorf(codes.ResourceExhausted, "the SDS server has %d streams open, its limit", s.cfg.MaxStreams)})
}

func (s *Server) release() {
	s.mu.Lock()
	s.calls--
	s.mu.Unlock()
}

// admitConnection counts a new connection in, up to MaxStreams: one that carries no stream
// serves nothing, and each holds buffers. It returns the function that counts it out.
func (s *Server) admitConnection(who string) (closed func(), err error) {
	s.mu.Lock()
	ok := s.conns < s.cfg.MaxStreams
	if ok {
		s.conns++
	}
	s.mu.Unlock()
	if !ok {
		_ = s.refuse(refusal{peer: who, reason: reasonTooManyConnections, code: codeClosed})
		return nil, errTooManyConnections
	}
	return sync.OnceFunc(func() {
		s.mu.Lock()
		s.conns--
		s.mu.Unlock()
	}), nil
}

var errTooManyConnections = errors.New("too many SDS connections open")

// peerCredentials secures nothing (the socket's mode says who may connect): it tells each
// connection's peer, so that a refusal says who asked, and admits connections.
type peerCredentials struct {
	admit func(who string) (closed func(), err error)
	next  atomic.Int64
}

// peerInfo is what the server knows of a connection's peer: its number and, on Linux, the
// process at the other end.
type peerInfo struct {
	credentials.CommonAuthInfo
	who string
}

func (peerInfo) AuthType() string { return "unix-peer" }

// peerOf says who is at the other end of a stream's connection.
func peerOf(ctx context.Context) string {
	if p, ok := peer.FromContext(ctx); ok {
		if info, ok := p.AuthInfo.(peerInfo); ok {
			return info.who
		}
	}
	return ""
}

func (c *peerCredentials) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	who := fmt.Sprintf("conn=%d", c.next.Add(1))
	if process := peerProcess(conn); process != "" {
		who += " " + process
	}
	closed, err := c.admit(who)
	if err != nil {
		return nil, nil, err
	}
	return &countedConn{Conn: conn, closed: closed}, peerInfo{CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity}, who: who}, nil
}

func (c *peerCredentials) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("the SDS server's credentials are for serving")
}

func (c *peerCredentials) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "unix-peer"}
}

func (c *peerCredentials) Clone() credentials.TransportCredentials {
	return &peerCredentials{admit: c.admit}
}

func (c *peerCredentials) OverrideServerName(string) error { return nil }

// countedConn counts its connection out when gRPC closes it.
type countedConn struct {
	net.Conn
	closed func()
}

func (c *countedConn) Close() error {
	c.closed()
	return c.Conn.Close()
}
