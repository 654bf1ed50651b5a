//go:build external

package kube_test

import (
	"context"
	"slices"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/ca/controller/kube"
)

func TestStoreFollowsNamespacesAndServiceAccounts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ns := env.Namespace(t, map[string]string{"team": "web"})
	env.ServiceAccount(t, ns, "web")
	env.ServiceAccount(t, ns, "api")

	store := kube.NewStore(kube.StoreConfig{Clients: clientsFor(t, env.Admin), Logger: testLogger(t)})
	if _, err := store.ServiceAccounts(ctx, ns); err == nil {
		t.Fatal("a store that has listed nothing yet answered")
	}
	if _, _, err := store.NamespaceLabels(ctx, ns); err == nil {
		t.Fatal("a store that has listed nothing yet answered")
	}
	start(t, store.Run)
	waitClosed(t, store.Synced(), "store synced")

	accounts, err := store.ServiceAccounts(ctx, ns)
	if err != nil {
		t.Fatal(err)
	}
	want := []controller.ServiceAccount{{Namespace: ns, Name: "api"}, {Namespace: ns, Name: "web"}}
	if !slices.Equal(accounts, want) {
		t.Errorf("service accounts %v, want %v", accounts, want)
	}
	labels, found, err := store.NamespaceLabels(ctx, ns)
	if err != nil || !found || labels["team"] != "web" {
		t.Errorf("labels of %s: %v %v %v", ns, labels, found, err)
	}
	all, err := store.Namespaces(ctx)
	if err != nil || !slices.IsSortedFunc(all, func(a, b controller.Namespace) int { return strings.Compare(a.Name, b.Name) }) ||
		!slices.ContainsFunc(all, func(n controller.Namespace) bool { return n.Name == ns }) {
		t.Errorf("namespaces %v (%v): want %s among them, sorted", all, err, ns)
	}

	// Labels changed at run time reach the targeting.
	targeting := controller.NewTargeting(controller.TargetingConfig{Store: store, CANamespace: "istio-system", EnabledByDefault: true})
	served := func() bool {
		ok, _, err := targeting.Targets(ctx, ns)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	if !served() {
		t.Fatal("an unlabelled namespace is not served")
	}
	labelNamespace(t, ns, controller.LabelOverride, "false")
	waitStore(t, store, "override=false stops serving", func() bool { return !served() })
	labelNamespace(t, ns, controller.LabelOverride, "true")
	waitStore(t, store, "override=true serves again", served)

	// A service account deleted leaves the store.
	if err := env.Core().ServiceAccounts(ns).Delete(ctx, "api", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitStore(t, store, "service account deleted", func() bool {
		accounts, err := store.ServiceAccounts(ctx, ns)
		return err == nil && slices.Equal(accounts, want[1:])
	})
}

func TestStoreListenedNamespaceLimitsServiceAccountsOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	listened, other := env.Namespace(t, nil), env.Namespace(t, map[string]string{controller.LabelOverride: "false"})
	env.ServiceAccount(t, listened, "web")
	env.ServiceAccount(t, other, "web")

	store := kube.NewStore(kube.StoreConfig{Clients: clientsFor(t, env.Admin), Namespace: listened, Logger: testLogger(t)})
	start(t, store.Run)
	waitClosed(t, store.Synced(), "store synced")
	accounts, err := store.ServiceAccounts(ctx, "")
	if want := []controller.ServiceAccount{{Namespace: listened, Name: "web"}}; err != nil || !slices.Equal(accounts, want) {
		t.Errorf("service accounts %v (%v), want %v", accounts, err, want)
	}
	// Its labels still count: a CSR from there is targeted by them, not by the default.
	if labels, found, err := store.NamespaceLabels(ctx, other); err != nil || !found || labels[controller.LabelOverride] != "false" {
		t.Errorf("namespace %s, not listened to: labels %v, found %v, %v; want its labels known", other, labels, found, err)
	}
}
