// Package sds serves Envoy's Secret Discovery Service on a Unix socket: StreamSecrets, DeltaSecrets
// and FetchSecrets, on the generated gRPC stubs and go-control-plane's types. It knows nothing of
// how certificates are obtained: it asks the secret manager and pushes what changes.
//
// It does not use go-control-plane's server: that server's cache and resource packages link every
// Envoy configuration type into the sidecar (memory and start-up paid in every pod), and it runs
// two goroutines per stream where one will do (BENCHMARKS.md, issue 15).
package sds

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	secretservice "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/secretmanager"
)

// Defaults of the SDS server.
const (
	SocketName        = "socket"
	DefaultSocketMode = 0o660
)

// ErrSocketInUse reports a socket path that another server already answers on.
var ErrSocketInUse = fsutil.ErrSocketInUse

// SocketCheckInterval is how often the server looks whether its socket path still leads to it,
// and, when another server took it, whether that one is gone.
const SocketCheckInterval = 2 * time.Second

// Config configures a Server.
type Config struct {
	// SocketPath is where Envoy connects: <workload socket dir>/socket.
	SocketPath string
	SocketMode os.FileMode
	Secrets    Secrets
	// DrainDuration is how long open streams may go on after the server is told to stop.
	DrainDuration time.Duration
	// MaxStreams bounds the streams and FetchSecrets calls open at once, over every connection,
	// and the connections (default DefaultMaxStreams); past it a stream is refused with
	// ResourceExhausted and a connection closed. MaxStreamsPerConnection bounds one connection's
	// streams (default DefaultMaxStreamsPerConnection), as HTTP/2 does: the client is told.
	MaxStreams              int
	MaxStreamsPerConnection int

	Clock clock.Clock
	// SocketClock paces the look at the socket path (every SocketCheckInterval); nil: the real
	// clock. It is not Clock: the look runs for the server's life, unlike the timers of a
	// stream or a drain.
	SocketClock clock.Clock
	Logger      *slog.Logger
	Registerer  prometheus.Registerer // optional
	// OnSocket, when set, is told after the fact when the socket path stops leading to the
	// server (why) and when it leads there again (nil).
	OnSocket func(error)

	// Resolve, when set, turns the name a caller asks for into the key of the secret it gets
	// (a node agent: each caller's own "default"), for every stream request and fetch; ctx is
	// the call's. Secrets is subscribed to by key, and the secret it gives keeps the name Envoy
	// asked for. Two names never resolve to one key. An error refuses the stream or fetch with
	// PermissionDenied. Nil: the key is the name (one workload).
	Resolve func(ctx context.Context, requested string) (key string, err error)
	// Credentials, when set, wraps the transport credentials of the socket's connections (which
	// admit and name them), to learn more of each caller at the handshake: a node agent's
	// attestation, which Resolve then reads from the call's peer.
	Credentials func(credentials.TransportCredentials) credentials.TransportCredentials
	// StreamInterceptor, when set, wraps every stream on the socket (SDS's and the services'
	// registered): a node agent's, to end the streams whose caller's identity changed.
	StreamInterceptor grpc.StreamServerInterceptor
}

// resolve returns the key of the secret that the caller of ctx gets for name.
func (s *Server) resolve(ctx context.Context, name string) (string, error) {
	if s.cfg.Resolve == nil {
		return name, nil
	}
	key, err := s.cfg.Resolve(ctx, name)
	if err != nil {
		return "", fmt.Errorf("caller not given secret %q: %w", name, err)
	}
	return key, nil
}

// unidentified is the refusal r of a caller Resolve gave no key for name.
func (s *Server) unidentified(r refusal, name string, err error) error {
	r.names, r.reason = []string{name}, reasonUnidentified
	r.err = status.Error(codes.PermissionDenied, err.Error())
	r.logged = errors.Is(err, admission.ErrLogged) // by the attestor, with the caller's process
	return s.refuse(r)
}

// Server is the SDS server.
type Server struct {
	cfg   Config
	log   *slog.Logger
	clock clock.Clock
	// socketClock paces the look at the socket path.
	socketClock clock.Clock
	cache       *secretCache
	socket      *fsutil.Socket
	metrics     *metrics
	logs        *admission.LogLimiter

	nextStream atomic.Int64 // numbers the streams, for the logs

	// pushes counts the goroutines sending a change to a stream (watcher.push); Run returns
	// after the last has ended.
	pushes sync.WaitGroup

	// gate counts the streams and calls, and the connections, admitted and not ended.
	gate *admission.Gate

	// services are the other services registered to share the socket (RegisterService); mu
	// guards them and started, set once Run has registered them.
	mu       sync.Mutex
	services []registeredService
	started  bool
}

// registeredService is another service registered on the server, its handlers wrapped by admitted.
type registeredService struct {
	desc *grpc.ServiceDesc
	impl any
}

// New prepares the socket directory, removes a stale socket, and listens (see
// fsutil.ListenSocket). It starts no goroutines; call Run.
func New(cfg Config) (*Server, error) {
	if cfg.Secrets == nil {
		return nil, errors.New("SDS server needs secrets to serve")
	}
	if err := fsutil.CheckSocketPath(cfg.SocketPath); err != nil {
		return nil, err
	}
	if cfg.SocketMode == 0 {
		cfg.SocketMode = DefaultSocketMode
	}
	if cfg.MaxStreams < 0 || cfg.MaxStreamsPerConnection < 0 {
		return nil, fmt.Errorf("SDS stream limits must be positive, not %d and %d per connection", cfg.MaxStreams, cfg.MaxStreamsPerConnection)
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
	socket, err := fsutil.ListenSocket(cfg.SocketPath, cfg.SocketMode, log)
	if err != nil {
		return nil, err
	}
	s := &Server{
		cfg:         cfg,
		log:         log,
		clock:       clock.OrReal(cfg.Clock),
		socketClock: clock.OrReal(cfg.SocketClock),
		socket:      socket,
		metrics:     newMetrics(),
		gate:        gate,
	}
	s.logs = admission.NewLogLimiter(s.clock)
	s.cache = newSecretCache(cfg.Secrets, s.clock, log)
	if cfg.Registerer != nil {
		if err := s.metrics.register(cfg.Registerer); err != nil {
			socket.Close()
			return nil, err
		}
	}
	return s, nil
}

// Run serves until ctx ends; then it stops accepting, lets open streams go on for the drain
// duration, and ends them. Meanwhile it looks every SocketCheckInterval whether the socket path
// still leads to it: another server that takes the path gets every new connection (see
// SocketProblem). It returns once every goroutine it started has ended: the serving ones, the
// stream handlers, and the pushes.
func (s *Server) Run(ctx context.Context) error {
	// Last: once the handlers have returned no stream is watched, so no push starts any more.
	defer s.pushes.Wait()
	defer s.cache.close()
	defer s.socket.Remove()
	grpcServer := grpc.NewServer(s.grpcOptions()...)
	secretservice.RegisterSecretDiscoveryServiceServer(grpcServer, service{s: s})
	s.mu.Lock()
	s.started = true
	for _, svc := range s.services {
		grpcServer.RegisterService(svc.desc, svc.impl)
	}
	s.mu.Unlock()

	s.log.Info("SDS serving", logkey.Socket, s.cfg.SocketPath)
	wait, err := s.socket.Serve(ctx, grpcServer.Serve, fsutil.Guarding{
		Clock: s.socketClock, Interval: SocketCheckInterval, Taken: s.metrics.socketTaken.Inc, Report: s.cfg.OnSocket})
	if err != nil {
		grpcServer.Stop() // returns once the handlers have (grpc.WaitForHandlers)
		_ = wait()
		return fmt.Errorf("serve SDS: %w", err)
	}
	s.drain(grpcServer)
	if err := wait(); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("serve SDS: %w", err)
	}
	s.log.Info("SDS stopped")
	return nil
}

// SocketProblem says why the socket path no longer leads to this server (it was removed, or
// another server took it); nil while it does.
func (s *Server) SocketProblem() error { return s.socket.Problem() }

func (s *Server) drain(grpcServer *grpc.Server) {
	stopped := make(chan struct{})
	go func() {
		grpcServer.GracefulStop() // stops accepting at once; returns when the streams end
		close(stopped)
	}()
	if s.cfg.DrainDuration > 0 {
		s.log.Info("SDS draining: no new connections; open streams end when Envoy closes them or the drain ends",
			logkey.Duration, s.cfg.DrainDuration, logkey.Streams, s.openStreams())
		timer := s.clock.NewTimer(s.cfg.DrainDuration)
		defer timer.Stop()
		select {
		case <-stopped:
			return
		case <-timer.C():
		}
	}
	grpcServer.Stop()
	<-stopped
}

// Close releases the socket of a server that will not Run.
func (s *Server) Close() {
	s.socket.Close()
}

// Subscriptions counts, for each secret name, the streams subscribed to it.
func (s *Server) Subscriptions() map[string]int {
	return s.cache.subscriptions()
}

// openStreams counts the streams and calls open.
func (s *Server) openStreams() int { return s.gate.Streams() }

// checkRequest refuses, before any subscription is made, a request without a node (on a
// stream, its first request must carry one) or for another type than secrets (an empty type is
// the stream's own). r says who asked.
func (s *Server) checkRequest(r refusal, typeURL string) error {
	if r.node == "" {
		r.reason = reasonMissingNode
		r.err = status.Error(codes.InvalidArgument, "the first request on a stream must carry a node with an id")
		return s.refuse(r)
	}
	if typeURL != "" && typeURL != SecretTypeURL {
		r.reason = reasonUnsupportedType
		r.err = status.Errorf(codes.InvalidArgument, "this server serves the type %s only, not %q", SecretTypeURL, logkey.Untrusted(typeURL))
		return s.refuse(r)
	}
	return nil
}

// Why requests are refused, as counted in meshid_sds_refusals_total.
const (
	reasonMissingNode     = "missing_node"
	reasonUnsupportedType = "unsupported_type"
	reasonUnknownName     = "unknown_name"
	reasonForbidden       = "forbidden_path"
	reasonTooMany         = "too_many_secrets"
	reasonStaleNonce      = "stale_nonce"
	reasonUnidentified    = "unidentified" // Resolve refused the caller
	reasonStopping        = "stopping"
	// Over the bounds of the server (boundary.go).
	reasonTooManyStreams     = "too_many_streams"
	reasonTooManyConnections = "too_many_connections"
	// codeDropped counts a request ignored while its stream goes on; codeClosed a connection
	// closed before it carried any stream.
	codeDropped = "dropped"
	codeClosed  = "closed"
)

func refusalReason(err error) string {
	switch {
	case errors.Is(err, secretmanager.ErrForbiddenPath):
		return reasonForbidden
	case errors.Is(err, secretmanager.ErrTooManyFiles):
		return reasonTooMany
	case errors.Is(err, secretmanager.ErrUnknownSecret):
		return reasonUnknownName
	default:
		return reasonStopping
	}
}

// refusal is a refused request: who asked (protocol, stream, node, peer), what, and why.
type refusal struct {
	protocol string // empty for a connection
	stream   int64  // 0 when the server's stream id is not known
	node     string
	peer     string
	names    []string
	reason   string
	// err is the status that ends the stream; nil when the request is dropped and the stream
	// goes on, or when the connection is closed (code says so).
	err  error
	code string
	// logged: the refusal was logged where it was decided (admission.ErrLogged); it is counted
	// here, not logged again.
	logged bool
}

// refuse counts a refused request and logs it, with who asked and why, unless too many of its
// reason came too fast (the next line logged says how many were left out: "dropped"). It returns
// the status that ends the stream (nil for a dropped request).
func (s *Server) refuse(r refusal) error {
	code := r.code
	switch {
	case r.err != nil:
		code = status.Code(r.err).String()
	case code == "":
		code = codeDropped
	}
	s.metrics.refusals.WithLabelValues(r.reason, code).Inc()
	if r.logged {
		return r.err
	}
	ok, dropped := s.logs.Allow(r.reason)
	if !ok {
		return r.err
	}
	msg := "SDS request refused"
	attrs := []any{logkey.Peer, r.peer, logkey.Reason, r.reason, logkey.Code, code}
	if r.protocol != "" {
		attrs = append(attrs, logkey.Node, logkey.Untrusted(r.node), logkey.Protocol, r.protocol)
	} else {
		msg = "SDS connection refused"
	}
	if r.stream != 0 {
		attrs = append(attrs, logkey.Stream, r.stream)
	}
	switch len(r.names) {
	case 0:
	case 1:
		attrs = append(attrs, logkey.Secret, logkey.Untrusted(r.names[0]))
	default:
		attrs = append(attrs, logkey.Secrets, logkey.UntrustedList(r.names))
	}
	if r.err != nil {
		attrs = append(attrs, logkey.Error, logkey.Untrusted(status.Convert(r.err).Message()))
	}
	if dropped > 0 {
		attrs = append(attrs, logkey.Dropped, dropped)
	}
	s.log.Warn(msg, attrs...)
	return r.err
}
