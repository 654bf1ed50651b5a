package main

import (
	"context"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/internal/envoytest"
	"github.com/meshid/meshid/internal/testutil"
)

// startEnvoyCA runs the control plane in process on loopback, serving envoytest.InboundMTLSConfig, and returns the
// agent flags that use it.
func startEnvoyCA(b *testing.B) []string {
	b.Helper()
	cfg := controlplanetest.Config(b)
	cfg.XDSConfig = filepath.Join(b.TempDir(), "xds.yaml")
	if err := os.WriteFile(cfg.XDSConfig, []byte(envoytest.InboundMTLSConfig), 0o600); err != nil {
		b.Fatal(err)
	}
	ca := controlplanetest.Start(b, cfg)
	tokenFile := filepath.Join(b.TempDir(), "token")
	tok := controlplanetest.Token(b, cfg.StateDir, "default", "demo", time.Now(), 24*time.Hour)
	if err := os.WriteFile(tokenFile, []byte(tok), 0o600); err != nil {
		b.Fatal(err)
	}
	return []string{"--ca-addr", ca.GRPCAddr(), "--ca-root-cert", filepath.Join(cfg.StateDir, "root-cert.pem"),
		"--token-path", tokenFile, "--namespace", "default", "--service-account", "demo"}
}

// agentArgs are the flags of a slim agent of the CA under a fresh root, with Envoy (the
// stand-in) as its child when standin is not empty.
func agentArgs(b *testing.B, caArgs []string, standin string) []string {
	b.Helper()
	root := testutil.ShortTempDir(b)
	args := append([]string{"agent", "--root-dir", root, "--status-addr", "127.0.0.1:0", "--debug-addr", ""}, caArgs...)
	if standin != "" {
		args = append(args, "--envoy-path", standin, "--envoy-admin-port", "0", "--envoy-prometheus-port", "0",
			"--exit-on-zero-active-connections", "--minimum-drain-duration", "0s")
	}
	return args
}

// ready polls the agent's /healthz/ready until 200; the agent and Envoy are starting.
func ready(b *testing.B, statusAddr string) {
	b.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get("http://" + statusAddr + "/healthz/ready")
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			b.Fatalf("the agent at %s was not ready within 30 s", statusAddr)
		}
		time.Sleep(time.Millisecond) // polling a starting process
	}
}

// idleMemory reports the agent's RSS and anonymous memory once ready and idle for 10 s.
func idleMemory(b *testing.B, cmd *exec.Cmd, started map[string]any) {
	b.Helper()
	ready(b, started["status_address"].(string))
	time.Sleep(10 * time.Second) // the measurement is of an idle agent
	b.ReportMetric(rssOf(b, cmd.Process.Pid), "rss-kB")
	b.ReportMetric(anonKB(b, cmd.Process.Pid), "anon-kB")
}

func stopProcess(cmd *exec.Cmd) {
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
}

// BenchmarkEnvoy measures Envoy's life under the agent (issue 26), with the stand-in as Envoy and
// the CA on loopback: exec of the agent → Envoy started (its log line), exec → ready (Envoy LIVE
// with its configuration ACKed and its certificate over SDS), SIGTERM → exit with no connection
// left, the agent's memory with Envoy as its child against the agent alone, and one
// /stats/prometheus scrape against /metrics. Baselines of the same run: `version`'s exec, the
// agent alone to ready, /metrics. Exec → ready is measured quiet and under diskContention too,
// alternating ("exec-to-ready-contended").
func BenchmarkEnvoy(b *testing.B) {
	bin := agentBinary(b, "--ca-addr")
	standin := envoytest.Build(b)
	caArgs := startEnvoyCA(b)
	b.Run("baseline-exec-version", func(b *testing.B) {
		for range b.N {
			if err := exec.Command(bin, "version").Run(); err != nil {
				b.Fatal(err)
			}
		}
	})
	// timed measures exec of the agent (with Envoy when standin is set) until it logs msg and,
	// with toReady, until it is ready.
	timed := func(name, standin, msg string, toReady bool) {
		b.Run(name, func(b *testing.B) {
			for range b.N {
				b.StopTimer()
				args := agentArgs(b, caArgs, standin)
				b.StartTimer()
				cmd, rec := startLogged(b, bin, msg, args...)
				if toReady {
					ready(b, rec["status_address"].(string))
				}
				b.StopTimer()
				stopProcess(cmd)
				b.StartTimer()
			}
		})
	}
	timed("baseline-exec-to-ready-without-envoy", "", "agent started", true)
	timed("exec-to-envoy-started", standin, "Envoy started", false)
	timed("exec-to-ready", standin, "agent started", true)
	// Envoy's certificate over SDS is on the path to ready, and no flush of the disk may be:
	// exec → ready quiet and under diskContention, alternating.
	b.Run("exec-to-ready-contended", func(b *testing.B) {
		quietAndContended(b, func() map[string]float64 {
			args := agentArgs(b, caArgs, standin)
			start := time.Now()
			cmd, rec := startLogged(b, bin, "agent started", args...)
			ready(b, rec["status_address"].(string))
			took := time.Since(start)
			stopProcess(cmd)
			return map[string]float64{"ready": ms(took)}
		})
	})
	b.Run("sigterm-to-exit", func(b *testing.B) {
		for range b.N {
			b.StopTimer()
			cmd, rec := startLogged(b, bin, "agent started", agentArgs(b, caArgs, standin)...)
			ready(b, rec["status_address"].(string))
			b.StartTimer()
			if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
				b.Fatal(err)
			}
			if err := cmd.Wait(); err != nil {
				b.Fatalf("the agent after SIGTERM: %v", err)
			}
		}
	})
	// The agent's memory idle with an Envoy connected over SDS and ADS: today's two processes, the
	// agent and an Envoy started beside it with the bootstrap command's bootstrap, against Envoy
	// as the agent's child.
	b.Run("rss/envoy-beside", func(b *testing.B) {
		for range b.N {
			args := agentArgs(b, caArgs, "")
			cmd, rec := startLogged(b, bin, "agent started", args...)
			bootstrap := filepath.Join(b.TempDir(), "envoy.json")
			if out, err := exec.Command(bin, append([]string{"bootstrap", "--envoy-admin-port", "0", "--envoy-prometheus-port", "0", "-o", bootstrap}, args[1:]...)...).CombinedOutput(); err != nil {
				b.Fatalf("bootstrap: %v\n%s", err, out)
			}
			envoy := exec.Command(standin, "-c", bootstrap)
			if err := envoy.Start(); err != nil {
				b.Fatal(err)
			}
			idleMemory(b, cmd, rec)
			stopProcess(envoy)
			stopProcess(cmd)
		}
	})
	b.Run("rss/envoy-as-child", func(b *testing.B) {
		for range b.N {
			cmd, rec := startLogged(b, bin, "agent started", agentArgs(b, caArgs, standin)...)
			idleMemory(b, cmd, rec)
			stopProcess(cmd)
		}
	})
	_, rec := startLogged(b, bin, "agent started", agentArgs(b, caArgs, standin)...)
	status := rec["status_address"].(string)
	ready(b, status)
	for _, path := range []string{"/metrics", "/stats/prometheus"} {
		b.Run("scrape"+path, func(b *testing.B) {
			client := &http.Client{}
			for range b.N {
				req, err := http.NewRequestWithContext(context.Background(), http.MethodGet, "http://"+status+path, nil)
				if err != nil {
					b.Fatal(err)
				}
				resp, err := client.Do(req)
				if err != nil {
					b.Fatal(err)
				}
				n, _ := io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					b.Fatalf("%s: %d", path, resp.StatusCode)
				}
				b.ReportMetric(float64(n), "bytes")
			}
		})
	}
}
