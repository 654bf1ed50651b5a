package nodemode

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/pki"
)

// blockedStream is a server stream whose client sends nothing until the test ends it.
type blockedStream struct {
	grpc.ServerStream
	ctx      context.Context //nolint:containedctx // the stream's
	received chan<- struct{} // if not nil, told of each RecvMsg as it starts waiting
}

func (b blockedStream) Context() context.Context { return b.ctx }
func (b blockedStream) RecvMsg(any) error {
	if b.received != nil {
		b.received <- struct{}{}
	}
	<-b.ctx.Done()
	return status.FromContextError(b.ctx.Err()).Err()
}

// testConn is a connection whose Close ends its streams, as grpc's closing of a transport does.
type testConn struct {
	net.Conn // nil: only Close is called
	end      context.CancelFunc
	closes   *atomic.Int32
}

func (c testConn) Close() error {
	c.closes.Add(1)
	c.end()
	return nil
}

// onTestConn is ctx on a connection of its own, as connCredentials make them, and a count of the
// times it was closed.
func onTestConn(ctx context.Context) (context.Context, *atomic.Int32) {
	ctx, cancel := context.WithCancel(ctx)
	closes := &atomic.Int32{}
	conn := &nodeConn{Conn: testConn{end: cancel, closes: closes}}
	return peer.NewContext(ctx, &peer.Peer{AuthInfo: connInfo{conn: conn}}), closes
}

// callers is the rules' answer for each caller, as the test sets it.
type callers struct {
	mu  sync.Mutex
	ids map[string]pki.SPIFFEID // by caller; absent: refused
}

type callerKey struct{}

func (c *callers) set(caller string, id *pki.SPIFFEID) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if id == nil {
		delete(c.ids, caller)
		return
	}
	c.ids[caller] = *id
}

func (c *callers) identify(ctx context.Context) (pki.SPIFFEID, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	id, ok := c.ids[ctx.Value(callerKey{}).(string)]
	if !ok {
		return pki.SPIFFEID{}, errors.New("no rule matches the caller")
	}
	return id, nil
}

// Each stream keeps the identity it was first given: a check after a reload ends the streams
// whose caller now has another identity or none (Unavailable, counted by reason), closing the
// connection of each that waits in Recv, and leaves the others; a stream identified under rules
// a reload replaced before its identity was noted is checked then; and a stream given a second
// identity is ended at once. A stream that waits on its context (the Workload API's) is ended
// with its connection left open, and so is one ended between two Recvs: it is told at the next.
func TestNodeStreamsEndWhenTheCallersIdentityChanges(t *testing.T) {
	t.Parallel()
	a := pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "a"}
	b := pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "b"}
	c := &callers{ids: map[string]pki.SPIFFEID{"kept": a, "moved": a, "refused": a, "late": a, "twice": a, "waits": a}}
	reg := prometheus.NewRegistry()
	n, err := newNodeStreams(c.identify, slog.New(slog.DiscardHandler), reg)
	if err != nil {
		t.Fatal(err)
	}
	resolver := nodeResolver{trustDomain: "cluster.local", streams: n, identify: func(ctx context.Context) (string, string, error) {
		id, err := c.identify(ctx)
		return id.Namespace, id.ServiceAccount, err
	}}

	type open struct {
		ctx    chan context.Context // the handler's stream context, once it runs
		result chan error           // what the interceptor returned
		closes *atomic.Int32        // times its connection was closed
		recv   chan struct{}        // a RecvMsg of the handler's
	}
	start := func(caller string, handle func(ss grpc.ServerStream) error) open {
		o := open{ctx: make(chan context.Context, 1), result: make(chan error, 1), recv: make(chan struct{}, 1)}
		ctx, cancel := context.WithCancel(context.WithValue(t.Context(), callerKey{}, caller))
		t.Cleanup(cancel)
		ctx, o.closes = onTestConn(ctx)
		go func() {
			o.result <- n.intercept(nil, blockedStream{ctx: ctx, received: o.recv}, &grpc.StreamServerInfo{FullMethod: "/test/" + caller},
				func(_ any, ss grpc.ServerStream) error {
					o.ctx <- ss.Context()
					return handle(ss)
				})
		}()
		return o
	}
	// The handler waits for its client, as SDS's does.
	recv := func(ss grpc.ServerStream) error { return ss.RecvMsg(nil) }
	// The handler waits on its context, as a Workload API stream's does.
	wait := func(ss grpc.ServerStream) error {
		<-ss.Context().Done()
		return status.FromContextError(ss.Context().Err()).Err()
	}
	streams, contexts := map[string]open{}, map[string]context.Context{}
	for caller, handle := range map[string]func(grpc.ServerStream) error{"kept": recv, "moved": recv, "refused": recv, "twice": recv, "waits": wait} {
		streams[caller] = start(caller, handle)
		contexts[caller] = <-streams[caller].ctx
		if _, err := resolver.identity(contexts[caller]); err != nil {
			t.Fatal(err)
		}
	}
	// Those that wait in Recv do before the reload: else their connections would not be closed.
	for _, caller := range []string{"kept", "moved", "refused", "twice"} {
		<-streams[caller].recv
	}
	late := start("late", recv)
	lateCtx := <-late.ctx
	generation := n.generationNow() // "late" is identified under these rules...

	c.set("moved", &b)
	c.set("refused", nil)
	c.set("late", &b)
	c.set("waits", &b)
	n.reloaded() // ...which a reload replaces before its identity is noted
	n.note(lateCtx, a, generation)

	for caller, want := range map[string]string{"moved": "it is spiffe://cluster.local/ns/shop/sa/b now", "refused": "give it none now",
		"late": "it is spiffe://cluster.local/ns/shop/sa/b now", "waits": "it is spiffe://cluster.local/ns/shop/sa/b now"} {
		o := streams[caller]
		if caller == "late" {
			o = late
		}
		err := resultWithin(t, o.result)
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "identity changed") {
			t.Errorf("%s ended with %v, want Unavailable saying %q", caller, err, want)
		}
	}
	for caller, want := range map[string]int32{"moved": 1, "refused": 1, "waits": 0} {
		if got := streams[caller].closes.Load(); got != want {
			t.Errorf("%s's connection closed %d times, want %d", caller, got, want)
		}
	}
	// A second identity on one stream (an SDS request resolved after the rules changed, before
	// the reload's check) ends it; the same caller's call outside it (a unary call) does not.
	c.set("twice", &b)
	if _, err := resolver.identity(context.WithValue(t.Context(), callerKey{}, "twice")); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-streams["twice"].result:
		t.Fatalf("a call outside the stream ended it: %v", err)
	default:
	}
	if _, err := resolver.identity(contexts["twice"]); err != nil {
		t.Fatal(err)
	}
	if err := resultWithin(t, streams["twice"].result); status.Code(err) != codes.Unavailable {
		t.Errorf("a stream given a second identity ended with %v, want Unavailable", err)
	}
	select {
	case err := <-streams["kept"].result:
		t.Fatalf("the stream whose identity did not change ended: %v", err)
	default:
	}
	if got := streams["kept"].closes.Load(); got != 0 {
		t.Errorf("the connection of the caller whose identity did not change was closed %d times", got)
	}
	if got := testutil.ToFloat64(n.ended.WithLabelValues(streamEndedChanged)); got != 4 {
		t.Errorf("ended for a changed identity: %v, want 4 (moved, late, twice, waits)", got)
	}
	if got := testutil.ToFloat64(n.ended.WithLabelValues(streamEndedRefused)); got != 1 {
		t.Errorf("ended for a refused caller: %v, want 1", got)
	}
}

// An SDS stream whose identity's manager has failed, ended while its handler serves a request
// (from Resolve), is told why at its next Recv; its connection stays open.
func TestNodeStreamEndedBetweenRecvsIsToldAtTheNext(t *testing.T) {
	t.Parallel()
	id := pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "a"}
	c := &callers{ids: map[string]pki.SPIFFEID{"caller": id}}
	n, err := newNodeStreams(c.identify, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	ctx, closes := onTestConn(context.WithValue(t.Context(), callerKey{}, "caller"))
	failed := fmt.Errorf("%w: no inotify instance left (test)", errIdentityFailed)
	err = n.intercept(nil, blockedStream{ctx: ctx}, &grpc.StreamServerInfo{FullMethod: sdsMethodPrefix + "StreamSecrets"},
		func(_ any, ss grpc.ServerStream) error {
			n.note(ss.Context(), id, n.generationNow())
			n.endStreamFailed(ss.Context(), id, failed)
			return ss.RecvMsg(nil) // would wait for ever, were it not told
		})
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "no inotify instance left") {
		t.Errorf("ended with %v, want Unavailable naming the failure", err)
	}
	if got := closes.Load(); got != 0 {
		t.Errorf("its connection was closed %d times, want 0", got)
	}
	if got := testutil.ToFloat64(n.ended.WithLabelValues(streamEndedFailed)); got != 1 {
		t.Errorf("ended for a failed identity: %v, want 1", got)
	}
}

// resultWithin is what a stream's interceptor returned, failing the test if it goes on.
func resultWithin(t *testing.T, ch <-chan error) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(30 * time.Second):
		t.Fatal("the stream was not ended")
		return nil
	}
}

// When an identity's secret manager fails, its SDS streams that wait in Recv are ended by
// closing their connections (counted, each connection once); its Workload API streams (which
// are told of the failure by the registry) and other identities' streams are left.
func TestNodeStreamsOfAFailedIdentityHaveTheirConnectionsClosed(t *testing.T) {
	t.Parallel()
	failedID := pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "broken"}
	fine := pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "fine"}
	n, err := newNodeStreams((&callers{ids: map[string]pki.SPIFFEID{}}).identify, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	type open struct {
		result chan error
		closes *atomic.Int32
	}
	start := func(id pki.SPIFFEID, method string) open {
		o := open{result: make(chan error, 1)}
		ctx, cancel := context.WithCancel(t.Context())
		t.Cleanup(cancel)
		ctx, o.closes = onTestConn(ctx)
		received := make(chan struct{}, 1)
		go func() {
			o.result <- n.intercept(nil, blockedStream{ctx: ctx, received: received}, &grpc.StreamServerInfo{FullMethod: method},
				func(_ any, ss grpc.ServerStream) error {
					n.note(ss.Context(), id, n.generationNow())
					return ss.RecvMsg(nil)
				})
		}()
		<-received
		return o
	}
	sds := sdsMethodPrefix + "StreamSecrets"
	broken := []open{start(failedID, sds), start(failedID, sdsMethodPrefix+"DeltaSecrets")}
	api := start(failedID, "/SpiffeWorkloadAPI/FetchX509SVID")
	other := start(fine, sds)

	n.endFailed(failedID, fmt.Errorf("%w: no inotify instance left (test)", errIdentityFailed))
	for i, o := range broken {
		if err := resultWithin(t, o.result); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "no inotify instance left") {
			t.Errorf("SDS stream %d ended with %v, want Unavailable naming the failure", i, err)
		}
		if got := o.closes.Load(); got != 1 {
			t.Errorf("SDS stream %d's connection closed %d times, want 1", i, got)
		}
	}
	for what, o := range map[string]open{"the identity's Workload API stream": api, "another identity's SDS stream": other} {
		select {
		case err := <-o.result:
			t.Errorf("%s ended: %v", what, err)
		default:
		}
		if got := o.closes.Load(); got != 0 {
			t.Errorf("%s's connection closed %d times", what, got)
		}
	}
	if got := testutil.ToFloat64(n.ended.WithLabelValues(streamEndedFailed)); got != 2 {
		t.Errorf("ended for a failed identity: %v, want 2", got)
	}
}

// countedPipe is one end of a pipe that counts its closes.
type countedPipe struct {
	net.Conn
	closes *atomic.Int32
}

func (c countedPipe) Close() error {
	c.closes.Add(1)
	return c.Conn.Close()
}

// innerCredentials hand back the connection as a countedPipe, as admission's count theirs.
type innerCredentials struct {
	connCredentials // for the methods not under test
	closes          *atomic.Int32
}

func (c innerCredentials) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return countedPipe{Conn: conn, closes: c.closes}, innerInfo{}, nil
}

type innerInfo struct{ credentials.CommonAuthInfo }

func (innerInfo) AuthType() string { return "inner" }

// wrappingInfo is the AuthInfo of credentials around connCredentials, as the attestor's.
type wrappingInfo struct {
	credentials.CommonAuthInfo
	inner credentials.AuthInfo
}

func (wrappingInfo) AuthType() string               { return "wrapping" }
func (w wrappingInfo) Unwrap() credentials.AuthInfo { return w.inner }

// A connection handed over by connCredentials is found from a call's peer through the AuthInfo
// of credentials around them, and closing it again (grpc does, after the agent) closes what the
// inner credentials gave once.
func TestConnCredentialsHandTheConnectionToItsStreams(t *testing.T) {
	t.Parallel()
	server, client := net.Pipe()
	t.Cleanup(func() { _ = client.Close() })
	closes := &atomic.Int32{}
	conn, info, err := connCredentials{inner: innerCredentials{closes: closes}}.ServerHandshake(server)
	if err != nil {
		t.Fatal(err)
	}
	ctx := peer.NewContext(t.Context(), &peer.Peer{AuthInfo: wrappingInfo{inner: info}})
	found := connOf(ctx)
	if found == nil || found != conn {
		t.Fatalf("the call's connection is %v, want the handshake's %v", found, conn)
	}
	if connOf(t.Context()) != nil {
		t.Error("a call with no peer has a connection")
	}
	if err := found.Close(); err != nil {
		t.Fatal(err)
	}
	_ = conn.Close()
	if got := closes.Load(); got != 1 {
		t.Errorf("the inner connection was closed %d times, want 1", got)
	}
	if _, err := client.Read(make([]byte, 1)); err == nil {
		t.Error("the client's end still reads")
	}
}
