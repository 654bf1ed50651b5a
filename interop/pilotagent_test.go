//go:build external

package interop_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/internal/testutil"
)

// Paths under pilot-agent's working directory: it resolves them relative to it.
const (
	rootCertPath  = "var/run/secrets/istio/root-cert.pem"
	tokenPath     = "var/run/secrets/tokens/istio-token"
	sdsSocketPath = "var/run/secrets/workload-spiffe-uds/socket"
	xdsSocketPath = "etc/istio/proxy/XDS"
)

// The workload pilot-agent runs as.
const (
	podName        = "demo-1"
	serviceAccount = "demo"
)

// scenarioLimit bounds every wait on pilot-agent in a scenario, in real time: a wait that ends
// there fails the test.
const scenarioLimit = time.Minute

// mesh is meshid's CA and discovery server with a real pilot-agent pointed at them.
type mesh struct {
	// XDSConfig is the discovery server's --xds-config file.
	XDSConfig string
	// RootFile is the CA's trust bundle, as pilot-agent is given it.
	RootFile string
	// Dir is pilot-agent's working directory; Log is its output, stdout and stderr.
	Dir string
	Log string
	// Ctx ends when pilot-agent exits (its cause says how), when scenarioLimit has passed, or
	// with the test.
	Ctx context.Context
}

// startMesh starts meshid's control plane in-process on 127.0.0.1, with xdsConfig as its
// discovery configuration, and pilot-agent as a workload of namespace with a token minted by it,
// with a fake Envoy (fakeEnvoy), and env (NAME=VALUE) besides the scenario's own variables. The
// process group of pilot-agent is killed when the test ends.
func startMesh(t *testing.T, namespace, xdsConfig string, env ...string) *mesh {
	t.Helper()
	bin := os.Getenv(istioBinEnv)
	if bin == "" {
		t.Fatalf("%s is not set", istioBinEnv)
	}

	cfgDir := t.TempDir()
	m := &mesh{XDSConfig: filepath.Join(cfgDir, "xds.yaml"), Dir: testutil.ShortTempDir(t)}
	writeFile(t, m.XDSConfig, xdsConfig)
	cpCfg := controlplane.DefaultConfig()
	cpCfg.StateDir = filepath.Join(cfgDir, "state")
	cpCfg.GRPCAddr = "127.0.0.1:0"
	cpCfg.MonitoringAddr = ""
	cpCfg.XDSConfig = m.XDSConfig
	var cpLog testutil.SyncBuffer
	cpCfg.Logger = slog.New(slog.NewTextHandler(&cpLog, &slog.HandlerOptions{Level: slog.LevelDebug}))
	cp := controlplanetest.Start(t, cpCfg)

	root, err := os.ReadFile(filepath.Join(cpCfg.StateDir, ca.RootCertFile))
	if err != nil {
		t.Fatal(err)
	}
	m.RootFile = filepath.Join(m.Dir, rootCertPath)
	writeFile(t, m.RootFile, string(root))
	writeFile(t, filepath.Join(m.Dir, tokenPath),
		controlplanetest.Token(t, cpCfg.StateDir, namespace, serviceAccount, time.Now(), time.Hour))

	log, err := os.Create(filepath.Join(cfgDir, "pilot-agent.log"))
	if err != nil {
		t.Fatal(err)
	}
	envoy, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// What pilot-agent would pass Envoy; fakeEnvoy ignores it.
	bootstrap := filepath.Join(cfgDir, "envoy.json")
	writeFile(t, bootstrap, "{}")
	proxyConfig, err := json.Marshal(map[string]string{
		"discoveryAddress": cp.GRPCAddr(), "binaryPath": envoy, "customConfigFile": bootstrap,
	})
	if err != nil {
		t.Fatal(err)
	}

	cmd := exec.Command(filepath.Join(bin, "pilot-agent"), "proxy", "sidecar")
	cmd.Dir = m.Dir
	// Only what the scenario means: pilot-agent reads dozens of variables, and none of the
	// test's environment should reach it.
	cmd.Env = []string{
		"HOME=" + m.Dir,
		fakeEnvoyEnv + "=1",
		"POD_NAMESPACE=" + namespace,
		"POD_NAME=" + podName,
		"SERVICE_ACCOUNT=" + serviceAccount,
		"INSTANCE_IP=127.0.0.1",
		"CA_ADDR=" + cp.GRPCAddr(),
		"PILOT_CERT_PROVIDER=istiod",
		"PROXY_CONFIG=" + string(proxyConfig),
	}
	cmd.Env = append(cmd.Env, env...)
	cmd.Stdout, cmd.Stderr = log, log
	m.Log = log.Name()
	// A process group of its own, to kill whatever it starts with it; killed with the test
	// binary, however it ends.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		_ = log.Close()
		t.Fatalf("start pilot-agent: %v", err)
	}
	_ = log.Close()

	ctx, cancel := context.WithCancelCause(context.Background())
	ctx, cancelLimit := context.WithTimeoutCause(ctx, scenarioLimit, fmt.Errorf("pilot-agent scenario: no answer within %s", scenarioLimit))
	m.Ctx = ctx
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait() // the state says how it ended
		cancel(fmt.Errorf("pilot-agent ended (%s); its log follows", cmd.ProcessState))
		close(exited)
	}()
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-exited
		cancelLimit()
		if t.Failed() || testing.Verbose() {
			out, _ := os.ReadFile(log.Name())
			t.Logf("pilot-agent's log:\n%s\nmeshid control plane's log:\n%s", out, cpLog.String())
		}
	})
	return m
}

// dial opens a gRPC client on one of pilot-agent's Unix sockets. Its calls wait until pilot-agent
// listens there: it creates the socket once it has started.
func (m *mesh) dial(t *testing.T, socket string) *grpc.ClientConn {
	t.Helper()
	bo := backoff.DefaultConfig
	bo.BaseDelay, bo.MaxDelay = 20*time.Millisecond, 500*time.Millisecond
	conn, err := grpc.NewClient("unix://"+filepath.Join(m.Dir, socket),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: bo, MinConnectTimeout: 5 * time.Second}),
		grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// writeFile writes data to path, making its directory, by a rename so that a watcher never sees
// it half-written.
func writeFile(t *testing.T, path, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path+".tmp", []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
}
