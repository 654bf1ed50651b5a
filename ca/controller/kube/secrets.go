package kube

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/tools/cache"

	"github.com/meshid/meshid/ca/controller"
)

// ServiceAccountAnnotation names, on a service-account Secret, the service account it is for,
// as Citadel writes it.
const ServiceAccountAnnotation = "istio.io/service-account.name"

// SecretStoreConfig configures a SecretStore.
type SecretStoreConfig struct {
	Clients *Clients
	// Namespace limits the store to one namespace (--listened-namespace); "" is every namespace.
	Namespace  string
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

// SecretStore is the controller.SecretStore of a cluster: Secrets istio.<sa> of type
// istio.io/key-and-cert, as Citadel writes them. The type is the mark: a Secret of that name and
// another type was not made by a CA and is never touched.
type SecretStore struct {
	cfg      SecretStoreConfig
	informer cache.SharedIndexInformer
	// view is the informer's cache with this store's own writes laid over it until the watch
	// brings them, so that a reconcile right after a write does not see the old Secret.
	view   cache.MutationCache
	synced chan struct{}
	once   sync.Once
	// onChange is what Run was given, set before the informer starts.
	onChange func(controller.SecretKey)
}

var _ controller.SecretStore = (*SecretStore)(nil)

// NewSecretStore returns the store; it starts no goroutine: call Run.
func NewSecretStore(cfg SecretStoreConfig) *SecretStore {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	lw := cache.NewListWatchFromClient(cfg.Clients.Core.RESTClient(), "secrets", cfg.Namespace,
		fields.OneTermEqualSelector("type", controller.SecretType))
	s := &SecretStore{
		cfg: cfg,
		informer: newInformer(lw, &corev1.Secret{}, "secrets", cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc},
			log, watchErrors(cfg.Registerer)),
		synced: make(chan struct{}),
	}
	s.view = cache.NewIntegerResourceVersionMutationCacheWithOptions(logr.FromSlogHandler(log.Handler()), s.informer.GetStore(),
		cache.MutationCacheOptions{Indexer: s.informer.GetIndexer(), IncludeAdds: true, MaxCacheSize: 1024})
	changed := func(obj any) {
		secret, ok := obj.(*corev1.Secret)
		if !ok {
			return
		}
		if sa, ok := strings.CutPrefix(secret.Name, controller.SecretPrefix); ok && s.onChange != nil {
			s.onChange(controller.SecretKey{Namespace: secret.Namespace, ServiceAccount: sa})
		}
	}
	_, _ = s.informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if secret, ok := obj.(*corev1.Secret); ok {
				s.view.OnAddOrUpdate(secret)
			}
			changed(obj)
		},
		UpdateFunc: func(_, obj any) {
			if secret, ok := obj.(*corev1.Secret); ok {
				s.view.OnAddOrUpdate(secret)
			}
			changed(obj)
		},
		DeleteFunc: func(obj any) {
			// A delete the watch missed comes as a tombstone: the view must drop it all the same.
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tomb.Obj
			}
			if secret, ok := obj.(*corev1.Secret); ok {
				s.view.OnDelete(secret)
			}
			changed(obj)
		},
	})
	return s
}

// Run runs the informer until ctx ends. onChange, when not nil, is told of every change the
// watch sees to a secret (the secret controller's Requeue), so that one a user deleted or edited
// is reconciled at once: the controller is built with this store, so it is given here, once both
// exist.
func (s *SecretStore) Run(ctx context.Context, onChange func(controller.SecretKey)) error {
	s.onChange = onChange
	var wg sync.WaitGroup
	wg.Go(func() { s.informer.RunWithContext(ctx) })
	if cache.WaitForCacheSync(ctx.Done(), s.informer.HasSynced) {
		s.once.Do(func() { close(s.synced) })
	}
	wg.Wait()
	return nil
}

// Synced is closed once the store has listed the Secrets.
func (s *SecretStore) Synced() <-chan struct{} { return s.synced }

func (s *SecretStore) checkSynced() error {
	select {
	case <-s.synced:
		return nil
	default:
		return errNotSynced
	}
}

// maxSecretName is the longest name a Secret may have (a DNS subdomain).
const maxSecretName = 253

// checkName refuses (controller.ErrSecretRefused) a service account whose Secret istio.<sa> would
// have a longer name than a Secret may: a valid service-account name may have 253 characters too.
// The API server would refuse every attempt alike, so none is made.
func checkName(k controller.SecretKey) error {
	name := controller.SecretPrefix + k.ServiceAccount
	if len(name) <= maxSecretName {
		return nil
	}
	return fmt.Errorf("%w: no Secret can be named %s/%s…: istio.<service account> has %d characters, and a Secret's name at most %d",
		controller.ErrSecretRefused, k.Namespace, name[:64], len(name), maxSecretName)
}

// Where names the Secret: namespace/name.
func (s *SecretStore) Where(k controller.SecretKey) string {
	return k.Namespace + "/" + controller.SecretPrefix + k.ServiceAccount
}

// Keys implements controller.SecretStore. Only Secrets of the CA's type are seen: one of another
// type is found foreign when a write meets it.
func (s *SecretStore) Keys(_ context.Context, namespace string) ([]controller.SecretKey, error) {
	if err := s.checkSynced(); err != nil {
		return nil, err
	}
	objs, err := listIn(s.informer, namespace)
	if err != nil {
		return nil, err
	}
	var keys []controller.SecretKey
	for _, obj := range objs {
		if secret, ok := obj.(*corev1.Secret); ok {
			if sa, ok := strings.CutPrefix(secret.Name, controller.SecretPrefix); ok && sa != "" {
				keys = append(keys, controller.SecretKey{Namespace: secret.Namespace, ServiceAccount: sa})
			}
		}
	}
	slices.SortFunc(keys, func(a, b controller.SecretKey) int {
		return cmp.Or(strings.Compare(a.Namespace, b.Namespace), strings.Compare(a.ServiceAccount, b.ServiceAccount))
	})
	return keys, nil
}

func (s *SecretStore) cached(k controller.SecretKey) (*corev1.Secret, error) {
	if err := s.checkSynced(); err != nil {
		return nil, err
	}
	obj, found, err := s.view.GetByKey(k.Namespace + "/" + controller.SecretPrefix + k.ServiceAccount)
	if err != nil || !found {
		return nil, err
	}
	secret, ok := obj.(*corev1.Secret)
	if !ok {
		return nil, fmt.Errorf("%s: unexpected %T", s.Where(k), obj)
	}
	return secret, nil
}

// Read implements controller.SecretStore.
func (s *SecretStore) Read(_ context.Context, k controller.SecretKey) (controller.StoredSecret, error) {
	if err := checkName(k); err != nil {
		return controller.StoredSecret{}, err
	}
	secret, err := s.cached(k)
	if err != nil || secret == nil {
		return controller.StoredSecret{}, err
	}
	return controller.StoredSecret{Exists: true, Ours: secret.Type == controller.SecretType, Data: secret.Data}, nil
}

// Write creates or updates the Secret. An update names the version it replaces: a Secret changed
// since it was read (a Conflict) is an error, and the controller retries from the new one.
func (s *SecretStore) Write(ctx context.Context, k controller.SecretKey, data map[string][]byte, _ string) error {
	if err := checkName(k); err != nil {
		return err
	}
	secrets := s.cfg.Clients.Core.Secrets(k.Namespace)
	current, err := s.cached(k)
	if err != nil {
		return err
	}
	if current == nil {
		created, err := secrets.Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{
				Name: controller.SecretPrefix + k.ServiceAccount, Namespace: k.Namespace,
				Annotations: map[string]string{ServiceAccountAnnotation: k.ServiceAccount},
			},
			Type: controller.SecretType,
			Data: data,
		}, metav1.CreateOptions{})
		if err == nil {
			s.view.Mutation(created)
			return nil
		}
		if !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create %s: %w", s.Where(k), err)
		}
		// Not in the view: made by someone else just now, or of another type than the view shows.
		if current, err = secrets.Get(ctx, controller.SecretPrefix+k.ServiceAccount, metav1.GetOptions{}); err != nil {
			return fmt.Errorf("read %s: %w", s.Where(k), err)
		}
	}
	if current.Type != controller.SecretType {
		return fmt.Errorf("%s is of type %q: %w", s.Where(k), current.Type, controller.ErrForeignSecret)
	}
	next := current.DeepCopy()
	next.Data = data
	if next.Annotations == nil {
		next.Annotations = map[string]string{}
	}
	next.Annotations[ServiceAccountAnnotation] = k.ServiceAccount
	updated, err := secrets.Update(ctx, next, metav1.UpdateOptions{})
	if err != nil {
		return fmt.Errorf("update %s: %w", s.Where(k), err)
	}
	s.view.Mutation(updated)
	return nil
}

// Delete deletes the Secret the view holds, and only that one: a Secret recreated since (another
// UID) is not deleted.
func (s *SecretStore) Delete(ctx context.Context, k controller.SecretKey) error {
	if err := checkName(k); err != nil {
		return err
	}
	current, err := s.cached(k)
	if err != nil || current == nil {
		return err
	}
	err = s.cfg.Clients.Core.Secrets(k.Namespace).Delete(ctx, current.Name, metav1.DeleteOptions{
		Preconditions: &metav1.Preconditions{UID: &current.UID},
	})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete %s: %w", s.Where(k), err)
	}
	return nil
}
