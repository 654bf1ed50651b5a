package sds_test

import (
	"context"
	"strings"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/sds/sdstest"
	"github.com/meshid/meshid/secretmanager"
)

func TestDelta(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1, r1, sp := p.workload(t), p.roots(t, rootCA), p.roots(t, spare)
	for _, s := range []*secretmanager.Secret{d1, r1, sp} {
		f.Publish(s)
	}
	h := startServer(t, f)

	d := h.delta()
	d.Subscribe(dflt, rootCA)
	first, versions, got := d.RecvAll(dflt, rootCA)
	checkAll(t, got, d1, r1)
	if versions[dflt] != d1.Version || versions[rootCA] != r1.Version {
		t.Fatalf("per-resource versions %v, want default=%s ROOTCA=%s", versions, d1.Version, r1.Version)
	}

	// ACK (without the node, as Envoy sends it): no response; the next one is the rotation.
	d.Ack(first)
	d2 := p.workload(t)
	f.Publish(d2)
	rotated := d.Recv()
	expect(t, rotated, d2)

	// A subscription change is honoured whatever nonce it carries (here an old one).
	d.Update(first, []string{spare}, []string{rootCA})
	added := d.Recv()
	expect(t, added, sp)

	// NACK: no re-send. ROOTCA, unsubscribed, is not pushed either: the next response is d3.
	const detail = "Failed to load trusted CA certificates from <inline>: test rejection"
	d.Nack(added, detail)
	r2 := p.roots(t, rootCA)
	f.Publish(r2)
	d3 := p.workload(t)
	f.Publish(d3)
	expect(t, d.Recv(), d3)
	if n := h.nacks(t); n != 1 {
		t.Fatalf("meshid_sds_nacks_total = %v, want 1", n)
	}
	if logs := h.logs.String(); !strings.Contains(logs, `error_detail="`+detail+`"`) {
		t.Fatalf("the NACK was not logged with its error_detail:\n%s", logs)
	}
	// A delta NACK subscribes to nothing: the line names the secrets of the response it rejects.
	if line := logLines(h.logs.String(), "Envoy rejected secrets (NACK); not sending them again until they change"); len(line) != 1 || !strings.Contains(line[0], "secrets=["+spare+"]") {
		t.Fatalf("the NACK's line does not name %s, the secret it rejects: %q", spare, line)
	}

	// A stream that already holds the current versions (an Envoy reconnecting) gets nothing
	// until one changes.
	e := h.delta()
	e.Send(&discovery.DeltaDiscoveryRequest{
		Node:                    &core.Node{Id: nodeID},
		ResourceNamesSubscribe:  []string{dflt, rootCA},
		InitialResourceVersions: map[string]string{dflt: d3.Version, rootCA: r2.Version},
	})
	d4 := p.workload(t)
	f.Publish(d4)
	expect(t, e.Recv(), d4)
	checkRefusals(t, h, map[string]float64{})
}

func TestFetch(t *testing.T) {
	t.Parallel()
	const unknown, forbidden = "spiffe://cluster.local/ns/shop/sa/other", "file-root:/etc/passwd"
	p, f := newPKI(t), newFakeSecrets()
	d1, r1 := p.workload(t), p.roots(t, rootCA)
	f.Publish(d1)
	f.Publish(r1)
	f.Refuse(unknown, secretmanager.ErrUnknownSecret)
	f.Refuse(forbidden, secretmanager.ErrForbiddenPath)
	h := startServer(t, f)

	for _, tc := range []struct {
		name  string
		names []string
		want  []*secretmanager.Secret
		code  codes.Code
		named string // the name the error must carry
	}{
		{name: "both", names: []string{dflt, rootCA}, want: []*secretmanager.Secret{d1, r1}},
		{name: "one", names: []string{rootCA}, want: []*secretmanager.Secret{r1}},
		{name: "unknown", names: []string{dflt, unknown}, code: codes.InvalidArgument, named: unknown},
		{name: "forbidden", names: []string{forbidden}, code: codes.PermissionDenied, named: forbidden},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
			defer cancel()
			resp, err := h.envoy.Client.FetchSecrets(ctx, &discovery.DiscoveryRequest{Node: &core.Node{Id: nodeID}, ResourceNames: tc.names, TypeUrl: sds.SecretTypeURL})
			if tc.code != codes.OK {
				st := status.Convert(err)
				if st.Code() != tc.code || !strings.Contains(st.Message(), tc.named) {
					t.Fatalf("FetchSecrets: %v, want %v naming %s", err, tc.code, tc.named)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if resp.GetVersionInfo() == "" {
				t.Fatal("response without version_info")
			}
			checkAll(t, sdstest.Decode(t, nil, resp.GetResources()), tc.want...)
		})
	}
}
