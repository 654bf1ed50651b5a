package agent_test

import (
	"context"
	"crypto"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	spiffeapi "github.com/spiffe/go-spiffe/v2/workloadapi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/sds/sdstest"
)

// x509Watcher hands go-spiffe's watch updates to the test.
type x509Watcher struct {
	updates chan *spiffeapi.X509Context
}

func (w x509Watcher) OnX509ContextUpdate(c *spiffeapi.X509Context) { w.updates <- c }
func (w x509Watcher) OnX509ContextWatchError(error)                {}

// checkSVID checks an X.509 context as a SPIFFE-aware application would: its one SVID is
// embeddedID, its key matches its leaf, and it verifies against its own trust domain's bundle
// at now (the fake clock's; go-spiffe would use the real one).
func checkSVID(t *testing.T, c *spiffeapi.X509Context, now time.Time) *x509svid.SVID {
	t.Helper()
	if len(c.SVIDs) != 1 {
		t.Fatalf("%d SVIDs, want 1", len(c.SVIDs))
	}
	svid := c.SVIDs[0]
	if svid.ID.String() != embeddedID {
		t.Fatalf("SVID of %s, want %s", svid.ID, embeddedID)
	}
	if !svid.PrivateKey.Public().(interface{ Equal(crypto.PublicKey) bool }).Equal(svid.Certificates[0].PublicKey) {
		t.Fatal("the SVID's key does not match its leaf")
	}
	id, _, err := x509svid.Verify(svid.Certificates, c.Bundles, x509svid.WithTime(now))
	if err != nil || id != svid.ID {
		t.Fatalf("the SVID does not verify against the bundle: %v, %v", id, err)
	}
	return svid
}

func serialOfSVID(s *x509svid.SVID) string { return serialOf(s.Certificates) }

// go-spiffe's own Workload API client, unmodified, against a running agent with its embedded
// CA, on the SDS socket: FetchX509Context and NewX509Source get the agent's identity, which
// verifies against the bundle; a watch sees a forced rotation with a new SVID; and Envoy's SDS
// on the same socket gets the same certificates, before and after.
func TestGoSPIFFEClientAgainstTheAgent(t *testing.T) {
	t.Parallel()
	clk := newFakeClock() // shared by the agent and its embedded CA
	cfg := testConfig(t, clk, newLogSink(t), nil)
	cfg.Certificate.TTL = time.Minute
	a := newAgent(t, cfg)
	runAgent(t, a)
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	addr := spiffeapi.WithAddr("unix://" + a.SocketPath())

	x509ctx, err := spiffeapi.FetchX509Context(ctx, addr)
	if err != nil {
		t.Fatalf("FetchX509Context: %v", err)
	}
	first := checkSVID(t, x509ctx, clk.Now())
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	bundle, err := x509ctx.Bundles.GetX509BundleForTrustDomain(td)
	if err != nil {
		t.Fatal(err)
	}

	source, err := spiffeapi.NewX509Source(ctx, spiffeapi.WithClientOptions(addr))
	if err != nil {
		t.Fatalf("NewX509Source: %v", err)
	}
	t.Cleanup(func() { _ = source.Close() })
	if svid, err := source.GetX509SVID(); err != nil || svid.ID.String() != embeddedID {
		t.Fatalf("X509Source SVID %v, %v; want %s", svid, err, embeddedID)
	}

	envoy := sdstest.Dial(t, a.SocketPath())
	sotw := envoy.StreamSecrets()
	sotw.Subscribe(secretNames...)
	last, secrets := sotw.RecvAll(secretNames...)
	sotw.Ack(last, secretNames...)
	if got := serialOf(workloadChain(t, secrets["default"])); got != serialOfSVID(first) {
		t.Fatalf("SDS serves %s, the Workload API %s", got, serialOfSVID(first))
	}
	roots := sdstest.Roots(t, secrets["ROOTCA"])
	if len(roots) != len(bundle.X509Authorities()) || !roots[0].Equal(bundle.X509Authorities()[0]) {
		t.Fatal("the Workload API's bundle is not ROOTCA's roots")
	}

	client, err := spiffeapi.New(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Close() })
	w := x509Watcher{updates: make(chan *spiffeapi.X509Context, 4)}
	watchCtx, endWatch := context.WithCancel(ctx)
	watched := make(chan error, 1)
	go func() { watched <- client.WatchX509Context(watchCtx, w) }()
	t.Cleanup(func() {
		endWatch()
		if err := <-watched; status.Code(err) != codes.Canceled && !errors.Is(err, context.Canceled) {
			t.Errorf("WatchX509Context: %v", err)
		}
	})
	if got := checkSVID(t, receive(t, w.updates, "the watch's first update"), clk.Now()); serialOfSVID(got) != serialOfSVID(first) {
		t.Fatalf("the watch began with %s, FetchX509Context got %s", serialOfSVID(got), serialOfSVID(first))
	}

	rotate(t, clk, a)
	rotated := checkSVID(t, receive(t, w.updates, "the rotated SVID"), clk.Now())
	if serialOfSVID(rotated) == serialOfSVID(first) {
		t.Fatal("the watch got the same SVID again")
	}
	p := sotw.Recv()
	if got := serialOf(workloadChain(t, p.Secrets["default"])); got != serialOfSVID(rotated) {
		t.Fatalf("SDS pushed %s on rotation, the Workload API %s", got, serialOfSVID(rotated))
	}
	if got := metric(t, a, `meshid_agent_workload_api_streams{method="FetchX509SVID"}`); got != "2" {
		t.Errorf("%s FetchX509SVID streams open, want 2 (the source's and the watch's)", got)
	}
	if got := metric(t, a, `meshid_agent_workload_api_calls_total{method="FetchX509SVID"}`); got != "3" {
		t.Errorf("%s FetchX509SVID calls counted, want 3", got)
	}
}

// --workload-api=false leaves the service off the socket: a client is told it is not there,
// and SDS is served as before.
func TestWorkloadAPIOff(t *testing.T) {
	t.Parallel()
	clk := newFakeClock()
	cfg := testConfig(t, clk, nil, nil)
	cfg.SDS.WorkloadAPI = false
	a := newAgent(t, cfg)
	runAgent(t, a)
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	_, err := spiffeapi.FetchX509Context(ctx, spiffeapi.WithAddr("unix://"+a.SocketPath()))
	if st := status.Convert(err); st.Code() != codes.Unimplemented || !strings.Contains(st.Message(), "SpiffeWorkloadAPI") {
		t.Fatalf("FetchX509Context: %v, want Unimplemented: the service is not registered", err)
	}
	if chain := workloadChain(t, sdsGet(t, a.SocketPath(), "default")["default"]); chain[0].URIs[0].String() != embeddedID {
		t.Fatalf("SDS serves %v", chain[0].URIs)
	}
}
