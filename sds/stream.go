package sds

import (
	"context"
	"errors"
	"io"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	secretservice "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/internal/logkey"
)

// The protocols, as streams are counted and refusals logged.
const (
	protocolSotW  = "sotw"
	protocolDelta = "delta"
	protocolFetch = "fetch"
)

// service serves SecretDiscoveryService on the generated stubs. Each stream is served by its
// handler's goroutine alone, which reads requests; a change of a secret is sent by a short-lived
// goroutine of the stream (watcher.notify), so that an open stream costs one goroutine.
type service struct {
	secretservice.UnimplementedSecretDiscoveryServiceServer
	s *Server
}

// watcher is one open stream: the names it subscribes to, what it was last sent of each, and
// whether a response awaits the client's next request. Both protocols send a response, then wait
// for the request that answers it (an ACK or a NACK) before sending another, as Envoy expects.
type watcher struct {
	id       int64
	protocol string
	peer     string
	node     string // of the stream's first request; only the handler's goroutine uses it
	cache    *secretCache
	metrics  *metrics
	// send writes one response with the given nonce; it runs with mu held.
	send func(nonce string, changed []pushed) error

	// ended is set when the handler returns: nothing is sent after it.
	ended atomic.Bool
	// pushing is set while a goroutine sends what changed; wake asks it to look once more.
	pushing, wake atomic.Bool

	// mu is held across a send, so that responses leave in the order of their nonces.
	mu        sync.Mutex
	names     []string          // subscribed, sorted, without the wildcard
	entries   []*entry          // the cache's entry of each name
	known     map[string]string // name → version the stream was last sent
	awaiting  bool              // a response was sent and no request has come since
	sent      int64             // responses sent: the last one's nonce
	lastNonce string

	// indexed is the names the cache indexes this watcher under; guarded by the cache's mu.
	indexed []string
}

// pushed is one secret in a response.
type pushed struct {
	name, version string
	resource      *anypb.Any
}

func (s *Server) newWatcher(ctx context.Context, protocol string, send func(string, []pushed) error) *watcher {
	s.metrics.streams.WithLabelValues(protocol).Inc()
	return &watcher{
		id:       s.nextStream.Add(1),
		protocol: protocol,
		peer:     peerOf(ctx),
		cache:    s.cache,
		metrics:  s.metrics,
		send:     send,
		known:    map[string]string{},
	}
}

// closeWatcher ends w's subscriptions at once; a response being sent still ends with the stream.
func (s *Server) closeWatcher(w *watcher) {
	w.ended.Store(true)
	s.cache.unwatch(w)
	s.metrics.streams.WithLabelValues(w.protocol).Dec()
}

func (w *watcher) refusal() refusal {
	return refusal{protocol: w.protocol, stream: w.id, node: w.node, peer: w.peer}
}

// notify tells w that a secret it subscribes to changed. It never blocks: it runs under the
// cache's lock, for every stream at once in a rotation.
func (w *watcher) notify() {
	w.wake.Store(true)
	if w.pushing.CompareAndSwap(false, true) {
		go w.push()
	}
}

// push sends what changed, and looks again as long as notify came meanwhile.
func (w *watcher) push() {
	for {
		w.wake.Store(false)
		w.mu.Lock()
		_ = w.respondLocked() // a failed send is the stream's end, which its handler reports
		w.mu.Unlock()
		w.pushing.Store(false)
		if !w.wake.Load() || !w.pushing.CompareAndSwap(false, true) {
			return
		}
	}
}

// respondLocked sends the subscribed secrets whose version differs from what the stream was last
// sent, unless a response awaits the client's next request.
func (w *watcher) respondLocked() error {
	if w.awaiting || w.ended.Load() {
		return nil
	}
	var changed []pushed
	now := w.cache.clock.Now()
	for i, e := range w.entries {
		if sv := e.served.Load(); sv != nil && w.known[w.names[i]] != sv.version && sv.validAt(now) {
			changed = append(changed, pushed{name: w.names[i], version: sv.version, resource: sv.resource})
		}
	}
	if len(changed) == 0 {
		return nil
	}
	w.sent++
	nonce := strconv.FormatInt(w.sent, 10)
	if err := w.send(nonce, changed); err != nil {
		return err
	}
	w.lastNonce, w.awaiting = nonce, true
	for _, p := range changed {
		w.known[p.name] = p.version
	}
	w.metrics.pushes.Add(float64(len(changed)))
	return nil
}

// follow takes a request's subscription (all the names, or those added and removed), subscribes
// to the new names, refusing the stream what cannot be served, and answers with what the stream
// does not have. initial is what a delta stream says it has already.
func (s *Server) follow(w *watcher, subscribe, unsubscribe []string, replace bool, initial map[string]string) error {
	// Subscribing refuses at once what cannot be served; the pins end once w is indexed.
	var pinned []string
	defer func() { s.cache.unpin(pinned) }()
	for _, name := range subscribe {
		if name == "*" {
			continue // SDS serves named secrets only
		}
		if err := s.cache.subscribe(name); err != nil {
			r := w.refusal()
			r.names, r.reason, r.err = []string{name}, refusalReason(err), refusalStatus(name, err)
			return s.refuse(r)
		}
		pinned = append(pinned, name)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	var names []string
	if replace {
		names = slices.Clone(pinned)
	} else {
		names = slices.Concat(w.names, pinned)
		names = slices.DeleteFunc(names, func(n string) bool { return slices.Contains(unsubscribe, n) })
	}
	slices.Sort(names)
	names = slices.Compact(names)
	w.names = names
	w.entries = s.cache.watch(w, names)
	for name := range w.known {
		if !slices.Contains(names, name) {
			delete(w.known, name) // sent again if subscribed again
		}
	}
	for name, version := range initial {
		if slices.Contains(names, name) {
			w.known[name] = version
		}
	}
	w.awaiting = false
	return w.respondLocked()
}

// noteNACK counts a rejected response and logs it once, however often the client repeats it.
func (s *Server) noteNACK(w *watcher, nack *rpcstatus.Status, rejected nackKey, last *nackKey, names []string) {
	if nack == nil {
		return
	}
	if *last == rejected {
		return
	}
	*last = rejected
	s.metrics.nacks.Inc()
	// A client can NACK with new nonces (delta) or versions as fast as it likes.
	ok, dropped := s.logs.allow("nack")
	if !ok {
		return
	}
	attrs := []any{logkey.Node, logkey.Untrusted(w.node), logkey.Peer, w.peer, logkey.Stream, w.id,
		logkey.Secrets, logkey.UntrustedList(names), logkey.Version, logkey.Untrusted(rejected.version),
		logkey.ErrorDetail, logkey.Untrusted(nack.GetMessage())}
	if dropped > 0 {
		attrs = append(attrs, logkey.Dropped, dropped)
	}
	s.log.Warn("Envoy rejected secrets (NACK); not sending them again until they change", attrs...)
}

// nackKey names the response a NACK rejects: the version the client kept (SotW) and the nonce.
type nackKey struct{ version, nonce string }

// endOf is a handler's result once Recv failed: a client that closed its side ends the stream
// cleanly.
func endOf(err error) error {
	if errors.Is(err, io.EOF) {
		return nil
	}
	return err
}

// StreamSecrets serves a state-of-the-world stream.
func (v service) StreamSecrets(stream secretservice.SecretDiscoveryService_StreamSecretsServer) error {
	s := v.s
	if err := s.admit(stream.Context(), protocolSotW); err != nil {
		return err
	}
	defer s.release()
	w := s.newWatcher(stream.Context(), protocolSotW, func(nonce string, changed []pushed) error {
		resources := make([]*anypb.Any, len(changed))
		versions := make(map[string]string, len(changed))
		for i, p := range changed {
			resources[i], versions[p.name] = p.resource, p.version
		}
		return stream.Send(&discovery.DiscoveryResponse{VersionInfo: versionInfo(versions), Resources: resources,
			TypeUrl: SecretTypeURL, Nonce: nonce})
	})
	defer s.closeWatcher(w)
	var nacked nackKey
	for {
		req, err := stream.Recv()
		if err != nil {
			return endOf(err)
		}
		if w.node == "" {
			w.node = req.GetNode().GetId()
		}
		// A request answers the latest response or none: one that answers an older one would
		// change the subscription behind the client's back. The first request is taken whatever
		// nonce it carries (an Envoy that reconnects to a restarted agent, spire#813).
		w.mu.Lock()
		last := w.lastNonce
		w.mu.Unlock()
		if last != "" && req.GetResponseNonce() != last {
			r := w.refusal()
			r.names, r.reason = req.GetResourceNames(), reasonStaleNonce
			_ = s.refuse(r)
			continue
		}
		if err := s.checkRequest(w.refusal(), req.GetTypeUrl()); err != nil {
			return err
		}
		s.noteNACK(w, req.GetErrorDetail(), nackKey{req.GetVersionInfo(), req.GetResponseNonce()}, &nacked, req.GetResourceNames())
		if err := s.follow(w, req.GetResourceNames(), nil, true, nil); err != nil {
			return err
		}
	}
}

// DeltaSecrets serves an incremental stream. Any request re-arms it, whatever nonce it carries:
// a subscription change is honoured at once.
func (v service) DeltaSecrets(stream secretservice.SecretDiscoveryService_DeltaSecretsServer) error {
	s := v.s
	if err := s.admit(stream.Context(), protocolDelta); err != nil {
		return err
	}
	defer s.release()
	w := s.newWatcher(stream.Context(), protocolDelta, func(nonce string, changed []pushed) error {
		resources := make([]*discovery.Resource, len(changed))
		versions := make(map[string]string, len(changed))
		for i, p := range changed {
			resources[i] = &discovery.Resource{Name: p.name, Version: p.version, Resource: p.resource}
			versions[p.name] = p.version
		}
		return stream.Send(&discovery.DeltaDiscoveryResponse{SystemVersionInfo: versionInfo(versions), Resources: resources,
			TypeUrl: SecretTypeURL, Nonce: nonce})
	})
	defer s.closeWatcher(w)
	var nacked nackKey
	for first := true; ; first = false {
		req, err := stream.Recv()
		if err != nil {
			return endOf(err)
		}
		if w.node == "" {
			w.node = req.GetNode().GetId()
		}
		if err := s.checkRequest(w.refusal(), req.GetTypeUrl()); err != nil {
			return err
		}
		s.noteNACK(w, req.GetErrorDetail(), nackKey{nonce: req.GetResponseNonce()}, &nacked, req.GetResourceNamesSubscribe())
		var initial map[string]string
		if first {
			initial = req.GetInitialResourceVersions()
		}
		if err := s.follow(w, req.GetResourceNamesSubscribe(), req.GetResourceNamesUnsubscribe(), false, initial); err != nil {
			return err
		}
	}
}

// FetchSecrets answers once every requested secret is known: with them, or with the reason one
// cannot be served.
func (v service) FetchSecrets(ctx context.Context, req *discovery.DiscoveryRequest) (*discovery.DiscoveryResponse, error) {
	s := v.s
	if err := s.admit(ctx, protocolFetch); err != nil {
		return nil, err
	}
	defer s.release()
	r := refusal{protocol: protocolFetch, node: req.GetNode().GetId(), peer: peerOf(ctx)}
	if err := s.checkRequest(r, req.GetTypeUrl()); err != nil {
		return nil, err
	}
	resp, refused, err := s.cache.fetch(ctx, req.GetResourceNames())
	if refused != "" {
		r.names, r.reason, r.err = []string{refused}, refusalReason(err), refusalStatus(refused, err)
		return nil, s.refuse(r)
	}
	return resp, err
}
