//go:build external

package kube_test

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	authorizationv1 "k8s.io/api/authorization/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	authorizationv1client "k8s.io/client-go/kubernetes/typed/authorization/v1"
	rbacv1client "k8s.io/client-go/kubernetes/typed/rbac/v1"
	"k8s.io/client-go/rest"

	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/ca/controller/kube"
	"github.com/meshid/meshid/ca/controller/kube/kubetest"
)

func clientsFor(t testing.TB, cfg *rest.Config) *kube.Clients {
	t.Helper()
	c, err := kube.NewClients(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) { w.t.Log(string(p)); return len(p), nil }

// start runs run until the test ends, and checks that it then returns without error.
func start(t *testing.T, run func(context.Context) error) context.CancelFunc {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return cancel
}

func waitClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(kubetest.WaitLimit):
		t.Fatalf("%s: not within %s", what, kubetest.WaitLimit)
	}
}

// waitStore waits, on the store's Changed, until cond holds.
func waitStore(t *testing.T, store controller.Store, what string, cond func() bool) {
	t.Helper()
	timeout := time.After(kubetest.WaitLimit)
	for {
		changed := store.Changed()
		if cond() {
			return
		}
		select {
		case <-changed:
		case <-timeout:
			t.Fatalf("%s: not within %s", what, kubetest.WaitLimit)
		}
	}
}

func labelNamespace(t *testing.T, ns, key, value string) {
	t.Helper()
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, key, value)
	if _, err := env.Core().Namespaces().Patch(context.Background(), ns, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

// metric sums the values (counter or gauge) of a metric's series that carry every label of
// labels, given as name, value pairs.
func metric(t *testing.T, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				if !slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool { return l.GetName() == labels[i] && l.GetValue() == labels[i+1] }) {
					continue series
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}

// bind grants the service account ns/sa roleRules in ns and clusterRules everywhere, for the
// test's life, and returns once the API server's authorizer applies them (it learns of bindings
// through its own watch).
func bind(t *testing.T, ns, sa string, roleRules, clusterRules []rbacv1.PolicyRule) {
	t.Helper()
	ctx := context.Background()
	rbac, err := rbacv1client.NewForConfig(env.Admin)
	if err != nil {
		t.Fatal(err)
	}
	subjects := []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: ns, Name: sa}}
	name := "meshid-test-" + ns + "-" + sa // cluster-wide: one per test
	if roleRules != nil {
		if _, err := rbac.Roles(ns).Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: roleRules}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if _, err := rbac.RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: name}, Subjects: subjects,
			RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: name},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if clusterRules != nil {
		if _, err := rbac.ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: clusterRules}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if _, err := rbac.ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: name}, Subjects: subjects,
			RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: name},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = rbac.ClusterRoleBindings().Delete(ctx, name, metav1.DeleteOptions{})
			_ = rbac.ClusterRoles().Delete(ctx, name, metav1.DeleteOptions{})
		})
	}
	authz, err := authorizationv1client.NewForConfig(env.Admin)
	if err != nil {
		t.Fatal(err)
	}
	user := "system:serviceaccount:" + ns + ":" + sa
	for _, rules := range []struct {
		namespace string
		rules     []rbacv1.PolicyRule
	}{{ns, roleRules}, {"", clusterRules}} {
		for _, rule := range rules.rules {
			attrs := &authorizationv1.ResourceAttributes{Namespace: rules.namespace, Verb: rule.Verbs[0],
				Group: rule.APIGroups[0], Resource: rule.Resources[0]}
			if len(rule.ResourceNames) > 0 {
				attrs.Name = rule.ResourceNames[0]
			}
			kubetest.Until(t, "the authorizer to apply "+user+"'s grants", func() bool {
				review, err := authz.SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{
					Spec: authorizationv1.SubjectAccessReviewSpec{User: user, ResourceAttributes: attrs},
				}, metav1.CreateOptions{})
				return err == nil && review.Status.Allowed
			})
		}
	}
}
