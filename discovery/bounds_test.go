package discovery_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	statusv3 "github.com/envoyproxy/go-control-plane/envoy/service/status/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshid/meshid/discovery"
)

// openCDS opens a SotW stream as client, sends a CDS request with node and returns the stream
// and the error of the first answer.
func openCDS(ctx context.Context, client discoveryv3.AggregatedDiscoveryServiceClient, node *corev3.Node) (discoveryv3.AggregatedDiscoveryService_StreamAggregatedResourcesClient, error) {
	stream, err := client.StreamAggregatedResources(ctx)
	if err != nil {
		return nil, err
	}
	if err := stream.Send(&discoveryv3.DiscoveryRequest{Node: node, TypeUrl: resource.ClusterType}); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	_, err = stream.Recv()
	return stream, err
}

// Streams are capped overall and per credential (one token: 10,000 streams through an agent's
// proxy took the CA to 330 MB); a stream that ends gives its place back.
func TestDiscoveryCapsStreams(t *testing.T) {
	t.Parallel()
	h := startDiscoveryWith(t, twoNamespaces, func(c *discovery.ServerConfig) {
		c.MaxStreams, c.MaxStreamsPerCredential = 3, 2
	})
	node := &corev3.Node{Id: "sidecar"}
	alice, aliceCtx := h.client("prod", "alice")
	var aliceStreams []discoveryv3.AggregatedDiscoveryService_StreamAggregatedResourcesClient
	for range 2 {
		stream, err := openCDS(aliceCtx, alice, node)
		if err != nil {
			t.Fatalf("alice's stream under the caps: %v", err)
		}
		aliceStreams = append(aliceStreams, stream)
	}
	if _, err := openCDS(aliceCtx, alice, node); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("alice's third stream: %v, want ResourceExhausted", err)
	}
	bob, bobCtx := h.client("prod", "bob")
	if _, err := openCDS(bobCtx, bob, node); err != nil {
		t.Fatalf("bob's stream, refused for alice's: %v", err)
	}
	carol, carolCtx := h.client("default", "carol")
	if _, err := openCDS(carolCtx, carol, node); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a fourth stream overall: %v, want ResourceExhausted", err)
	}
	// One of alice's ends: once the client sees it end, its place is free.
	if err := aliceStreams[0].CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := aliceStreams[0].Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("alice's closed stream: %v, want its end", err)
	}
	if _, err := openCDS(aliceCtx, alice, node); err != nil {
		t.Fatalf("alice's stream after one of hers ended: %v", err)
	}
	for reason, want := range map[string]float64{"too_many_streams_per_credential": 1, "too_many_streams": 1} {
		if got := labelled(t, h.registry, "meshid_discovery_refusals_total", map[string]string{"reason": reason, "code": "ResourceExhausted"}); got != want {
			t.Errorf("%s: %v refusals counted, want %v", reason, got, want)
		}
	}
	if lines := h.logs.Records(t, "discovery request refused"); len(lines) != 2 || lines[0]["identity"] != "spiffe://cluster.local/ns/prod/sa/test" {
		t.Errorf("refusals logged: %v", lines)
	}
}

// A node over 512 KiB is refused (50 streams with 3.9 MB nodes held gigabytes); Envoy's and
// pilot-agent's, of a few kB, pass, and so does one of 400 kB.
func TestDiscoveryRefusesLargeNodes(t *testing.T) {
	t.Parallel()
	h := startDiscovery(t, twoNamespaces)
	client, ctx := h.client("prod", "")
	nodeOf := func(size int) *corev3.Node {
		return &corev3.Node{Id: "sidecar", Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
			"BLOB": structpb.NewStringValue(strings.Repeat("x", size)),
		}}}
	}
	for _, tc := range []struct {
		name string
		size int
		want codes.Code
	}{
		{"a sidecar's", 4 << 10, codes.OK},
		{"400 kB", 400 << 10, codes.OK},
		{"600 kB", 600 << 10, codes.InvalidArgument},
	} {
		if _, err := openCDS(ctx, client, nodeOf(tc.size)); status.Code(err) != tc.want {
			t.Errorf("%s node: %v, want %v", tc.name, err, tc.want)
		}
	}
	// Sent later in the stream, too.
	stream, err := openCDS(ctx, client, nodeOf(1<<10))
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&discoveryv3.DiscoveryRequest{Node: nodeOf(600 << 10), TypeUrl: resource.ListenerType}); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); status.Code(err) != codes.InvalidArgument {
		t.Errorf("a large node in a later request: %v, want InvalidArgument", err)
	}
	if got := labelled(t, h.registry, "meshid_discovery_refusals_total", map[string]string{"reason": "node_too_large", "code": "InvalidArgument"}); got != 2 {
		t.Errorf("%v refusals counted, want 2", got)
	}
}

// syncz lists at most 1,000 nodes and stays within the answer size, sorted as before, its last
// resource saying how many nodes were left out (one token's 50 streams with 3.9 MB nodes made
// each answer 195 MB). The stream that asks is listed too, first: it has sent no node.
func TestSynczIsCapped(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name          string
		nodes, idSize int
		wantListed    int // with the asking stream's
	}{
		{"by count", 1003, 10, 1000},
		{"by size", 12, 500 << 10, 9}, // 8 ids of 500 kB (and their JSON) fit in 4 MiB less the margin
		{"uncut", 5, 10, 6},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := startDiscovery(t, twoNamespaces)
			// Streams of several credentials, below the per-credential cap.
			var clients []discoveryv3.AggregatedDiscoveryServiceClient
			var ctxs []context.Context
			for i := range (tc.nodes + 99) / 100 {
				c, cctx := h.client("prod", fmt.Sprint("node-", i))
				clients, ctxs = append(clients, c), append(ctxs, cctx)
			}
			for i := range tc.nodes {
				id := fmt.Sprintf("sidecar-%05d-%s", i, strings.Repeat("x", tc.idSize))
				if _, err := openCDS(ctxs[i/100], clients[i/100], &corev3.Node{Id: id}); err != nil {
					t.Fatalf("node %d: %v", i, err)
				}
			}
			asker, askerCtx := h.client("prod", "asker")
			stream, err := asker.StreamAggregatedResources(askerCtx)
			if err != nil {
				t.Fatal(err)
			}
			if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: discovery.DebugSyncz}); err != nil {
				t.Fatal(err)
			}
			resp, err := stream.Recv()
			if err != nil {
				t.Fatal(err)
			}
			var ids []string
			left := 0.0
			for _, a := range resp.GetResources() {
				v := &structpb.Value{}
				if err := a.UnmarshalTo(v); err != nil {
					t.Fatal(err)
				}
				data, err := protojson.Marshal(v)
				if err != nil {
					t.Fatal(err)
				}
				cc := &statusv3.ClientConfig{}
				if err := protojson.Unmarshal(data, cc); err != nil {
					t.Fatal(err)
				}
				if cc.GetNode().GetId() == discovery.LeftOutNodeID {
					left = cc.GetNode().GetMetadata().GetFields()[discovery.LeftOutMetadataKey].GetNumberValue()
					continue
				}
				ids = append(ids, cc.GetNode().GetId())
			}
			if len(ids) != tc.wantListed || int(left) != tc.nodes+1-tc.wantListed {
				t.Fatalf("%d nodes listed and %v left out, want %d and %d", len(ids), left, tc.wantListed, tc.nodes+1-tc.wantListed)
			}
			for i, id := range ids[1:] {
				if !strings.HasPrefix(id, fmt.Sprintf("sidecar-%05d-", i)) {
					t.Fatalf("node %d is %.20s…, want them sorted by id after the asker's", i, id)
				}
			}
			if size := len(resp.String()); size > discovery.MaxAnswerSize {
				t.Fatalf("the answer is %d bytes, over %d", size, discovery.MaxAnswerSize)
			}
		})
	}
}

// A configuration with an answer that would pass the send limit is refused, at start and on
// reload (the last good one serving on), naming the namespace and the type.
func TestConfigWithAnOversizedAnswerIsRefused(t *testing.T) {
	t.Parallel()
	many := func(n, nameSize int, fields string) string {
		var b strings.Builder
		b.WriteString("[")
		for i := range n {
			fmt.Fprintf(&b, `{"name": "r%d-%s"%s},`, i, strings.Repeat("x", nameSize), fields)
		}
		return strings.TrimSuffix(b.String(), ",") + "]"
	}
	manyClusters := func(n, nameSize int) string { return many(n, nameSize, `, "connect_timeout": "1s"`) }
	for _, tc := range []struct {
		name, config string
		want         []string
	}{
		{"a namespace's clusters", `{"namespaces": {"prod": {"clusters": ` + manyClusters(4, 1100<<10) + `}}}`,
			[]string{"namespace prod", resource.ClusterType}},
		{"the top-level clusters", `{"clusters": ` + manyClusters(4, 1100<<10) + `}`,
			[]string{"top-level", resource.ClusterType}},
		// Each answer of a type fits; the config dump, all of them as JSON, does not.
		{"a namespace's config dump", `{"namespaces": {"prod": {"clusters": ` + manyClusters(2, 1<<20) + `, "routes": ` + many(2, 1<<20, "") + `}}}`,
			[]string{"namespace prod", discovery.DebugConfigDump}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			path := filepath.Join(t.TempDir(), "xds.yaml")
			if err := os.WriteFile(path, []byte(tc.config), 0o600); err != nil {
				t.Fatal(err)
			}
			_, err := discovery.NewServer(discovery.ServerConfig{ConfigPath: path, Authorizer: headerAuthenticator{}})
			for _, want := range tc.want {
				if err == nil || !strings.Contains(err.Error(), want) {
					t.Fatalf("start: %v, want an error naming %q", err, want)
				}
			}
		})
	}
	// On reload, as any invalid edit (a few MB of JSON take seconds under -race: one case).
	h := startDiscovery(t, twoNamespaces)
	h.write(`{"namespaces": {"prod": {"clusters": ` + manyClusters(4, 1100<<10) + `}}}`)
	if err := h.reloaded(); err == nil || !strings.Contains(err.Error(), "namespace prod") {
		t.Fatalf("reload: %v, want it refused naming namespace prod", err)
	}
	if got, _ := clusters(t, h.ads("prod", "")); len(got) != 1 || got[0] != "prod-backend" {
		t.Fatalf("after the refused reload prod gets %v, want the last good [prod-backend]", got)
	}
}
