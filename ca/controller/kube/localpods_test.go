//go:build external

package kube_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshid/meshid/ca/controller/kube"
	"github.com/meshid/meshid/ca/controller/kube/kubetest"
	"github.com/meshid/meshid/internal/attest"
	"github.com/meshid/meshid/internal/testutil"
)

// podWait is the lookups' bound in these tests; only the fake clock ever reaches it.
const podWait = 3 * time.Second

type resolved struct {
	id  attest.Identity
	err error
}

// resolveAsync starts a lookup and returns its answer's channel once the lookup waits on the
// clock (its bound's timer is armed).
func resolveAsync(t *testing.T, lp *kube.LocalPods, clk *testutil.FakeClock, uid string) <-chan resolved {
	t.Helper()
	armed := clk.PendingTimers()
	out := make(chan resolved, 1)
	go func() {
		id, err := lp.ResolvePod(context.Background(), uid)
		out <- resolved{id, err}
	}()
	ctx, cancel := context.WithTimeout(t.Context(), kubetest.WaitLimit)
	defer cancel()
	waiting := make(chan error, 1)
	go func() { waiting <- clk.WaitForTimers(ctx, armed+1) }()
	select {
	case err := <-waiting:
		if err != nil {
			t.Fatalf("lookup of %s: not waiting: %v", uid, err)
		}
	case r := <-out:
		t.Fatalf("lookup of %s: answered without waiting: %+v, %v", uid, r.id, r.err)
	}
	return out
}

func answer(t *testing.T, ch <-chan resolved) resolved {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(kubetest.WaitLimit):
		t.Fatalf("no answer within %s", kubetest.WaitLimit)
		return resolved{}
	}
}

// missing checks that uid is not found once the bound has elapsed on the clock.
func missing(t *testing.T, lp *kube.LocalPods, clk *testutil.FakeClock, uid, what string) {
	t.Helper()
	ch := resolveAsync(t, lp, clk, uid)
	clk.Advance(podWait)
	if r := answer(t, ch); !errors.Is(r.err, attest.ErrPodNotFound) {
		t.Fatalf("%s: %+v, %v; want ErrPodNotFound", what, r.id, r.err)
	}
}

// resolveNow looks uid up without waiting: the identity, or ErrPodNotFound for a pod that has
// ended, or context.Canceled for a pod not (or no longer) in the view.
func resolveNow(lp *kube.LocalPods, uid string) (attest.Identity, error) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return lp.ResolvePod(ctx, uid)
}

// mirrorHash is a static pod's config hash: 32 hex digits, as the kubelet names its cgroup.
func mirrorHash(t *testing.T) string {
	t.Helper()
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// createMirrorPod creates the mirror pod of a static pod of hash on node, as the kubelet does:
// it names no service account (the API server refuses one that does).
func createMirrorPod(t *testing.T, ns, name, node, hash string) *corev1.Pod {
	t.Helper()
	pod, err := env.Core().Pods(ns).Create(context.Background(), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{
			corev1.MirrorPodAnnotationKey: hash, "kubernetes.io/config.hash": hash, "kubernetes.io/config.source": "file"}},
		Spec: corev1.PodSpec{NodeName: node, AutomountServiceAccountToken: new(false),
			Containers: []corev1.Container{{Name: "app", Image: "example.invalid/app"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pod
}

// A node agent's view of its node's pods, watched with exactly the rule of
// deploy/kubernetes/rbac-node-agent-pods.yaml: a pod of the node resolves to its namespace and
// service account, a static pod by its config hash; another node's pod, a deleted pod, an ended
// pod and an unknown UID do not; a pod that appears while a lookup waits is found, and one that
// does not is refused when the bound elapses.
func TestLocalPodsResolve(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	for _, sa := range []string{"node-agent", "app-a", "app-b", "batch"} {
		env.ServiceAccount(t, ns, sa)
	}
	bind(t, ns, "node-agent", nil, clusterRoleRules(t, "rbac-node-agent-pods.yaml"))
	node := "node-" + ns
	appA := createPod(t, ns, "app-a", "app-a", node)
	appB := createPod(t, ns, "app-b", "app-b", "other-"+node)
	batch := createPod(t, ns, "batch", "batch", node)
	static := mirrorHash(t)
	createMirrorPod(t, ns, "static-"+node, node, static)

	clk := testutil.NewFakeClock(time.Now())
	lp, err := kube.NewLocalPods(kube.LocalPodsConfig{Clients: clientsFor(t, env.As(t, ns, "node-agent")), NodeName: node,
		Wait: podWait, Clock: clk, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	// A lookup made before the pods are listed waits for the list.
	early := resolveAsync(t, lp, clk, string(appA.UID))
	start(t, lp.Run)
	if r := answer(t, early); r.err != nil || r.id != (attest.Identity{Namespace: ns, ServiceAccount: "app-a"}) {
		t.Fatalf("a lookup made before the list: %+v, %v", r.id, r.err)
	}
	waitClosed(t, lp.Synced(), "pods listed")

	for _, tt := range []struct {
		name, uid string
		want      attest.Identity
	}{
		{"a pod of the node", string(appA.UID), attest.Identity{Namespace: ns, ServiceAccount: "app-a"}},
		{"another pod of the node", string(batch.UID), attest.Identity{Namespace: ns, ServiceAccount: "batch"}},
		{"a static pod, by its config hash", static, attest.Identity{Namespace: ns, ServiceAccount: kube.DefaultServiceAccount}},
	} {
		if id, err := lp.ResolvePod(t.Context(), tt.uid); err != nil || id != tt.want {
			t.Errorf("%s: %+v, %v; want %+v", tt.name, id, err, tt.want)
		}
	}
	missing(t, lp, clk, string(appB.UID), "a pod of another node")
	missing(t, lp, clk, "00000000-0000-0000-0000-000000000000", "an unknown UID")

	// A pod that appears while the lookup waits is found within the bound: the clock never moves.
	late := mirrorHash(t)
	ch := resolveAsync(t, lp, clk, late)
	createMirrorPod(t, ns, "late-"+node, node, late)
	if r := answer(t, ch); r.err != nil || r.id != (attest.Identity{Namespace: ns, ServiceAccount: kube.DefaultServiceAccount}) {
		t.Fatalf("a pod created while the lookup waited: %+v, %v", r.id, r.err)
	}

	// Two pods claiming one config hash: neither is believed.
	createMirrorPod(t, ns, "impostor-"+node, node, static)
	kubetest.Until(t, "the impostor is seen", func() bool {
		_, err := resolveNow(lp, static)
		return errors.Is(err, kube.ErrAmbiguousPod)
	})

	// An ended pod stops resolving as soon as the watch says so, without waiting.
	batch.Status.Phase = corev1.PodSucceeded
	if _, err := env.Core().Pods(ns).UpdateStatus(t.Context(), batch, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.Until(t, "the ended pod is refused", func() bool {
		_, err := resolveNow(lp, string(batch.UID))
		return errors.Is(err, attest.ErrPodNotFound)
	})
	// A deleted pod leaves the view, and is then not found.
	if err := env.Core().Pods(ns).Delete(t.Context(), appA.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	kubetest.Until(t, "the deleted pod leaves the view", func() bool {
		_, err := resolveNow(lp, string(appA.UID))
		return errors.Is(err, context.Canceled)
	})
	missing(t, lp, clk, string(appA.UID), "a deleted pod")

	// A pod whose mirror annotation names the deleted pod's UID does not stand in for it: only a
	// config hash is looked for among mirror pods. The marker, created after it, says when the
	// watch has brought it.
	createMirrorPod(t, ns, "claims-app-a-"+node, node, string(appA.UID))
	marker := mirrorHash(t)
	createMirrorPod(t, ns, "marker-"+node, node, marker)
	kubetest.Until(t, "the marker is seen", func() bool {
		_, err := resolveNow(lp, marker)
		return err == nil
	})
	missing(t, lp, clk, string(appA.UID), "a deleted pod that another pod's annotation names")
}

// Pods that are never listed (the agent may not list pods): a lookup is refused when the bound
// elapses, and not as a pod that is not there, which nobody knows.
func TestLocalPodsNotListed(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	env.ServiceAccount(t, ns, "node-agent")
	clk := testutil.NewFakeClock(time.Now())
	lp, err := kube.NewLocalPods(kube.LocalPodsConfig{Clients: clientsFor(t, env.As(t, ns, "node-agent")), NodeName: "node-" + ns,
		Wait: podWait, Clock: clk, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	start(t, lp.Run)
	ch := resolveAsync(t, lp, clk, "00000000-0000-0000-0000-000000000000")
	clk.Advance(podWait)
	r := answer(t, ch)
	if r.err == nil || errors.Is(r.err, attest.ErrPodNotFound) {
		t.Fatalf("before the pods are listed: %+v, %v; want an error that is not ErrPodNotFound", r.id, r.err)
	}
	// ctx ends the wait too.
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	armed := clk.PendingTimers()
	go func() {
		_, err := lp.ResolvePod(ctx, "00000000-0000-0000-0000-000000000000")
		done <- err
	}()
	wctx, wcancel := context.WithTimeout(t.Context(), kubetest.WaitLimit)
	defer wcancel()
	if err := clk.WaitForTimers(wctx, armed+1); err != nil {
		t.Fatal(err)
	}
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("ctx ended: %v", err)
		}
	case <-time.After(kubetest.WaitLimit):
		t.Fatal("ctx's end did not end the lookup")
	}
}

func TestNewLocalPodsNeedsANode(t *testing.T) {
	t.Parallel()
	if _, err := kube.NewLocalPods(kube.LocalPodsConfig{Clients: clientsFor(t, env.Admin)}); err == nil {
		t.Fatal("no node name: accepted")
	}
}
