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

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/logkey"
)

// The protocols, as streams are counted and refusals logged.
const (
	protocolSotW  = "sotw"
	protocolDelta = "delta"
	protocolFetch = "fetch"
)

// service serves SecretDiscoveryService on the generated stubs. A stream's handler goroutine reads
// its requests and answers them; a change of a secret is sent by a goroutine started for it
// (watcher.notify) that ends once sent, so that an idle stream costs one goroutine. The server
// counts those (Server.pushes), and Run waits for them.
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
	pushes   *sync.WaitGroup // the server's: counts the push goroutines
	// send writes one response with the given nonce; it runs with mu held.
	send func(nonce string, changed []pushed) error
	// resolve gives the cache key of a name for this stream's caller.
	resolve func(name string) (string, error)

	// pushing is set while a goroutine sends what changed; wake asks it to look once more.
	pushing, wake atomic.Bool

	// mu is held across a send, so that responses leave in the order of their nonces, and so
	// that closeWatcher can wait for one being sent.
	mu        sync.Mutex
	ended     bool              // the handler is returning: grpc forbids a Send after it
	names     []string          // subscribed, sorted, without the wildcard
	keys      map[string]string // the cache key of each name
	entries   []*entry          // the cache's entry of each name
	known     map[string]string // name → version the stream was last sent
	awaiting  bool              // a response was sent and no request has come since
	sent      int64             // responses sent: the last one's nonce
	lastNonce string
	lastNames []string // the secrets of the last response, which a NACK rejects

	// indexed is the names the cache indexes this watcher under; guarded by the cache's mu.
	indexed []string
}

// pushed is one secret in a response.
type pushed struct {
	name   string
	served *servedSecret
}

// openWatcher admits a stream and returns its watcher, which closeWatcher ends.
func (s *Server) openWatcher(ctx context.Context, protocol string, send func(string, []pushed) error) (*watcher, error) {
	if err := s.admit(ctx, protocol); err != nil {
		return nil, err
	}
	s.metrics.streams.WithLabelValues(protocol).Inc()
	return &watcher{
		id:       s.nextStream.Add(1),
		protocol: protocol,
		peer:     admission.Peer(ctx),
		cache:    s.cache,
		metrics:  s.metrics,
		pushes:   &s.pushes,
		send:     send,
		resolve:  func(name string) (string, error) { return s.resolve(ctx, name) },
		keys:     map[string]string{},
		known:    map[string]string{},
	}, nil
}

// closeWatcher ends w's subscriptions and its admission. It waits for a response being sent to
// leave: grpc forbids a Send once the handler has returned. (A client that half-closed its side
// and stopped reading can make that wait until its connection ends; it holds only its own stream
// meanwhile.)
func (s *Server) closeWatcher(w *watcher) {
	w.mu.Lock()
	w.ended = true
	w.mu.Unlock()
	s.cache.unwatch(w)
	s.metrics.streams.WithLabelValues(w.protocol).Dec()
	s.release()
}

func (w *watcher) refusal() refusal {
	return refusal{protocol: w.protocol, stream: w.id, node: w.node, peer: w.peer}
}

// notify tells w that a secret it subscribes to changed. It never blocks: it runs under the
// cache's lock, for every stream at once in a rotation.
func (w *watcher) notify() {
	w.wake.Store(true)
	if w.pushing.CompareAndSwap(false, true) {
		w.pushes.Go(w.push)
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
	if w.awaiting || w.ended {
		return nil
	}
	var changed []pushed
	now := w.cache.clock.Now()
	for i, e := range w.entries {
		if sv := e.served.Load(); sv != nil && w.known[w.names[i]] != sv.version && sv.validAt(now) {
			changed = append(changed, pushed{name: w.names[i], served: sv})
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
	w.lastNames = w.lastNames[:0]
	for _, p := range changed {
		w.known[p.name] = p.served.version
		w.lastNames = append(w.lastNames, p.name)
	}
	w.metrics.pushes.Add(float64(len(changed)))
	return nil
}

// request is what follow takes of a client's request.
type request struct {
	subscribe, unsubscribe []string
	replace                bool              // subscribe is the whole subscription (SotW)
	initial                map[string]string // delta: the versions the client already has
	nonce                  *string           // SotW: the response the request answers
}

// errStaleNonce is a SotW request that answers a response older than the last one sent.
var errStaleNonce = errors.New("stale nonce")

// follow takes a request's subscription (all the names, or those added and removed), subscribes
// to the new names, refusing the stream what cannot be served, and answers with what the stream
// does not have. A SotW request that does not answer the latest response is dropped
// (errStaleNonce): it would change the subscription behind the client's back.
func (s *Server) follow(w *watcher, req request) error {
	if same, err := s.followSame(w, req); same {
		return err
	}
	// Subscribing refuses at once what cannot be served; the pins end once w is indexed.
	var pinned, requested []string
	resolved := map[string]string{}
	defer func() { s.cache.unpin(pinned) }()
	for _, name := range req.subscribe {
		if name == "*" {
			continue // SDS serves named secrets only
		}
		key, err := w.resolve(name)
		if err != nil {
			return s.unidentified(w.refusal(), name, err)
		}
		if err := s.cache.subscribe(key); err != nil {
			r := w.refusal()
			r.names, r.reason, r.err = []string{name}, refusalReason(err), refusalStatus(name, err)
			return s.refuse(r)
		}
		pinned = append(pinned, key)
		requested = append(requested, name)
		resolved[name] = key
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if req.nonce != nil && !w.answers(*req.nonce) {
		return errStaleNonce
	}
	var names []string
	if req.replace {
		names = requested
	} else {
		names = slices.Concat(w.names, requested)
		names = slices.DeleteFunc(names, func(n string) bool { return slices.Contains(req.unsubscribe, n) })
	}
	slices.Sort(names)
	names = slices.Compact(names)
	keys := make([]string, len(names))
	for i, name := range names {
		if key, ok := resolved[name]; ok {
			w.keys[name] = key // resolved again: the rules may have changed
		}
		keys[i] = w.keys[name]
	}
	w.names = names
	w.entries = s.cache.watch(w, keys)
	for name := range w.keys {
		if !slices.Contains(names, name) {
			delete(w.keys, name)
		}
	}
	for name := range w.known {
		if !slices.Contains(names, name) {
			delete(w.known, name) // sent again if subscribed again
		}
	}
	for name, version := range req.initial {
		if slices.Contains(names, name) {
			w.known[name] = version
		}
	}
	w.awaiting = false
	return w.respondLocked()
}

// followSame answers a request that leaves the stream's subscription as it is, which most are
// (the ACK of every response, a NACK), without the cache: in a rotation every stream acknowledges
// at once, and the cache's lock is the one the rotation's notifications hold. It reports false,
// having done nothing, for any other request, and when names are resolved per caller (whose
// rules may have changed since: follow resolves them again) or the server is stopping (follow
// refuses).
func (s *Server) followSame(w *watcher, req request) (bool, error) {
	if s.cfg.Resolve != nil || s.cache.stopping.Load() {
		return false, nil
	}
	var names []string
	if req.replace {
		names = slices.DeleteFunc(slices.Clone(req.subscribe), func(n string) bool { return n == "*" })
		slices.Sort(names)
		names = slices.Compact(names)
	} else if len(req.subscribe) > 0 || len(req.unsubscribe) > 0 || req.initial != nil {
		return false, nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if req.replace && !slices.Equal(names, w.names) {
		return false, nil
	}
	if req.nonce != nil && !w.answers(*req.nonce) {
		return true, errStaleNonce
	}
	w.awaiting = false
	return true, w.respondLocked()
}

// answers reports whether a SotW request carrying nonce answers the latest response. The first
// request is taken whatever nonce it carries (an Envoy that reconnects to a restarted agent,
// spire#813). w.mu must be held.
func (w *watcher) answers(nonce string) bool {
	return w.lastNonce == "" || nonce == w.lastNonce
}

// rejected returns the secrets of the last response, which a NACK names.
func (w *watcher) rejected() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.lastNames)
}

// noteNACK counts a rejected response and logs it once, however often the client repeats it.
func (s *Server) noteNACK(w *watcher, nack *rpcstatus.Status, rejected nackKey, last *nackKey) {
	if nack == nil {
		return
	}
	if *last == rejected {
		return
	}
	*last = rejected
	names := w.rejected()
	s.metrics.nacks.Inc()
	// A client can NACK with new nonces (delta) or versions as fast as it likes.
	ok, dropped := s.logs.Allow("nack")
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

// dropStale refuses a SotW request that answers an old response; the stream goes on.
func (s *Server) dropStale(w *watcher, names []string) {
	r := w.refusal()
	r.names, r.reason = names, reasonStaleNonce
	_ = s.refuse(r)
}

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
	w, err := s.openWatcher(stream.Context(), protocolSotW, func(nonce string, changed []pushed) error {
		if len(changed) == 1 { // a rotation's response: its body is every stream's
			return stream.SendMsg(&encodedResponse{body: changed[0].served.sotw, nonce: nonce})
		}
		resources := make([]*anypb.Any, len(changed))
		versions := make(map[string]string, len(changed))
		for i, p := range changed {
			resources[i], versions[p.name] = p.served.resource, p.served.version
		}
		return stream.Send(&discovery.DiscoveryResponse{VersionInfo: versionInfo(versions), Resources: resources,
			TypeUrl: SecretTypeURL, Nonce: nonce})
	})
	if err != nil {
		return err
	}
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
		// Checked here before anything else, and again by follow under the stream's lock, for
		// a response sent meanwhile.
		nonce := req.GetResponseNonce()
		w.mu.Lock()
		answers := w.answers(nonce)
		w.mu.Unlock()
		if !answers {
			s.dropStale(w, req.GetResourceNames())
			continue
		}
		if err := s.checkRequest(w.refusal(), req.GetTypeUrl()); err != nil {
			return err
		}
		s.noteNACK(w, req.GetErrorDetail(), nackKey{req.GetVersionInfo(), nonce}, &nacked)
		err = s.follow(w, request{subscribe: req.GetResourceNames(), replace: true, nonce: &nonce})
		switch {
		case errors.Is(err, errStaleNonce):
			s.dropStale(w, req.GetResourceNames())
		case err != nil:
			return err
		}
	}
}

// DeltaSecrets serves an incremental stream. Any request re-arms it, whatever nonce it carries:
// a subscription change is honoured at once.
func (v service) DeltaSecrets(stream secretservice.SecretDiscoveryService_DeltaSecretsServer) error {
	s := v.s
	w, err := s.openWatcher(stream.Context(), protocolDelta, func(nonce string, changed []pushed) error {
		if len(changed) == 1 { // a rotation's response: its body is every stream's
			p := changed[0]
			if body := p.served.deltaBody(p.name, p.served.version, p.served.resource); body != nil {
				return stream.SendMsg(&encodedResponse{body: body, nonce: nonce})
			}
		}
		resources := make([]*discovery.Resource, len(changed))
		versions := make(map[string]string, len(changed))
		for i, p := range changed {
			resources[i] = &discovery.Resource{Name: p.name, Version: p.served.version, Resource: p.served.resource}
			versions[p.name] = p.served.version
		}
		return stream.Send(&discovery.DeltaDiscoveryResponse{SystemVersionInfo: versionInfo(versions), Resources: resources,
			TypeUrl: SecretTypeURL, Nonce: nonce})
	})
	if err != nil {
		return err
	}
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
		s.noteNACK(w, req.GetErrorDetail(), nackKey{nonce: req.GetResponseNonce()}, &nacked)
		r := request{subscribe: req.GetResourceNamesSubscribe(), unsubscribe: req.GetResourceNamesUnsubscribe()}
		if first {
			r.initial = req.GetInitialResourceVersions()
		}
		if err := s.follow(w, r); err != nil {
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
	r := refusal{protocol: protocolFetch, node: req.GetNode().GetId(), peer: admission.Peer(ctx)}
	if err := s.checkRequest(r, req.GetTypeUrl()); err != nil {
		return nil, err
	}
	resp, refused, err := s.cache.fetch(ctx, req.GetResourceNames(), func(name string) (string, error) { return s.resolve(ctx, name) })
	if u := (unresolved{}); errors.As(err, &u) {
		return nil, s.unidentified(r, refused, u.error)
	}
	if refused != "" {
		r.names, r.reason, r.err = []string{refused}, refusalReason(err), refusalStatus(refused, err)
		return nil, s.refuse(r)
	}
	return resp, err
}
