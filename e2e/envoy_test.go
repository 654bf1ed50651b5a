package e2e_test

import (
	"errors"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/meshid/meshid/internal/envoytest"
)

// The one-container shape, as the proxy image runs it: meshid-agent starts Envoy (the stand-in)
// with the bootstrap it writes, once the workload certificate is in service; `meshid-agent wait`
// returns once Envoy is LIVE with its configuration; /stats/prometheus is the agent's and
// Envoy's; SIGTERM drains Envoy, which holds no connection, and both exit 0.
func TestOneContainerShape(t *testing.T) {
	t.Parallel()
	standin := envoytest.Build(t)
	ca := startCA(t, mesh(""), envoytest.InboundMTLSConfig)
	w := workload{name: "proxy", namespace: "default", serviceAccount: "frontend", secretTTL: time.Hour}
	a := startAgentWith(t, ca, w, agentOptions{extraArgs: []string{"--envoy-path", standin, "--envoy-admin-port", "0",
		"--envoy-prometheus-port", "0", "--exit-on-zero-active-connections", "--minimum-drain-duration", "0s"}})

	// The bootstrap the bootstrap command writes for these flags is the one Envoy runs, and
	// Envoy takes it.
	bootstrap := filepath.Join(t.TempDir(), "bootstrap.json")
	if out, err := exec.Command(filepath.Join(binDir, "meshid-agent"), append([]string{"bootstrap", "-o", bootstrap}, a.args[1:]...)...).CombinedOutput(); err != nil {
		t.Fatalf("meshid-agent bootstrap: %v\n%s", err, out)
	}
	if out, err := exec.Command(standin, "--mode", "validate", "-c", bootstrap).CombinedOutput(); err != nil {
		t.Fatalf("Envoy refuses the bootstrap: %v\n%s", err, out)
	}

	wait := exec.Command(filepath.Join(binDir, "meshid-agent"), "wait", "--addr", a.statusAddr, "--timeout", "60s")
	if out, err := wait.CombinedOutput(); err != nil {
		t.Fatalf("meshid-agent wait: %v\n%s", err, out)
	}
	if body := httpGet(t, "http://"+a.statusAddr+"/healthz/ready"); !strings.Contains(body, "ready") {
		t.Fatalf("/healthz/ready after wait: %q", body)
	}
	started := a.awaitLog(t, "Envoy started", nil)
	envoyPID := int(started["pid"].(float64))

	parser := expfmt.NewTextParser(model.LegacyValidation)
	families, err := parser.TextToMetricFamilies(strings.NewReader(httpGet(t, "http://"+a.statusAddr+"/stats/prometheus")))
	if err != nil {
		t.Fatalf("/stats/prometheus does not parse: %v", err)
	}
	for _, name := range []string{"envoy_server_live", "envoy_listener_manager_lds_update_success", "meshid_agent_cert_valid"} {
		if families[name] == nil {
			t.Errorf("/stats/prometheus lacks %s", name)
		}
	}

	a.signal(t, syscall.SIGTERM)
	a.awaitLog(t, "Envoy has no active connections left", nil)
	if code := a.awaitExit(t); code != 0 {
		t.Errorf("the agent exited %d after SIGTERM, want 0", code)
	}
	if err := syscall.Kill(envoyPID, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("Envoy (pid %d) outlived the agent: %v", envoyPID, err)
	}
	if resp, err := http.Get("http://" + a.statusAddr + "/healthz/ready"); err == nil {
		_ = resp.Body.Close()
		t.Error("the status port still answers after the agent exited")
	}
}

// Envoy's death ends the agent with Envoy's status, and a killed agent takes Envoy with it.
func TestOneContainerShapeEndsTogether(t *testing.T) {
	t.Parallel()
	standin := envoytest.Build(t)
	ca := startCA(t, mesh(""), "")
	for _, kill := range []string{"envoy", "agent"} {
		t.Run(kill, func(t *testing.T) {
			w := workload{name: "proxy-" + kill, namespace: "default", serviceAccount: "frontend", secretTTL: time.Hour}
			a := startAgentWith(t, ca, w, agentOptions{extraArgs: []string{"--envoy-path", standin, "--envoy-admin-port", "0",
				"--envoy-prometheus-port", "0"}})
			started := a.awaitLog(t, "Envoy started", nil)
			envoyPID := int(started["pid"].(float64))
			if kill == "envoy" {
				if err := syscall.Kill(envoyPID, syscall.SIGKILL); err != nil {
					t.Fatal(err)
				}
				if code := a.awaitExit(t); code != 128+int(syscall.SIGKILL) {
					t.Errorf("the agent exited %d after Envoy was killed, want Envoy's 137", code)
				}
				return
			}
			a.kill(t)
			envoytest.Eventually(t, wait, func() error {
				if err := syscall.Kill(envoyPID, 0); !errors.Is(err, syscall.ESRCH) {
					return errors.New("Envoy outlives its agent")
				}
				return nil
			})
		})
	}
}
