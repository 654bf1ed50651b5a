//go:build external

package controlplane_test

import (
	"context"
	"crypto/x509"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshid/meshid/ca/controller/kube/kubetest"
	caserver "github.com/meshid/meshid/ca/server"
	"github.com/meshid/meshid/controlplane"
)

// placePod creates a pod of ns/sa on node, as a scheduler would have placed it (the API server
// admits it once its ServiceAccount admission has seen the account).
func placePod(t *testing.T, ns, name, sa, node string) *corev1.Pod {
	t.Helper()
	var pod *corev1.Pod
	kubetest.Until(t, "create pod "+ns+"/"+name, func() bool {
		var err error
		pod, err = kubeEnv.Core().Pods(ns).Create(context.Background(), &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: corev1.PodSpec{ServiceAccountName: sa, NodeName: node, AutomountServiceAccountToken: new(false),
				Containers: []corev1.Container{{Name: "app", Image: "example.invalid/app"}}},
		}, metav1.CreateOptions{})
		return err == nil
	})
	return pod
}

// impersonate asks the CA, with tok, for a certificate of spiffeID on behalf of a node's workload,
// as ztunnel does.
func impersonate(t *testing.T, r *replica, tok, spiffeID string) (*x509.Certificate, error) {
	t.Helper()
	md, err := structpb.NewStruct(map[string]any{caserver.ImpersonatedIdentityKey: spiffeID})
	if err != nil {
		t.Fatal(err)
	}
	chain, err := createCertificateWith(t, r.cp.GRPCAddr(), r.rootFile(), tok, spiffeID, md)
	if err != nil {
		return nil, err
	}
	return chain[0], nil
}

// Issue 28 part 2 on a real API server: a node agent whose token TokenRequest bound to its pod
// on node A gets certificates for the service accounts with a running pod on node A, not for one
// whose pods are on node B only, and no more for one whose pod is deleted, once the CA's watch
// has seen it. Any other caller may not ask.
func TestNodeAgentImpersonationOnKubernetes(t *testing.T) {
	t.Parallel()
	ns := kubeEnv.Namespace(t, nil)
	for _, sa := range []string{"node-agent", "app-a", "app-b"} {
		kubeEnv.ServiceAccount(t, ns, sa)
	}
	r := startReplica(t, "node-agents", func(cfg *controlplane.Config) {
		cfg.CANamespace = ns
		cfg.Kubernetes.Kubeconfig = kubetest.Kubeconfig(t, t.TempDir(), kubeEnv.Admin)
		cfg.TrustedNodeAccounts = []string{ns + "/node-agent"}
	})
	agentPod := placePod(t, ns, "agent", "node-agent", "node-a")
	appA := placePod(t, ns, "app-a", "app-a", "node-a")
	placePod(t, ns, "app-b", "app-b", "node-b")
	seconds := int64(3600)
	tr, err := kubeEnv.Core().ServiceAccounts(ns).CreateToken(t.Context(), "node-agent", &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{Audiences: []string{"istio-ca"}, ExpirationSeconds: &seconds,
			BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: agentPod.Name, UID: agentPod.UID}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	agent := tr.Status.Token
	idA := "spiffe://cluster.local/ns/" + ns + "/sa/app-a"
	idB := "spiffe://cluster.local/ns/" + ns + "/sa/app-b"

	// The pods were created after the CA listed them: its watch brings them.
	var leaf *x509.Certificate
	kubetest.Until(t, "a certificate for app-a, on the agent's node", func() bool {
		leaf, err = impersonate(t, r, agent, idA)
		return err == nil
	})
	if got := leaf.URIs[0].String(); got != idA {
		t.Fatalf("certificate for %s, want %s", got, idA)
	}
	if _, err := impersonate(t, r, agent, idB); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("app-b, on node-b only: %v, want PermissionDenied", err)
	}
	appToken := kubeEnv.Token(t, ns, "app-a", time.Hour, "istio-ca")
	if _, err := impersonate(t, r, appToken, idB); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a caller that is not a node account: %v, want PermissionDenied", err)
	}

	if err := kubeEnv.Core().Pods(ns).Delete(t.Context(), appA.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	kubetest.Until(t, "app-a refused once its pod is gone", func() bool {
		_, err := impersonate(t, r, agent, idA)
		return status.Code(err) == codes.PermissionDenied
	})
}
