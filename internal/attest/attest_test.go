package attest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/testutil"
)

type harness struct {
	attestor *Attestor
	clock    *testutil.FakeClock
	logs     *testutil.SyncBuffer
	reg      *prometheus.Registry
	rules    string
}

// newHarness writes rules to a file and makes an Attestor on it, reading proc ("": the real /proc).
func newHarness(t *testing.T, rules, proc string, pods PodResolver) *harness {
	t.Helper()
	h := &harness{clock: testutil.NewFakeClock(time.Now()), logs: &testutil.SyncBuffer{}, reg: prometheus.NewRegistry(),
		rules: filepath.Join(t.TempDir(), "rules.yaml")}
	writeFile(t, h.rules, rules)
	a, err := New(Config{RulesFile: h.rules, Proc: proc, Pods: pods, Clock: h.clock, Registerer: h.reg,
		Logger: slog.New(slog.NewJSONHandler(h.logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	h.attestor = a
	return h
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

type identified struct {
	info AuthInfo
	id   Identity
	err  error
}

// serve runs a gRPC server with the attestor's credentials (over inner) on a Unix socket; each
// call's peer is identified and sent on the returned channel. It returns the socket's client.
func serve(t *testing.T, a *Attestor, inner credentials.TransportCredentials) (healthpb.HealthClient, <-chan identified) {
	t.Helper()
	calls := make(chan identified, 8)
	srv := grpc.NewServer(grpc.Creds(a.Credentials(inner)), grpc.UnaryInterceptor(
		func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			info, _ := authInfoFrom(ctx)
			id, err := a.Identify(ctx)
			calls <- identified{info: info, id: id, err: err}
			return handler(ctx, req)
		}))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	socket := filepath.Join(testutil.ShortTempDir(t), "s")
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(lis) }()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		srv.Stop()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return healthpb.NewHealthClient(conn), calls
}

func call(t *testing.T, client healthpb.HealthClient, calls <-chan identified) identified {
	t.Helper()
	if _, err := client.Check(t.Context(), &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	return <-calls
}

// The test process connects to itself: the handshake reads its own credentials from the kernel
// and the real /proc.
func TestRealSocketIdentifiesThisProcess(t *testing.T) {
	t.Parallel()
	uid := os.Getuid()
	h := newHarness(t, fmt.Sprintf("rules:\n- {uid: %d, namespace: tests, serviceAccount: self}\n", uid), "", nil)
	client, calls := serve(t, h.attestor, nil)
	got := call(t, client, calls)
	if got.err != nil {
		t.Fatalf("Identify: %v", got.err)
	}
	if got.id != (Identity{Namespace: "tests", ServiceAccount: "self"}) {
		t.Fatalf("identity %+v", got.id)
	}
	p := got.info.Process
	start, err := ProcFS{}.StartTime(int32(os.Getpid()))
	if err != nil {
		t.Fatal(err)
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	if got.info.Err != nil || int(p.PID) != os.Getpid() || int(p.UID) != uid || int(p.GID) != os.Getgid() || p.StartTime != start || p.Exe != exe {
		t.Fatalf("AuthInfo = %+v (err %v), want pid %d uid %d gid %d start %d exe %s", p, got.info.Err, os.Getpid(), uid, os.Getgid(), start, exe)
	}
	if len(p.Cgroups) == 0 {
		t.Errorf("no cgroup read of this process")
	}
}

func TestRealSocketNoRuleIsRefused(t *testing.T) {
	t.Parallel()
	h := newHarness(t, fmt.Sprintf("rules:\n- {uid: %d, namespace: tests, serviceAccount: other}\n", os.Getuid()+1), "", nil)
	client, calls := serve(t, h.attestor, nil)
	for range 3 {
		got := call(t, client, calls)
		var refusal *Refusal
		if !errors.As(got.err, &refusal) || !errors.Is(got.err, ErrNoRule) || refusal.Reason != ReasonNoRule || int(refusal.Caller.PID) != os.Getpid() {
			t.Fatalf("Identify = %+v, %v; want a no_rule refusal naming this process", got.id, got.err)
		}
		// Logged here: the servers refusing the call do not log it again.
		if !errors.Is(got.err, admission.ErrLogged) {
			t.Fatalf("the refusal %v is not marked as logged", got.err)
		}
	}
	if n := promtest.ToFloat64(h.attestor.metrics.refusals.WithLabelValues(ReasonNoRule)); n != 3 {
		t.Errorf("no_rule refusals counted %v, want 3", n)
	}
	// One process refused for one reason is logged once.
	recs := h.logs.Records(t, "workload attestation refused a caller")
	if len(recs) != 1 {
		t.Fatalf("%d refusal lines, want 1: %s", len(recs), h.logs)
	}
	if peer, _ := recs[0]["peer"].(string); !strings.Contains(peer, fmt.Sprintf("pid=%d uid=%d", os.Getpid(), os.Getuid())) || recs[0]["reason"] != ReasonNoRule {
		t.Errorf("refusal line %v", recs[0])
	}
}

// The handshake reads the process once; a call is checked against the pid's start time now.
func TestPIDReusedOrGoneIsRefused(t *testing.T) {
	t.Parallel()
	pid := int32(os.Getpid())
	for _, tc := range []struct {
		name   string
		change func(*fakeProc)
		want   error
		reason string
	}{
		{name: "reused", change: func(p *fakeProc) { p.write(pid, "stat", statLine(pid, 200)) }, want: ErrPIDReused, reason: ReasonPIDReused},
		{name: "gone", change: func(p *fakeProc) {
			if err := os.RemoveAll(filepath.Join(p.root, fmt.Sprint(pid))); err != nil {
				t.Fatal(err)
			}
		}, want: ErrProcessGone, reason: ReasonPeerExited},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			proc := newFakeProc(t)
			proc.add(pid, 100, "/usr/bin/app", "", "0::/system.slice/app.service\n")
			h := newHarness(t, "rules:\n- {cgroup: /system.slice/app.service, namespace: apps, serviceAccount: app}\n", proc.root, nil)
			client, calls := serve(t, h.attestor, nil)
			if got := call(t, client, calls); got.err != nil || got.id.ServiceAccount != "app" {
				t.Fatalf("before: %+v, %v", got.id, got.err)
			}
			tc.change(proc)
			got := call(t, client, calls)
			var refusal *Refusal
			if !errors.Is(got.err, tc.want) || !errors.As(got.err, &refusal) || refusal.Reason != tc.reason {
				t.Fatalf("after: %+v, %v; want %v (%s)", got.id, got.err, tc.want, tc.reason)
			}
			if got.info.Process.StartTime != 100 || got.info.Process.Exe != "/usr/bin/app" {
				t.Errorf("the handshake's facts changed: %+v", got.info.Process)
			}
		})
	}
}

// A peer whose pid cannot be read when it connects is served, and its calls refused.
func TestUnreadablePeerIsRefused(t *testing.T) {
	t.Parallel()
	proc := newFakeProc(t) // holds no entry for this process
	h := newHarness(t, "rules:\n- {gid: 0, namespace: a, serviceAccount: b}\n", proc.root, nil)
	client, calls := serve(t, h.attestor, nil)
	got := call(t, client, calls)
	if !errors.Is(got.err, ErrProcessGone) || !errors.Is(got.info.Err, ErrProcessGone) {
		t.Fatalf("Identify = %v, handshake %v; want the process not found", got.err, got.info.Err)
	}
	if int(got.info.Process.PID) != os.Getpid() || int(got.info.Process.UID) != os.Getuid() {
		t.Errorf("the refusal does not name the caller by the kernel's credentials: %+v", got.info.Process)
	}
	_, err := h.attestor.Identify(t.Context()) // no gRPC peer at all
	var refusal *Refusal
	if !errors.As(err, &refusal) || refusal.Reason != ReasonPeerUnknown || !errors.Is(err, ErrPeerUnknown) {
		t.Fatalf("Identify without a peer = %v", err)
	}
}

// Attest of a connection that is not a Unix socket's names no one.
func TestAttestNotUnix(t *testing.T) {
	t.Parallel()
	a, b := net.Pipe()
	defer func() { _ = a.Close(); _ = b.Close() }()
	if _, err := Attest(a, ProcFS{}); !errors.Is(err, ErrPeerUnknown) {
		t.Fatalf("Attest(pipe) = %v, want ErrPeerUnknown", err)
	}
}

// The credentials wrap a server's own (admission here): its refusal refuses the connection,
// and its AuthInfo is kept.
func TestCredentialsWrapAdmission(t *testing.T) {
	t.Parallel()
	h := newHarness(t, fmt.Sprintf("rules:\n- {uid: %d, namespace: tests, serviceAccount: self}\n", os.Getuid()), "", nil)
	gate, err := admission.NewGate(admission.Limits{Connections: 1})
	if err != nil {
		t.Fatal(err)
	}
	refused := make(chan string, 4)
	client, calls := serve(t, h.attestor, admission.UnixPeerCredentials(gate, func(who string, _ error) { refused <- who }))
	got := call(t, client, calls)
	if got.err != nil || got.info.Inner == nil || got.info.Inner.AuthType() != "unix-peer" || got.info.Unwrap() != got.info.Inner {
		t.Fatalf("call: %v, AuthInfo %+v", got.err, got.info)
	}
	// A second connection passes the gate's cap: the inner handshake refuses it.
	lis := h.attestor.Credentials(admission.UnixPeerCredentials(gate, func(who string, _ error) { refused <- who }))
	c1, c2 := unixPair(t)
	defer func() { _ = c1.Close(); _ = c2.Close() }()
	if _, _, err := lis.ServerHandshake(c1); !errors.Is(err, admission.ErrTooManyConnections) {
		t.Fatalf("handshake past the cap: %v", err)
	}
	if who := <-refused; !strings.Contains(who, fmt.Sprintf("pid=%d", os.Getpid())) {
		t.Errorf("refused %q", who)
	}
}

// unixPair returns both ends of a connection on a Unix socket.
func unixPair(t *testing.T) (server, client net.Conn) {
	t.Helper()
	lis, err := net.Listen("unix", filepath.Join(testutil.ShortTempDir(t), "p"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lis.Close() }()
	client, err = net.Dial("unix", lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server, err = lis.Accept()
	if err != nil {
		t.Fatal(err)
	}
	return server, client
}

type fakePods map[string]Identity

func (f fakePods) ResolvePod(_ context.Context, uid string) (Identity, error) {
	if uid == "broken" {
		return Identity{}, errors.New("API server unreachable")
	}
	id, ok := f[uid]
	if !ok {
		return Identity{}, fmt.Errorf("pod %s: %w", uid, ErrPodNotFound)
	}
	return id, nil
}

// Rules are tried first; a caller in a pod that no rule matches is the pod's.
func TestPodResolver(t *testing.T) {
	t.Parallel()
	proc := newFakeProc(t)
	cgroup := func(uid string) string { return "0::/kubepods/burstable/pod" + uid + "/" + containerID + "\n" }
	const other = "11111111-2222-3333-4444-555555555555"
	proc.add(10, 1, "/app", "", cgroup(podUID))
	proc.add(11, 1, "/app", "", cgroup(other))
	proc.add(12, 1, "/pinned", "", cgroup(podUID))
	proc.add(13, 1, "/app", "", "0::/user.slice\n")
	pods := fakePods{podUID: {Namespace: "shop", ServiceAccount: "cart"}}
	h := newHarness(t, "rules:\n- {path: /pinned, namespace: ops, serviceAccount: pinned}\n", proc.root, pods)
	fs := ProcFS{Root: proc.root}
	for _, tc := range []struct {
		name   string
		pid    int32
		want   Identity
		reason string
	}{
		{name: "the pod's identity", pid: 10, want: Identity{"shop", "cart"}},
		{name: "a rule before the pod", pid: 12, want: Identity{"ops", "pinned"}},
		{name: "a pod not on this node", pid: 11, reason: ReasonPodNotFound},
		{name: "not in a pod", pid: 13, reason: ReasonNoRule},
	} {
		p, err := fs.Read(tc.pid)
		if err != nil {
			t.Fatal(err)
		}
		id, err := h.attestor.IdentifyProcess(t.Context(), p, nil)
		var refusal *Refusal
		switch {
		case tc.reason == "" && (err != nil || id != tc.want):
			t.Errorf("%s: %+v, %v; want %+v", tc.name, id, err, tc.want)
		case tc.reason != "" && (!errors.As(err, &refusal) || refusal.Reason != tc.reason):
			t.Errorf("%s: %+v, %v; want refused %s", tc.name, id, err, tc.reason)
		}
	}
	p, err := fs.Read(10)
	if err != nil {
		t.Fatal(err)
	}
	p.PodUID = "broken"
	var refusal *Refusal
	if _, err := h.attestor.IdentifyProcess(t.Context(), p, nil); !errors.As(err, &refusal) || refusal.Reason != ReasonPodsFailed {
		t.Errorf("a failed lookup: %v", err)
	}
	if n := promtest.ToFloat64(h.attestor.metrics.identified.WithLabelValues("pod")); n != 1 {
		t.Errorf("identified by pod %v, want 1", n)
	}
}

func TestNewRefusesAnUnreadableFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if _, err := New(Config{RulesFile: filepath.Join(dir, "absent.yaml")}); err == nil {
		t.Error("a missing rules file was accepted")
	}
	broken := filepath.Join(dir, "broken.yaml")
	writeFile(t, broken, "rules: [")
	if _, err := New(Config{RulesFile: broken}); err == nil {
		t.Error("an unparseable rules file was accepted")
	}
}

// run starts the attestor's watch and waits until the load after the watch is in place.
func (h *harness) run(t *testing.T) {
	t.Helper()
	loaded := h.attestor.Loaded()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.attestor.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	select {
	case <-loaded:
	case err := <-done:
		t.Fatalf("Run ended: %v", err)
	}
}

// rewrite replaces the rules file and lets the debounce pass until it is loaded.
func (h *harness) rewrite(t *testing.T, content string) {
	t.Helper()
	loaded := h.attestor.Loaded()
	tmp := h.rules + ".new"
	writeFile(t, tmp, content)
	if err := os.Rename(tmp, h.rules); err != nil {
		t.Fatal(err)
	}
	testutil.Drive(t, h.clock, filewatch.DefaultDebounce, 0, loaded)
}

func TestRulesReload(t *testing.T) {
	t.Parallel()
	h := newHarness(t, "rules:\n- {uid: 1, namespace: one, serviceAccount: a}\n- {uid: 2, namespace: Bad, serviceAccount: b}\n", "", nil)
	if got := h.attestor.Rules(); len(got) != 1 || got[0].Namespace != "one" {
		t.Fatalf("rules %+v", got)
	}
	skipped := h.logs.Records(t, "workload attestation rule skipped")
	if len(skipped) != 1 || skipped[0]["item"] != float64(1) || !strings.Contains(fmt.Sprint(skipped[0]["error"]), "namespace") {
		t.Fatalf("skipped rules logged: %v", skipped)
	}
	h.run(t)

	h.rewrite(t, "rules:\n- {uid: 3, namespace: three, serviceAccount: c}\n- {uid: 4, namespace: four, serviceAccount: d}\n")
	if got := h.attestor.Rules(); len(got) != 2 || got[0].Namespace != "three" || got[1].Namespace != "four" {
		t.Fatalf("after a change: %+v", got)
	}
	if n := promtest.ToFloat64(h.attestor.metrics.rules); n != 2 {
		t.Errorf("rules gauge %v, want 2", n)
	}

	h.rewrite(t, "rules: [{uid: 5")
	if got := h.attestor.Rules(); len(got) != 2 || got[0].Namespace != "three" {
		t.Fatalf("a broken file replaced the rules: %+v", got)
	}
	if n := promtest.ToFloat64(h.attestor.metrics.loads.WithLabelValues("error")); n != 1 {
		t.Errorf("failed loads counted %v, want 1", n)
	}
	if recs := h.logs.Records(t, "workload attestation rules not reloaded, the previous ones are kept"); len(recs) != 1 {
		t.Errorf("failed load logged %d times, want once", len(recs))
	}
	if n := promtest.ToFloat64(h.attestor.metrics.badRules); n != 1 {
		t.Errorf("skipped rules counted %v, want 1", n)
	}
	if err := promtest.GatherAndCompare(h.reg, strings.NewReader(`
# HELP meshid_agent_attestation_rules Workload attestation rules in force.
# TYPE meshid_agent_attestation_rules gauge
meshid_agent_attestation_rules 2
`), "meshid_agent_attestation_rules"); err != nil {
		t.Error(err)
	}
}
