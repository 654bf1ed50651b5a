package agent_test

import (
	"net/http"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/secretmanager"
)

// writeEmbeddedManifest labels the embedded agent's own namespace (default) in the manifests
// its control plane reads from <root-dir>/var/lib/meshid/manifests.
func writeEmbeddedManifest(t *testing.T, cfg agent.Config, labels string) {
	t.Helper()
	testutil.WriteFiles(t, filepath.Join(cfg.RootDir, "var/lib/meshid/manifests"), map[string][]byte{
		"namespaces.yaml": []byte("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: default\n  labels: {" + labels + "}\n"),
	})
}

// One command, targeting included: a manifest that takes the agent's namespace away from every
// CA (ca.istio.io/override=false) makes the embedded CA refuse it, and the agent says so.
func TestEmbeddedCARefusesANamespaceLabelledAway(t *testing.T) {
	t.Parallel()
	why := []string{"PermissionDenied", "namespace default", `ca.istio.io/override="false"`, "no CA instance serves it"}

	t.Run("from the start", func(t *testing.T) {
		t.Parallel()
		ev := newEvents()
		cfg := testConfig(t, newFakeClock(), newLogSink(t), ev)
		writeEmbeddedManifest(t, cfg, `ca.istio.io/override: "false"`)
		a := newAgent(t, cfg)
		runAgent(t, a)
		ev.await(t, "the refusal", func(x secretmanager.Event) bool {
			return x.Kind == secretmanager.EventChanged && x.Name == "default" && x.Err != nil
		})
		code, body := httpGet(t, "http://"+a.StatusAddr()+"/healthz/ready")
		if code != http.StatusServiceUnavailable {
			t.Fatalf("/healthz/ready = %d %q, want 503", code, body)
		}
		st := debugSecret(t, a, "default")
		for _, want := range why {
			if !strings.Contains(body, want) || !strings.Contains(st.Error, want) {
				t.Errorf("/healthz/ready %q and /debug/secrets %q: want both to name %q", body, st.Error, want)
			}
		}
		if st.Valid {
			t.Error("/debug/secrets shows a valid certificate")
		}
	})

	t.Run("relabelled while running", func(t *testing.T) {
		t.Parallel()
		clk := newFakeClock()
		ev := newEvents()
		cfg := testConfig(t, clk, newLogSink(t), ev)
		writeEmbeddedManifest(t, cfg, `ca.istio.io/env: istio-system`)
		a := newAgent(t, cfg)
		first := issued(t, a)
		runAgent(t, a)
		receive(t, first, "a first certificate")

		writeEmbeddedManifest(t, cfg, `ca.istio.io/override: "false"`)
		// The edit reaches the CA after its watcher's debounce, which the clock steps of the
		// renewals also pass: renew until one is refused.
		outcome := ev.channel(t, func(x secretmanager.Event) bool {
			return x.Name == "default" && (x.Kind == secretmanager.EventIssued || x.Kind == secretmanager.EventRenewalFailed)
		})
		for {
			rotate(t, clk, a)
			if x := receive(t, outcome, "the renewal's outcome"); x.Kind == secretmanager.EventRenewalFailed {
				break
			}
		}
		st := debugSecret(t, a, "default")
		for _, want := range why {
			if !strings.Contains(st.Error, want) {
				t.Errorf("/debug/secrets default error %q does not name %q", st.Error, want)
			}
		}
		if !st.Valid {
			t.Error("the certificate still valid is no longer served")
		}
		if got := metric(t, a, "meshid_agent_cert_renewal_failures_total"); got == "" || got == "0" {
			t.Errorf("renewal failures %q, want the refusal counted", got)
		}
	})
}
