package agent

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/pki"
)

// blockedStream is a server stream whose client sends nothing until the test ends it.
type blockedStream struct {
	grpc.ServerStream
	ctx context.Context //nolint:containedctx // the stream's
}

func (b blockedStream) Context() context.Context { return b.ctx }
func (b blockedStream) RecvMsg(any) error {
	<-b.ctx.Done()
	return status.FromContextError(b.ctx.Err()).Err()
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
// whose caller now has another identity or none (Unavailable, counted by reason), and leaves the
// others; a stream identified under rules a reload replaced before its identity was noted is
// checked then; and a stream given a second identity is ended at once.
func TestNodeStreamsEndWhenTheCallersIdentityChanges(t *testing.T) {
	t.Parallel()
	a := pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "a"}
	b := pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "b"}
	c := &callers{ids: map[string]pki.SPIFFEID{"kept": a, "moved": a, "refused": a, "late": a, "twice": a}}
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
	}
	start := func(caller string) open {
		o := open{ctx: make(chan context.Context, 1), result: make(chan error, 1)}
		ctx, cancel := context.WithCancel(context.WithValue(t.Context(), callerKey{}, caller))
		t.Cleanup(cancel)
		go func() {
			o.result <- n.intercept(nil, blockedStream{ctx: ctx}, &grpc.StreamServerInfo{FullMethod: "/test/" + caller},
				func(_ any, ss grpc.ServerStream) error {
					o.ctx <- ss.Context()
					return ss.RecvMsg(nil) // the handler waits for its client, as SDS's does
				})
		}()
		return o
	}
	streams, contexts := map[string]open{}, map[string]context.Context{}
	for _, caller := range []string{"kept", "moved", "refused", "twice"} {
		streams[caller] = start(caller)
		contexts[caller] = <-streams[caller].ctx
		if _, err := resolver.identity(contexts[caller]); err != nil {
			t.Fatal(err)
		}
	}
	late := start("late")
	lateCtx := <-late.ctx
	generation := n.generationNow() // "late" is identified under these rules...

	c.set("moved", &b)
	c.set("refused", nil)
	c.set("late", &b)
	n.reloaded() // ...which a reload replaces before its identity is noted
	n.note(lateCtx, a, generation)

	for caller, want := range map[string]string{"moved": "it is spiffe://cluster.local/ns/shop/sa/b now", "refused": "give it none now",
		"late": "it is spiffe://cluster.local/ns/shop/sa/b now"} {
		o := streams[caller]
		if caller == "late" {
			o = late
		}
		err := resultWithin(t, o.result)
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "identity changed") {
			t.Errorf("%s ended with %v, want Unavailable saying %q", caller, err, want)
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
	if got := testutil.ToFloat64(n.ended.WithLabelValues(streamEndedChanged)); got != 3 {
		t.Errorf("ended for a changed identity: %v, want 3 (moved, late, twice)", got)
	}
	if got := testutil.ToFloat64(n.ended.WithLabelValues(streamEndedRefused)); got != 1 {
		t.Errorf("ended for a refused caller: %v, want 1", got)
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
