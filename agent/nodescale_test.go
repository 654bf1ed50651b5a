package agent_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	grpccreds "google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/agent/nodemode"
	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/internal/pki"
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
	cfg.SDS.Node, cfg.XDS.Proxy = nodemode.New(newMetadataAttestor), false
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

// failingCA refuses a signer of the identities fail names, so that their secret managers cannot
// be made.
type failingCA struct {
	agent.NodeCA
	fail func(pki.SPIFFEID) error
}

func (c failingCA) ForIdentity(id pki.SPIFFEID) (*caclient.IdentitySigner, error) {
	if err := c.fail(id); err != nil {
		return nil, err
	}
	return c.NodeCA.ForIdentity(id)
}

// A node agent whose secret manager for an identity cannot start tells that identity's callers
// why at once, instead of leaving them waiting: an SDS stream ends with Unavailable naming the
// reason, a fetch and a Workload API stream are answered so; the failure is counted. Once the
// cause is gone the manager is made again after its backoff, and the identity is served; other
// identities are served throughout.
func TestNodeAgentIdentityWhoseManagerFailsIsRefused(t *testing.T) {
	t.Parallel()
	clk := newFakeClock()
	cfg := testConfig(t, clk, nil, nil)
	cfg.SDS.WorkloadAttestation = filepath.Join(t.TempDir(), "rules.yaml")
	var failing atomic.Bool
	failing.Store(true)
	const cause = "no inotify instance left (test)"
	var node *nodemode.Node
	newNode := nodemode.New(newMetadataAttestor)
	cfg.SDS.Node = func(c agent.NodeConfig) (agent.Node, error) {
		c.CA = failingCA{NodeCA: c.CA, fail: func(id pki.SPIFFEID) error {
			if id.ServiceAccount == "broken" && failing.Load() {
				return errors.New(cause)
			}
			return nil
		}}
		n, err := newNode(c)
		if err != nil {
			return nil, err
		}
		node = n.(*nodemode.Node)
		return n, nil
	}
	cfg.XDS.Proxy = false
	a := newAgent(t, cfg)
	runAgent(t, a)
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	broken := metadata.AppendToOutgoingContext(ctx, callerHeader, "shop/broken")
	c, err := sdsclient.Dial(a.SocketPath(), sdsclient.WithNode(&core.Node{Id: sdstest.NodeID}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	wantUnavailable := func(what string, err error) {
		t.Helper()
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), cause) {
			t.Fatalf("%s: %v, want Unavailable naming %q", what, err, cause)
		}
	}

	// An SDS stream, the first ask: ended.
	st, err := c.StreamSecrets(broken)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Subscribe("default"); err != nil {
		t.Fatal(err)
	}
	_, err = st.Collect("default")
	wantUnavailable("SDS stream", err)
	// A second stream, while the manager waits for its retry: ended too.
	st, err = c.StreamSecrets(broken)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Subscribe("default"); err != nil {
		t.Fatal(err)
	}
	_, err = st.Collect("default")
	wantUnavailable("second SDS stream", err)
	_, err = c.Fetch(broken, "default")
	wantUnavailable("FetchSecrets", err)

	conn, err := grpc.NewClient("unix://"+a.SocketPath(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	svids, err := workload.NewSpiffeWorkloadAPIClient(conn).FetchX509SVID(metadata.AppendToOutgoingContext(broken, "workload.spiffe.io", "true"),
		&workload.X509SVIDRequest{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = svids.Recv()
	wantUnavailable("Workload API stream", err)

	// Another identity is served.
	if _, err := c.Fetch(metadata.AppendToOutgoingContext(ctx, callerHeader, "shop/fine"), "default"); err != nil {
		t.Fatalf("another identity: %v", err)
	}
	if got := metric(t, a, `meshid_agent_identity_manager_failures_total{stage="start"}`); got != "1" {
		t.Errorf("start failures %q, want 1: the manager is not made again before its backoff", got)
	}
	if got := metric(t, a, `meshid_agent_node_streams_ended_total{reason="identity_failed"}`); got != "2" {
		t.Errorf("streams ended for the failure %q, want 2", got)
	}

	// The cause gone, the manager is made again once its backoff has passed: a stream opened
	// then gets the certificate (one opened before the retry is ended, as above).
	failing.Store(false)
	brokenID := pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "shop", ServiceAccount: "broken"}
	retryAt := node.RetryAt(brokenID)
	if err := clk.WaitForDeadline(ctx, retryAt); err != nil {
		t.Fatal(err)
	}
	clk.Set(retryAt)
	for {
		st, err := c.StreamSecrets(broken)
		if err != nil {
			t.Fatal(err)
		}
		if err := st.Subscribe("default"); err != nil {
			t.Fatal(err)
		}
		got, err := st.Collect("default")
		if err != nil {
			wantUnavailable("SDS stream during the retry", err)
			continue
		}
		if id := workloadChain(t, got["default"])[0].URIs[0].String(); id != "spiffe://cluster.local/ns/shop/sa/broken" {
			t.Fatalf("served %s", id)
		}
		return
	}
}
