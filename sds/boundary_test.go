package sds_test

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/sds/sdstest"
)

// Attack: any type URL was taken, and each one left a watch on the stream (6,000 type URLs cost
// 12 s of CPU), answered with secrets. A request for anything but secrets ends its stream with
// InvalidArgument before a watch or a subscription is made, SotW and delta alike.
func TestOtherTypesAreRefused(t *testing.T) {
	t.Parallel()
	const cluster = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
	for _, tc := range []struct {
		name, typeURL string
	}{
		{"a cluster", cluster},
		{"garbage", "x" + strings.Repeat("y", 10000)},
		{"the secret type, misspelt", sdstest.TypeURL + " "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, f := newPKI(t), newFakeSecrets()
			f.Publish(p.workload(t))
			h := startServer(t, f)
			s := h.sotw()
			s.Send(&discovery.DiscoveryRequest{Node: h.envoy.Node, ResourceNames: []string{dflt}, TypeUrl: tc.typeURL})
			if st := s.RecvErr(); st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), "type") {
				t.Fatalf("SotW stream of type %.40q: %v, want InvalidArgument", tc.typeURL, st)
			}
			d := h.delta()
			d.Send(&discovery.DeltaDiscoveryRequest{Node: h.envoy.Node, ResourceNamesSubscribe: []string{dflt}, TypeUrl: tc.typeURL})
			if st := d.RecvErr(); st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), "type") {
				t.Fatalf("delta stream of type %.40q: %v, want InvalidArgument", tc.typeURL, st)
			}
			if n := f.Calls(dflt); n != 0 {
				t.Fatalf("the server subscribed to default %d times for a request of another type", n)
			}
			checkRefusals(t, h, map[string]float64{"unsupported_type/InvalidArgument": 2})
			if logs := h.logs.String(); len(logs) > 4000 || !strings.Contains(logs, "unsupported_type") {
				t.Fatalf("refusals not logged, or logged unbounded (%d bytes):\n%.2000s", len(logs), logs)
			}
		})
	}
}

// A secret stream that switches to another type mid-way is refused too, and the secrets it
// subscribed to go on being served to others.
func TestTypeSwitchIsRefused(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1 := p.workload(t)
	f.Publish(d1)
	h := startServer(t, f)
	s := h.sotw()
	s.Subscribe(dflt)
	first := s.Recv()
	expect(t, first, d1)
	s.Send(&discovery.DiscoveryRequest{VersionInfo: first.Version, ResponseNonce: first.Nonce, ResourceNames: []string{dflt},
		TypeUrl: "type.googleapis.com/envoy.config.listener.v3.Listener"})
	if st := s.RecvErr(); st.Code() != codes.InvalidArgument {
		t.Fatalf("a switch to listeners: %v, want InvalidArgument", st)
	}
	other := h.sotw()
	other.Subscribe(dflt)
	expect(t, other.Recv(), d1)
}

// Attack: 20,000 streams took the agent to 469 MB. Past MaxStreams, open at once on any number
// of connections (FetchSecrets calls in progress included), a stream is refused with
// ResourceExhausted, logged with the peer and counted; one that ends frees its place.
func TestStreamLimit(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1 := p.workload(t)
	f.Publish(d1)
	h := startServer(t, f, func(c *sds.Config) { c.MaxStreams = 3 })
	second := sdstest.Dial(t, h.socket)
	open := []*sdstest.Stream{h.sotw(), second.StreamSecrets(), second.StreamSecrets()}
	for _, s := range open {
		s.Subscribe(dflt)
		expect(t, s.Recv(), d1)
	}
	over := []func() *status.Status{
		func() *status.Status { s := h.sotw(); s.Subscribe(dflt); return s.RecvErr() },
		func() *status.Status { d := second.DeltaSecrets(); d.Subscribe(dflt); return d.RecvErr() },
		func() *status.Status {
			ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
			defer cancel()
			_, err := h.envoy.Fetch(ctx, dflt)
			return status.Convert(err)
		},
	}
	for i, call := range over {
		if st := call(); st.Code() != codes.ResourceExhausted {
			t.Fatalf("call %d over the limit: %v, want ResourceExhausted", i, st)
		}
	}
	checkRefusals(t, h, map[string]float64{"too_many_streams/ResourceExhausted": 3})
	if logs := h.logs.String(); !strings.Contains(logs, "reason=too_many_streams") || !strings.Contains(logs, "peer=") {
		t.Fatalf("the refusal was not logged with the peer:\n%s", logs)
	}

	// An ended stream frees its place (the server has released it before the client reads the end).
	open[0].CloseSend()
	if _, err := open[0].Stream.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("Recv: %v, want the end of the stream", err)
	}
	again := h.sotw()
	again.Subscribe(dflt)
	expect(t, again.Recv(), d1)
}

// A connection is bounded too, by HTTP/2: the server advertises MaxStreamsPerConnection in its
// SETTINGS, so that a client holds further streams back, and a client that
// floods it with pings is sent away (GOAWAY).
func TestConnectionSettings(t *testing.T) {
	t.Parallel()
	h := startServer(t, newFakeSecrets(), func(c *sds.Config) { c.MaxStreamsPerConnection = 7 })
	conn := testutil.H2Dial(t, h.socket)
	settings := conn.Settings(t)
	if got, ok := settings[testutil.H2SettingMaxConcurrentStreams]; !ok || got != 7 {
		t.Fatalf("SETTINGS_MAX_CONCURRENT_STREAMS = %d (sent: %v), want 7", got, ok)
	}
	for range 10 {
		conn.Write(t, testutil.H2FramePing, 0, make([]byte, 8))
	}
	if code, ok := conn.GoAway(t); !ok || code != testutil.H2ErrEnhanceYourCalm {
		t.Fatalf("a ping flood: GOAWAY %v with code %#x, want ENHANCE_YOUR_CALM", ok, code)
	}
}

// A request over the size limit (1 MiB; SDS requests are a node and a few names) ends its
// stream with ResourceExhausted before any secret is subscribed to.
func TestOversizedRequest(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	f.Publish(p.workload(t))
	h := startServer(t, f)
	huge := strings.Repeat("n", 2<<20)
	s := h.sotw()
	s.Send(&discovery.DiscoveryRequest{Node: h.envoy.Node, ResourceNames: []string{dflt, huge}})
	if st := s.RecvErr(); st.Code() != codes.ResourceExhausted {
		t.Fatalf("a 2 MiB request: %v, want ResourceExhausted", st)
	}
	d := h.delta()
	d.Send(&discovery.DeltaDiscoveryRequest{Node: h.envoy.Node, ResourceNamesSubscribe: []string{dflt, huge}})
	if st := d.RecvErr(); st.Code() != codes.ResourceExhausted {
		t.Fatalf("a 2 MiB delta request: %v, want ResourceExhausted", st)
	}
	// Refused by grpc's transport, before any handler: not counted (a wrapper that could count it
	// costs every stream 4 kB).
	if n := f.Calls(dflt); n != 0 {
		t.Fatalf("the server subscribed to default %d times for an oversized request", n)
	}
}

// Connections are bounded by MaxStreams too (one that carries no stream serves nothing): past it
// a new connection is closed at once, counted and logged; a closed one frees its place.
func TestConnectionLimit(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1 := p.workload(t)
	f.Publish(d1)
	h := startServer(t, f, func(c *sds.Config) { c.MaxStreams = 2 })
	second := sdstest.Dial(t, h.socket)
	for _, e := range []*sdstest.Envoy{h.envoy, second} {
		s := e.StreamSecrets()
		s.Subscribe(dflt)
		expect(t, s.Recv(), d1)
	}
	fetch := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
		defer cancel()
		e := sdstest.Dial(t, h.socket)
		defer e.Close()
		_, err := e.Fetch(ctx, dflt)
		return err
	}
	if err := fetch(); status.Code(err) != codes.Unavailable {
		t.Fatalf("a third connection: %v, want Unavailable (closed)", err)
	}
	if n := h.refusals(t)["too_many_connections/closed"]; n < 1 {
		t.Fatalf("meshid_sds_refusals_total = %v, want too_many_connections/closed", h.refusals(t))
	}
	if logs := h.logs.String(); !strings.Contains(logs, "reason=too_many_connections") || !strings.Contains(logs, "peer=") {
		t.Fatalf("the refusal was not logged with the peer:\n%s", logs)
	}

	// The server sees a closed connection a moment after the client, and releases its stream a
	// moment after the connection: until both, a new connection is closed (Unavailable) or its
	// fetch refused (ResourceExhausted); the first one after is served.
	second.Close()
	limit := time.Now().Add(waitLimit)
	for err := fetch(); err != nil; err = fetch() {
		if code := status.Code(err); code != codes.Unavailable && code != codes.ResourceExhausted || time.Now().After(limit) {
			t.Fatalf("after a connection closed: %v", err)
		}
	}
}

// Attack: FetchSecrets without a node was answered while a stream without one is refused. A
// fetch without a node (none, or one without an id) is refused the same way: InvalidArgument,
// counted as missing_node, before any secret is subscribed to.
func TestFetchWithoutNodeIsRefused(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	f.Publish(p.workload(t))
	h := startServer(t, f)
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()

	s := h.sotw()
	s.Send(&discovery.DiscoveryRequest{ResourceNames: []string{dflt}})
	stream := s.RecvErr()
	if stream.Code() != codes.InvalidArgument {
		t.Fatalf("a stream without a node: %v, want InvalidArgument", stream)
	}
	for _, node := range []*core.Node{nil, {}, {Cluster: "cart.shop"}} {
		resp, err := h.envoy.Client.FetchSecrets(ctx, &discovery.DiscoveryRequest{Node: node, ResourceNames: []string{dflt}})
		if st := status.Convert(err); st.Code() != stream.Code() || st.Message() != stream.Message() {
			t.Fatalf("a fetch with node %v: %v (%d secrets), want %v as for a stream", node, err, len(resp.GetResources()), stream.Err())
		}
	}
	checkRefusals(t, h, map[string]float64{"missing_node/InvalidArgument": 4})
	if n := f.Calls(dflt); n != 0 {
		t.Fatalf("the server subscribed to default %d times for requests without a node", n)
	}
}
