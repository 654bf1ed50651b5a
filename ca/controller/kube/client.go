// Package kube runs the CA on Kubernetes: the API server is its store of namespaces and service
// accounts, the keeper of its secrets and of its key material (the cacerts Secret), its token
// authority (TokenReview) and its lock (a Lease). Only `meshid` links it; `meshid-agent` links no
// Kubernetes client.
package kube

import (
	"fmt"

	authenticationv1client "k8s.io/client-go/kubernetes/typed/authentication/v1"
	coordinationv1client "k8s.io/client-go/kubernetes/typed/coordination/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// Clients are the API groups the CA uses. Typed clients per group, not the whole clientset: the
// clientset would link (and register at start-up) every API group Kubernetes has.
type Clients struct {
	Core           corev1client.CoreV1Interface
	Coordination   coordinationv1client.CoordinationV1Interface
	Authentication authenticationv1client.AuthenticationV1Interface
}

// NewClients returns the clients of cfg.
func NewClients(cfg *rest.Config) (*Clients, error) {
	cfg = rest.CopyConfig(cfg)
	if cfg.UserAgent == "" {
		cfg.UserAgent = "meshid-ca"
	}
	// client-go's 5 QPS would queue the TokenReviews of a renewal storm past their deadline;
	// istiod's defaults.
	if cfg.QPS == 0 {
		cfg.QPS, cfg.Burst = 80, 160
	}
	core, err := corev1client.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	coordination, err := coordinationv1client.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	authentication, err := authenticationv1client.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	return &Clients{Core: core, Coordination: coordination, Authentication: authentication}, nil
}

// LoadConfig reads a kubeconfig file, or, when path is empty, the in-cluster configuration of
// the pod this runs in.
func LoadConfig(path string) (*rest.Config, error) {
	if path == "" {
		cfg, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("in-cluster Kubernetes configuration: %w", err)
		}
		return cfg, nil
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
	}
	return cfg, nil
}
