// Package xdsproxy proxies Envoy's ADS streams to the upstream discovery server: Envoy connects on
// a Unix socket, and each of its streams (state of the world or delta) gets a stream of its own
// upstream, over which requests and responses pass unchanged. A pass-through owns no nonces, so it
// is served with the generated ADS stubs, not go-control-plane's server. It also answers
// istio.io/debug requests over HTTP on a stream of its own (DebugHandler).
package xdsproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/logkey"
)

// Defaults of the proxy.
const (
	DefaultSocketMode   = 0o660
	DefaultDebugTimeout = 5 * time.Second
	// DebugTypePrefix prefixes the type of a debug request: GET /debug/syncz asks for
	// istio.io/debug/syncz.
	DebugTypePrefix = "istio.io/debug/"
)

// SocketCheckInterval is how often the proxy looks whether its socket path still leads to it,
// and, when another server took it, whether that one is gone.
const SocketCheckInterval = 2 * time.Second

// ErrSocketInUse reports a socket path that another server already answers on.
var ErrSocketInUse = fsutil.ErrSocketInUse

// Config configures a Proxy.
type Config struct {
	// Socket is the Unix socket Envoy dials.
	Socket string
	// SocketMode is the socket file's mode (default DefaultSocketMode, as the SDS socket's).
	SocketMode os.FileMode
	// Upstream is the discovery server, dialed (TLS, credentials) by the caller. The proxy never
	// closes it.
	Upstream grpc.ClientConnInterface
	// CallOptions go with each upstream stream (per-RPC credentials, say).
	CallOptions []grpc.CallOption
	// Node is the proxy's own node, sent with debug requests.
	Node *corev3.Node
	// DebugTimeout bounds the wait for the answer to a debug request (default
	// DefaultDebugTimeout).
	DebugTimeout time.Duration
	// MaxStreams bounds Envoy's streams open at once, over every connection, and the
	// connections (default DefaultMaxStreams); past it a stream is refused with
	// ResourceExhausted and a connection closed. MaxStreamsPerConnection bounds one
	// connection's streams (default DefaultMaxStreamsPerConnection), as HTTP/2 does: the client
	// is told.
	MaxStreams              int
	MaxStreamsPerConnection int

	Clock clock.Clock
	// SocketClock paces the look at the socket path (every SocketCheckInterval); nil: the real
	// clock. It is not Clock: the look runs for the proxy's life, unlike its other timers.
	SocketClock clock.Clock
	Logger      *slog.Logger
	Registerer  prometheus.Registerer // optional
	// OnSocket, when set, is told after the fact when the socket path stops leading to the proxy
	// (why) and when it leads there again (nil).
	OnSocket func(error)
}

// Proxy is the ADS proxy.
type Proxy struct {
	cfg   Config
	log   *slog.Logger
	clock clock.Clock
	// socketClock paces the look at the socket path.
	socketClock clock.Clock
	upstream    discovery.AggregatedDiscoveryServiceClient
	metrics     *metrics
	socket      *fsutil.Socket
	gate        *admission.Gate
	logs        *admission.LogLimiter

	// wg counts the goroutines Run must wait for besides the gRPC server's own: each Envoy
	// stream's request forwarder, the debug loop and its stream's reader.
	wg sync.WaitGroup
	// stopping is set once Run's context has ended, for the log of the streams it ends.
	stopping atomic.Bool
	// config is what the proxy saw of Envoy's configuration, for the agent's readiness.
	config configState

	// debugAsks hands debug requests to Run's debug loop; debugStopped is closed when it ends.
	debugAsks    chan debugAsk
	debugStopped chan struct{}
}

// New checks cfg, fills in its defaults and listens on the socket (see fsutil.ListenSocket). It
// starts no goroutines; call Run, or Close if Run will not be called.
func New(cfg Config) (*Proxy, error) {
	if cfg.Socket == "" {
		return nil, errors.New("the xDS proxy needs a socket path")
	}
	if err := fsutil.CheckSocketPath(cfg.Socket); err != nil {
		return nil, err
	}
	if cfg.Upstream == nil {
		return nil, errors.New("the xDS proxy needs an upstream connection")
	}
	if cfg.DebugTimeout < 0 {
		return nil, fmt.Errorf("the debug timeout must be positive, not %v", cfg.DebugTimeout)
	}
	if cfg.DebugTimeout == 0 {
		cfg.DebugTimeout = DefaultDebugTimeout
	}
	if cfg.SocketMode == 0 {
		cfg.SocketMode = DefaultSocketMode
	}
	if cfg.MaxStreams < 0 || cfg.MaxStreamsPerConnection < 0 {
		return nil, fmt.Errorf("xDS proxy stream limits must be positive, not %d and %d per connection", cfg.MaxStreams, cfg.MaxStreamsPerConnection)
	}
	if cfg.MaxStreams == 0 {
		cfg.MaxStreams = DefaultMaxStreams
	}
	if cfg.MaxStreamsPerConnection == 0 {
		cfg.MaxStreamsPerConnection = DefaultMaxStreamsPerConnection
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	gate, err := admission.NewGate(admission.Limits{Streams: cfg.MaxStreams, Connections: cfg.MaxStreams})
	if err != nil {
		return nil, err
	}
	clk := clock.OrReal(cfg.Clock)
	p := &Proxy{
		cfg:          cfg,
		log:          log,
		clock:        clk,
		socketClock:  clock.OrReal(cfg.SocketClock),
		upstream:     discovery.NewAggregatedDiscoveryServiceClient(cfg.Upstream),
		metrics:      newMetrics(),
		gate:         gate,
		logs:         admission.NewLogLimiter(clk),
		debugAsks:    make(chan debugAsk),
		debugStopped: make(chan struct{}),
	}
	if cfg.Registerer != nil {
		if err := p.metrics.register(cfg.Registerer); err != nil {
			return nil, fmt.Errorf("register the xDS proxy's metrics: %w", err)
		}
	}
	if p.socket, err = fsutil.ListenSocket(cfg.Socket, cfg.SocketMode, log); err != nil {
		return nil, err
	}
	return p, nil
}

// Close releases the socket of a proxy that will not Run.
func (p *Proxy) Close() { p.socket.Close() }

// Run serves until ctx ends; then it ends every stream, Envoy's and its own, and returns once
// all its goroutines have stopped. Meanwhile it looks every SocketCheckInterval whether the
// socket path still leads to it (see SocketProblem). A Proxy runs once.
func (p *Proxy) Run(ctx context.Context) error {
	defer p.socket.Remove()
	debugCtx, stopDebug := context.WithCancel(ctx)
	defer stopDebug()
	p.wg.Go(func() { p.debugLoop(debugCtx) })

	// WaitForHandlers: Stop returns only once every stream handler has, so that none outlives Run.
	grpcServer := grpc.NewServer(append(p.grpcOptions(), grpc.WaitForHandlers(true))...)
	discovery.RegisterAggregatedDiscoveryServiceServer(grpcServer, adsServer{p: p})
	p.log.Info("xDS proxy serving", logkey.Socket, p.cfg.Socket)
	wait, serveErr := p.socket.Serve(ctx, grpcServer.Serve, fsutil.Guarding{
		Clock: p.socketClock, Interval: SocketCheckInterval, Taken: p.metrics.socketTaken.Inc, Report: p.cfg.OnSocket})
	// Envoy's streams never end by themselves, so there is nothing to drain: Stop cancels them,
	// which cancels their upstream streams.
	p.stopping.Store(true)
	grpcServer.Stop()
	if err := wait(); serveErr == nil {
		serveErr = err
	}
	stopDebug()
	p.wg.Wait()
	if serveErr != nil && !errors.Is(serveErr, grpc.ErrServerStopped) {
		return fmt.Errorf("serve the xDS proxy: %w", serveErr)
	}
	p.log.Info("xDS proxy stopped")
	return nil
}

// SocketProblem says why the socket path no longer leads to the proxy (it was removed, or another
// server took it); nil while it does.
func (p *Proxy) SocketProblem() error { return p.socket.Problem() }

// ConfigProblem says why Envoy has no configuration through the proxy: the upstream serves no ADS
// (ErrUpstreamNoADS), or Envoy has not acknowledged clusters and listeners yet. Nil once it has,
// for good: Envoy keeps its configuration when a stream ends. Before any Envoy stream, nil unless
// expectEnvoy (the agent runs Envoy, so one will come).
func (p *Proxy) ConfigProblem(expectEnvoy bool) error { return p.config.problem(expectEnvoy) }

// adsServer serves Envoy's ADS streams, each by a stream of its own upstream.
type adsServer struct {
	discovery.UnimplementedAggregatedDiscoveryServiceServer
	p *Proxy
}

func (s adsServer) StreamAggregatedResources(down grpc.BidiStreamingServer[discovery.DiscoveryRequest, discovery.DiscoveryResponse]) error {
	if err := s.p.admit(down.Context(), protocolSotW); err != nil {
		return err
	}
	defer s.p.gate.Release("")
	return pipe(s.p, protocolSotW, down,
		func(ctx context.Context) (grpc.BidiStreamingClient[discovery.DiscoveryRequest, discovery.DiscoveryResponse], error) {
			return s.p.upstream.StreamAggregatedResources(ctx, s.p.cfg.CallOptions...)
		},
		func(r *discovery.DiscoveryRequest) requestInfo {
			return requestInfo{node: r.GetNode().GetId(), typeURL: r.GetTypeUrl(), nonce: r.GetResponseNonce(), nack: r.GetErrorDetail() != nil}
		})
}

func (s adsServer) DeltaAggregatedResources(down grpc.BidiStreamingServer[discovery.DeltaDiscoveryRequest, discovery.DeltaDiscoveryResponse]) error {
	if err := s.p.admit(down.Context(), protocolDelta); err != nil {
		return err
	}
	defer s.p.gate.Release("")
	return pipe(s.p, protocolDelta, down,
		func(ctx context.Context) (grpc.BidiStreamingClient[discovery.DeltaDiscoveryRequest, discovery.DeltaDiscoveryResponse], error) {
			return s.p.upstream.DeltaAggregatedResources(ctx, s.p.cfg.CallOptions...)
		},
		func(r *discovery.DeltaDiscoveryRequest) requestInfo {
			return requestInfo{node: r.GetNode().GetId(), typeURL: r.GetTypeUrl(), nonce: r.GetResponseNonce(), nack: r.GetErrorDetail() != nil}
		})
}

// requestInfo is what the proxy reads of Envoy's request: its node and type for the log, and
// whether it acknowledges a response (a nonce and no error) or refuses one.
type requestInfo struct {
	node, typeURL, nonce string
	nack                 bool
}

// pipe proxies one Envoy stream (down) through a stream of its own upstream, opened by open, until
// either end ends it. describe reads a request (requestInfo).
//
// Concurrency: one goroutine per direction, each holding at most the one message it is passing
// on. Unlike istio's handleStream, which queues Envoy's requests in a channel, nothing here
// buffers: a slow reader at either end stops its writer's goroutine in Send, and gRPC's flow
// control pushes back on the other end, so memory stays bounded per stream.
func pipe[Req, Resp any](p *Proxy, protocol string, down grpc.BidiStreamingServer[Req, Resp],
	open func(context.Context) (grpc.BidiStreamingClient[Req, Resp], error), describe func(*Req) requestInfo,
) error {
	p.metrics.streams.Inc()
	p.metrics.streamsTotal.Inc()
	defer p.metrics.streams.Dec()
	p.config.streamOpened()
	info := &streamInfo{protocol: protocol, peer: admission.Peer(down.Context())}

	// The upstream stream lives within Envoy's: when Envoy goes, it is cancelled.
	ctx, cancel := context.WithCancel(down.Context())
	defer cancel()
	up, err := open(ctx)
	if err != nil {
		return p.upstreamFailed(info, err)
	}

	// Requests, down to up. This goroutine may be blocked in down.Recv when the handler returns;
	// gRPC then ends the stream and Recv returns. Run waits for it.
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			req, err := down.Recv()
			if errors.Is(err, io.EOF) {
				// Envoy is done sending; the responses still flow until the upstream ends.
				_ = up.CloseSend()
				return
			}
			if err != nil {
				cancel()
				return
			}
			ri := describe(req)
			info.note(ri.node, ri.typeURL)
			if ri.nonce != "" {
				p.config.answered(ri.typeURL, !ri.nack)
			}
			// Counted as taken from Envoy, before it is passed on, so that the count never
			// lags behind what the other end has seen.
			p.metrics.messages.WithLabelValues(directionRequest).Inc()
			if err := up.Send(req); err != nil {
				// The upstream stream has ended; up.Recv, in the handler, says why.
				return
			}
		}
	}()

	// Responses, up to down.
	for {
		resp, err := up.Recv()
		switch {
		case err == nil:
		case ctx.Err() != nil:
			// Envoy went away, or the proxy is stopping, and the upstream stream with it.
			reason := "Envoy closed the stream"
			if p.stopping.Load() {
				reason = "the proxy is stopping"
			}
			p.streamEnded(info, slog.LevelInfo, reason)
			return status.FromContextError(ctx.Err()).Err()
		case errors.Is(err, io.EOF):
			// The upstream ended the stream with OK: so does Envoy's, and Envoy reconnects.
			p.streamEnded(info, slog.LevelInfo, "the upstream closed the stream")
			return nil
		default:
			return p.upstreamFailed(info, err)
		}
		p.config.upstreamServes()
		p.metrics.messages.WithLabelValues(directionResponse).Inc()
		if err := down.Send(resp); err != nil {
			p.streamEnded(info, slog.LevelInfo, "Envoy closed the stream")
			return err
		}
	}
}

// upstreamFailed counts and logs an upstream error, and returns the status that ends Envoy's
// stream: the upstream's own code and message, so that Envoy reconnects, or sees the refusal.
func (p *Proxy) upstreamFailed(info *streamInfo, err error) error {
	st := status.Convert(err)
	if st.Code() == codes.Unimplemented {
		p.config.upstreamRefuses(st.Message())
	}
	p.metrics.upstreamErrors.WithLabelValues(st.Code().String()).Inc()
	p.streamEnded(info, slog.LevelWarn, "upstream error", logkey.Code, st.Code().String(), logkey.Error, st.Message())
	return st.Err()
}

// streamEnded logs the end of an Envoy stream, once, unless too many streams ended for the same
// reason too fast (a client can open and end streams as fast as it likes): the next line of that
// reason then says how many were left out.
func (p *Proxy) streamEnded(info *streamInfo, level slog.Level, reason string, attrs ...any) {
	ok, dropped := p.logs.Allow("end: " + reason)
	if !ok {
		return
	}
	node, types := info.get()
	attrs = append([]any{logkey.Protocol, info.protocol, logkey.Node, logkey.Untrusted(node), logkey.Peer, info.peer,
		logkey.Types, logkey.UntrustedList(types), logkey.Reason, reason}, attrs...)
	if dropped > 0 {
		attrs = append(attrs, logkey.Dropped, dropped)
	}
	p.log.Log(context.Background(), level, "xDS proxy stream ended", attrs...)
}

// maxLoggedTypes bounds the types remembered per stream for its log line.
const maxLoggedTypes = 16

// streamInfo is what the log says of a stream: its node, and the types it asked for. The request
// goroutine writes it, the handler reads it.
type streamInfo struct {
	protocol string
	peer     string
	mu       sync.Mutex
	node     string
	types    []string
}

func (i *streamInfo) note(node, typeURL string) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.node == "" {
		i.node = node
	}
	if typeURL != "" && len(i.types) < maxLoggedTypes && !slices.Contains(i.types, typeURL) {
		i.types = append(i.types, typeURL)
	}
}

func (i *streamInfo) get() (string, []string) {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.node, slices.Clone(i.types)
}
