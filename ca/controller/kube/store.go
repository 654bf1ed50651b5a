package kube

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/tools/cache"

	"github.com/meshid/meshid/ca/controller"
)

// StoreConfig configures a Store.
type StoreConfig struct {
	Clients *Clients
	// Namespace limits the service accounts to one namespace (--listened-namespace); "" is every
	// namespace. Namespaces are always all known.
	Namespace  string
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

// Store is the controller.Store of a cluster: its namespaces and service accounts, as two
// informers see them.
type Store struct {
	namespaces, accounts cache.SharedIndexInformer
	synced               chan struct{}

	mu      sync.Mutex
	changed chan struct{}
	ready   bool // both informers have synced
}

var _ controller.Store = (*Store)(nil)

// NewStore returns the store; it starts no goroutine: call Run.
func NewStore(cfg StoreConfig) *Store {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	errs := watchErrors(cfg.Registerer)
	core := cfg.Clients.Core.RESTClient()
	s := &Store{
		// Every namespace, whatever the listened one: targeting decides on every caller's
		// namespace from its labels, and an unknown namespace would take the default.
		namespaces: newInformer(cache.NewListWatchFromClient(core, "namespaces", metav1.NamespaceAll, fields.Everything()),
			&corev1.Namespace{}, "namespaces", nil, log, errs),
		accounts: newInformer(cache.NewListWatchFromClient(core, "serviceaccounts", cfg.Namespace, fields.Everything()),
			&corev1.ServiceAccount{}, "serviceaccounts", cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc}, log, errs),
		synced:  make(chan struct{}),
		changed: make(chan struct{}),
	}
	// Only what the store answers counts as a change: a namespace's labels, a service account's
	// existence. A service account's updates (its secrets, say) are not.
	_, _ = s.namespaces.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(any) { s.notify() },
		UpdateFunc: func(old, cur any) {
			o, ok1 := old.(*corev1.Namespace)
			c, ok2 := cur.(*corev1.Namespace)
			if !ok1 || !ok2 || !maps.Equal(o.Labels, c.Labels) {
				s.notify()
			}
		},
		DeleteFunc: func(any) { s.notify() },
	})
	_, _ = s.accounts.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { s.notify() },
		DeleteFunc: func(any) { s.notify() },
	})
	return s
}

// Run runs the informers until ctx ends.
func (s *Store) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	wg.Go(func() { s.namespaces.RunWithContext(ctx) })
	wg.Go(func() { s.accounts.RunWithContext(ctx) })
	if cache.WaitForCacheSync(ctx.Done(), s.namespaces.HasSynced, s.accounts.HasSynced) {
		s.mu.Lock()
		first := !s.ready
		s.ready = true
		s.mu.Unlock()
		if first {
			close(s.synced)
			s.notify()
		}
	}
	wg.Wait()
	return nil
}

// Synced is closed once the store has listed both namespaces and service accounts.
func (s *Store) Synced() <-chan struct{} { return s.synced }

func (s *Store) notify() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.ready {
		return // nobody reads a store that answers nothing yet; the sync itself notifies
	}
	close(s.changed)
	s.changed = make(chan struct{})
}

// Changed implements controller.Store.
func (s *Store) Changed() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.changed
}

func (s *Store) checkSynced() error {
	select {
	case <-s.synced:
		return nil
	default:
		return errNotSynced
	}
}

// NamespaceLabels implements controller.NamespaceStore.
func (s *Store) NamespaceLabels(_ context.Context, namespace string) (map[string]string, bool, error) {
	if err := s.checkSynced(); err != nil {
		return nil, false, err
	}
	obj, found, err := s.namespaces.GetStore().GetByKey(namespace)
	if err != nil || !found {
		return nil, false, err
	}
	ns, ok := obj.(*corev1.Namespace)
	if !ok {
		return nil, false, fmt.Errorf("namespace %s: unexpected %T", namespace, obj)
	}
	return maps.Clone(ns.Labels), true, nil
}

// Namespaces implements controller.NamespaceStore.
func (s *Store) Namespaces(context.Context) ([]controller.Namespace, error) {
	if err := s.checkSynced(); err != nil {
		return nil, err
	}
	var out []controller.Namespace
	for _, obj := range s.namespaces.GetStore().List() {
		if ns, ok := obj.(*corev1.Namespace); ok {
			out = append(out, controller.Namespace{Name: ns.Name, Labels: maps.Clone(ns.Labels)})
		}
	}
	slices.SortFunc(out, func(a, b controller.Namespace) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// ServiceAccounts implements controller.Store.
func (s *Store) ServiceAccounts(_ context.Context, namespace string) ([]controller.ServiceAccount, error) {
	if err := s.checkSynced(); err != nil {
		return nil, err
	}
	objs, err := listIn(s.accounts, namespace)
	if err != nil {
		return nil, err
	}
	out := make([]controller.ServiceAccount, 0, len(objs))
	for _, obj := range objs {
		if sa, ok := obj.(*corev1.ServiceAccount); ok {
			out = append(out, controller.ServiceAccount{Namespace: sa.Namespace, Name: sa.Name})
		}
	}
	slices.SortFunc(out, func(a, b controller.ServiceAccount) int {
		return cmp.Or(strings.Compare(a.Namespace, b.Namespace), strings.Compare(a.Name, b.Name))
	})
	return out, nil
}
