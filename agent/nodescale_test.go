package agent_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	grpccreds "google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/sds/sdsclient"
	"github.com/meshid/meshid/sds/sdstest"
)

// callerHeader carries "namespace/serviceAccount" to metadataAttestor.
const callerHeader = "x-test-caller"

// metadataAttestor gives each caller the identity its call's metadata names: many identities
// from one process, which the executable-path rules cannot give.
type metadataAttestor struct{ loaded chan struct{} }

func newMetadataAttestor(agent.AttestConfig) (agent.Attestor, error) {
	return metadataAttestor{loaded: make(chan struct{})}, nil
}

func (metadataAttestor) Credentials(inner grpccreds.TransportCredentials) grpccreds.TransportCredentials {
	return inner
}

func (metadataAttestor) Caller(ctx context.Context) (string, string, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if v := md.Get(callerHeader); len(v) == 1 {
		if ns, sa, ok := strings.Cut(v[0], "/"); ok {
			return ns, sa, nil
		}
	}
	return "", "", errors.New("no caller header")
}

func (metadataAttestor) Run(ctx context.Context) error {
	<-ctx.Done()
	return nil
}

// Loaded never fires: the rules never change.
func (a metadataAttestor) Loaded() <-chan struct{} { return a.loaded }

// inotifyInstances counts this process's inotify instances.
func inotifyInstances(t *testing.T) int {
	t.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	n := 0
	for _, fd := range fds {
		if target, err := os.Readlink(filepath.Join("/proc/self/fd", fd.Name())); err == nil && target == "anon_inode:inotify" {
			n++
		}
	}
	return n
}

// A node agent serving many identities holds one inotify instance for all their secret
// managers, however many there are: the kernel allows a user 128 by default, and a manager
// each (each watches the CA root file) left identities past that with no certificate.
//
// Not parallel: it counts the process's inotify instances, which parallel tests would change.
func TestNodeAgentIdentitiesShareOneInotifyInstance(t *testing.T) { //nolint:paralleltest // see above
	cfg := testConfig(t, newFakeClock(), nil, nil)
	cfg.SDS.WorkloadAttestation = filepath.Join(t.TempDir(), "rules.yaml")
	cfg.SDS.Attest, cfg.XDS.Proxy = newMetadataAttestor, false
	a := newAgent(t, cfg)
	runAgent(t, a)
	c, err := sdsclient.Dial(a.SocketPath(), sdsclient.WithNode(&core.Node{Id: sdstest.NodeID}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	fetch := func(i int) {
		t.Helper()
		sa := fmt.Sprintf("sa-%d", i)
		got, err := c.Fetch(metadata.AppendToOutgoingContext(ctx, callerHeader, "shop/"+sa), "default")
		if err != nil {
			t.Fatalf("identity %d: %v", i, err)
		}
		if id := workloadChain(t, got["default"])[0].URIs[0].String(); id != "spiffe://cluster.local/ns/shop/sa/"+sa {
			t.Fatalf("identity %d was given %s", i, id)
		}
	}

	before := inotifyInstances(t)
	const identities = 24
	for i := range identities {
		fetch(i)
	}
	if after := inotifyInstances(t); after > before+1 {
		t.Fatalf("serving %d identities took %d inotify instances, want at most 1 (the agent's)", identities, after-before)
	}
}
