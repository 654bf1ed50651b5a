package kube

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/cache"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
)

// errNotSynced: a view that has not listed everything yet answers nothing rather than a part.
var errNotSynced = errors.New("the Kubernetes API has not been listed yet")

// watchErrors counts failed lists and watches of the API by resource; one vector shared by every
// informer of a registry.
func watchErrors(reg prometheus.Registerer) *prometheus.CounterVec {
	return registerCounterVec(reg, prometheus.CounterOpts{
		Name: "meshid_ca_kube_watch_errors_total",
		Help: "Failed lists and watches of the Kubernetes API, by resource.",
	}, "resource")
}

// registerCounterVec registers a vector, or returns the one already registered under its name,
// so that components sharing a registry share the vector.
func registerCounterVec(reg prometheus.Registerer, opts prometheus.CounterOpts, labels ...string) *prometheus.CounterVec {
	v := prometheus.NewCounterVec(opts, labels)
	if reg == nil {
		return v
	}
	if err := reg.Register(v); err != nil {
		if are, ok := errors.AsType[prometheus.AlreadyRegisteredError](err); ok {
			if existing, ok := are.ExistingCollector.(*prometheus.CounterVec); ok {
				return existing
			}
		}
	}
	return v
}

// newInformer returns an informer of one resource whose list and watch failures are logged
// (once per distinct failure, since the reflector retries every second or so) and counted.
// Managed fields are dropped: they are most of an object's size and nothing here reads them.
func newInformer(lw cache.ListerWatcher, example runtime.Object, resource string, indexers cache.Indexers,
	log *slog.Logger, errs *prometheus.CounterVec) cache.SharedIndexInformer {
	informer := cache.NewSharedIndexInformerWithOptions(lw, example, cache.SharedIndexInformerOptions{
		Indexers: indexers, ObjectDescription: resource,
	})
	var (
		mu   sync.Mutex
		last string
	)
	// Both setters fail only once the informer runs.
	_ = informer.SetTransform(func(obj any) (any, error) {
		if m, ok := obj.(metav1.Object); ok {
			m.SetManagedFields(nil)
		}
		return obj, nil
	})
	_ = informer.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		errs.WithLabelValues(resource).Inc()
		mu.Lock()
		repeated := err.Error() == last
		last = err.Error()
		mu.Unlock()
		if !repeated {
			log.Error("cannot list or watch the Kubernetes API; retrying", logkey.Object, resource, logkey.Error, err.Error())
		}
	})
	return informer
}

// listIn lists what an informer holds in namespace, or everywhere when it is "". The informer
// must index by namespace.
func listIn(informer cache.SharedIndexInformer, namespace string) ([]any, error) {
	if namespace == "" {
		return informer.GetStore().List(), nil
	}
	return informer.GetIndexer().ByIndex(cache.NamespaceIndex, namespace)
}

// secretWatch names one Secret to follow, and how to report on its watch.
type secretWatch struct {
	clients         *Clients
	namespace, name string
	clock           clock.Clock
	log             *slog.Logger
	errs            *prometheus.CounterVec // watchErrors
	deleted         func()                 // optional, told of each deletion
}

// followSecret runs an informer of one Secret until ctx ends. Once it has listed, sync is called
// with the Secret (nil while there is none), then again at each change, and once the wait it
// returned has passed (0: none); one call at a time, each with the Secret as it is then.
func followSecret(ctx context.Context, w secretWatch, sync func(*corev1.Secret) time.Duration) error {
	informer := newInformer(cache.NewListWatchFromClient(w.clients.Core.RESTClient(), "secrets", w.namespace,
		fields.OneTermEqualSelector("metadata.name", w.name)), &corev1.Secret{}, "secrets/"+w.name, nil, w.log, w.errs)
	// One pending wake-up is enough: each sync reads the latest version.
	wake := make(chan struct{}, 1)
	poke := func() {
		select {
		case wake <- struct{}{}:
		default:
		}
	}
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { poke() },
		UpdateFunc: func(any, any) { poke() },
		DeleteFunc: func(any) {
			if w.deleted != nil {
				w.deleted()
			}
			poke()
		},
	}); err != nil {
		return err
	}
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { informer.RunWithContext(ctx); return nil })
	g.Go(func() error {
		if !cache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
			return nil // ctx ended
		}
		for {
			var s *corev1.Secret
			if obj, ok, _ := informer.GetStore().GetByKey(w.namespace + "/" + w.name); ok {
				s = obj.(*corev1.Secret)
			}
			var timer clock.Timer
			var due <-chan time.Time
			if wait := sync(s); wait > 0 {
				timer = w.clock.NewTimer(wait)
				due = timer.C()
			}
			select {
			case <-ctx.Done():
			case <-wake:
			case <-due:
			}
			if timer != nil {
				timer.Stop()
			}
			if ctx.Err() != nil {
				return nil
			}
		}
	})
	return g.Wait()
}
