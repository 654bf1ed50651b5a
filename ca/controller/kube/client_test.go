//go:build external

package kube_test

import (
	"context"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshid/meshid/ca/controller/kube"
	"github.com/meshid/meshid/ca/controller/kube/kubetest"
)

func TestLoadConfigReadsAKubeconfig(t *testing.T) {
	t.Parallel()
	path := kubetest.Kubeconfig(t, t.TempDir(), env.Admin)
	cfg, err := kube.LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	clients, err := kube.NewClients(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := clients.Core.Namespaces().List(context.Background(), metav1.ListOptions{Limit: 1}); err != nil {
		t.Fatalf("list namespaces with the kubeconfig's credentials: %v", err)
	}
}

func TestLoadConfigNamesWhatIsMissing(t *testing.T) {
	t.Parallel()
	if _, err := kube.LoadConfig("/nonexistent/kubeconfig"); err == nil || !strings.Contains(err.Error(), "/nonexistent/kubeconfig") {
		t.Fatalf("a missing kubeconfig: %v, want an error naming it", err)
	}
}
