package kube

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
)

// The trust bundle ConfigMap, as istiod publishes it; the sidecars mount it as the CA root.
const (
	RootCertConfigMap = "istio-ca-root-cert"
	RootCertKey       = ca.RootCertFile
	// LabelIstioConfig is the label istiod puts on the ConfigMaps it writes.
	LabelIstioConfig = "istio.io/config"
)

// TrustBundle is the source of the roots to publish: ca.Authority.
type TrustBundle interface {
	// Bundle is the key material in service; Changed is closed at its next change.
	Bundle() *ca.Bundle
	Changed() <-chan struct{}
}

// NamespaceStore is what RootConfigMaps reads of a store: its namespaces and their changes (see
// controller.Store).
type NamespaceStore interface {
	controller.NamespaceStore
	Changed() <-chan struct{}
}

// RootConfigMapsConfig configures RootConfigMaps.
type RootConfigMapsConfig struct {
	Clients   *Clients
	Store     NamespaceStore
	Targeting *controller.Targeting // over Store
	Bundle    TrustBundle
	// RetryBase and RetryMax bound the per-namespace backoff after a failed write (defaults 1s
	// and 5m), timed on Clock.
	RetryBase, RetryMax time.Duration
	Clock               clock.Clock
	Logger              *slog.Logger
	Registerer          prometheus.Registerer // optional
}

// RootConfigMaps publishes the CA's trusted roots (retained ones included) as the ConfigMap
// istio-ca-root-cert in every namespace the CA serves, as istiod's namespace controller does: it
// creates a missing one and puts back one that differs (a root change, a user's edit or
// deletion). Namespaces it does not serve are left alone. Run it on one replica at a time.
type RootConfigMaps struct {
	cfg     RootConfigMapsConfig
	clock   clock.Clock
	log     *slog.Logger
	limiter workqueue.TypedRateLimiter[string]
	writes  *prometheus.CounterVec
	apiErrs *prometheus.CounterVec
	// watchErrs counts failed lists and watches, shared with the other informers.
	watchErrs *prometheus.CounterVec
	wake      chan struct{} // a retry was scheduled

	mu  sync.Mutex
	due map[string]time.Time // namespaces to retry, and when
}

// allNamespaces is the queue key that stands for every served namespace.
const allNamespaces = ""

// NewRootConfigMaps returns a RootConfigMaps. It starts no goroutine.
func NewRootConfigMaps(cfg RootConfigMapsConfig) (*RootConfigMaps, error) {
	switch {
	case cfg.Clients == nil:
		return nil, errors.New("root configmaps: no Kubernetes clients")
	case cfg.Store == nil || cfg.Targeting == nil:
		return nil, errors.New("root configmaps: no namespace store or targeting")
	case cfg.Bundle == nil:
		return nil, errors.New("root configmaps: no trust bundle")
	}
	if cfg.RetryBase <= 0 {
		cfg.RetryBase = time.Second
	}
	if cfg.RetryMax < cfg.RetryBase {
		cfg.RetryMax = max(5*time.Minute, cfg.RetryBase)
	}
	r := &RootConfigMaps{
		watchErrs: watchErrors(cfg.Registerer),
		cfg:       cfg,
		clock:     clock.OrReal(cfg.Clock),
		log:       cfg.Logger,
		limiter:   workqueue.NewTypedItemExponentialFailureRateLimiter[string](cfg.RetryBase, cfg.RetryMax),
		wake:      make(chan struct{}, 1),
		due:       map[string]time.Time{},
		writes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "root_configmap_writes_total",
			Help: "Writes of the istio-ca-root-cert ConfigMaps, by operation (create, update).",
		}, []string{"operation"}),
		apiErrs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "root_configmap_errors_total",
			Help: "Failures to publish the istio-ca-root-cert ConfigMaps, by operation (list, watch, create, update); each is retried.",
		}, []string{"operation"}),
	}
	if r.log == nil {
		r.log = slog.New(slog.DiscardHandler)
	}
	if cfg.Registerer != nil {
		for _, c := range []prometheus.Collector{r.writes, r.apiErrs} {
			if err := cfg.Registerer.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return r, nil
}

// Run keeps the ConfigMaps current until ctx ends.
func (r *RootConfigMaps) Run(ctx context.Context) error {
	informer := newInformer(cache.NewListWatchFromClient(r.cfg.Clients.Core.RESTClient(), "configmaps", metav1.NamespaceAll,
		fields.OneTermEqualSelector("metadata.name", RootCertConfigMap)), &corev1.ConfigMap{}, "configmaps/"+RootCertConfigMap, nil, r.log, r.watchErrs)
	queue := workqueue.NewTyped[string]()
	enqueue := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			if ns, _, err := cache.SplitMetaNamespaceKey(key); err == nil && ns != "" {
				queue.Add(ns)
			}
		}
	}
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    enqueue,
		UpdateFunc: func(_, obj any) { enqueue(obj) },
		DeleteFunc: enqueue,
	}); err != nil {
		return err
	}

	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { informer.RunWithContext(ctx); return nil })
	g.Go(func() error {
		<-ctx.Done()
		queue.ShutDown()
		return nil
	})
	g.Go(func() error {
		if !cache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
			return nil
		}
		return r.trigger(ctx, queue)
	})
	g.Go(func() error {
		if !cache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
			return nil
		}
		for r.processNext(ctx, queue, informer.GetStore()) {
		}
		return nil
	})
	return g.Wait()
}

// trigger queues every namespace, at once and whenever the namespaces or the roots change, and
// each namespace whose retry is due.
func (r *RootConfigMaps) trigger(ctx context.Context, queue *workqueue.Typed[string]) error {
	all := true
	var storeChanged, bundleChanged <-chan struct{}
	for {
		if all {
			// Taken before the pass they trigger reads the store and the bundle: no change is missed.
			storeChanged, bundleChanged = r.cfg.Store.Changed(), r.cfg.Bundle.Changed()
			queue.Add(allNamespaces)
			all = false
		}
		var (
			timer   clock.Timer
			timeout <-chan time.Time
		)
		if next, ok := r.addDue(queue, r.clock.Now()); ok {
			timer = r.clock.NewTimer(next.Sub(r.clock.Now()))
			timeout = timer.C()
		}
		select {
		case <-ctx.Done():
		case <-storeChanged:
			all = true
		case <-bundleChanged:
			all = true
		case <-r.wake:
		case <-timeout:
		}
		if timer != nil {
			timer.Stop()
		}
		if ctx.Err() != nil {
			return nil
		}
	}
}

// addDue queues the namespaces whose retry is due and returns when the next one is.
func (r *RootConfigMaps) addDue(queue *workqueue.Typed[string], now time.Time) (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var next time.Time
	for ns, at := range r.due {
		switch {
		case !now.Before(at):
			delete(r.due, ns)
			queue.Add(ns)
		case next.IsZero() || at.Before(next):
			next = at
		}
	}
	return next, !next.IsZero()
}

// retry schedules ns again after its backoff.
func (r *RootConfigMaps) retry(ns string) time.Time {
	at := r.clock.Now().Add(r.limiter.When(ns))
	r.mu.Lock()
	if cur, ok := r.due[ns]; !ok || at.Before(cur) {
		r.due[ns] = at
	}
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
	return at
}

func (r *RootConfigMaps) processNext(ctx context.Context, queue *workqueue.Typed[string], cms cache.Store) bool {
	ns, shutdown := queue.Get()
	if shutdown {
		return false
	}
	defer queue.Done(ns)
	var err error
	if ns == allNamespaces {
		err = r.enqueueServed(ctx, queue)
	} else {
		err = r.reconcile(ctx, ns, cms)
	}
	switch {
	case err == nil:
		r.limiter.Forget(ns)
	case ctx.Err() != nil:
	case apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err):
		// Our informer has not seen the latest version yet: look again once it has.
		r.log.Debug("root configmap changed meanwhile; retrying", logkey.Namespace, ns, logkey.RetryAt, r.retry(ns))
	default:
		r.log.Warn("cannot publish the root configmap; retrying", logkey.Namespace, ns, logkey.ConfigMap, RootCertConfigMap,
			logkey.Error, err.Error(), logkey.RetryAt, r.retry(ns))
	}
	return true
}

// enqueueServed queues every namespace this CA serves.
func (r *RootConfigMaps) enqueueServed(ctx context.Context, queue *workqueue.Typed[string]) error {
	decisions, err := r.cfg.Targeting.Decisions(ctx)
	if err != nil {
		r.apiErrs.WithLabelValues("list").Inc()
		return err
	}
	for _, d := range decisions {
		if d.Served && !systemNamespace(d.Namespace) {
			queue.Add(d.Namespace)
		}
	}
	return nil
}

// systemNamespaces get no ConfigMap, as istiod's namespace controller leaves them alone: no
// workload of the mesh runs there.
func systemNamespace(ns string) bool {
	switch ns {
	case "kube-system", "kube-public", "kube-node-lease", "local-path-storage":
		return true
	}
	return false
}

// reconcile makes the ConfigMap of ns hold the trusted roots, if the CA serves ns.
func (r *RootConfigMaps) reconcile(ctx context.Context, ns string, cms cache.Store) error {
	d, err := r.cfg.Targeting.Decide(ctx, ns)
	if err != nil {
		return err
	}
	b := r.cfg.Bundle.Bundle()
	if !d.Known || !d.Served || b == nil || systemNamespace(ns) {
		return nil // not ours (or no roots yet: their arrival queues every namespace)
	}
	want := string(b.RootsPEM())
	obj, exists, err := cms.GetByKey(ns + "/" + RootCertConfigMap)
	if err != nil {
		return err
	}
	client := r.cfg.Clients.Core.ConfigMaps(ns)
	if !exists {
		_, err := client.Create(ctx, &corev1.ConfigMap{
			ObjectMeta: metav1.ObjectMeta{Name: RootCertConfigMap, Namespace: ns, Labels: map[string]string{LabelIstioConfig: "true"}},
			Data:       map[string]string{RootCertKey: want},
		}, metav1.CreateOptions{})
		return r.count("create", ns, err)
	}
	cm := obj.(*corev1.ConfigMap)
	if cm.Data[RootCertKey] == want && cm.Labels[LabelIstioConfig] == "true" {
		return nil
	}
	next := cm.DeepCopy()
	next.Data = maps.Clone(cm.Data)
	if next.Data == nil {
		next.Data = map[string]string{}
	}
	next.Data[RootCertKey] = want
	if next.Labels == nil {
		next.Labels = map[string]string{}
	}
	next.Labels[LabelIstioConfig] = "true"
	_, err = client.Update(ctx, next, metav1.UpdateOptions{})
	return r.count("update", ns, err)
}

func (r *RootConfigMaps) count(op, ns string, err error) error {
	switch {
	case err == nil:
		r.writes.WithLabelValues(op).Inc()
		r.log.Info("published the trusted roots", logkey.Namespace, ns, logkey.ConfigMap, RootCertConfigMap, logkey.Operation, op)
		return nil
	case apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err):
		return err
	default:
		r.apiErrs.WithLabelValues(op).Inc()
		return fmt.Errorf("%s configmap %s/%s: %w", op, ns, RootCertConfigMap, err)
	}
}
