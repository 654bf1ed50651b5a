package sds_test

import (
	"strings"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"

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
