//go:build external

package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/agent/nodemode"
	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller/kube"
	"github.com/meshid/meshid/ca/controller/kube/kubetest"
	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds/sdsclient"
)

func randomSuffix(t *testing.T) string {
	t.Helper()
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// boundTokenFile writes a token of ns/sa bound to pod, as the kubelet mounts a projected one.
func boundTokenFile(t *testing.T, ns, sa string, pod *corev1.Pod) string {
	t.Helper()
	token := kubeEnv.BoundToken(t, ns, sa, pod)
	path := filepath.Join(t.TempDir(), "istio-token")
	if err := os.WriteFile(path, []byte(token), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// procTree is a /proc tree holding this process, the peer of the test's SDS connections, with
// its real stat and status and a cgroup file the test writes: the pod the kubelet would have
// placed it in.
type procTree struct {
	t    *testing.T
	root string
}

func newProcTree(t *testing.T) *procTree {
	t.Helper()
	p := &procTree{t: t, root: t.TempDir()}
	dir := filepath.Join(p.root, strconv.Itoa(os.Getpid()))
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"stat", "status"} {
		data, err := os.ReadFile(filepath.Join("/proc/self", name))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return p
}

// inPod puts the process in a container of the pod of uid, as the kubelet's systemd driver and
// containerd name the cgroups; connections made after it are attested in that pod.
func (p *procTree) inPod(uid string) {
	p.t.Helper()
	path := fmt.Sprintf("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod%s.slice/cri-containerd-%s.scope\n",
		strings.ReplaceAll(uid, "-", "_"), strings.Repeat("ab", 32))
	if err := os.WriteFile(filepath.Join(p.root, strconv.Itoa(os.Getpid()), "cgroup"), []byte(path), 0o600); err != nil {
		p.t.Fatal(err)
	}
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url) //nolint:noctx // a test's loopback request
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(body)
}

// sdsDefault fetches "default" on a connection of its own and returns its leaf's SPIFFE ID.
func sdsDefault(ctx context.Context, socket string) (string, error) {
	got, err := sdsclient.Get(ctx, socket, "sidecar~10.0.0.1~app.shop~shop.svc.cluster.local", "default")
	if err != nil {
		return "", err
	}
	certs, err := pki.ParseCertificates(got["default"].GetTlsCertificate().GetCertificateChain().GetInlineBytes())
	if err != nil {
		return "", err
	}
	if len(certs) == 0 || len(certs[0].URIs) != 1 {
		return "", fmt.Errorf("no leaf with one URI SAN in %d certificates", len(certs))
	}
	return certs[0].URIs[0].String(), nil
}

// Issue 28's Kubernetes source end to end, on a real API server: meshid agent in node mode
// with --workload-attestation-pods, watching its node's pods with exactly the RBAC of
// deploy/kubernetes/rbac-node-agent-pods.yaml and asking meshid ca (--trusted-node-accounts,
// on the same API server) for each caller's identity. It is not ready until it can list the
// pods. A caller whose cgroup names a pod of the node gets that pod's identity over SDS; one
// whose cgroup names a pod nobody knows is refused (PermissionDenied, counted pod_not_found)
// once the wait for the pod has elapsed on its clock.
func TestNodeAgentAttestsThePodsOfItsNode(t *testing.T) {
	t.Parallel()
	node := "node-" + randomSuffix(t)
	kubeEnv.Apply(t, false, filepath.Join("..", "..", "deploy", "kubernetes", "00-namespace.yaml"))
	// The shipped RBAC names this account: made, and removed with the RBAC, by each run.
	kubeEnv.ServiceAccount(t, "istio-system", "meshid-node-agent")
	t.Cleanup(func() {
		if err := kubeEnv.Core().ServiceAccounts("istio-system").Delete(context.Background(), "meshid-node-agent", metav1.DeleteOptions{}); err != nil {
			t.Errorf("delete the node agent's service account: %v", err)
		}
	})
	ns := kubeEnv.Namespace(t, nil)
	kubeEnv.ServiceAccount(t, ns, "app")
	agentPod := kubeEnv.Pod(t, "istio-system", "meshid-node-"+node, "meshid-node-agent", node)
	appPod := kubeEnv.Pod(t, ns, "app", "app", node)

	caCfg := controlplanetest.Config(t)
	caCfg.CANamespace = "istio-system"
	caCfg.Kubernetes.Kubeconfig = kubetest.Kubeconfig(t, t.TempDir(), kubeEnv.Admin)
	caCfg.Kubernetes.Identity = "ca-" + node
	caCfg.TrustedNodeAccounts = []string{"istio-system/meshid-node-agent"}
	cp := controlplanetest.Start(t, caCfg)

	proc := newProcTree(t)
	proc.inPod(string(appPod.UID))
	podClock := testutil.NewFakeClock(time.Now())
	cfg := agent.DefaultConfig(testutil.ShortTempDir(t))
	cfg.CA.Address, cfg.CA.RootCert = cp.GRPCAddr(), filepath.Join(caCfg.StateDir, ca.RootCertFile)
	cfg.CA.TokenPath = boundTokenFile(t, "istio-system", "meshid-node-agent", agentPod)
	cfg.Identity.Namespace, cfg.Identity.ServiceAccount = "istio-system", "meshid-node-agent"
	cfg.SDS.SocketDir = testutil.ShortTempDir(t)
	cfg.Servers.StatusAddr, cfg.Servers.DebugAddr = "127.0.0.1:0", ""
	cfg.XDS.Proxy, cfg.XDS.ProxyDebug = false, false
	cfg.SDS.AttestPods = agent.AttestPods{Enabled: true, NodeName: node,
		Kubeconfig: kubetest.Kubeconfig(t, t.TempDir(), kubeEnv.As(t, "istio-system", "meshid-node-agent"))}
	cfg.SDS.Node = nodemode.New(func(c agent.AttestConfig) (agent.Attestor, error) { return newAttestorIn(proc.root, podClock, c) })
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("agent Run: %v", err)
		}
	})

	// The agent's account may not list pods yet: not ready, and saying why.
	ready := "http://" + a.StatusAddr() + "/healthz/ready"
	notListed := "the pods of node " + node + " have not been listed yet"
	if code, body := get(t, ready); code != http.StatusServiceUnavailable || !strings.Contains(body, notListed) {
		t.Fatalf("before the pods can be listed: %d %q, want 503 saying %q", code, body, notListed)
	}
	rbac := kubeEnv.Apply(t, false, filepath.Join("..", "..", "deploy", "kubernetes", "rbac-node-agent-pods.yaml"))
	t.Cleanup(func() { kubeEnv.Delete(t, rbac...) })
	kubetest.Eventually(t, "ready once the pods are listed", func() error {
		if code, body := get(t, ready); code != http.StatusOK {
			return fmt.Errorf("%d %s", code, body)
		}
		return nil
	})

	fetchCtx, fetchCancel := context.WithTimeout(t.Context(), kubetest.WaitLimit)
	defer fetchCancel()
	want := "spiffe://cluster.local/ns/" + ns + "/sa/app"
	if got, err := sdsDefault(fetchCtx, a.SocketPath()); err != nil || got != want {
		t.Fatalf("a caller in the app's pod: %q, %v; want %s", got, err, want)
	}

	// A pod nobody knows: waited for, then refused.
	proc.inPod("0badc0de-0000-4000-8000-000000000000")
	refused := make(chan error, 1)
	go func() {
		_, err := sdsDefault(fetchCtx, a.SocketPath())
		refused <- err
	}()
	if err := podClock.WaitForTimers(fetchCtx, 1); err != nil {
		t.Fatalf("the lookup of the unknown pod does not wait: %v", err)
	}
	podClock.Advance(kube.DefaultPodWait)
	select {
	case err := <-refused:
		if status.Code(err) != codes.PermissionDenied {
			t.Fatalf("a caller in an unknown pod: %v, want PermissionDenied", err)
		}
	case <-fetchCtx.Done():
		t.Fatal("a caller in an unknown pod: no answer")
	}
	_, metrics := get(t, "http://"+a.StatusAddr()+"/metrics")
	for _, line := range []string{
		`meshid_agent_attestation_refusals_total{reason="pod_not_found"} 1`,
		`meshid_agent_attestation_identified_total{source="pod"} 1`,
	} {
		if !strings.Contains(metrics, line) {
			t.Errorf("/metrics does not say %s", line)
		}
	}
}
