package nodemode

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// errIdentityChanged is the cause of a node-mode stream ended because its caller's identity is
// not the one the stream serves any more; its client is told Unavailable, and reconnects.
var errIdentityChanged = errors.New("the caller's identity changed")

// Why a node-mode stream was ended, as counted.
const (
	streamEndedChanged = "identity_changed" // the caller now has another identity
	streamEndedRefused = "refused"          // the caller now has none
	streamEndedFailed  = "identity_failed"  // the identity's secret manager failed
)

// sdsMethodPrefix names SDS's streams. The Workload API's end by themselves when told their
// identity failed; SDS's streams keep what they have and wait for more, so they are ended.
const sdsMethodPrefix = "/envoy.service.secret.v3.SecretDiscoveryService/"

// endedStatus is the status of a stream ended for cause, when nodeStreams ended it.
func endedStatus(cause error) (error, bool) {
	if errors.Is(cause, errIdentityChanged) || errors.Is(cause, errIdentityFailed) {
		return status.Error(codes.Unavailable, cause.Error()), true
	}
	return nil, false
}

// nodeStreams follows the streams open on a node agent's socket (SDS's and the Workload API's)
// and the identity each serves, which is decided when the stream first resolves its caller. A
// stream's identity is fixed for its life: after each reload of the rules, each stream's caller
// is identified again, and a stream whose caller now has another identity, or none, is ended
// with Unavailable, so that its client reconnects and gets what the rules now give it.
//
// Ending a stream cancels its context, which a Workload API handler waits on: it returns, and
// its client is told why. An SDS handler waits in Recv instead, which grpc ends only with the
// stream; so a stream that waits in Recv when it is ended has its connection closed, which ends
// every stream on it (attestation is per connection: they all have the same caller), and its
// client reconnects and is identified anew. A handler that comes to Recv after its stream was
// ended is told why at once. This costs no goroutine per stream, nor per Recv.
type nodeStreams struct {
	// identify identifies the caller of a stream's context anew (it does not note it).
	identify func(ctx context.Context) (pki.SPIFFEID, error)
	log      *slog.Logger
	ended    *prometheus.CounterVec

	mu sync.Mutex
	// generation counts the reloads seen, so that a stream identified under rules that a reload
	// replaced before the identity was noted is checked again.
	generation uint64
	open       map[*nodeStream]struct{}
}

// nodeStream is one stream: the server's, with a context that ending it cancels.
type nodeStream struct {
	grpc.ServerStream
	ctx     context.Context //nolint:containedctx // the stream's, which Context returns
	cancel  context.CancelCauseFunc
	method  string
	streams *nodeStreams
	conn    *nodeConn // nil when the connection's handshake was not nodeCredentials'

	// Guarded by nodeStreams.mu.
	identity  *pki.SPIFFEID // nil until the stream resolves its caller
	ending    bool
	receiving bool // the handler waits in Recv
}

type nodeStreamKey struct{}

func newNodeStreams(identify func(context.Context) (pki.SPIFFEID, error), log *slog.Logger, reg prometheus.Registerer) (*nodeStreams, error) {
	n := &nodeStreams{
		identify: identify,
		log:      log,
		open:     map[*nodeStream]struct{}{},
		ended: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "node_streams_ended_total",
			Help: "Streams a node agent ended for their client to reconnect, by reason: after a reload of its rules, identity_changed, refused; identity_failed, their identity's secret manager failed.",
		}, []string{"reason"}),
	}
	if reg != nil {
		if err := reg.Register(n.ended); err != nil {
			return nil, fmt.Errorf("register node stream metrics: %w", err)
		}
	}
	return n, nil
}

// intercept is the socket's stream interceptor: it follows the stream while its handler runs,
// and when the stream is ended for its caller's identity, says so with Unavailable.
func (n *nodeStreams) intercept(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	ctx, cancel := context.WithCancelCause(ss.Context())
	st := &nodeStream{ServerStream: ss, cancel: cancel, method: info.FullMethod, streams: n, conn: connOf(ss.Context())}
	st.ctx = context.WithValue(ctx, nodeStreamKey{}, st)
	n.mu.Lock()
	n.open[st] = struct{}{}
	n.mu.Unlock()
	defer func() {
		n.mu.Lock()
		delete(n.open, st)
		n.mu.Unlock()
		cancel(nil)
	}()
	err := handler(srv, st)
	if ended, ok := endedStatus(context.Cause(st.ctx)); ok {
		return ended
	}
	return err
}

func (st *nodeStream) Context() context.Context { return st.ctx }

// RecvMsg returns the next message, or, once the stream is ended for its caller's identity,
// why. A stream ended while its handler waits here has had its connection closed, which ends
// the wait.
func (st *nodeStream) RecvMsg(m any) error {
	n := st.streams
	n.mu.Lock()
	if st.ending {
		n.mu.Unlock()
		return st.endedErr()
	}
	st.receiving = true
	n.mu.Unlock()
	err := st.ServerStream.RecvMsg(m)
	n.mu.Lock()
	st.receiving = false
	ending := st.ending
	n.mu.Unlock()
	if ending {
		return st.endedErr()
	}
	return err
}

// endedErr is the status of st, which was ended.
func (st *nodeStream) endedErr() error {
	cause := context.Cause(st.ctx)
	if ended, ok := endedStatus(cause); ok {
		return ended
	}
	return status.FromContextError(cause).Err()
}

// generationNow is the count of reloads seen; read it before identifying a caller, and pass it
// to note.
func (n *nodeStreams) generationNow() uint64 {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.generation
}

// note records id as the identity of the stream of ctx (none for a call that is not a stream),
// identified under the rules of generation: the first identity a stream is given is its own for
// its life, and another one later ends it.
func (n *nodeStreams) note(ctx context.Context, id pki.SPIFFEID, generation uint64) {
	st, _ := ctx.Value(nodeStreamKey{}).(*nodeStream)
	if st == nil {
		return
	}
	var e endings
	n.mu.Lock()
	var stale bool
	switch {
	case st.identity == nil:
		st.identity = &id
		// A reload since: its check did not see this stream's identity yet.
		stale = generation != n.generation
	case *st.identity != id:
		n.endChangedLocked(&e, st, streamEndedChanged, id.String())
	}
	n.mu.Unlock()
	if stale {
		n.check(&e, st)
	}
	n.finishChanged(&e)
}

// Run checks the open streams after each load of the rules that loaded signals, until ctx ends.
func (n *nodeStreams) Run(ctx context.Context, loaded func() <-chan struct{}) error {
	next := loaded()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-next:
		}
		// Taken before the check: a load during it is checked again.
		next = loaded()
		n.reloaded()
	}
}

// reloaded checks every stream that has an identity against the rules now in force.
func (n *nodeStreams) reloaded() {
	n.mu.Lock()
	n.generation++
	streams := make([]*nodeStream, 0, len(n.open))
	for st := range n.open {
		if st.identity != nil && !st.ending {
			streams = append(streams, st)
		}
	}
	n.mu.Unlock()
	var e endings
	for _, st := range streams {
		n.check(&e, st)
	}
	n.finishChanged(&e)
}

// check identifies st's caller again and ends st, into e, when it is not given st's identity
// any more.
func (n *nodeStreams) check(e *endings, st *nodeStream) {
	now, err := n.identify(st.ctx)
	n.mu.Lock()
	defer n.mu.Unlock()
	switch {
	case err != nil:
		n.endChangedLocked(e, st, streamEndedRefused, err.Error())
	case now != *st.identity:
		n.endChangedLocked(e, st, streamEndedChanged, now.String())
	}
}

// endChangedLocked ends st, whose caller is now (another identity, or why it has none), and
// counts it by reason; e gathers it with the other streams of its connection, to be logged.
func (n *nodeStreams) endChangedLocked(e *endings, st *nodeStream, reason, now string) {
	was := *st.identity
	var cause error
	if reason == streamEndedRefused {
		cause = fmt.Errorf("%w: the workload attestation rules give it none now (it was %s); reconnect", errIdentityChanged, was)
	} else {
		cause = fmt.Errorf("%w: it is %s now (it was %s); reconnect", errIdentityChanged, now, was)
	}
	if ended, closeConn := n.endLocked(st, cause); ended {
		n.ended.WithLabelValues(reason).Inc()
		e.add(st, closeConn, reason, was, now)
	}
}

// finishChanged closes the connections e says to, and logs each connection whose streams were
// ended once, with who and what it is now.
func (n *nodeStreams) finishChanged(e *endings) {
	for _, c := range e.conns {
		msg := "caller's streams ended: its identity changed with the workload attestation rules"
		if c.closeConn {
			msg = "caller's connection closed: its identity changed with the workload attestation rules"
			_ = c.first.conn.Close() // an error says nothing of use: the connection is gone either way
		}
		n.log.Warn(msg, logkey.Peer, admission.Peer(c.first.ctx), logkey.Protocol, c.first.method, logkey.Streams, c.streams,
			logkey.Identity, c.was.String(), logkey.Current, c.now, logkey.Reason, c.reason)
	}
}

// endLocked ends st with cause, once: its context is cancelled, which ends a handler that waits
// on it, and a handler that comes to Recv is told cause. It reports whether st was ended now,
// and whether its connection is to be closed: its handler waits in Recv, which only that ends.
func (n *nodeStreams) endLocked(st *nodeStream, cause error) (ended, closeConn bool) {
	if st.ending {
		return false, false
	}
	st.ending = true
	st.cancel(cause)
	return true, st.receiving && st.conn != nil
}

// endings gathers the streams one event ended, by connection.
type endings struct {
	conns  []*connEnded
	byConn map[any]*connEnded // by *nodeConn, or by *nodeStream for a stream of no known connection
}

// connEnded is what one event ended on one connection.
type connEnded struct {
	first     *nodeStream // the first stream ended, which names the connection's peer
	streams   int
	closeConn bool
	reason    string
	was       pki.SPIFFEID
	now       string
}

func (e *endings) add(st *nodeStream, closeConn bool, reason string, was pki.SPIFFEID, now string) {
	var key any = st.conn
	if st.conn == nil {
		key = st
	}
	c := e.byConn[key]
	if c == nil {
		if e.byConn == nil {
			e.byConn = map[any]*connEnded{}
		}
		c = &connEnded{first: st, reason: reason, was: was, now: now}
		e.byConn[key] = c
		e.conns = append(e.conns, c)
	}
	c.streams++
	c.closeConn = c.closeConn || closeConn
}

// endFailed ends the open SDS streams of identity id, whose secret manager failed for why, with
// Unavailable (those waiting in Recv by closing their connections): counted, and logged once for
// them all (the failure itself is logged by the registry).
func (n *nodeStreams) endFailed(id pki.SPIFFEID, why error) {
	var e endings
	n.mu.Lock()
	for st := range n.open {
		if st.identity != nil && *st.identity == id && strings.HasPrefix(st.method, sdsMethodPrefix) {
			if ended, closeConn := n.endLocked(st, fmt.Errorf("%w; reconnect", why)); ended {
				e.add(st, closeConn, streamEndedFailed, id, "")
			}
		}
	}
	n.mu.Unlock()
	if len(e.conns) == 0 {
		return
	}
	ended, closed := 0, 0
	for _, c := range e.conns {
		ended += c.streams
		if c.closeConn {
			_ = c.first.conn.Close()
			closed++
		}
	}
	n.ended.WithLabelValues(streamEndedFailed).Add(float64(ended))
	n.log.Warn("streams ended: their identity's secret manager failed", logkey.Identity, id.String(), logkey.Streams, ended,
		logkey.Connections, closed, logkey.Reason, streamEndedFailed)
}

// endStreamFailed ends the SDS stream of ctx, if it is one, whose identity id has a secret
// manager that failed for why: it would wait for a secret that does not come. It is called
// while the stream's handler serves a request, so its next Recv says why.
func (n *nodeStreams) endStreamFailed(ctx context.Context, id pki.SPIFFEID, why error) {
	st, _ := ctx.Value(nodeStreamKey{}).(*nodeStream)
	if st == nil || !strings.HasPrefix(st.method, sdsMethodPrefix) {
		return
	}
	n.mu.Lock()
	ended, closeConn := n.endLocked(st, fmt.Errorf("%w; reconnect", why))
	n.mu.Unlock()
	if !ended {
		return
	}
	if closeConn {
		_ = st.conn.Close()
	}
	n.ended.WithLabelValues(streamEndedFailed).Inc()
	n.log.Warn("stream ended: its identity's secret manager failed", logkey.Peer, admission.Peer(st.ctx), logkey.Protocol, st.method,
		logkey.Identity, id.String(), logkey.Reason, streamEndedFailed, logkey.Error, why.Error())
}

// nodeCredentials are the node socket's transport credentials: the attestor's, around
// connCredentials, around the server's own (inner, its admission).
func nodeCredentials(attestor agent.Attestor) func(credentials.TransportCredentials) credentials.TransportCredentials {
	return func(inner credentials.TransportCredentials) credentials.TransportCredentials {
		return attestor.Credentials(connCredentials{inner: inner})
	}
}

// connCredentials hand each connection to grpc as a *nodeConn, which its streams find through
// their peer's AuthInfo (connOf), so that ending them can close it. Nothing else holds it: a
// connection grpc closes is gone with its streams.
type connCredentials struct {
	inner credentials.TransportCredentials
}

// nodeConn is a connection on the socket; closing it more than once closes it once (grpc closes
// it too), so that what the inner credentials count is counted out once.
type nodeConn struct {
	net.Conn
	once sync.Once
	err  error
}

func (c *nodeConn) Close() error {
	c.once.Do(func() { c.err = c.Conn.Close() })
	return c.err
}

// connInfo is connCredentials' AuthInfo: the inner credentials' (Unwrap, for admission.Peer)
// and the connection.
type connInfo struct {
	credentials.CommonAuthInfo
	inner credentials.AuthInfo
	conn  *nodeConn
}

func (connInfo) AuthType() string { return "node-conn" }

// Unwrap returns the inner credentials' AuthInfo, for code that looks for its own.
func (i connInfo) Unwrap() credentials.AuthInfo { return i.inner }

func (c connCredentials) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn := raw
	info := connInfo{CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity}}
	if c.inner != nil {
		var err error
		if conn, info.inner, err = c.inner.ServerHandshake(raw); err != nil {
			return nil, nil, err
		}
		if ci, ok := info.inner.(interface {
			GetCommonAuthInfo() credentials.CommonAuthInfo
		}); ok {
			info.CommonAuthInfo = ci.GetCommonAuthInfo()
		}
	}
	info.conn = &nodeConn{Conn: conn}
	return info.conn, info, nil
}

func (connCredentials) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("these credentials are for serving")
}

func (c connCredentials) Info() credentials.ProtocolInfo {
	if c.inner != nil {
		return c.inner.Info()
	}
	return credentials.ProtocolInfo{SecurityProtocol: "node-conn"}
}

func (c connCredentials) Clone() credentials.TransportCredentials {
	if c.inner != nil {
		return connCredentials{inner: c.inner.Clone()}
	}
	return c
}

func (connCredentials) OverrideServerName(string) error { return nil }

// connOf is the connection of a call made on a connection of connCredentials, or nil.
func connOf(ctx context.Context) *nodeConn {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil
	}
	for info := p.AuthInfo; info != nil; {
		if ci, ok := info.(connInfo); ok {
			return ci.conn
		}
		w, ok := info.(interface{ Unwrap() credentials.AuthInfo })
		if !ok {
			return nil
		}
		info = w.Unwrap()
	}
	return nil
}
