package kube

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/tools/cache"

	"github.com/meshid/meshid/internal/attest"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
)

// DefaultPodWait bounds how long a lookup waits for a pod the watch has not delivered yet.
const DefaultPodWait = 5 * time.Second

// Indexes of LocalPods' informer.
const (
	podUIDIndex    = "uid"
	mirrorPodIndex = "mirror"
)

// configHash is a static pod's UID as the kubelet makes it, and names its cgroup: 32 hex digits.
var configHash = regexp.MustCompile(`^[0-9a-f]{32}$`)

// DefaultServiceAccount is the account of a pod that names none: a static pod, whose mirror pod
// may not reference service accounts (the ServiceAccount admission plugin refuses it).
const DefaultServiceAccount = "default"

// ErrAmbiguousPod: more than one pod of the node claims a static pod's config hash; a pod's
// annotations are its creator's to write, so none of them is believed.
var ErrAmbiguousPod = errors.New("several pods claim the static pod's config hash")

// LocalPodsConfig configures LocalPods.
type LocalPodsConfig struct {
	Clients *Clients
	// NodeName is the node whose pods are watched (spec.nodeName); required.
	NodeName string
	// Wait bounds a lookup's wait for a pod not listed yet; 0: DefaultPodWait.
	Wait       time.Duration
	Clock      clock.Clock // times the wait
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

// LocalPods is a node agent's view of the pods the API server has bound to its node: it gives a
// caller in a pod, found by the pod UID of its cgroup, that pod's namespace and service account
// (attest.PodResolver). A static pod is found by its config hash, which the kubelet names its
// cgroup after and writes in its mirror pod's kubernetes.io/config.mirror annotation.
type LocalPods struct {
	node  string
	wait  time.Duration
	clock clock.Clock
	pods  cache.SharedIndexInformer

	synced     chan struct{}
	syncedOnce sync.Once

	mu      sync.Mutex
	changed chan struct{} // closed and replaced when a pod is added or updated
}

var _ attest.PodResolver = (*LocalPods)(nil)

// NewLocalPods returns LocalPods; it starts no goroutine: call Run.
func NewLocalPods(cfg LocalPodsConfig) (*LocalPods, error) {
	if cfg.NodeName == "" {
		return nil, errors.New("pods of the node: no node name")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	wait := cfg.Wait
	if wait <= 0 {
		wait = DefaultPodWait
	}
	// The node's pods only: a node agent reads no other node's, and a node has tens of pods
	// where the cluster may have tens of thousands.
	onNode := fields.OneTermEqualSelector("spec.nodeName", cfg.NodeName)
	lw := cache.NewListWatchFromClient(cfg.Clients.Core.RESTClient(), "pods", metav1.NamespaceAll, onNode)
	errs := registerCounterVec(cfg.Registerer, prometheus.CounterOpts{
		Name: "meshid_agent_kube_watch_errors_total",
		Help: "Failed lists and watches of the Kubernetes API by the node agent, by resource.",
	}, "resource")
	pods := newInformer(lw, &corev1.Pod{}, "pods", cache.Indexers{podUIDIndex: indexPodUID, mirrorPodIndex: indexMirrorHash},
		log.With(logkey.Node, cfg.NodeName), errs)
	// Replaces newInformer's transform, which this one subsumes; the informer has not started.
	if err := pods.SetTransform(slimLocalPod); err != nil {
		return nil, fmt.Errorf("pods of node %s: %w", cfg.NodeName, err)
	}
	p := &LocalPods{node: cfg.NodeName, wait: wait, clock: clock.OrReal(cfg.Clock), pods: pods,
		synced: make(chan struct{}), changed: make(chan struct{})}
	// Called after the indexer holds the pod, so that a lookup woken by it finds the pod.
	if _, err := pods.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { p.notify() },
		UpdateFunc: func(any, any) { p.notify() },
	}); err != nil {
		return nil, fmt.Errorf("pods of node %s: %w", cfg.NodeName, err)
	}
	return p, nil
}

// slimLocalPod keeps what a lookup reads of a pod (and its name, the store's key).
func slimLocalPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil // a tombstone (cache.DeletedFinalStateUnknown)
	}
	slim := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace, UID: p.UID, ResourceVersion: p.ResourceVersion},
		Spec:       corev1.PodSpec{NodeName: p.Spec.NodeName, ServiceAccountName: p.Spec.ServiceAccountName},
		Status:     corev1.PodStatus{Phase: p.Status.Phase},
	}
	if hash, ok := p.Annotations[corev1.MirrorPodAnnotationKey]; ok {
		slim.Annotations = map[string]string{corev1.MirrorPodAnnotationKey: hash}
	}
	return slim, nil
}

func indexPodUID(obj any) ([]string, error) {
	if p, ok := obj.(*corev1.Pod); ok && p.UID != "" {
		return []string{string(p.UID)}, nil
	}
	return nil, nil
}

func indexMirrorHash(obj any) ([]string, error) {
	if p, ok := obj.(*corev1.Pod); ok {
		if hash := p.Annotations[corev1.MirrorPodAnnotationKey]; hash != "" {
			return []string{hash}, nil
		}
	}
	return nil, nil
}

// Run runs the informer until ctx ends.
func (p *LocalPods) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	wg.Go(func() { p.pods.RunWithContext(ctx) })
	if cache.WaitForCacheSync(ctx.Done(), p.pods.HasSynced) {
		p.syncedOnce.Do(func() { close(p.synced) })
	}
	wg.Wait()
	return nil
}

// Node is the node whose pods these are.
func (p *LocalPods) Node() string { return p.node }

// Synced is closed once the node's pods have been listed.
func (p *LocalPods) Synced() <-chan struct{} { return p.synced }

func (p *LocalPods) notify() {
	p.mu.Lock()
	defer p.mu.Unlock()
	close(p.changed)
	p.changed = make(chan struct{})
}

func (p *LocalPods) changes() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.changed
}

// ResolvePod implements attest.PodResolver. A pod's containers can start before the watch
// delivers the pod, and before the first list: a UID not known yet is waited for, up to the
// configured wait and ctx, then refused. A pod that has ended is refused at once.
func (p *LocalPods) ResolvePod(ctx context.Context, podUID string) (attest.Identity, error) {
	if id, found, err := p.listedLookup(podUID); found || err != nil {
		return id, err
	}
	timer := p.clock.NewTimer(p.wait)
	defer timer.Stop()
	synced := p.synced // nil once seen closed, so that the wait does not spin on it
	for {
		changed := p.changes()
		if isClosed(synced) {
			synced = nil
		}
		// Looked up again after taking changed: a pod added in between closes it.
		if id, found, err := p.listedLookup(podUID); found || err != nil {
			return id, err
		}
		select {
		case <-changed:
		case <-synced:
		case <-timer.C():
			if !isClosed(p.synced) {
				return attest.Identity{}, fmt.Errorf("the pods of node %s have not been listed within %s", p.node, p.wait)
			}
			if id, found, err := p.lookup(podUID); found || err != nil {
				return id, err
			}
			return attest.Identity{}, fmt.Errorf("%w: no pod of node %s has UID or config hash %s (waited %s)",
				attest.ErrPodNotFound, p.node, podUID, p.wait)
		case <-ctx.Done():
			return attest.Identity{}, fmt.Errorf("waiting for pod %s of node %s: %w", podUID, p.node, ctx.Err())
		}
	}
}

// listedLookup is lookup once the pods have been listed, and finds nothing before.
func (p *LocalPods) listedLookup(podUID string) (_ attest.Identity, found bool, _ error) {
	if !isClosed(p.synced) {
		return attest.Identity{}, false, nil
	}
	return p.lookup(podUID)
}

// lookup finds the pod of podUID, or a static pod whose config hash it is. found is false when
// no pod has it yet.
func (p *LocalPods) lookup(podUID string) (_ attest.Identity, found bool, _ error) {
	idx := p.pods.GetIndexer()
	objs, err := idx.ByIndex(podUIDIndex, podUID)
	if err != nil {
		return attest.Identity{}, false, fmt.Errorf("pods of node %s: %w", p.node, err)
	}
	// Only a static pod's form of UID, a config hash, is looked for among the mirror pods: a
	// pod's annotations are its creator's to write, and must not name a pod the API server
	// made (one deleted while its processes linger, say).
	if len(objs) == 0 && configHash.MatchString(podUID) {
		if objs, err = idx.ByIndex(mirrorPodIndex, podUID); err != nil {
			return attest.Identity{}, false, fmt.Errorf("pods of node %s: %w", p.node, err)
		}
		if len(objs) > 1 {
			return attest.Identity{}, true, fmt.Errorf("%w: %d pods of node %s claim %s", ErrAmbiguousPod, len(objs), p.node, podUID)
		}
	}
	if len(objs) == 0 {
		return attest.Identity{}, false, nil
	}
	pod, ok := objs[0].(*corev1.Pod)
	switch {
	case !ok:
		return attest.Identity{}, false, nil
	case ended(pod):
		return attest.Identity{}, true, fmt.Errorf("%w: pod %s/%s of node %s has ended (%s)", attest.ErrPodNotFound,
			pod.Namespace, pod.Name, p.node, pod.Status.Phase)
	case pod.Spec.NodeName != p.node:
		// The field selector keeps them out; this guards against a watch that ignored it.
		return attest.Identity{}, true, fmt.Errorf("%w: pod %s/%s is on node %s, not %s", attest.ErrPodNotFound,
			pod.Namespace, pod.Name, pod.Spec.NodeName, p.node)
	}
	sa := pod.Spec.ServiceAccountName
	if sa == "" {
		sa = DefaultServiceAccount
	}
	return attest.Identity{Namespace: pod.Namespace, ServiceAccount: sa}, true, nil
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}
