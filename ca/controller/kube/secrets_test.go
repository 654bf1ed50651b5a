//go:build external

package kube_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/ca/controller/kube"
	"github.com/meshid/meshid/ca/controller/kube/kubetest"
	"github.com/meshid/meshid/internal/istio"
	"github.com/meshid/meshid/internal/pki"
)

// secretControllerRules are what the secret controller needs cluster-wide, as
// deploy/kubernetes/rbac.yaml grants them.
func secretControllerRules() []rbacv1.PolicyRule {
	return []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"namespaces", "serviceaccounts"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"get", "list", "watch", "create", "update", "delete"}},
	}
}

// secretsOnKube runs the secret controller of namespace ns over the Kubernetes stores, with the
// credentials of cfg, and reports its events.
type secretsOnKube struct {
	t         *testing.T
	ns        string
	authority *ca.Authority
	events    chan controller.SecretEvent
}

func runSecretsOnKube(t *testing.T, cfg *rest.Config, ns string) *secretsOnKube {
	t.Helper()
	now := time.Now()
	bundle, err := ca.CreateSelfSigned(t.TempDir(), ca.SelfSignedConfig{KeyAlgorithm: pki.ECDSA, Org: "test", TTL: 24 * time.Hour}, now)
	if err != nil {
		t.Fatal(err)
	}
	h := &secretsOnKube{t: t, ns: ns, authority: ca.New(ca.Config{DefaultTTL: time.Hour}, bundle), events: make(chan controller.SecretEvent, 1024)}
	clients, log := clientsFor(t, cfg), testLogger(t)
	store := kube.NewStore(kube.StoreConfig{Clients: clients, Logger: log})
	// Scoped to the namespace as the control plane scopes it (its listened namespace): unscoped,
	// the controllers of parallel tests each saw the others' secrets, out of their namespace, and
	// removed them ("namespace not listened to").
	secretStore := kube.NewSecretStore(kube.SecretStoreConfig{Clients: clients, Namespace: ns, Logger: log})
	secrets, err := controller.NewSecrets(controller.SecretsConfig{
		Store:     store,
		Targeting: controller.NewTargeting(controller.TargetingConfig{Store: store, CANamespace: "istio-system", EnabledByDefault: true}),
		Signer:    h.authority, Secrets: secretStore, TrustDomain: "cluster.local", Namespace: ns,
		Logger: log, OnEvent: func(ev controller.SecretEvent) { h.events <- ev },
	})
	if err != nil {
		t.Fatal(err)
	}
	start(t, store.Run)
	start(t, func(ctx context.Context) error { return secretStore.Run(ctx, secrets.Requeue) })
	waitClosed(t, store.Synced(), "store synced")
	waitClosed(t, secretStore.Synced(), "secret store synced")
	start(t, secrets.Run)
	return h
}

// await waits for the controller to report kind for sa.
func (h *secretsOnKube) await(sa string, kind controller.SecretEventKind) {
	h.t.Helper()
	timeout := time.After(kubetest.WaitLimit)
	for {
		select {
		case ev := <-h.events:
			if ev.ServiceAccount == sa && ev.Kind == kind {
				return
			}
		case <-timeout:
			h.t.Fatalf("no %s event for %s/%s", kind, h.ns, sa)
		}
	}
}

// secret reads istio.<sa> and checks it as an agent mounting it would: a key matching a leaf
// for the service account's identity, chained to the CA's roots.
func (h *secretsOnKube) secret(sa string) (*corev1.Secret, error) {
	s, err := env.Core().Secrets(h.ns).Get(context.Background(), "istio."+sa, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	if s.Type != controller.SecretType || s.Annotations[kube.ServiceAccountAnnotation] != sa {
		return nil, fmt.Errorf("type %q, annotations %v", s.Type, s.Annotations)
	}
	key, err := pki.ParsePrivateKey(s.Data[istio.KeyFile])
	if err != nil {
		return nil, err
	}
	chain, err := pki.ParseCertificates(s.Data[istio.CertChainFile])
	if err != nil {
		return nil, err
	}
	id := fmt.Sprintf("spiffe://cluster.local/ns/%s/sa/%s", h.ns, sa)
	if err := pki.CheckKeyPair(chain, key, id, time.Now()); err != nil {
		return nil, err
	}
	if string(s.Data[istio.RootCertFile]) != string(h.authority.Bundle().RootsPEM()) {
		return nil, errors.New("root-cert.pem is not the CA's roots")
	}
	return s, nil
}

func (h *secretsOnKube) gone(sa string) error {
	_, err := env.Core().Secrets(h.ns).Get(context.Background(), "istio."+sa, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err == nil {
		return errors.New("still there")
	}
	return err
}

// The secret controller's lifecycle on Kubernetes, run with exactly the rights the deploy
// manifests give it.
func TestSecretsLifecycleOnKubernetes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	caNS, ns := env.Namespace(t, nil), env.Namespace(t, nil)
	env.ServiceAccount(t, caNS, "meshid-ca")
	bind(t, caNS, "meshid-ca", nil, secretControllerRules())
	// A Secret of that name that no CA made, with its service account: never touched.
	env.ServiceAccount(t, ns, "legacy")
	foreign, err := env.Core().Secrets(ns).Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "istio.legacy"}, Type: corev1.SecretTypeOpaque, Data: map[string][]byte{"app": []byte("mine")},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	env.ServiceAccount(t, ns, "web")
	h := runSecretsOnKube(t, env.As(t, caNS, "meshid-ca"), ns)

	var first *corev1.Secret
	kubetest.Eventually(t, "istio.web created", func() (err error) { first, err = h.secret("web"); return err })
	h.await("legacy", controller.SecretForeign)
	if s, err := env.Core().Secrets(ns).Get(ctx, "istio.legacy", metav1.GetOptions{}); err != nil || s.ResourceVersion != foreign.ResourceVersion {
		t.Errorf("the foreign secret was changed: %v", err)
	}

	// A user deletes it: recreated at once, not at the next resync.
	if err := env.Core().Secrets(ns).Delete(ctx, "istio.web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.Eventually(t, "istio.web recreated", func() error {
		s, err := h.secret("web")
		if err == nil && s.UID == first.UID {
			return errors.New("not deleted yet")
		}
		return err
	})

	// A user edits it: re-issued.
	edited, err := env.Core().Secrets(ns).Get(ctx, "istio.web", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	edited.Data[istio.CertChainFile] = []byte("garbage")
	if _, err := env.Core().Secrets(ns).Update(ctx, edited, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.Eventually(t, "istio.web repaired", func() error { _, err := h.secret("web"); return err })

	// The namespace opts out: its secrets go, the foreign one stays; it opts back in.
	labelNamespace(t, ns, controller.LabelOverride, "false")
	kubetest.Eventually(t, "istio.web removed", func() error { return h.gone("web") })
	labelNamespace(t, ns, controller.LabelOverride, "true")
	kubetest.Eventually(t, "istio.web restored", func() error { _, err := h.secret("web"); return err })

	// The service account goes, and its secret with it.
	if err := env.Core().ServiceAccounts(ns).Delete(ctx, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.Eventually(t, "istio.web deleted with its service account", func() error { return h.gone("web") })
	if _, err := env.Core().Secrets(ns).Get(ctx, "istio.legacy", metav1.GetOptions{}); err != nil {
		t.Errorf("the foreign secret: %v", err)
	}
}

// Without its rights the store never answers, and says why.
func TestStoreWithoutRightsSaysSo(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	env.ServiceAccount(t, ns, "nobody")
	reg := prometheus.NewRegistry()
	store := kube.NewStore(kube.StoreConfig{Clients: clientsFor(t, env.As(t, ns, "nobody")), Logger: testLogger(t), Registerer: reg})
	start(t, store.Run)
	kubetest.Eventually(t, "a refused list counted", func() error {
		n, err := promtest.GatherAndCount(reg, "meshid_ca_kube_watch_errors_total")
		if err == nil && n == 0 {
			return errors.New("none yet")
		}
		return err
	})
	select {
	case <-store.Synced():
		t.Fatal("a store that may not list synced")
	default:
	}
	if _, err := store.ServiceAccounts(context.Background(), ""); err == nil {
		t.Error("a store that may not list answered")
	}
}

// A valid service-account name of 248 to 253 characters makes istio.<sa> longer than a Secret's
// name may be: the controller says so once, as a refusal, rather than failing and retrying.
func TestSecretNameTooLongIsRefusedOnce(t *testing.T) {
	t.Parallel()
	caNS, ns := env.Namespace(t, nil), env.Namespace(t, nil)
	env.ServiceAccount(t, caNS, "meshid-ca")
	bind(t, caNS, "meshid-ca", nil, secretControllerRules())
	label := strings.Repeat("a", 63)
	long := label + "." + label + "." + label + "." + strings.Repeat("b", 61) // 253
	env.ServiceAccount(t, ns, long)
	env.ServiceAccount(t, ns, "web")
	h := runSecretsOnKube(t, env.As(t, caNS, "meshid-ca"), ns)
	kubetest.Eventually(t, "istio.web created", func() error { _, err := h.secret("web"); return err })

	timeout := time.After(kubetest.WaitLimit)
	for refused := false; !refused; {
		select {
		case ev := <-h.events:
			if ev.ServiceAccount != long {
				continue
			}
			if ev.Kind != controller.SecretRefused {
				t.Fatalf("%s for the long name (%v), want %s", ev.Kind, ev.Err, controller.SecretRefused)
			}
			if !errors.Is(ev.Err, controller.ErrSecretRefused) || !strings.Contains(ev.Err.Error(), "253") {
				t.Fatalf("refusal %v, want ErrSecretRefused saying why", ev.Err)
			}
			refused = true
		case <-timeout:
			t.Fatalf("no refusal for the long name within %s", kubetest.WaitLimit)
		}
	}
	store := kube.NewSecretStore(kube.SecretStoreConfig{Clients: clientsFor(t, env.Admin)})
	k := controller.SecretKey{Namespace: ns, ServiceAccount: long}
	if err := store.Write(context.Background(), k, map[string][]byte{"key.pem": []byte("x")}, ""); !errors.Is(err, controller.ErrSecretRefused) {
		t.Errorf("Write: %v, want ErrSecretRefused before any request", err)
	}
	if _, err := store.Read(context.Background(), k); !errors.Is(err, controller.ErrSecretRefused) {
		t.Errorf("Read: %v, want ErrSecretRefused", err)
	}
}
