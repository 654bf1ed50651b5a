package agent_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/agent/nodemode"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/sds/sdsclient"
	"github.com/meshid/meshid/sds/sdstest"
)

// sdsStreamEnv names the SDS socket a copy of the test binary follows "default" on.
const sdsStreamEnv = "MESHID_TEST_SDS_STREAM"

// sdsStreamMain follows "default" on one stream of socket, printing for each push the leaf's
// SPIFFE ID, serial, NotBefore and NotAfter (Unix seconds), and, when the stream ends,
// "code=CODE MESSAGE". It runs until killed.
func sdsStreamMain(socket string) int {
	c, err := sdsclient.Dial(socket, sdsclient.WithNode(&core.Node{Id: sdstest.NodeID}))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer func() { _ = c.Close() }()
	st, err := c.StreamSecrets(context.Background())
	if err == nil {
		err = st.Subscribe("default")
	}
	if err == nil {
		err = st.Follow([]string{"default"}, func(r sdsclient.Response) error {
			certs, err := pki.ParseCertificates(r.Secrets["default"].GetTlsCertificate().GetCertificateChain().GetInlineBytes())
			if err != nil || len(certs) == 0 || len(certs[0].URIs) != 1 {
				return fmt.Errorf("no leaf with one URI SAN: %w", err)
			}
			leaf := certs[0]
			fmt.Println(leaf.URIs[0], leaf.SerialNumber.Text(16), leaf.NotBefore.Unix(), leaf.NotAfter.Unix())
			return nil
		})
	}
	fmt.Println("code=" + status.Code(err).String() + " " + status.Convert(err).Message())
	<-make(chan struct{}) // killed by the test
	return 0
}

// writeRules replaces the rules file at path, as an operator's tool does: a new file renamed
// over it.
func writeRules(t *testing.T, path, rules string) {
	t.Helper()
	tmp := path + ".new"
	if err := os.WriteFile(tmp, []byte(rules), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// A node agent whose rules file changes so that one caller (this test binary) gets another
// identity: its SDS stream's connection is closed (its client sees Unavailable, and reconnects)
// and its Workload API stream ends with Unavailable saying why, its connection left open (each
// logged once and counted), and a new stream gets the new identity's "default"; the other
// caller's stream (a copy of the test binary, whose rule is unchanged) goes on, and receives its
// rotation.
func TestNodeAgentRulesReloadEndsStreamsOfChangedIdentities(t *testing.T) {
	t.Parallel()
	clientA := copyExecutable(t, t.TempDir(), "client-a")
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	rules := filepath.Join(t.TempDir(), "rules.yaml")
	rulesFor := func(selfSA string) string {
		return fmt.Sprintf("rules:\n  - {path: %q, namespace: shop, serviceAccount: a}\n  - {path: %q, namespace: node, serviceAccount: %s}\n",
			clientA, realPath(t, self), selfSA)
	}
	writeRules(t, rules, rulesFor("tests"))
	clk := newFakeClock()
	received := clk.Now() // the clock stands still until the rules change
	logs := newLogSink(t)
	cfg := testConfig(t, clk, logs, nil)
	cfg.SDS.WorkloadAttestation, cfg.SDS.Node, cfg.XDS.Proxy = rules, nodemode.New(newAttestor), false
	a := newAgent(t, cfg)
	runAgent(t, a)
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()

	// The other caller follows its "default" from its own process.
	other := exec.CommandContext(ctx, clientA, "-test.run=^$")
	other.Env = append(os.Environ(), sdsStreamEnv+"="+a.SocketPath())
	other.Stderr = os.Stderr
	out, err := other.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		_ = other.Wait()
	})
	lines := make(chan string, 8)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
		_, _ = io.Copy(io.Discard, out)
	}()
	firstPush := strings.Fields(receive(t, lines, "push to the other caller"))
	if len(firstPush) != 4 || firstPush[0] != "spiffe://cluster.local/ns/shop/sa/a" {
		t.Fatalf("the other caller got %q", firstPush)
	}

	// This process: an SDS stream and a Workload API stream, of its rule's identity.
	sdsStream := sdstest.Dial(t, a.SocketPath()).StreamSecrets()
	sdsStream.Subscribe("default")
	if id := workloadChain(t, sdsStream.Collect("default")["default"])[0].URIs[0].String(); id != "spiffe://cluster.local/ns/node/sa/tests" {
		t.Fatalf("SDS default of %s", id)
	}
	conn, err := grpc.NewClient("unix://"+a.SocketPath(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	svids, err := workload.NewSpiffeWorkloadAPIClient(conn).FetchX509SVID(metadata.AppendToOutgoingContext(ctx, "workload.spiffe.io", "true"),
		&workload.X509SVIDRequest{})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := svids.Recv()
	if err != nil || len(resp.GetSvids()) != 1 || resp.GetSvids()[0].GetSpiffeId() != "spiffe://cluster.local/ns/node/sa/tests" {
		t.Fatalf("FetchX509SVID: %v, %v", resp, err)
	}

	type end struct {
		what string
		*status.Status
	}
	ended := make(chan end, 2)
	go func() { ended <- end{"SDS", sdsStream.RecvErr()} }()
	go func() {
		_, err := svids.Recv()
		ended <- end{"Workload API", status.Convert(err)}
	}()
	writeRules(t, rules, rulesFor("moved"))
	// The watch's debounce is on the fake clock: moved past it once it waits (unless the
	// reload came without, from the load the watch makes when it starts).
	const debounce = 100 * time.Millisecond
	due := clk.Now().Add(debounce)
	var ends []end
	for len(ends) < 2 {
		changed := clk.Changed()
		if slices.ContainsFunc(clk.Deadlines(), due.Equal) {
			clk.Advance(debounce)
		}
		select {
		case st := <-ended:
			ends = append(ends, st)
		case <-changed:
		case <-ctx.Done():
			t.Fatalf("the streams of the identity the rules changed did not end: %d of 2", len(ends))
		}
	}
	for _, st := range ends {
		switch {
		case st.Code() != codes.Unavailable:
			t.Errorf("%s stream ended with %v, want Unavailable", st.what, st.Status)
		case st.what == "Workload API" && (!strings.Contains(st.Message(), "identity changed") ||
			!strings.Contains(st.Message(), "spiffe://cluster.local/ns/node/sa/moved")):
			t.Errorf("Workload API stream ended with %v, want it to say the identity changed to the new one", st.Status)
		}
	}
	if got := metric(t, a, `meshid_agent_node_streams_ended_total{reason="identity_changed"}`); got != "2" {
		t.Errorf("streams ended for a changed identity %q, want 2", got)
	}
	// One line per connection, naming its protocol. The SDS stream's connection is closed when
	// its handler waits in Recv, and the stream is ended without it when the reload comes as the
	// handler takes the ACK of its push: either way, once (streams_internal_test.go has each).
	closed := logs.records(t, "caller's connection closed: its identity changed with the workload attestation rules")
	open := logs.records(t, "caller's streams ended: its identity changed with the workload attestation rules")
	byProtocol := map[string]int{}
	for _, r := range append(closed, open...) {
		p, _ := r["protocol"].(string)
		byProtocol[p]++
	}
	if len(closed)+len(open) != 2 || byProtocol["/envoy.service.secret.v3.SecretDiscoveryService/StreamSecrets"] != 1 ||
		byProtocol["/SpiffeWorkloadAPI/FetchX509SVID"] != 1 {
		t.Errorf("log lines of ended streams by protocol %v, want one for the SDS connection and one for the Workload API's", byProtocol)
	}
	for _, r := range closed {
		if r["protocol"] != "/envoy.service.secret.v3.SecretDiscoveryService/StreamSecrets" {
			t.Errorf("the Workload API stream's connection was closed (%v): its handler returns by itself", r)
		}
	}
	// A new stream is the new identity's.
	again := sdstest.Dial(t, a.SocketPath()).StreamSecrets()
	again.Subscribe("default")
	if id := workloadChain(t, again.Collect("default")["default"])[0].URIs[0].String(); id != "spiffe://cluster.local/ns/node/sa/moved" {
		t.Fatalf("SDS default of %s after the rules changed, want the new identity's", id)
	}

	// The other caller's stream goes on: its certificate's renewal reaches it.
	select {
	case l := <-lines:
		t.Fatalf("the other caller's stream changed: %q", l)
	default:
	}
	notBefore, err1 := strconv.ParseInt(firstPush[2], 10, 64)
	notAfter, err2 := strconv.ParseInt(firstPush[3], 10, 64)
	if err1 != nil || err2 != nil {
		t.Fatalf("push %q", firstPush)
	}
	// As the secret manager counts it: half the lifetime from receipt (GraceRatio, no jitter).
	na := time.Unix(notAfter, 0)
	renewAt := received.Add(min(na.Sub(received), na.Sub(time.Unix(notBefore, 0))) / 2)
	if err := clk.WaitForDeadline(ctx, renewAt); err != nil {
		t.Fatalf("no renewal armed for %s: %v", renewAt, err)
	}
	clk.Advance(renewAt.Sub(clk.Now()))
	push := strings.Fields(receive(t, lines, "the other caller's renewal"))
	if len(push) != 4 || push[0] != "spiffe://cluster.local/ns/shop/sa/a" || push[1] == firstPush[1] {
		t.Fatalf("the other caller got %q after its renewal, first %q", push, firstPush)
	}
}
