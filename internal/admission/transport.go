package admission

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/peer"

	"github.com/meshid/meshid/internal/fsutil"
)

// Transport are the bounds gRPC's transport enforces itself: what passes them is refused before
// any handler runs (and so is not counted by the server).
type Transport struct {
	// MaxStreamsPerConnection is told to the client (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS):
	// gRPC clients and Envoy hold further streams back until one ends; a stream sent anyway is
	// reset. Zero: no limit.
	MaxStreamsPerConnection int
	// MaxRecvMsgSize bounds one message from a client (ResourceExhausted past it).
	MaxRecvMsgSize int
	// MaxSendMsgSize bounds one message to a client; zero: gRPC's default (no limit).
	MaxSendMsgSize int
	// MaxHeaderListSize bounds a stream's headers (gRPC's default is 16 MiB).
	MaxHeaderListSize uint32
	// KeepaliveMinTime is the shortest interval between a client's pings before the server
	// sends it away.
	KeepaliveMinTime time.Duration
	// MaxConnectionAge ends a connection after this long (then MaxConnectionAgeGrace for the
	// streams on it), so that a client reconnects and shows its credential again. Zero: never.
	MaxConnectionAge, MaxConnectionAgeGrace time.Duration
}

// ServerOptions are t as gRPC server options.
func (t Transport) ServerOptions() []grpc.ServerOption {
	perConnection := uint32(math.MaxUint32)
	if n := t.MaxStreamsPerConnection; n > 0 && uint64(n) < math.MaxUint32 {
		perConnection = uint32(n)
	}
	opts := []grpc.ServerOption{
		grpc.MaxConcurrentStreams(perConnection),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: t.KeepaliveMinTime, PermitWithoutStream: true}),
	}
	if t.MaxRecvMsgSize > 0 {
		opts = append(opts, grpc.MaxRecvMsgSize(t.MaxRecvMsgSize))
	}
	if t.MaxSendMsgSize > 0 {
		opts = append(opts, grpc.MaxSendMsgSize(t.MaxSendMsgSize))
	}
	if t.MaxHeaderListSize > 0 {
		opts = append(opts, grpc.MaxHeaderListSize(t.MaxHeaderListSize))
	}
	if t.MaxConnectionAge > 0 {
		opts = append(opts, grpc.KeepaliveParams(keepalive.ServerParameters{
			MaxConnectionAge:      t.MaxConnectionAge,
			MaxConnectionAgeGrace: t.MaxConnectionAgeGrace,
		}))
	}
	return opts
}

// Bounds of a server that Envoy, or another local client, reaches on a Unix socket.
const (
	// localHeaderListSize bounds a stream's headers (gRPC's default is 16 MiB); Envoy's are a
	// few hundred bytes.
	localHeaderListSize = 64 << 10
	// localKeepaliveMinTime is the shortest interval between a client's pings before the
	// server sends it away; Envoy's HTTP/2 keepalive, when configured, pings far less often.
	localKeepaliveMinTime = 5 * time.Second
)

// LocalServerOptions are the options of a gRPC server on a Unix socket that local clients (Envoy)
// reach: at most maxStreamsPerConnection streams a connection and maxRecvMsgSize bytes a request,
// Envoy-sized headers, a keepalive floor, and each connection admitted through gate and named by
// its peer, refused told who was turned away. The transport enforces these before any handler
// runs, so only the refused connections are for the server to count.
func LocalServerOptions(gate *Gate, maxStreamsPerConnection, maxRecvMsgSize int, refused func(who string, err error)) []grpc.ServerOption {
	return append(Transport{
		MaxStreamsPerConnection: maxStreamsPerConnection,
		MaxRecvMsgSize:          maxRecvMsgSize,
		MaxHeaderListSize:       localHeaderListSize,
		KeepaliveMinTime:        localKeepaliveMinTime,
	}.ServerOptions(), grpc.Creds(UnixPeerCredentials(gate, refused)))
}

// UnixPeerCredentials are transport credentials for a Unix socket server. They secure nothing
// (the socket's mode says who may connect): they name each connection's peer, as the kernel saw
// it connect, so that a refusal says who asked (Peer), and admit connections through gate,
// telling refused who was turned away.
func UnixPeerCredentials(gate *Gate, refused func(who string, err error)) credentials.TransportCredentials {
	return &unixPeerCredentials{gate: gate, refused: refused, next: &atomic.Int64{}}
}

type unixPeerCredentials struct {
	gate    *Gate
	refused func(who string, err error)
	next    *atomic.Int64
}

// peerInfo is what a server knows of a connection's peer: its number and, on Linux, the process
// at the other end.
type peerInfo struct {
	credentials.CommonAuthInfo
	who string
}

func (peerInfo) AuthType() string { return "unix-peer" }

// Peer says who is at the other end of a stream's or an HTTP request's connection: "conn=N
// pid=P uid=U" for a gRPC connection made through UnixPeerCredentials (or credentials wrapping
// them, whose AuthInfo has an Unwrap() credentials.AuthInfo method), "pid=P uid=U" or the
// remote address for an HTTP connection of a server with ConnContext, "" otherwise.
func Peer(ctx context.Context) string {
	if p, ok := peer.FromContext(ctx); ok {
		for info := p.AuthInfo; info != nil; {
			if pi, ok := info.(peerInfo); ok {
				return pi.who
			}
			w, ok := info.(interface{ Unwrap() credentials.AuthInfo })
			if !ok {
				break
			}
			info = w.Unwrap()
		}
	}
	if who, ok := ctx.Value(httpPeerKey{}).(string); ok {
		return who
	}
	return ""
}

type httpPeerKey struct{}

// ConnContext is an http.Server's ConnContext that names each connection's peer for Peer: the
// process at the other end of a Unix connection, the address of another.
func ConnContext(ctx context.Context, conn net.Conn) context.Context {
	who := fsutil.PeerProcess(conn)
	if who == "" {
		who = "addr=" + conn.RemoteAddr().String()
	}
	return context.WithValue(ctx, httpPeerKey{}, who)
}

func (c *unixPeerCredentials) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	who := fmt.Sprintf("conn=%d", c.next.Add(1))
	if process := fsutil.PeerProcess(conn); process != "" {
		who += " " + process
	}
	closed, err := c.gate.AdmitConnection()
	if err != nil {
		if c.refused != nil {
			c.refused(who, err)
		}
		return nil, nil, err
	}
	return &countedConn{Conn: conn, closed: closed}, peerInfo{CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity}, who: who}, nil
}

func (c *unixPeerCredentials) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("these credentials are for serving")
}

func (c *unixPeerCredentials) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "unix-peer"}
}

// Clone shares the connection numbering, so that a clone never repeats a number.
func (c *unixPeerCredentials) Clone() credentials.TransportCredentials {
	clone := *c
	return &clone
}

func (c *unixPeerCredentials) OverrideServerName(string) error { return nil }

// countedConn counts its connection out when gRPC closes it.
type countedConn struct {
	net.Conn
	closed func()
}

func (c *countedConn) Close() error {
	c.closed()
	return c.Conn.Close()
}
