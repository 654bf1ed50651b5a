package e2e_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
)

// Issue 26: the README's first command runs `meshid ca` with no --xds-config. An Envoy through
// an agent of that CA gets an empty configuration (no listeners, no clusters), which it ACKs,
// instead of a stream ended Unimplemented that it retries for ever; the agent's
// /debug/config_dump answers 200, not 502. The CA says once at start why there is nothing.
func TestCAWithoutXDSConfig(t *testing.T) {
	t.Parallel()
	ca := startCA(t, mesh(""), "")
	ca.awaitLog(t, "no --xds-config: Envoy gets an empty configuration (no listeners, no clusters)", nil)
	a := startAgent(t, ca, workload{name: "quickstart", namespace: "default", serviceAccount: "frontend", secretTTL: time.Hour})
	e := &envoy{name: a.name, node: &corev3.Node{Id: "sidecar~127.0.0.1~quickstart.default~default.svc.cluster.local", Cluster: a.name}}
	listeners, clusters := e.fetchConfig(t, t.Context(), dial(t, a.xdsSocket()))
	if len(listeners) != 0 || len(clusters) != 0 {
		t.Fatalf("without --xds-config: %d listeners and %d clusters, want none", len(listeners), len(clusters))
	}

	debugSocket := filepath.Join(a.rootDir, "etc/istio/proxy/debug.sock")
	client := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", debugSocket)
	}}}
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://localhost/debug/config_dump", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "configs") {
		t.Fatalf("/debug/config_dump: %d %s %v", resp.StatusCode, body, err)
	}
}
