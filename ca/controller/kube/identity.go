package kube

import (
	"fmt"
	"os"

	"github.com/google/uuid"
)

// ReplicaIdentity names this process in the leader election as client-go's own example does:
// the host name (a pod's name) and a UUID, so that two processes on one host never both believe
// they hold the Lease.
func ReplicaIdentity() (string, error) {
	host, err := os.Hostname()
	if err != nil {
		return "", fmt.Errorf("leader election identity: %w", err)
	}
	return host + "_" + uuid.NewString(), nil
}
