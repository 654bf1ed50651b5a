package kube

import (
	"context"
	"fmt"
	"log/slog"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/tools/cache"

	caserver "github.com/meshid/meshid/ca/server"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// nodeAccountIndex indexes pods by node and service account: "NODE/NAMESPACE/SERVICE_ACCOUNT".
const nodeAccountIndex = "node-account"

// NodePodsConfig configures NodePods.
type NodePodsConfig struct {
	Clients    *Clients
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

// NodePods answers, from an informer of the cluster's live pods, whether a service account
// has a pod on a node agent's node: the CA's node authorization (caserver.NodeAuthorizer), as
// Istio's NodeAuthorizer does for CA_TRUSTED_NODE_ACCOUNTS.
type NodePods struct {
	pods   cache.SharedIndexInformer
	synced chan struct{}
	once   sync.Once
}

var _ caserver.NodeAuthorizer = (*NodePods)(nil)

// NewNodePods returns NodePods; it starts no goroutine: call Run. Its informer lists and watches
// every pod of the cluster that has not ended (phase neither Succeeded nor Failed): a pod that ends
// leaves it as a deleted one does.
func NewNodePods(cfg NodePodsConfig) (*NodePods, error) {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	running := fields.AndSelectors(
		fields.OneTermNotEqualSelector("status.phase", string(corev1.PodSucceeded)),
		fields.OneTermNotEqualSelector("status.phase", string(corev1.PodFailed)))
	lw := cache.NewListWatchFromClient(cfg.Clients.Core.RESTClient(), "pods", metav1.NamespaceAll, running)
	pods := newInformer(lw, &corev1.Pod{}, "pods", cache.Indexers{nodeAccountIndex: indexNodeAccount},
		log, watchErrors(cfg.Registerer))
	// A cluster has many pods and this reads four fields of each: keep only those. It replaces
	// newInformer's transform, which this one subsumes; the informer has not started.
	if err := pods.SetTransform(slimPod); err != nil {
		return nil, fmt.Errorf("pods of the nodes: %w", err)
	}
	return &NodePods{pods: pods, synced: make(chan struct{})}, nil
}

// slimPod keeps what node authorization reads of a pod.
func slimPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil // a tombstone (cache.DeletedFinalStateUnknown)
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace, UID: p.UID, ResourceVersion: p.ResourceVersion},
		Spec:       corev1.PodSpec{NodeName: p.Spec.NodeName, ServiceAccountName: p.Spec.ServiceAccountName},
		Status:     corev1.PodStatus{Phase: p.Status.Phase},
	}, nil
}

func nodeAccountKey(node, namespace, serviceAccount string) string {
	return node + "/" + namespace + "/" + serviceAccount
}

func indexNodeAccount(obj any) ([]string, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok || p.Spec.NodeName == "" || p.Spec.ServiceAccountName == "" || ended(p) {
		return nil, nil
	}
	return []string{nodeAccountKey(p.Spec.NodeName, p.Namespace, p.Spec.ServiceAccountName)}, nil
}

// ended reports a pod that will run no more; the field selector keeps them out already, this
// guards against a watch that ignored it.
func ended(p *corev1.Pod) bool {
	return p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed
}

// Run runs the informer until ctx ends.
func (n *NodePods) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	wg.Go(func() { n.pods.RunWithContext(ctx) })
	if cache.WaitForCacheSync(ctx.Done(), n.pods.HasSynced) {
		n.once.Do(func() { close(n.synced) })
	}
	wg.Wait()
	return nil
}

// Synced is closed once the pods have been listed.
func (n *NodePods) Synced() <-chan struct{} { return n.synced }

// OnCallersNode implements caserver.NodeAuthorizer: the caller's token must be bound to a pod
// that is still a live pod of the caller's service account (same UID: not a pod re-created
// under its name) on a node, and target must have a live pod on that node.
func (n *NodePods) OnCallersNode(_ context.Context, caller caserver.Caller, target pki.SPIFFEID) error {
	select {
	case <-n.synced:
	default:
		return caserver.ErrNodesUnavailable
	}
	bound := caller.Pod
	if bound.Name == "" {
		return caserver.ErrNoBoundPod
	}
	ns := caller.Identity.Namespace
	obj, found, err := n.pods.GetStore().GetByKey(ns + "/" + bound.Name)
	if err != nil {
		return fmt.Errorf("%w: %w", caserver.ErrNodesUnavailable, err)
	}
	pod, ok := obj.(*corev1.Pod)
	switch {
	case !found || !ok:
		return fmt.Errorf("%w: no live pod %s/%s", caserver.ErrCallerPodUnknown, ns, logkey.Untrusted(bound.Name))
	case string(pod.UID) != bound.UID:
		// The pod was re-created under its name; a token of the new one will do.
		return fmt.Errorf("%w: pod %s/%s is another pod now (UID %s, the token's %s)", caserver.ErrCallerPodUnknown,
			ns, pod.Name, pod.UID, logkey.Untrusted(bound.UID))
	case pod.Spec.ServiceAccountName != caller.Identity.ServiceAccount:
		return fmt.Errorf("%w: pod %s/%s runs as %s, not %s", caserver.ErrCallerPodUnknown,
			ns, pod.Name, pod.Spec.ServiceAccountName, caller.Identity.ServiceAccount)
	case pod.Spec.NodeName == "":
		return fmt.Errorf("%w: pod %s/%s is on no node yet", caserver.ErrCallerPodUnknown, ns, pod.Name)
	}
	node := pod.Spec.NodeName
	on, err := n.pods.GetIndexer().ByIndex(nodeAccountIndex, nodeAccountKey(node, target.Namespace, target.ServiceAccount))
	if err != nil {
		return fmt.Errorf("%w: %w", caserver.ErrNodesUnavailable, err)
	}
	if len(on) == 0 {
		return fmt.Errorf("%w: no live pod of %s/%s on node %s", caserver.ErrNotOnNode, target.Namespace, target.ServiceAccount, node)
	}
	return nil
}
