package sds_test

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/sds/sdstest"
	"github.com/meshid/meshid/secretmanager"
)

// PublishAs makes s the current secret of key, which Envoy asks for by s.Name.
func (f *fakeSecrets) PublishAs(key string, s *secretmanager.Secret) {
	f.set(key, fakeState{secret: s})
}

// taggedCredentials name each connection's caller at the handshake, in the order connections
// come: a stand-in for a node agent's attestation.
type taggedCredentials struct {
	credentials.TransportCredentials
	callers []string
	next    *atomic.Int64
}

// tagged is the AuthInfo of taggedCredentials; it unwraps to the admission's.
type tagged struct {
	credentials.AuthInfo
	caller string
}

func (t tagged) Unwrap() credentials.AuthInfo { return t.AuthInfo }

func (c taggedCredentials) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, inner, err := c.TransportCredentials.ServerHandshake(conn)
	if err != nil {
		return nil, nil, err
	}
	caller := "nobody"
	if n := int(c.next.Add(1)) - 1; n < len(c.callers) {
		caller = c.callers[n]
	}
	return conn, tagged{AuthInfo: inner, caller: caller}, nil
}

func (c taggedCredentials) Clone() credentials.TransportCredentials { return c }

var errNobody = errors.New("no rule matches the caller")

// resolveByCaller gives each tagged caller its own "default"; "nobody" is refused.
func resolveByCaller(ctx context.Context, name string) (string, error) {
	p, _ := peer.FromContext(ctx)
	info, ok := p.AuthInfo.(tagged)
	if !ok || info.caller == "nobody" {
		return "", errNobody
	}
	if name == dflt {
		return dflt + "@" + info.caller, nil
	}
	return name, nil
}

// perCaller runs a server whose connections are callers a, b, then nobody, in the order they
// first call.
func perCaller(t *testing.T, f *fakeSecrets) *harness {
	t.Helper()
	return startServer(t, f, func(c *sds.Config) {
		c.Resolve = resolveByCaller
		c.Credentials = func(inner credentials.TransportCredentials) credentials.TransportCredentials {
			return taggedCredentials{TransportCredentials: inner, callers: []string{"a", "b"}, next: &atomic.Int64{}}
		}
	})
}

// Two callers asking for "default" get each their own secret, named "default" as asked; a
// rotation of one reaches only its streams.
func TestResolveGivesEachCallerItsOwnSecret(t *testing.T) {
	t.Parallel()
	for _, protocol := range []string{"sotw", "delta"} {
		t.Run(protocol, func(t *testing.T) {
			t.Parallel()
			p, f := newPKI(t), newFakeSecrets()
			a1, b1, roots := p.workload(t), p.workload(t), p.roots(t, rootCA)
			f.PublishAs(dflt+"@a", a1)
			f.PublishAs(dflt+"@b", b1)
			f.Publish(roots)
			h := perCaller(t, f)
			// One stream per caller, opened in turn: the first connection is a's.
			type stream struct {
				recv func() sdstest.Push
				ack  func(sdstest.Push)
			}
			open := func(e *sdstest.Envoy) stream {
				if protocol == "sotw" {
					s := e.StreamSecrets()
					s.Subscribe(dflt, rootCA)
					return stream{recv: s.Recv, ack: func(p sdstest.Push) { s.Ack(p, dflt, rootCA) }}
				}
				d := e.DeltaSecrets()
				d.Subscribe(dflt, rootCA)
				return stream{recv: d.Recv, ack: d.Ack}
			}
			a := open(h.envoy)
			pa := a.recv()
			expect(t, pa, a1, roots)
			a.ack(pa)
			b := open(sdstest.Dial(t, h.socket))
			pb := b.recv()
			expect(t, pb, b1, roots)
			b.ack(pb)

			a2 := p.workload(t)
			f.PublishAs(dflt+"@a", a2)
			expect(t, a.recv(), a2)
			// b was not sent a's rotation: its next push is its own.
			b2 := p.workload(t)
			f.PublishAs(dflt+"@b", b2)
			expect(t, b.recv(), b2)
			if got := h.server.Subscriptions(); got[dflt+"@a"] != 1 || got[dflt+"@b"] != 1 || got[dflt] != 0 {
				t.Fatalf("subscriptions %v, want one stream on each caller's key", got)
			}
			if f.Calls(dflt) != 0 {
				t.Fatal("the secret manager was asked for the unresolved name")
			}
		})
	}
}

// A fetch resolves its names as a stream does.
func TestResolveFetch(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	a1, roots := p.workload(t), p.roots(t, rootCA)
	f.PublishAs(dflt+"@a", a1)
	f.Publish(roots)
	h := perCaller(t, f)
	ctx, cancel := context.WithTimeout(t.Context(), waitLimit)
	defer cancel()
	got, err := h.envoy.Fetch(ctx, dflt, rootCA)
	if err != nil {
		t.Fatal(err)
	}
	checkAll(t, got, a1, roots)
}

// A caller the resolver refuses is refused its stream or fetch with PermissionDenied, counted
// and logged with who asked.
func TestResolveRefusesTheUnidentified(t *testing.T) {
	t.Parallel()
	for _, protocol := range []string{"sotw", "delta", "fetch"} {
		t.Run(protocol, func(t *testing.T) {
			t.Parallel()
			p, f := newPKI(t), newFakeSecrets()
			f.PublishAs(dflt+"@a", p.workload(t))
			h := perCaller(t, f)
			// a and b connect first: the third connection is nobody's.
			const unknown = "unknown"
			f.Refuse(unknown, secretmanager.ErrUnknownSecret)
			for range 2 {
				e := sdstest.Dial(t, h.socket)
				ctx, cancel := context.WithTimeout(t.Context(), waitLimit)
				if _, err := e.Fetch(ctx, unknown); status.Code(err) != codes.InvalidArgument {
					t.Fatalf("fetch of an unknown name: %v", err)
				}
				cancel()
				e.Close()
			}
			nobody := sdstest.Dial(t, h.socket)
			var st *status.Status
			switch protocol {
			case "sotw":
				s := nobody.StreamSecrets()
				s.Subscribe(dflt)
				st = s.RecvErr()
			case "delta":
				d := nobody.DeltaSecrets()
				d.Subscribe(dflt)
				st = d.RecvErr()
			case "fetch":
				ctx, cancel := context.WithTimeout(t.Context(), waitLimit)
				defer cancel()
				_, err := nobody.Fetch(ctx, dflt)
				st = status.Convert(err)
			}
			if st.Code() != codes.PermissionDenied || !strings.Contains(st.Message(), errNobody.Error()) {
				t.Fatalf("status %v, want PermissionDenied saying %q", st, errNobody)
			}
			if n := h.refusals(t)["unidentified/PermissionDenied"]; n != 1 {
				t.Fatalf("refusals %v, want one unidentified", h.refusals(t))
			}
			lines := logLines(h.logs.String(), "SDS request refused")
			var found bool
			for _, l := range lines {
				// The peer is named through the wrapping credentials (admission.Peer unwraps).
				if strings.Contains(l, "reason=unidentified") && strings.Contains(l, "peer=\"conn=3") {
					found = true
				}
			}
			if !found {
				t.Fatalf("no refusal line naming the third connection:\n%s", strings.Join(lines, "\n"))
			}
		})
	}
}

// A refusal the resolver says it has logged (an attestor's, with the caller's process) is
// counted but not logged a second time.
func TestResolveRefusalLoggedWhereDecidedIsOnlyCounted(t *testing.T) {
	t.Parallel()
	f := newFakeSecrets()
	h := startServer(t, f, func(c *sds.Config) {
		c.Resolve = func(context.Context, string) (string, error) { return "", admission.Logged(errNobody) }
	})
	s := sdstest.Dial(t, h.socket).StreamSecrets()
	s.Subscribe(dflt)
	if st := s.RecvErr(); st.Code() != codes.PermissionDenied || !strings.Contains(st.Message(), errNobody.Error()) {
		t.Fatalf("status %v, want PermissionDenied saying %q", st, errNobody)
	}
	if n := h.refusals(t)["unidentified/PermissionDenied"]; n != 1 {
		t.Fatalf("refusals %v, want one unidentified", h.refusals(t))
	}
	if lines := logLines(h.logs.String(), "SDS request refused"); len(lines) != 0 {
		t.Fatalf("the refusal was logged again:\n%s", strings.Join(lines, "\n"))
	}
}
