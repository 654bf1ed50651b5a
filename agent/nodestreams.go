package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

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
	ctx    context.Context //nolint:containedctx // the stream's, which Context returns
	cancel context.CancelCauseFunc
	method string

	// Guarded by nodeStreams.mu.
	identity *pki.SPIFFEID // nil until the stream resolves its caller
	ending   bool
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
	st := &nodeStream{ServerStream: ss, cancel: cancel, method: info.FullMethod}
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

// RecvMsg returns the next message, or, when the stream is ended for its caller's identity,
// that at once. The handler waits here for the life of an SDS stream, and grpc has no way to
// interrupt the wait but the end of the stream, which comes when the handler returns: so the
// wait is in a goroutine of its own, which the end of the stream releases. A node agent's
// streams pay that goroutine (about 4 kB of stack per SDS stream, measured at 2,000); a
// sidecar's do not. Closing the caller's connection instead would cost nothing, but its client
// would be told of a broken transport, not why.
func (st *nodeStream) RecvMsg(m any) error {
	done := make(chan error, 1)
	go func() { done <- st.ServerStream.RecvMsg(m) }()
	select {
	case err := <-done:
		return err
	case <-st.ctx.Done():
		if ended, ok := endedStatus(context.Cause(st.ctx)); ok {
			return ended
		}
		return <-done // the client went, or the server stops: the wait ends with it
	}
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
	n.mu.Lock()
	var stale bool
	switch {
	case st.identity == nil:
		st.identity = &id
		// A reload since: its check did not see this stream's identity yet.
		stale = generation != n.generation
	case *st.identity != id:
		n.endLocked(st, streamEndedChanged, *st.identity, id.String())
	}
	n.mu.Unlock()
	if stale {
		n.check(st)
	}
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
	for _, st := range streams {
		n.check(st)
	}
}

// check identifies st's caller again and ends st when it is not given st's identity any more.
func (n *nodeStreams) check(st *nodeStream) {
	now, err := n.identify(st.ctx)
	n.mu.Lock()
	defer n.mu.Unlock()
	switch {
	case err != nil:
		n.endLocked(st, streamEndedRefused, *st.identity, err.Error())
	case now != *st.identity:
		n.endLocked(st, streamEndedChanged, *st.identity, now.String())
	}
}

// endLocked ends st for reason, once: counted, and logged with who and what it is now.
func (n *nodeStreams) endLocked(st *nodeStream, reason string, was pki.SPIFFEID, now string) {
	if st.ending {
		return
	}
	st.ending = true
	var cause error
	if reason == streamEndedRefused {
		cause = fmt.Errorf("%w: the workload attestation rules give it none now (it was %s); reconnect", errIdentityChanged, was)
	} else {
		cause = fmt.Errorf("%w: it is %s now (it was %s); reconnect", errIdentityChanged, now, was)
	}
	st.cancel(cause)
	n.ended.WithLabelValues(reason).Inc()
	n.log.Warn("stream ended: its caller's identity changed with the workload attestation rules", logkey.Peer, admission.Peer(st.ctx),
		logkey.Protocol, st.method, logkey.Identity, was.String(), logkey.Current, now, logkey.Reason, reason)
}

// endFailed ends the open SDS streams of identity id, whose secret manager failed for why, with
// Unavailable: counted, and logged once for them all (the failure itself is logged by the
// registry).
func (n *nodeStreams) endFailed(id pki.SPIFFEID, why error) {
	n.mu.Lock()
	ended := 0
	for st := range n.open {
		if st.identity != nil && *st.identity == id && !st.ending && strings.HasPrefix(st.method, sdsMethodPrefix) {
			st.ending = true
			st.cancel(fmt.Errorf("%w; reconnect", why))
			ended++
		}
	}
	n.mu.Unlock()
	if ended == 0 {
		return
	}
	n.ended.WithLabelValues(streamEndedFailed).Add(float64(ended))
	n.log.Warn("streams ended: their identity's secret manager failed", logkey.Identity, id.String(), logkey.Streams, ended,
		logkey.Reason, streamEndedFailed)
}

// endStreamFailed ends the SDS stream of ctx, if it is one, whose identity id has a secret
// manager that failed for why: it would wait for a secret that does not come.
func (n *nodeStreams) endStreamFailed(ctx context.Context, id pki.SPIFFEID, why error) {
	st, _ := ctx.Value(nodeStreamKey{}).(*nodeStream)
	if st == nil || !strings.HasPrefix(st.method, sdsMethodPrefix) {
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if st.ending {
		return
	}
	st.ending = true
	st.cancel(fmt.Errorf("%w; reconnect", why))
	n.ended.WithLabelValues(streamEndedFailed).Inc()
	n.log.Warn("stream ended: its identity's secret manager failed", logkey.Peer, admission.Peer(st.ctx), logkey.Protocol, st.method,
		logkey.Identity, id.String(), logkey.Reason, streamEndedFailed, logkey.Error, why.Error())
}
