package kubetest_test

import (
	"context"
	"os"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	authenticationv1client "k8s.io/client-go/kubernetes/typed/authentication/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"

	"github.com/meshid/meshid/ca/controller/kube/kubetest"
)

var env *kubetest.Env

func TestMain(m *testing.M) { os.Exit(kubetest.Main(m, &env)) }

// A service account with no role is refused by RBAC, and its token passes a TokenReview for the
// audience it was issued for: what the CA's tests rely on.
func TestEnvAuthenticatesServiceAccountsAndEnforcesRBAC(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	env.ServiceAccount(t, ns, "nobody")
	client, err := corev1client.NewForConfig(env.As(t, ns, "nobody"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.Secrets(ns).List(context.Background(), metav1.ListOptions{}); err == nil {
		t.Fatal("a service account without a role listed secrets")
	}
	reviews, err := authenticationv1client.NewForConfig(env.Admin)
	if err != nil {
		t.Fatal(err)
	}
	tok := env.Token(t, ns, "nobody", 10*time.Minute, "istio-ca")
	r, err := reviews.TokenReviews().Create(context.Background(), &authenticationv1.TokenReview{
		Spec: authenticationv1.TokenReviewSpec{Token: tok, Audiences: []string{"istio-ca"}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !r.Status.Authenticated || r.Status.User.Username != "system:serviceaccount:"+ns+":nobody" {
		t.Fatalf("token review: %+v", r.Status)
	}
}
