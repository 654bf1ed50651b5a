// Package sds serves Envoy's Secret Discovery Service on a Unix socket: StreamSecrets, DeltaSecrets
// and FetchSecrets, on go-control-plane's server with a cache of its own. It knows nothing of how
// certificates are obtained: it asks the secret manager and pushes what changes.
package sds

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/meshid/meshid/internal/logkey"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	secretservice "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/sotw/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/prometheus/client_golang/prometheus"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/secretmanager"
)

// Defaults of the SDS server.
const (
	SocketName        = "socket"
	DefaultSocketMode = 0o660
)

// ErrSocketInUse reports a socket path that another server already answers on.
var ErrSocketInUse = errors.New("another server listens on the socket")

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

	Clock      clock.Clock
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

// Server is the SDS server.
type Server struct {
	cfg     Config
	log     *slog.Logger
	clock   clock.Clock
	cache   *secretCache
	lis     net.Listener
	metrics *metrics
	logs    *logLimiter

	mu sync.Mutex
	// streams holds what each open stream subscribes to: the one record of subscriptions. The
	// SotW and delta servers number their streams separately, so the protocol is part of the key.
	streams map[streamKey]*stream
	// calls and conns count the streams and calls, and the connections, admitted and not ended.
	calls, conns int
}

type streamKey struct {
	protocol string
	id       int64
}

// SocketServing reports whether something accepts connections on the Unix socket at path.
func SocketServing(path string) bool {
	conn, err := net.DialTimeout("unix", path, time.Second)
	if err != nil {
		return false
	}
	_ = conn.Close()
	return true
}

// New prepares the socket directory, removes a stale socket, and listens. It starts no
// goroutines; call Run.
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
	dir := filepath.Dir(cfg.SocketPath)
	if err := fsutil.EnsureDir(dir, 0o750); err != nil {
		return nil, err
	}
	// Served on all the same: Kubernetes makes an emptyDir, where Envoy's socket usually lives,
	// writable by everyone, and only the pod's containers can reach it.
	if err := fsutil.CheckSocketDir(dir); errors.Is(err, fsutil.ErrSharedDir) {
		log.Warn("the SDS socket directory is writable by every user: any of them could replace the socket",
			logkey.Dir, dir, logkey.Error, err.Error())
	} else if err != nil {
		return nil, err
	}
	if _, err := os.Lstat(cfg.SocketPath); err == nil {
		if SocketServing(cfg.SocketPath) {
			return nil, fmt.Errorf("%w: %s", ErrSocketInUse, cfg.SocketPath)
		}
		if err := os.Remove(cfg.SocketPath); err != nil {
			return nil, fmt.Errorf("remove the stale socket %s: %w", cfg.SocketPath, err)
		}
		log.Info("removed a stale SDS socket", logkey.Path, cfg.SocketPath)
	}
	lis, err := fsutil.ListenUnix(cfg.SocketPath, cfg.SocketMode)
	if err != nil {
		return nil, err
	}
	s := &Server{
		cfg:     cfg,
		log:     log,
		clock:   clock.OrReal(cfg.Clock),
		lis:     lis,
		metrics: newMetrics(),
		streams: map[streamKey]*stream{},
	}
	s.logs = newLogLimiter(s.clock)
	s.cache = newSecretCache(cfg.Secrets, s.clock, log)
	if cfg.Registerer != nil {
		if err := s.metrics.register(cfg.Registerer); err != nil {
			_ = lis.Close()
			return nil, err
		}
	}
	return s, nil
}

// Run serves until ctx ends; then it stops accepting, lets open streams go on for the drain
// duration, and ends them.
func (s *Server) Run(ctx context.Context) error {
	defer s.cache.close()
	// The streams outlive ctx by the drain duration; serveCtx ends them.
	serveCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()

	grpcServer := grpc.NewServer(s.grpcOptions()...)
	xds := serverv3.NewServer(serveCtx, s.cache, s.callbacks(), sotw.DeactivateLegacyWildcard(), sotw.WithLogger(xdsLogger{log: s.log, limit: s.logs}))
	secretservice.RegisterSecretDiscoveryServiceServer(grpcServer, staleNonceFilter{Server: xds, refuse: s.refuse})

	served := make(chan error, 1)
	go func() { served <- grpcServer.Serve(s.lis) }()
	s.log.Info("SDS serving", logkey.Socket, s.cfg.SocketPath)
	select {
	case err := <-served:
		return fmt.Errorf("serve SDS: %w", err)
	case <-ctx.Done():
	}
	s.drain(grpcServer)
	cancel()
	if err := <-served; err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("serve SDS: %w", err)
	}
	s.log.Info("SDS stopped")
	return nil
}

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
	_ = s.lis.Close()
}

// Subscriptions counts, for each secret name, the streams subscribed to it.
func (s *Server) Subscriptions() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	counts := map[string]int{}
	for _, st := range s.streams {
		for _, n := range st.names {
			counts[n]++
		}
	}
	return counts
}

func (s *Server) openStreams() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.streams)
}

// stream is what the server knows of one open stream: who is at the other end (its node, its
// connection's peer) and the names it subscribes to.
type stream struct {
	node  string
	peer  string
	names []string
	// nacked is the last response this stream rejected, logged once however often the NACK
	// comes.
	nacked nackKey
}

// nackKey names the response a NACK rejects: the version the client kept (SotW) and the nonce.
type nackKey struct{ version, nonce string }

func (s *Server) callbacks() serverv3.Callbacks {
	opened := func(protocol string) func(context.Context, int64, string) error {
		return func(ctx context.Context, id int64, _ string) error {
			s.metrics.streams.WithLabelValues(protocol).Inc()
			s.mu.Lock()
			s.streams[streamKey{protocol, id}] = &stream{peer: peerOf(ctx)}
			s.mu.Unlock()
			return nil
		}
	}
	closed := func(protocol string) func(int64, *core.Node) {
		return func(id int64, _ *core.Node) {
			s.metrics.streams.WithLabelValues(protocol).Dec()
			s.mu.Lock()
			delete(s.streams, streamKey{protocol, id})
			s.mu.Unlock()
		}
	}
	return serverv3.CallbackFuncs{
		StreamOpenFunc:        opened("sotw"),
		StreamClosedFunc:      closed("sotw"),
		DeltaStreamOpenFunc:   opened("delta"),
		DeltaStreamClosedFunc: closed("delta"),
		StreamRequestFunc: func(id int64, req *discovery.DiscoveryRequest) error {
			// The SotW server has already filled in the node of the stream's first request, and
			// the type of a request that names none.
			key := streamKey{"sotw", id}
			if err := s.onRequest(key, req.GetNode(), req.GetTypeUrl(), req.GetErrorDetail(), req.GetResourceNames(), nackKey{req.GetVersionInfo(), req.GetResponseNonce()}); err != nil {
				return err
			}
			s.setSubscription(key, req.GetResourceNames(), nil, true)
			return nil
		},
		StreamDeltaRequestFunc: func(id int64, req *discovery.DeltaDiscoveryRequest) error {
			// The delta server hands over a request without the node that only the stream's first
			// request carried (the stream remembers it), and before it fills in a missing type.
			key := streamKey{"delta", id}
			if err := s.onRequest(key, req.GetNode(), req.GetTypeUrl(), req.GetErrorDetail(), req.GetResourceNamesSubscribe(), nackKey{nonce: req.GetResponseNonce()}); err != nil {
				return err
			}
			s.setSubscription(key, req.GetResourceNamesSubscribe(), req.GetResourceNamesUnsubscribe(), false)
			return nil
		},
		FetchRequestFunc: func(ctx context.Context, req *discovery.DiscoveryRequest) error {
			return s.check(refusal{protocol: "fetch", node: req.GetNode().GetId(), peer: peerOf(ctx)}, req.GetTypeUrl(), req.GetResourceNames())
		},
		StreamResponseFunc: func(_ context.Context, _ int64, _ *discovery.DiscoveryRequest, resp *discovery.DiscoveryResponse) {
			s.metrics.pushes.Add(float64(len(resp.GetResources())))
		},
		StreamDeltaResponseFunc: func(_ int64, _ *discovery.DeltaDiscoveryRequest, resp *discovery.DeltaDiscoveryResponse) {
			s.metrics.pushes.Add(float64(len(resp.GetResources())))
		},
	}
}

// onRequest checks a stream's request, refusing it (and so ending the stream) when it lacks a
// node, asks for another type than secrets or names a secret that cannot be served, and logs a
// NACK once per response it rejects, with Envoy's reason; the cache then sends nothing until the
// secret changes (istio#21111).
func (s *Server) onRequest(key streamKey, node *core.Node, typeURL string, nack *rpcstatus.Status, names []string, rejected nackKey) error {
	s.mu.Lock()
	st := s.streams[key]
	if st != nil && st.node == "" {
		st.node = node.GetId()
	}
	nodeID, who := node.GetId(), ""
	if st != nil {
		if nodeID == "" {
			nodeID = st.node
		}
		who = st.peer
	}
	repeated := false
	if nack != nil && st != nil {
		repeated = st.nacked == rejected
		st.nacked = rejected
	}
	s.mu.Unlock()
	if err := s.check(refusal{protocol: key.protocol, stream: key.id, node: nodeID, peer: who}, typeURL, names); err != nil {
		return err
	}
	if nack == nil || repeated {
		return nil
	}
	s.metrics.nacks.Inc()
	// A client can NACK with new nonces (delta) or versions as fast as it likes.
	ok, dropped := s.logs.allow("nack")
	if !ok {
		return nil
	}
	attrs := []any{logkey.Node, logkey.Untrusted(nodeID), logkey.Peer, who, logkey.Stream, key.id,
		logkey.Secrets, logkey.UntrustedList(names), logkey.Version, logkey.Untrusted(rejected.version),
		logkey.ErrorDetail, logkey.Untrusted(nack.GetMessage())}
	if dropped > 0 {
		attrs = append(attrs, logkey.Dropped, dropped)
	}
	s.log.Warn("Envoy rejected secrets (NACK); not sending them again until they change", attrs...)
	return nil
}

// check refuses, before any watch is made, a request without a node, for another type than
// secrets (an empty type is the stream's own), or naming a secret that cannot be served. r says
// who asked.
func (s *Server) check(r refusal, typeURL string, names []string) error {
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
	// Subscribing now refuses at once what cannot be served; the watch made next subscribes again
	// (at no cost: the names are followed), so the pins taken here end here.
	var pinned []string
	defer func() { s.cache.unpin(pinned) }()
	for _, name := range names {
		if name == "*" {
			continue
		}
		if err := s.cache.subscribe(name); err != nil {
			r.names, r.reason, r.err = []string{name}, refusalReason(err), refusalStatus(name, err)
			return s.refuse(r)
		}
		pinned = append(pinned, name)
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
	ok, dropped := s.logs.allow(r.reason)
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

// setSubscription records the names a stream subscribes to: all of them (SotW), or those added
// and removed (delta).
func (s *Server) setSubscription(key streamKey, subscribe, unsubscribe []string, replace bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.streams[key]
	if st == nil {
		return
	}
	if replace {
		st.names = slices.Clone(subscribe)
		return
	}
	for _, n := range subscribe {
		if !slices.Contains(st.names, n) {
			st.names = append(st.names, n)
		}
	}
	st.names = slices.DeleteFunc(st.names, func(n string) bool { return slices.Contains(unsubscribe, n) })
}

// staleNonceFilter drops the SotW requests that answer an older response than the last one the
// stream was sent. The SotW server checks the nonce only while a response awaits its ACK: once
// acknowledged, it takes any nonce, and a late request carrying an older one would change the
// subscription. A stream's first request is taken whatever nonce it carries (an Envoy that
// reconnects to a restarted agent, spire#813).
type staleNonceFilter struct {
	serverv3.Server
	refuse func(refusal) error
}

func (f staleNonceFilter) StreamSecrets(stream secretservice.SecretDiscoveryService_StreamSecretsServer) error {
	return f.Server.StreamSecrets(&nonceCheckedStream{SecretDiscoveryService_StreamSecretsServer: stream, refuse: f.refuse})
}

// nonceCheckedStream remembers the last nonce sent. Send runs on the stream's goroutine and Recv
// on the server's reader goroutine, hence the mutex.
type nonceCheckedStream struct {
	secretservice.SecretDiscoveryService_StreamSecretsServer
	refuse    func(refusal) error
	node      string // of the first request, for the log
	mu        sync.Mutex
	lastNonce string
}

func (s *nonceCheckedStream) Send(resp *discovery.DiscoveryResponse) error {
	s.mu.Lock()
	s.lastNonce = resp.GetNonce()
	s.mu.Unlock()
	return s.SecretDiscoveryService_StreamSecretsServer.Send(resp)
}

func (s *nonceCheckedStream) Recv() (*discovery.DiscoveryRequest, error) {
	for {
		req, err := s.SecretDiscoveryService_StreamSecretsServer.Recv()
		if err != nil {
			return nil, err
		}
		if s.node == "" {
			s.node = req.GetNode().GetId()
		}
		s.mu.Lock()
		last := s.lastNonce
		s.mu.Unlock()
		if last == "" || req.GetResponseNonce() == last {
			return req, nil
		}
		// The stream's id is the server's; the nonces say which exchange this was.
		_ = s.refuse(refusal{protocol: "sotw", node: s.node, peer: peerOf(s.Context()), names: req.GetResourceNames(), reason: reasonStaleNonce})
	}
}

// xdsLogger puts go-control-plane's own messages in our logs. Its warnings and errors name what
// clients sent (a type URL, say), so they are bounded and limited like refusals.
type xdsLogger struct {
	log   *slog.Logger
	limit *logLimiter
}

func (l xdsLogger) Debugf(format string, args ...any) {
	l.log.Debug("go-control-plane", logkey.Detail, logkey.Untrusted(fmt.Sprintf(format, args...)))
}

// Infof is debug too: go-control-plane's info messages repeat per request what we log ourselves.
func (l xdsLogger) Infof(format string, args ...any) {
	l.log.Debug("go-control-plane", logkey.Detail, logkey.Untrusted(fmt.Sprintf(format, args...)))
}

func (l xdsLogger) Warnf(format string, args ...any) {
	l.limited(slog.LevelWarn, format, args)
}

func (l xdsLogger) Errorf(format string, args ...any) {
	l.limited(slog.LevelError, format, args)
}

func (l xdsLogger) limited(level slog.Level, format string, args []any) {
	ok, dropped := l.limit.allow("go-control-plane")
	if !ok {
		return
	}
	attrs := []any{logkey.Detail, logkey.Untrusted(fmt.Sprintf(format, args...))}
	if dropped > 0 {
		attrs = append(attrs, logkey.Dropped, dropped)
	}
	l.log.Log(context.Background(), level, "go-control-plane", attrs...)
}
