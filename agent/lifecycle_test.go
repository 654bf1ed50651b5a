package agent_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/meshid/meshid/secretmanager"
)

// Once an Envoy opens a stream through the xDS proxy, the agent is ready only when Envoy has
// acknowledged clusters and listeners, and says which it lacks (issue 26: it was ready while
// Envoy had nothing).
func TestReadinessWaitsForEnvoysConfiguration(t *testing.T) {
	t.Parallel()
	ev := newEvents()
	cfg := testConfig(t, newFakeClock(), nil, ev)
	a := newAgent(t, cfg)
	runAgent(t, a)
	ev.await(t, "a certificate", func(x secretmanager.Event) bool { return x.Kind == secretmanager.EventIssued })
	ready := "http://" + a.StatusAddr() + "/healthz/ready"
	if code, body := httpGet(t, ready); code != http.StatusOK {
		t.Fatalf("/healthz/ready before any Envoy: %d %q, want 200 (nothing says an Envoy will come)", code, body)
	}

	stream, err := xdsClient(t, cfg).StreamAggregatedResources(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	// ask sends a request of typeURL, ACKing what came before, and returns the answer: once it
	// has come, the proxy has taken the ACK.
	node := &corev3.Node{Id: "sidecar~10.0.0.1~demo.default~default.svc.cluster.local"}
	ask := func(typeURL string, ack *discoveryv3.DiscoveryResponse) *discoveryv3.DiscoveryResponse {
		t.Helper()
		if ack != nil {
			if err := stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: ack.GetTypeUrl(), VersionInfo: ack.GetVersionInfo(), ResponseNonce: ack.GetNonce()}); err != nil {
				t.Fatal(err)
			}
		}
		if err := stream.Send(&discoveryv3.DiscoveryRequest{Node: node, TypeUrl: typeURL}); err != nil {
			t.Fatal(err)
		}
		resp, err := stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	lds := ask(resource.ListenerType, nil)
	code, body := httpGet(t, ready)
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "not yet acknowledged by Envoy through the xDS proxy: clusters (CDS) and listeners (LDS)") {
		t.Fatalf("/healthz/ready with Envoy connected and nothing ACKed: %d %q", code, body)
	}
	cds := ask(resource.ClusterType, lds)
	if code, body := httpGet(t, ready); code != http.StatusServiceUnavailable || !strings.Contains(body, ": clusters (CDS)") || strings.Contains(body, "listeners") {
		t.Fatalf("/healthz/ready with the listeners ACKed: %d %q, want 503 naming the clusters only", code, body)
	}
	ask(resource.RouteType, cds)
	if code, body := httpGet(t, ready); code != http.StatusOK {
		t.Fatalf("/healthz/ready once Envoy ACKed both: %d %q", code, body)
	}
}

// POST /quitquitquit ends an agent that runs no Envoy, with status 0; GET is refused.
func TestQuitquitquitEndsTheAgent(t *testing.T) {
	t.Parallel()
	ev := newEvents()
	a := newAgent(t, testConfig(t, newFakeClock(), nil, ev))
	done := make(chan error, 1)
	go func() { done <- a.Run(context.Background()) }()
	ev.await(t, "a certificate", func(x secretmanager.Event) bool { return x.Kind == secretmanager.EventIssued })
	quit := "http://" + a.StatusAddr() + "/quitquitquit"
	if code, _ := httpGet(t, quit); code != http.StatusMethodNotAllowed {
		t.Errorf("GET /quitquitquit: %d, want 405", code)
	}
	resp, err := http.Post(quit, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST /quitquitquit: %d", resp.StatusCode)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run after /quitquitquit: %v, want nil (exit 0)", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the agent did not stop after /quitquitquit")
	}
}

// Only loopback may end the agent: a peer on the pod network, or a web page rebinding a name to
// 127.0.0.1, is refused, counted and logged, and the agent goes on.
func TestQuitquitquitRefusesOthers(t *testing.T) {
	t.Parallel()
	logs := newLogSink(t)
	ev := newEvents()
	a := newAgent(t, testConfig(t, newFakeClock(), logs, ev))
	runAgent(t, a)
	for _, tc := range []struct{ remote, host, reason string }{
		{"10.0.0.7:41000", "10.0.0.5:15020", "peer"},
		{"127.0.0.1:41000", "rebound.example:15020", "host"},
	} {
		req := httptest.NewRequest(http.MethodPost, "/quitquitquit", nil)
		req.RemoteAddr, req.Host = tc.remote, tc.host
		rec := httptest.NewRecorder()
		a.QuitHandler().ServeHTTP(rec, req)
		if rec.Code != http.StatusForbidden {
			t.Errorf("%s: %d, want 403", tc.reason, rec.Code)
		}
		if got := metric(t, a, `meshid_agent_quit_refusals_total{reason="`+tc.reason+`"}`); got != "1" {
			t.Errorf("refusals by %s: %q, want 1", tc.reason, got)
		}
	}
	if recs := logs.records(t, "/quitquitquit refused: only a request from loopback, for localhost, may end the agent"); len(recs) != 2 || recs[0]["peer"] != "10.0.0.7:41000" {
		t.Errorf("refusals logged as %v", recs)
	}
	ev.await(t, "a certificate", func(x secretmanager.Event) bool { return x.Kind == secretmanager.EventIssued })
	if code, body := httpGet(t, "http://"+a.StatusAddr()+"/healthz/ready"); code != http.StatusOK {
		t.Fatalf("the agent after refused quits: %d %q", code, body)
	}
}
