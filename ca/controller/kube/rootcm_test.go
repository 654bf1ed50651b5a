//go:build external

package kube_test

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/ca/controller/kube"
	"github.com/meshid/meshid/ca/controller/kube/kubetest"
	"github.com/meshid/meshid/internal/testutil"
)

// startNamespaceStore runs a Store of every namespace, as admin, until the test ends.
func startNamespaceStore(t *testing.T) *kube.Store {
	t.Helper()
	store := kube.NewStore(kube.StoreConfig{Clients: clientsFor(t, env.Admin), Logger: testLogger(t)})
	start(t, store.Run)
	waitClosed(t, store.Synced(), "namespace store synced")
	return store
}

// selfSignedBundle is key material of a new self-signed root, as a cacerts Secret gives it.
func selfSignedBundle(t *testing.T, name string) *ca.Bundle {
	t.Helper()
	root := testutil.NewRootCA(t, testutil.CAOptions{CommonName: name})
	b, err := ca.BundleFromData(map[string][]byte{
		ca.CACertFile: testutil.CertPEM(root.Cert), ca.CAKeyFile: testutil.KeyPEM(t, root.Key),
		ca.CertChainFile: nil, ca.RootCertFile: nil,
	}, name, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// runRootConfigMaps publishes authority's roots for the CA instance of caNS, as cfg's user,
// until the test ends.
func runRootConfigMaps(t *testing.T, cfg *rest.Config, caNS string, store *kube.Store, authority *ca.Authority, reg prometheus.Registerer) {
	t.Helper()
	clients := clientsFor(t, cfg)
	r, err := kube.NewRootConfigMaps(kube.RootConfigMapsConfig{
		Clients:    clients,
		Store:      store,
		Targeting:  controller.NewTargeting(controller.TargetingConfig{Store: store, CANamespace: caNS}),
		Bundle:     authority,
		RetryBase:  10 * time.Millisecond,
		Registerer: reg,
	})
	if err != nil {
		t.Fatal(err)
	}
	start(t, r.Run)
}

// waitConfigMap polls the API server until the namespace's root ConfigMap holds want.
func waitConfigMap(t *testing.T, ns string, want []byte) *corev1.ConfigMap {
	t.Helper()
	var cm *corev1.ConfigMap
	kubetest.Eventually(t, "the root configmap of "+ns+" holds the expected roots", func() (err error) {
		if cm, err = env.Core().ConfigMaps(ns).Get(context.Background(), kube.RootCertConfigMap, metav1.GetOptions{}); err == nil && cm.Data[kube.RootCertKey] != string(want) {
			err = errors.New("other roots")
		}
		return err
	})
	return cm
}

func requireNoConfigMap(t *testing.T, ns string) {
	t.Helper()
	_, err := env.Core().ConfigMaps(ns).Get(context.Background(), kube.RootCertConfigMap, metav1.GetOptions{})
	if !apierrors.IsNotFound(err) {
		t.Fatalf("namespace %s, which the CA does not serve, has a root configmap (err %v)", ns, err)
	}
}

func TestRootConfigMaps(t *testing.T) {
	t.Parallel()
	caNS := env.Namespace(t, nil)
	mine := map[string]string{controller.LabelEnv: caNS}
	served := env.Namespace(t, mine)
	servedToo := env.Namespace(t, mine)
	off := env.Namespace(t, map[string]string{controller.LabelEnv: caNS, controller.LabelOverride: "false"})
	other := env.Namespace(t, map[string]string{controller.LabelEnv: caNS + "-other"})

	authority := ca.New(ca.Config{}, nil)
	keys, err := ca.NewKeyManager(ca.KeyManagerConfig{
		Authority: authority, StateDir: t.TempDir(), Initial: selfSignedBundle(t, "first root"), InitialOrigin: ca.OriginCACertsSecret,
	})
	if err != nil {
		t.Fatal(err)
	}
	runRootConfigMaps(t, env.Admin, caNS, startNamespaceStore(t), authority, prometheus.NewRegistry())

	roots := authority.Bundle().RootsPEM()
	for _, ns := range []string{served, servedToo} {
		cm := waitConfigMap(t, ns, roots)
		if cm.Labels[kube.LabelIstioConfig] != "true" {
			t.Fatalf("the root configmap of %s is labelled %v", ns, cm.Labels)
		}
	}
	requireNoConfigMap(t, off)
	requireNoConfigMap(t, other)

	// A new root: the old one stays trusted, and both are published.
	if ev := keys.Offer(selfSignedBundle(t, "second root"), "test"); ev.Kind != ca.EventReloaded {
		t.Fatalf("offer: %s", ev.Kind)
	}
	roots = authority.Bundle().RootsPEM()
	if n := strings.Count(string(roots), "BEGIN CERTIFICATE"); n != 2 {
		t.Fatalf("%d roots in the trust bundle, want the new and the retained one", n)
	}
	waitConfigMap(t, served, roots)
	waitConfigMap(t, servedToo, roots)

	// A user deletes one and edits the other.
	if err := env.Core().ConfigMaps(served).Delete(t.Context(), kube.RootCertConfigMap, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	cm := waitConfigMap(t, servedToo, roots)
	cm.Data[kube.RootCertKey] = "junk"
	cm.Data["mine"] = "kept"
	delete(cm.Labels, kube.LabelIstioConfig)
	if _, err := env.Core().ConfigMaps(servedToo).Update(t.Context(), cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitConfigMap(t, served, roots)
	cm = waitConfigMap(t, servedToo, roots)
	if cm.Data["mine"] != "kept" || cm.Labels[kube.LabelIstioConfig] != "true" {
		t.Fatalf("the restored configmap has data keys %v and labels %v", slices.Collect(maps.Keys(cm.Data)), cm.Labels)
	}

	// Namespaces that become served get theirs.
	ns, err := env.Core().Namespaces().Get(t.Context(), off, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	delete(ns.Labels, controller.LabelOverride)
	if _, err := env.Core().Namespaces().Update(t.Context(), ns, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitConfigMap(t, off, roots)
	waitConfigMap(t, env.Namespace(t, mine), roots)
	requireNoConfigMap(t, other)
}

// The system namespaces get no ConfigMap even when served, as with istiod.
func TestRootConfigMapsLeaveSystemNamespacesAlone(t *testing.T) {
	t.Parallel()
	caNS := env.Namespace(t, nil)
	// Served by every CA instance: override=true wins over the env label and the default.
	labelNamespace(t, "kube-system", controller.LabelOverride, "true")
	t.Cleanup(func() {
		patch := `{"metadata":{"labels":{"` + controller.LabelOverride + `":null}}}`
		if _, err := env.Core().Namespaces().Patch(context.Background(), "kube-system", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			t.Error(err)
		}
	})
	served := env.Namespace(t, map[string]string{controller.LabelEnv: caNS})
	authority := ca.New(ca.Config{}, selfSignedBundle(t, "root"))
	runRootConfigMaps(t, env.Admin, caNS, startNamespaceStore(t), authority, prometheus.NewRegistry())
	// One worker takes the namespaces in name order: kube-system's turn came before this one's.
	waitConfigMap(t, served, authority.Bundle().RootsPEM())
	requireNoConfigMap(t, "kube-system")
}
