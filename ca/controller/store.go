package controller

import "context"

// Namespace is a namespace as a store knows it.
type Namespace struct {
	Name   string
	Labels map[string]string
}

// ServiceAccount is a service account as a store knows it.
type ServiceAccount struct {
	Namespace string
	Name      string
}

// Store is a read-only view of a cluster's namespaces and service accounts: the local manifests
// (Manifests) or the Kubernetes API. Its methods are safe for concurrent use, and what they return
// is the caller's to keep. A store answers from a complete view: until it has one it returns an
// error, never a partial answer, since a namespace missing from a partial view would count as
// unlabelled and might be served against its labels.
type Store interface {
	NamespaceStore
	// ServiceAccounts lists the service accounts of namespace, or of every namespace when it is
	// "", sorted by namespace and name.
	ServiceAccounts(ctx context.Context, namespace string) ([]ServiceAccount, error)
	// Changed returns a channel that is closed at the next change of what the store holds.
	// Take it before reading the store, then wait on it and take a new one: so no change between
	// the read and the wait is missed. Several changes may close one channel.
	Changed() <-chan struct{}
}
