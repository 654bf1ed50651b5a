package discovery_test

import (
	"context"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/discovery"
)

// answerWithin bounds how long a test waits for an answer the server owes.
const answerWithin = 30 * time.Second

// labelled is the value of the series of a counter vector with exactly these labels.
func labelled(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	metrics:
		for _, m := range f.GetMetric() {
			if len(m.GetLabel()) != len(labels) {
				continue
			}
			for _, l := range m.GetLabel() {
				if labels[l.GetName()] != l.GetValue() {
					continue metrics
				}
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

// client is an ADS client of namespace ns, credential id (empty: the namespace's), on a
// connection of its own; its context ends after answerWithin.
func (h *discoveryHarness) client(ns, id string) (discoveryv3.AggregatedDiscoveryServiceClient, context.Context) {
	h.t.Helper()
	conn, err := grpc.NewClient(h.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { _ = conn.Close() })
	ctx, cancel := context.WithTimeout(h.t.Context(), answerWithin)
	h.t.Cleanup(cancel)
	ctx = metadata.AppendToOutgoingContext(ctx, "x-credential-namespace", ns)
	if id != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "x-credential-id", id)
	}
	return discoveryv3.NewAggregatedDiscoveryServiceClient(conn), ctx
}

// Every type go-control-plane's cache knows is answered, on SotW and delta streams alike, empty
// where the file has none; the four of the file were, before, the only ones.
func TestDiscoveryAnswersEveryEnvoyType(t *testing.T) {
	t.Parallel()
	h := startDiscovery(t, twoNamespaces)
	for _, typeURL := range []string{
		resource.ClusterType, resource.EndpointType, resource.ListenerType, resource.RouteType,
		resource.ScopedRouteType, resource.VirtualHostType, resource.SecretType, resource.RuntimeType,
		resource.ExtensionConfigType, resource.RateLimitConfigType,
	} {
		t.Run(typeURL, func(t *testing.T) {
			t.Parallel()
			client, ctx := h.client("prod", "")
			sotw, err := client.StreamAggregatedResources(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := sotw.Send(&discoveryv3.DiscoveryRequest{Node: &corev3.Node{Id: "sidecar"}, TypeUrl: typeURL}); err != nil {
				t.Fatal(err)
			}
			resp, err := sotw.Recv()
			if err != nil || resp.GetTypeUrl() != typeURL || resp.GetVersionInfo() == "" {
				t.Fatalf("SotW %s: %v, %v; want a versioned answer", typeURL, resp, err)
			}
			delta, err := client.DeltaAggregatedResources(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := delta.Send(&discoveryv3.DeltaDiscoveryRequest{Node: &corev3.Node{Id: "sidecar"}, TypeUrl: typeURL,
				ResourceNamesSubscribe: []string{"*"}}); err != nil {
				t.Fatal(err)
			}
			if resp, err := delta.Recv(); err != nil || resp.GetTypeUrl() != typeURL {
				t.Fatalf("delta %s: %v, %v; want an answer", typeURL, resp, err)
			}
		})
	}
}

// A type the server does not serve ends the stream with InvalidArgument, is counted and logged
// (paced, the type cut): a stream can no longer make the server hold a watch per type it
// invents.
func TestDiscoveryRefusesTypesItDoesNotServe(t *testing.T) {
	t.Parallel()
	long := "type.googleapis.com/" + strings.Repeat("x", 10000)
	for _, tc := range []struct {
		name, typeURL string
		delta         bool
	}{
		{"an unknown type", "type.googleapis.com/google.protobuf.Empty", false},
		{"a long type", long, false},
		{"an unknown debug type", "istio.io/debug/secrets", false},
		{"an unknown type on delta", "type.googleapis.com/google.protobuf.Empty", true},
		{"syncz on delta", discovery.DebugSyncz, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := startDiscovery(t, twoNamespaces)
			client, ctx := h.client("prod", "")
			const tries = 25 // more than the log lets through at once
			for range tries {
				var err error
				if tc.delta {
					var stream discoveryv3.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
					if stream, err = client.DeltaAggregatedResources(ctx); err != nil {
						t.Fatal(err)
					}
					_ = stream.Send(&discoveryv3.DeltaDiscoveryRequest{Node: &corev3.Node{Id: "sidecar"}, TypeUrl: tc.typeURL})
					_, err = stream.Recv()
				} else {
					var stream discoveryv3.AggregatedDiscoveryService_StreamAggregatedResourcesClient
					if stream, err = client.StreamAggregatedResources(ctx); err != nil {
						t.Fatal(err)
					}
					_ = stream.Send(&discoveryv3.DiscoveryRequest{Node: &corev3.Node{Id: "sidecar"}, TypeUrl: tc.typeURL})
					_, err = stream.Recv()
				}
				if status.Code(err) != codes.InvalidArgument {
					t.Fatalf("%s: %v, want InvalidArgument", tc.name, err)
				}
			}
			if got := labelled(t, h.registry, "meshid_discovery_refusals_total", map[string]string{"reason": "unknown_type", "code": "InvalidArgument"}); got != tries {
				t.Errorf("%v refusals counted, want %d", got, tries)
			}
			lines := h.logs.Records(t, "discovery request refused")
			// Ten at once, and one more if a second passed meanwhile.
			if len(lines) == 0 || len(lines) > 11 {
				t.Fatalf("%d lines logged for %d refusals, want the burst of 10", len(lines), tries)
			}
			rec := lines[0]
			if rec["identity"] != "spiffe://cluster.local/ns/prod/sa/test" || !strings.HasPrefix(rec["peer"].(string), "127.0.0.1:") ||
				rec["reason"] != "unknown_type" || len(rec["type_url"].(string)) > 300 || len(rec["error"].(string)) > 600 {
				t.Errorf("logged %v, want the identity, the peer, the reason and the type cut", rec)
			}
		})
	}
}

// Istio's agent sends its own types on Envoy's stream (its DNS proxy's name table with
// ISTIO_META_DNS_CAPTURE, WorkloadEntry health, proxy config). They are not served, and dropped
// rather than refused, counted: the stream they came on goes on, as pilot-agent's Envoy needs.
func TestDiscoveryDropsIstioAgentTypes(t *testing.T) {
	t.Parallel()
	h := startDiscovery(t, twoNamespaces)
	client, ctx := h.client("prod", "")
	sotw, err := client.StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	delta, err := client.DeltaAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, typeURL := range []string{
		"type.googleapis.com/istio.networking.nds.v1.NameTable",
		"type.googleapis.com/istio.v1.HealthInformation",
		"type.googleapis.com/istio.mesh.v1alpha1.ProxyConfig",
	} {
		if err := sotw.Send(&discoveryv3.DiscoveryRequest{Node: &corev3.Node{Id: "sidecar"}, TypeUrl: typeURL}); err != nil {
			t.Fatal(err)
		}
		if err := delta.Send(&discoveryv3.DeltaDiscoveryRequest{Node: &corev3.Node{Id: "sidecar"}, TypeUrl: typeURL}); err != nil {
			t.Fatal(err)
		}
	}
	if err := sotw.Send(&discoveryv3.DiscoveryRequest{TypeUrl: resource.ClusterType}); err != nil {
		t.Fatal(err)
	}
	if resp, err := sotw.Recv(); err != nil || resp.GetTypeUrl() != resource.ClusterType {
		t.Fatalf("SotW clusters after Istio's types: %v, %v", resp, err)
	}
	if err := delta.Send(&discoveryv3.DeltaDiscoveryRequest{TypeUrl: resource.ClusterType, ResourceNamesSubscribe: []string{"*"}}); err != nil {
		t.Fatal(err)
	}
	if resp, err := delta.Recv(); err != nil || resp.GetTypeUrl() != resource.ClusterType {
		t.Fatalf("delta clusters after Istio's types: %v, %v", resp, err)
	}
	if got := labelled(t, h.registry, "meshid_discovery_refusals_total", map[string]string{"reason": "istio_agent_type", "code": "dropped"}); got != 6 {
		t.Errorf("%v requests of Istio's agent types counted, want 6", got)
	}
}
