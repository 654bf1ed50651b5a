package kube_test

import (
	"os"
	"strings"
	"testing"

	"github.com/meshid/meshid/ca/controller/kube"
)

// Two processes on one host get different identities, each led by the host name.
func TestReplicaIdentity(t *testing.T) {
	t.Parallel()
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	a, errA := kube.ReplicaIdentity()
	b, errB := kube.ReplicaIdentity()
	if errA != nil || errB != nil {
		t.Fatal(errA, errB)
	}
	if a == b || !strings.HasPrefix(a, host+"_") || !strings.HasPrefix(b, host+"_") {
		t.Fatalf("identities %q and %q, want two different ones led by %q", a, b, host+"_")
	}
}
