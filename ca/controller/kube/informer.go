package kube

import (
	"context"
	"errors"
	"log/slog"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/cache"

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
