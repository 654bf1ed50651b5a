package agent_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/agent/envoy"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/envoytest"
	"github.com/meshid/meshid/internal/testutil"
)

// envoyAgent is an agent of the embedded control plane that runs the stand-in Envoy, its
// configuration envoytest.InboundMTLSConfig.
func envoyAgent(t *testing.T, clk *testutil.FakeClock, logs *logSink, adjust func(*agent.Config)) (*agent.Agent, agent.Config, *testutil.SyncBuffer) {
	t.Helper()
	cfg := testConfig(t, clk, logs, nil)
	stateDir := filepath.Join(cfg.RootDir, agent.DefaultEmbeddedDir)
	if err := os.MkdirAll(stateDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(stateDir, controlplane.EmbeddedXDSConfig), []byte(envoytest.InboundMTLSConfig), 0o600); err != nil {
		t.Fatal(err)
	}
	out := &testutil.SyncBuffer{}
	cfg.Envoy.Path = envoytest.Build(t)
	// The admin on a port of the kernel's choosing, which Envoy writes to a file the agent reads.
	cfg.Envoy.AdminPort, cfg.Envoy.PrometheusPort = 0, 0
	cfg.Envoy.Stdout, cfg.Envoy.Stderr = out, out
	cfg.Envoy.MinimumDrainDuration, cfg.Envoy.TerminationDrainDuration = 0, time.Hour
	if adjust != nil {
		adjust(&cfg)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("Envoy's output:\n%s", out)
		}
	})
	return newAgent(t, cfg), cfg, out
}

// awaitReady polls /healthz/ready until it answers 200: the agent, the stand-in Envoy and the
// control plane all work in real time here; the bound only turns a hang into a failure.
func awaitReady(t *testing.T, a *agent.Agent) {
	t.Helper()
	envoytest.Eventually(t, 60*time.Second, func() error {
		if code, body := httpGet(t, "http://"+a.StatusAddr()+"/healthz/ready"); code != http.StatusOK {
			return errors.New(body)
		}
		return nil
	})
}

func start(a *agent.Agent) (cancel context.CancelFunc, done <-chan error) {
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan error, 1)
	go func() { ch <- a.Run(ctx) }()
	return cancel, ch
}

func await(t *testing.T, done <-chan error) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(60 * time.Second):
		t.Fatal("the agent did not stop")
		return nil
	}
}

// The agent starts Envoy once the certificate is in service, with its bootstrap and Istio's
// command line, is ready only when Envoy is LIVE with its configuration, serves Envoy's metrics
// with its own, and on SIGTERM drains Envoy until its last connection is gone, serving SDS and
// xDS meanwhile; Envoy's 0 is the agent's.
func TestAgentRunsEnvoyAndDrainsItToZeroConnections(t *testing.T) {
	t.Parallel()
	clk := newFakeClock()
	logs := newLogSink(t)
	a, cfg, _ := envoyAgent(t, clk, logs, func(c *agent.Config) { c.Envoy.ExitOnZeroActiveConnections = true })
	stop, done := start(a)
	defer stop()
	awaitReady(t, a)

	adminAddr, err := a.EnvoyAdmin()
	if err != nil {
		t.Fatal(err)
	}
	admin := envoytest.NewAdmin(adminAddr)
	info, err := admin.ServerInfo(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if opts := info.GetCommandLineOptions(); opts.GetConcurrency() != agent.DefaultEnvoyConcurrency || opts.GetDrainTime().AsDuration() != envoy.DefaultDrainDuration ||
		opts.GetConfigPath() != filepath.Join(cfg.RootDir, agent.DefaultBootstrapPath) {
		t.Errorf("Envoy started with %v", opts)
	}
	if recs := logs.records(t, "Envoy started"); len(recs) != 1 {
		t.Errorf("Envoy's start logged %d times", len(recs))
	}

	// One page of the agent's metrics and Envoy's, which Prometheus' parser takes.
	_, page := httpGet(t, "http://"+a.StatusAddr()+"/stats/prometheus")
	parser := expfmt.NewTextParser(model.LegacyValidation)
	families, err := parser.TextToMetricFamilies(strings.NewReader(page))
	if err != nil {
		t.Fatalf("/stats/prometheus does not parse: %v\n%s", err, page)
	}
	for _, name := range []string{"envoy_server_state", "meshid_agent_cert_valid"} {
		if families[name] == nil {
			t.Errorf("/stats/prometheus lacks %s", name)
		}
	}

	// A workload connection, held through the drain.
	listeners, err := admin.Listeners(t.Context())
	if err != nil || len(listeners.GetListenerStatuses()) != 1 {
		t.Fatalf("Envoy's listeners: %v, %v", listeners, err)
	}
	sa := listeners.GetListenerStatuses()[0].GetLocalAddress().GetSocketAddress()
	conn, err := net.Dial("tcp", net.JoinHostPort(sa.GetAddress(), strconv.Itoa(int(sa.GetPortValue()))))
	if err != nil {
		t.Fatal(err)
	}
	envoytest.Eventually(t, 30*time.Second, func() error {
		if stats, err := admin.Stats(t.Context()); err != nil || stats["server.total_connections"] < 1 {
			return errors.New("the connection is not counted yet")
		}
		return nil
	})

	stop()
	envoytest.Eventually(t, 30*time.Second, func() error {
		code, body := httpGet(t, "http://"+a.StatusAddr()+"/healthz/ready")
		if code != http.StatusServiceUnavailable || !strings.Contains(body, "the agent is shutting down") || !strings.Contains(body, "Envoy is draining") {
			return errors.New(body)
		}
		return nil
	})
	// Draining, Envoy asks SDS for nothing new, but the agent still serves it: its socket answers.
	if code, _ := httpGet(t, "http://"+a.StatusAddr()+"/healthz/ready"); code != http.StatusServiceUnavailable {
		t.Fatal("ready while draining")
	}
	// Envoy holds the connection: the agent looks again each second, on its clock.
	if err := clk.WaitForTimers(t.Context(), 1); err != nil {
		t.Fatal(err)
	}
	clk.Advance(envoy.ActiveConnectionsInterval)
	if err := clk.WaitForTimers(t.Context(), 1); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		t.Fatalf("the agent stopped with a connection left: %v", err)
	default:
	}
	_ = conn.Close()
	err = pollUntilDone(t, clk, done)
	if err != nil {
		t.Fatalf("Run: %v, want Envoy's 0", err)
	}
	if recs := logs.records(t, "Envoy exited"); len(recs) != 1 || recs[0]["reason"] != "after the drain" {
		t.Errorf("Envoy's exit logged as %v", recs)
	}
	if len(logs.records(t, "Envoy has no active connections left")) != 1 {
		t.Error("the drain did not end on zero connections")
	}
}

// pollUntilDone moves the clock to each look at Envoy's connections (a timer due within
// ActiveConnectionsInterval), and never to the grace an exiting Envoy is given, until Run returns.
func pollUntilDone(t *testing.T, clk *testutil.FakeClock, done <-chan error) error {
	t.Helper()
	giveUp := time.After(60 * time.Second)
	for {
		changed := clk.Changed()
		if d := clk.Deadlines(); len(d) > 0 && d[0].Sub(clk.Now()) <= envoy.ActiveConnectionsInterval {
			clk.Advance(d[0].Sub(clk.Now()))
			continue
		}
		select {
		case err := <-done:
			return err
		case <-changed:
		case <-giveUp:
			t.Fatal("the agent did not stop")
		}
	}
}

// Envoy's death is the agent's, with Envoy's status, so that the kubelet restarts the pair.
func TestAgentExitsWithEnvoy(t *testing.T) {
	t.Parallel()
	logs := newLogSink(t)
	a, _, _ := envoyAgent(t, newFakeClock(), logs, nil)
	stop, done := start(a)
	defer stop()
	awaitReady(t, a)
	if err := syscall.Kill(a.EnvoyPID(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	err := await(t, done)
	var exit *envoy.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 128+int(syscall.SIGKILL) {
		t.Fatalf("Run: %v, want Envoy's death by SIGKILL (137)", err)
	}
	if recs := logs.records(t, "Envoy exited"); len(recs) != 1 || recs[0]["reason"] != "on its own" || recs[0]["status"] != float64(137) {
		t.Errorf("Envoy's exit logged as %v", recs)
	}
}

// /quitquitquit ends Envoy and the agent at once, with status 0: a Job's sidecar.
func TestAgentQuitquitquitEndsEnvoy(t *testing.T) {
	t.Parallel()
	logs := newLogSink(t)
	a, _, _ := envoyAgent(t, newFakeClock(), logs, func(c *agent.Config) { c.Envoy.MinimumDrainDuration = time.Hour })
	stop, done := start(a)
	defer stop()
	awaitReady(t, a)
	pid := a.EnvoyPID()
	resp, err := http.Post("http://"+a.StatusAddr()+"/quitquitquit", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if err := await(t, done); err != nil {
		t.Fatalf("Run after /quitquitquit: %v, want 0", err)
	}
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("Envoy (pid %d) still runs: %v", pid, err)
	}
	if recs := logs.records(t, "Envoy exited"); len(recs) != 1 || recs[0]["reason"] != "after /quitquitquit" {
		t.Errorf("Envoy's exit logged as %v", recs)
	}
}
