//go:build external

package kube_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/meshid/meshid/ca/controller/kube"
	"github.com/meshid/meshid/ca/controller/kube/kubetest"
	caserver "github.com/meshid/meshid/ca/server"
	"github.com/meshid/meshid/internal/pki"
)

// nodePodsRules are the rules of deploy/kubernetes/rbac-node-agents.yaml's ClusterRole, which
// the pod watch must need no more than.
func nodePodsRules(t *testing.T) []rbacv1.PolicyRule {
	t.Helper()
	return clusterRoleRules(t, "rbac-node-agents.yaml")
}

// clusterRoleRules are the rules of the ClusterRole of deploy/kubernetes/file.
func clusterRoleRules(t *testing.T, file string) []rbacv1.PolicyRule {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "..", "..", "deploy", "kubernetes", file))
	if err != nil {
		t.Fatal(err)
	}
	for doc := range strings.SplitSeq(string(data), "\n---\n") {
		var role rbacv1.ClusterRole
		if err := yaml.Unmarshal([]byte(doc), &role); err != nil {
			t.Fatal(err)
		}
		if role.Kind == "ClusterRole" {
			return role.Rules
		}
	}
	t.Fatal(file + " holds no ClusterRole")
	return nil
}

// createPod creates a pod of ns/sa on node, as a scheduler would have placed it.
func createPod(t *testing.T, ns, name, sa, node string) *corev1.Pod {
	t.Helper()
	return env.Pod(t, ns, name, sa, node)
}

// boundToken asks TokenRequest for a token of ns/sa bound to pod, as the kubelet mounts them.
func boundToken(t *testing.T, ns, sa string, pod *corev1.Pod) string {
	t.Helper()
	return env.BoundToken(t, ns, sa, pod)
}

// A node agent whose token is bound to its pod on node A may have the identities with a running
// pod on node A, and no other; a workload whose pod is deleted or has ended leaves its node as
// soon as the watch says so; a token bound to no pod, or to a pod that is gone, asks for nothing.
// The watch runs with exactly the rule of deploy/kubernetes/rbac-node-agents.yaml.
func TestNodePodsAuthorizeNodeAgents(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	for _, sa := range []string{"node-agent", "ca", "app-a", "app-b", "batch"} {
		env.ServiceAccount(t, ns, sa)
	}
	bind(t, ns, "ca", nil, nodePodsRules(t))
	agentPod := createPod(t, ns, "agent", "node-agent", "node-a")
	appA := createPod(t, ns, "app-a", "app-a", "node-a")
	createPod(t, ns, "app-b", "app-b", "node-b")
	batch := createPod(t, ns, "batch", "batch", "node-a")

	np, err := kube.NewNodePods(kube.NodePodsConfig{Clients: clientsFor(t, env.As(t, ns, "ca")), Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	id := func(sa string) pki.SPIFFEID {
		return pki.SPIFFEID{TrustDomain: reviewTrustDomain, Namespace: ns, ServiceAccount: sa}
	}
	reviewer := newReviewer(t, nil, "istio-ca")
	agent, err := reviewer.auth.Authenticate(reviewBearer(t.Context(), boundToken(t, ns, "node-agent", agentPod)))
	if err != nil {
		t.Fatal(err)
	}
	if agent.Pod != (caserver.BoundPod{Name: "agent", UID: string(agentPod.UID)}) {
		t.Fatalf("TokenReview gave bound pod %+v, want agent/%s", agent.Pod, agentPod.UID)
	}
	if err := np.OnCallersNode(t.Context(), agent, id("app-a")); !errors.Is(err, caserver.ErrNodesUnavailable) {
		t.Fatalf("before the pods are listed: %v, want ErrNodesUnavailable", err)
	}
	start(t, np.Run)
	waitClosed(t, np.Synced(), "pods listed")

	for _, tt := range []struct {
		sa   string
		want error
	}{{"app-a", nil}, {"batch", nil}, {"node-agent", nil}, {"app-b", caserver.ErrNotOnNode}, {"nobody", caserver.ErrNotOnNode}} {
		if err := np.OnCallersNode(t.Context(), agent, id(tt.sa)); !errors.Is(err, tt.want) {
			t.Errorf("%s: %v, want %v", tt.sa, err, tt.want)
		}
	}
	unbound, err := reviewer.auth.Authenticate(reviewBearer(t.Context(), env.Token(t, ns, "node-agent", time.Hour, "istio-ca")))
	if err != nil {
		t.Fatal(err)
	}
	if err := np.OnCallersNode(t.Context(), unbound, id("app-a")); !errors.Is(err, caserver.ErrNoBoundPod) {
		t.Errorf("a token bound to no pod: %v, want ErrNoBoundPod", err)
	}
	other := agent
	other.Pod.UID = "00000000-0000-0000-0000-000000000000"
	if err := np.OnCallersNode(t.Context(), other, id("app-a")); !errors.Is(err, caserver.ErrCallerPodUnknown) {
		t.Errorf("a pod re-created under the agent's name: %v, want ErrCallerPodUnknown", err)
	}

	// The workload's pod goes: refused once the watch has seen it.
	if err := env.Core().Pods(ns).Delete(t.Context(), appA.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	kubetest.Until(t, "app-a leaves node-a", func() bool {
		return errors.Is(np.OnCallersNode(t.Context(), agent, id("app-a")), caserver.ErrNotOnNode)
	})
	// A pod that has ended is no pod.
	batch.Status.Phase = corev1.PodSucceeded
	if _, err := env.Core().Pods(ns).UpdateStatus(t.Context(), batch, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.Until(t, "the ended batch pod leaves node-a", func() bool {
		return errors.Is(np.OnCallersNode(t.Context(), agent, id("batch")), caserver.ErrNotOnNode)
	})
	// The node agent's own pod goes: it asks for nothing more.
	if err := env.Core().Pods(ns).Delete(t.Context(), agentPod.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	kubetest.Until(t, "the agent's pod is gone", func() bool {
		return errors.Is(np.OnCallersNode(t.Context(), agent, id("node-agent")), caserver.ErrCallerPodUnknown)
	})
}
