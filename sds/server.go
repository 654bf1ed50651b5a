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
)

// Defaults of the SDS server.
const (
	SocketName        = "socket"
	DefaultSocketMode = 0o660
	// MaxSocketPath is the longest Unix socket path the kernel takes (sun_path holds 108 bytes
	// with the terminating NUL).
	MaxSocketPath = 107
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

	Clock      clock.Clock
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

// Server is the SDS server.
type Server struct {
	cfg     Config
	log     *slog.Logger
	cache   *secretCache
	grpc    *grpc.Server
	lis     net.Listener
	metrics *metrics

	mu sync.Mutex
	// streams holds the names each stream subscribes to. The SotW and delta servers number
	// their streams separately, so the protocol is part of the key.
	streams map[streamKey][]string
	// deltaNodes holds the node of each delta stream: the delta server hands the callback a
	// request without the node that only the stream's first request carried.
	deltaNodes map[int64]*core.Node
}

type streamKey struct {
	protocol string
	id       int64
}

// CheckSocketPath refuses a socket path the kernel cannot bind.
func CheckSocketPath(path string) error {
	if len(path) > MaxSocketPath {
		return fmt.Errorf("socket path %s is %d bytes, over the kernel's limit of %d: choose a shorter directory", path, len(path), MaxSocketPath)
	}
	return nil
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
	if err := CheckSocketPath(cfg.SocketPath); err != nil {
		return nil, err
	}
	if cfg.SocketMode == 0 {
		cfg.SocketMode = DefaultSocketMode
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err := fsutil.EnsureDir(filepath.Dir(cfg.SocketPath), 0o750); err != nil {
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
	lis, err := net.Listen("unix", cfg.SocketPath)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", cfg.SocketPath, err)
	}
	if err := os.Chmod(cfg.SocketPath, cfg.SocketMode); err != nil {
		_ = lis.Close()
		return nil, fmt.Errorf("set the mode of %s: %w", cfg.SocketPath, err)
	}
	s := &Server{
		cfg:        cfg,
		log:        log,
		cache:      newSecretCache(cfg.Secrets, clock.OrReal(cfg.Clock), log),
		lis:        lis,
		metrics:    newMetrics(),
		streams:    map[streamKey][]string{},
		deltaNodes: map[int64]*core.Node{},
	}
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
	serveCtx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stopUpdates := s.cache.start(serveCtx)
	defer stopUpdates()

	s.grpc = grpc.NewServer()
	xds := serverv3.NewServer(serveCtx, s.cache, s.callbacks(), sotw.DeactivateLegacyWildcard())
	secretservice.RegisterSecretDiscoveryServiceServer(s.grpc, staleNonceFilter{xds})

	served := make(chan error, 1)
	go func() { served <- s.grpc.Serve(s.lis) }()
	s.log.Info("SDS serving", logkey.Socket, s.cfg.SocketPath)
	select {
	case err := <-served:
		return fmt.Errorf("serve SDS: %w", err)
	case <-ctx.Done():
	}
	s.drain()
	if err := <-served; err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("serve SDS: %w", err)
	}
	s.log.Info("SDS stopped")
	return nil
}

func (s *Server) drain() {
	stopped := make(chan struct{})
	go func() {
		s.grpc.GracefulStop() // stops accepting at once; returns when the streams end
		close(stopped)
	}()
	if s.cfg.DrainDuration > 0 {
		timer := clock.OrReal(s.cfg.Clock).NewTimer(s.cfg.DrainDuration)
		defer timer.Stop()
		select {
		case <-stopped:
			return
		case <-timer.C():
		}
	}
	s.grpc.Stop()
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
	for _, names := range s.streams {
		for _, n := range names {
			counts[n]++
		}
	}
	return counts
}

func (s *Server) callbacks() serverv3.Callbacks {
	opened := func(protocol string) func(context.Context, int64, string) error {
		return func(_ context.Context, id int64, _ string) error {
			s.metrics.streams.WithLabelValues(protocol).Inc()
			s.mu.Lock()
			s.streams[streamKey{protocol, id}] = nil
			s.mu.Unlock()
			return nil
		}
	}
	closed := func(protocol string) func(int64, *core.Node) {
		return func(id int64, _ *core.Node) {
			s.metrics.streams.WithLabelValues(protocol).Dec()
			s.mu.Lock()
			delete(s.streams, streamKey{protocol, id})
			if protocol == "delta" {
				delete(s.deltaNodes, id)
			}
			s.mu.Unlock()
		}
	}
	return serverv3.CallbackFuncs{
		StreamOpenFunc:        opened("sotw"),
		StreamClosedFunc:      closed("sotw"),
		DeltaStreamOpenFunc:   opened("delta"),
		DeltaStreamClosedFunc: closed("delta"),
		StreamRequestFunc: func(id int64, req *discovery.DiscoveryRequest) error {
			// The SotW server has already filled in the node of the stream's first request.
			if err := s.onRequest(id, req.GetNode(), req.GetErrorDetail(), req.GetResourceNames(), req.GetVersionInfo()); err != nil {
				return err
			}
			s.setSubscription(streamKey{"sotw", id}, req.GetResourceNames())
			return nil
		},
		StreamDeltaRequestFunc: func(id int64, req *discovery.DeltaDiscoveryRequest) error {
			if err := s.onRequest(id, s.deltaNode(id, req.GetNode()), req.GetErrorDetail(), req.GetResourceNamesSubscribe(), ""); err != nil {
				return err
			}
			s.updateSubscription(streamKey{"delta", id}, req.GetResourceNamesSubscribe(), req.GetResourceNamesUnsubscribe())
			return nil
		},
		StreamResponseFunc: func(_ context.Context, _ int64, _ *discovery.DiscoveryRequest, resp *discovery.DiscoveryResponse) {
			s.metrics.pushes.Add(float64(len(resp.GetResources())))
		},
		StreamDeltaResponseFunc: func(_ int64, _ *discovery.DeltaDiscoveryRequest, resp *discovery.DeltaDiscoveryResponse) {
			s.metrics.pushes.Add(float64(len(resp.GetResources())))
		},
	}
}

// deltaNode returns the node of a delta stream's request: the one it carries, else the one its
// stream's first request carried.
func (s *Server) deltaNode(id int64, node *core.Node) *core.Node {
	s.mu.Lock()
	defer s.mu.Unlock()
	if first, ok := s.deltaNodes[id]; ok {
		if node == nil {
			return first
		}
		return node
	}
	if node.GetId() != "" {
		s.deltaNodes[id] = node
	}
	return node
}

// onRequest checks what every request must carry and logs a NACK once, with Envoy's reason; the
// cache then sends nothing until the secret changes (istio#21111).
func (s *Server) onRequest(id int64, node *core.Node, nack *rpcstatus.Status, names []string, version string) error {
	if node.GetId() == "" {
		return status.Error(codes.InvalidArgument, "the first request on a stream must carry a node with an id")
	}
	if nack != nil {
		s.metrics.nacks.Inc()
		s.log.Warn("Envoy rejected secrets (NACK); not sending them again until they change",
			logkey.Node, node.GetId(), logkey.Stream, id, logkey.Secrets, names, logkey.Version, version, logkey.ErrorDetail, nack.GetMessage())
	}
	return nil
}

func (s *Server) setSubscription(id streamKey, names []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.streams[id] = append([]string(nil), names...)
}

func (s *Server) updateSubscription(id streamKey, subscribe, unsubscribe []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	names := s.streams[id]
	for _, n := range subscribe {
		if !slices.Contains(names, n) {
			names = append(names, n)
		}
	}
	kept := names[:0]
	for _, n := range names {
		if !slices.Contains(unsubscribe, n) {
			kept = append(kept, n)
		}
	}
	s.streams[id] = kept
}

// staleNonceFilter drops the SotW requests that answer an older response than the last one the
// stream was sent. The SotW server checks the nonce only while a response awaits its ACK: once
// acknowledged, it takes any nonce, and a late request carrying an older one would change the
// subscription. A stream's first request is taken whatever nonce it carries (an Envoy that
// reconnects to a restarted agent, spire#813).
type staleNonceFilter struct {
	serverv3.Server
}

func (f staleNonceFilter) StreamSecrets(stream secretservice.SecretDiscoveryService_StreamSecretsServer) error {
	return f.Server.StreamSecrets(&nonceCheckedStream{SecretDiscoveryService_StreamSecretsServer: stream})
}

// nonceCheckedStream remembers the last nonce sent. Send runs on the stream's goroutine and Recv
// on the server's reader goroutine, hence the mutex.
type nonceCheckedStream struct {
	secretservice.SecretDiscoveryService_StreamSecretsServer
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
		s.mu.Lock()
		last := s.lastNonce
		s.mu.Unlock()
		if last == "" || req.GetResponseNonce() == last {
			return req, nil
		}
	}
}
