package envoy_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/meshid/meshid/agent/envoy"
	"github.com/meshid/meshid/internal/envoytest"
	"github.com/meshid/meshid/internal/testutil"
)

// The test binary is its own fake Envoy: run with fakeEnvoyEnv set, it prints its arguments and
// the signals it gets, and exits as its mode says.
const fakeEnvoyEnv = "MESHID_FAKE_ENVOY"

func TestMain(m *testing.M) {
	if mode, ok := os.LookupEnv(fakeEnvoyEnv); ok {
		os.Exit(fakeEnvoy(mode))
	}
	os.Exit(runTests(m))
}

// fakeEnvoys are the fake Envoy's paths, by mode: scripts that run the test binary as a fake
// Envoy. They are written before any test runs: an executable written while parallel tests fork
// can be held open for writing by a child between its fork and its exec, and exec'ing it then
// fails with "text file busy".
var fakeEnvoys = map[string]string{}

func runTests(m *testing.M) int {
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	dir, err := os.MkdirTemp("", "fake-envoy")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer func() { _ = os.RemoveAll(dir) }()
	for i, mode := range []string{"", "exit=0", "exit=3", "kill", "stubborn"} {
		path := filepath.Join(dir, fmt.Sprint("envoy-", i))
		script := fmt.Sprintf("#!/bin/sh\n%s=%q exec %q \"$@\"\n", fakeEnvoyEnv, mode, exe)
		if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fakeEnvoys[mode] = path
	}
	return m.Run()
}

// fakeEnvoy: "exit=N" exits N at once; "kill" dies of SIGKILL; "stubborn" ignores SIGTERM;
// otherwise it waits for SIGTERM and exits 0.
func fakeEnvoy(mode string) int {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGUSR1, syscall.SIGHUP)
	args, _ := json.Marshal(os.Args[1:])
	fmt.Printf("args %s\n", args)
	switch {
	case strings.HasPrefix(mode, "exit="):
		var n int
		_, _ = fmt.Sscanf(mode, "exit=%d", &n)
		return n
	case mode == "kill":
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	}
	for sig := range sigs {
		fmt.Printf("signal %s\n", sig)
		if sig == syscall.SIGTERM && mode != "stubborn" {
			return 0
		}
	}
	return 1
}

// fakeAdmin is Envoy's admin as the supervisor uses it.
type fakeAdmin struct {
	mu          sync.Mutex
	ready       string
	connections []int // answered in turn, the last one for good
	calls       []string
	onQuit      func()
}

func (f *fakeAdmin) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, r.Method+" "+r.URL.RequestURI())
	switch r.URL.Path {
	case "/ready":
		if f.ready != envoy.ReadyLive {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_, _ = fmt.Fprintln(w, f.ready)
	case "/stats":
		n := f.connections[0]
		if len(f.connections) > 1 {
			f.connections = f.connections[1:]
		}
		_, _ = fmt.Fprintf(w, "http.admin.downstream_cx_active: 1\nlistener.admin.downstream_cx_active: 1\n")
		_, _ = fmt.Fprintf(w, "listener.0.0.0.0_15090.downstream_cx_active: 3\nlistener.0.0.0.0_15006.downstream_cx_active: %d\n", n)
	case "/drain_listeners":
	case "/quitquitquit":
		if f.onQuit != nil {
			go f.onQuit()
		}
	default:
		http.NotFound(w, r)
	}
}

func (f *fakeAdmin) called() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.calls)
}

type run struct {
	sup      *envoy.Supervisor
	admin    *fakeAdmin
	clock    *testutil.FakeClock
	out      *testutil.SyncBuffer
	logs     *testutil.SyncBuffer
	signals  chan os.Signal
	start    chan struct{}
	shutdown chan struct{}
	cancel   context.CancelFunc
	done     chan error
}

func startSupervisor(t *testing.T, mode string, drain envoy.DrainConfig) *run {
	t.Helper()
	t.Parallel()
	wrapper, ok := fakeEnvoys[mode]
	if !ok {
		t.Fatalf("no fake Envoy for mode %q", mode)
	}
	admin := &fakeAdmin{ready: envoy.ReadyLive, connections: []int{0}}
	srv := httptest.NewServer(admin)
	t.Cleanup(srv.Close)
	r := &run{
		admin: admin, clock: testutil.NewFakeClock(epoch), out: &testutil.SyncBuffer{}, logs: &testutil.SyncBuffer{},
		signals: make(chan os.Signal, 1), start: make(chan struct{}), shutdown: make(chan struct{}), done: make(chan error, 1),
	}
	var err error
	r.sup, err = envoy.NewSupervisor(envoy.SupervisorConfig{
		Options: envoy.Options{Path: wrapper, BootstrapPath: "/etc/envoy.json", LogLevel: "info", ComponentLogLevel: "misc:error",
			Concurrency: 2, DrainDuration: 45 * time.Second},
		Drain:   drain,
		Admin:   envoy.NewAdmin(strings.TrimPrefix(srv.URL, "http://"), 15090),
		Signals: r.signals,
		Stdout:  r.out,
		Clock:   r.clock,
		Logger:  slog.New(slog.NewJSONHandler(r.logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go func() { r.done <- r.sup.Run(ctx, r.start, r.shutdown) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-r.done:
			if err != nil {
				t.Logf("Run, at cleanup: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("Run did not return")
		}
	})
	return r
}

// waitFor polls cond until it holds (envoytest.Eventually); a bound on the wait turns a hang
// into a failure.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	envoytest.Eventually(t, 20*time.Second, func() error {
		if !cond() {
			return errors.New("not yet: " + what)
		}
		return nil
	})
}

func (r *run) wait(t *testing.T) error {
	t.Helper()
	select {
	case err := <-r.done:
		r.done <- err // for Cleanup
		return err
	case <-time.After(20 * time.Second):
		t.Fatal("Run did not return")
		return nil
	}
}

// stepTo waits until the supervisor waits for the moment d after the start of the test's clock,
// and moves the clock there.
func (r *run) stepTo(t *testing.T, d time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	at := epoch.Add(d)
	if err := r.clock.WaitForDeadline(ctx, at); err != nil {
		t.Fatalf("the supervisor did not wait for +%v: pending %v", d, r.clock.Deadlines())
	}
	r.clock.Advance(at.Sub(r.clock.Now()))
}

// epoch is the fake clock's start.
var epoch = time.Unix(1e9, 0)

func (r *run) started(t *testing.T) {
	t.Helper()
	close(r.start)
	waitFor(t, "the fake Envoy printed its arguments", func() bool { return strings.Contains(r.out.String(), "args ") })
}

func TestSupervisorStartsEnvoyOnlyOnceAllowedWithIstiosCommandLine(t *testing.T) {
	r := startSupervisor(t, "", envoy.DrainConfig{})
	if err := r.sup.Problem(context.Background()); err == nil || !strings.Contains(err.Error(), "not started") {
		t.Fatalf("Problem before start: %v, want not started", err)
	}
	if r.sup.PID() != 0 || strings.Contains(r.out.String(), "args") {
		t.Fatal("Envoy started before it was allowed to")
	}
	r.started(t)
	line := strings.TrimPrefix(strings.SplitN(r.out.String(), "\n", 2)[0], "args ")
	var args []string
	if err := json.Unmarshal([]byte(line), &args); err != nil {
		t.Fatal(err)
	}
	want := []string{"-c", "/etc/envoy.json", "--drain-time-s", "45", "--drain-strategy", "immediate", "--local-address-ip-version", "v4",
		"--file-flush-interval-msec", "1000", "--disable-hot-restart", "--allow-unknown-static-fields", "-l", "info",
		"--component-log-level", "misc:error", "--concurrency", "2"}
	if !slices.Equal(args, want) {
		t.Errorf("Envoy's arguments:\n %q\nwant\n %q", args, want)
	}
	if r.sup.PID() == 0 || r.sup.State() != envoy.Running {
		t.Errorf("PID %d, state %v: want Envoy's, running", r.sup.PID(), r.sup.State())
	}
	if err := r.sup.Problem(context.Background()); err != nil {
		t.Errorf("Problem with a LIVE admin: %v", err)
	}
	r.admin.mu.Lock()
	r.admin.ready = "INITIALIZING"
	r.admin.mu.Unlock()
	if err := r.sup.Problem(context.Background()); err == nil || !strings.Contains(err.Error(), "INITIALIZING") {
		t.Errorf("Problem with an INITIALIZING admin: %v", err)
	}
}

func TestSupervisorExitsWithEnvoysStatus(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		mode     string
		code     int
		signaled bool
	}{{"exit=0", 0, false}, {"exit=3", 3, false}, {"kill", 128 + 9, true}} {
		t.Run(tc.mode, func(t *testing.T) {
			r := startSupervisor(t, tc.mode, envoy.DrainConfig{})
			close(r.start)
			err := r.wait(t)
			var exit *envoy.ExitError
			switch {
			case tc.code == 0 && err != nil:
				t.Fatalf("Run: %v, want nil for Envoy's status 0", err)
			case tc.code != 0 && (!errors.As(err, &exit) || exit.ExitCode() != tc.code || (exit.Signal != 0) != tc.signaled):
				t.Fatalf("Run: %#v, want Envoy's exit status %d", err, tc.code)
			}
			recs := r.logs.Records(t, "Envoy exited")
			if len(recs) != 1 || recs[0]["reason"] != "on its own" || recs[0]["status"] != float64(tc.code) {
				t.Errorf("exit logged as %v, want status %d on its own", recs, tc.code)
			}
			if r.sup.State() != envoy.Exited {
				t.Errorf("state %v after exit", r.sup.State())
			}
		})
	}
}

func TestSupervisorForwardsSignals(t *testing.T) {
	r := startSupervisor(t, "", envoy.DrainConfig{})
	r.started(t)
	r.signals <- syscall.SIGUSR1
	waitFor(t, "Envoy got SIGUSR1", func() bool { return strings.Contains(r.out.String(), "signal user defined signal 1") })
}

// Without ExitOnZeroActiveConnections the drain lasts the termination drain duration, from when
// it began; Envoy gets SIGTERM only then, and its 0 is the agent's.
func TestSupervisorDrainsForTheTerminationDuration(t *testing.T) {
	r := startSupervisor(t, "", envoy.DrainConfig{Minimum: 2 * time.Second, Termination: 5 * time.Second})
	r.started(t)
	close(r.shutdown)
	r.stepTo(t, 2*time.Second)
	if strings.Contains(r.out.String(), "signal") {
		t.Fatal("Envoy got a signal before the termination drain was over")
	}
	r.stepTo(t, 5*time.Second)
	if err := r.wait(t); err != nil {
		t.Fatal(err)
	}
	calls := r.admin.called()
	if !slices.Contains(calls, "POST /drain_listeners?graceful&inboundonly") {
		t.Errorf("admin calls %v: want a graceful drain of the inbound listeners", calls)
	}
	if strings.Count(r.out.String(), "signal terminated") != 1 {
		t.Errorf("Envoy's output %q: want one SIGTERM", r.out.String())
	}
	if recs := r.logs.Records(t, "Envoy exited"); len(recs) != 1 || recs[0]["reason"] != "after the drain" {
		t.Errorf("exit logged as %v", recs)
	}
}

// With ExitOnZeroActiveConnections Envoy is stopped once the workload's connections are gone (the
// admin's and the stats listener's do not count), after the minimum.
func TestSupervisorStopsEnvoyAtZeroActiveConnections(t *testing.T) {
	r := startSupervisor(t, "", envoy.DrainConfig{Minimum: 2 * time.Second, Termination: time.Minute, ExitOnZeroActiveConnections: true})
	r.admin.connections = []int{4, 1, 0}
	r.started(t)
	close(r.shutdown)
	// 2s of minimum, then 4 and 1 connections a second apart, then none.
	for _, at := range []time.Duration{2 * time.Second, 3 * time.Second, 4 * time.Second} {
		r.stepTo(t, at)
	}
	if err := r.wait(t); err != nil {
		t.Fatal(err)
	}
	if n := len(r.logs.Records(t, "Envoy still has active connections")); n != 2 {
		t.Errorf("%d reports of active connections, want 2", n)
	}
	if r.sup.State() != envoy.Exited {
		t.Errorf("state %v", r.sup.State())
	}
}

func TestSupervisorStopsEnvoyAtTheTerminationDrainWithConnectionsLeft(t *testing.T) {
	r := startSupervisor(t, "", envoy.DrainConfig{Minimum: time.Second, Termination: 3 * time.Second, ExitOnZeroActiveConnections: true})
	r.admin.connections = []int{7}
	r.started(t)
	close(r.shutdown)
	for _, at := range []time.Duration{time.Second, 2 * time.Second, 3 * time.Second} {
		r.stepTo(t, at)
	}
	if err := r.wait(t); err != nil {
		t.Fatal(err)
	}
	if len(r.logs.Records(t, "the termination drain is over with connections left")) != 1 {
		t.Errorf("logs %s", r.logs)
	}
}

// Readiness fails as soon as the drain begins.
func TestSupervisorIsNotReadyWhileDraining(t *testing.T) {
	r := startSupervisor(t, "", envoy.DrainConfig{Minimum: time.Minute, Termination: time.Minute})
	r.started(t)
	close(r.shutdown)
	waitFor(t, "draining", func() bool { return r.sup.State() == envoy.Draining })
	if err := r.sup.Problem(context.Background()); err == nil || !strings.Contains(err.Error(), "draining") {
		t.Errorf("Problem while draining: %v", err)
	}
}

// quitquitquit ends Envoy through its admin at once, without a drain.
func TestSupervisorQuit(t *testing.T) {
	r := startSupervisor(t, "", envoy.DrainConfig{Minimum: time.Minute, Termination: time.Minute})
	r.admin.onQuit = func() { _ = syscall.Kill(r.sup.PID(), syscall.SIGTERM) }
	r.started(t)
	r.sup.Quit()
	if err := r.wait(t); err != nil {
		t.Fatalf("Run after quit: %v, want Envoy's 0", err)
	}
	if calls := r.admin.called(); !slices.Contains(calls, "POST /quitquitquit") || slices.Contains(calls, "POST /drain_listeners?graceful&inboundonly") {
		t.Errorf("admin calls %v: want quitquitquit and no drain", calls)
	}
	if recs := r.logs.Records(t, "Envoy exited"); len(recs) != 1 || recs[0]["reason"] != "after /quitquitquit" {
		t.Errorf("exit logged as %v", recs)
	}
}

// An Envoy that does not exit on SIGTERM is killed after StopGrace, and the agent says so.
func TestSupervisorKillsAStubbornEnvoy(t *testing.T) {
	r := startSupervisor(t, "stubborn", envoy.DrainConfig{})
	r.started(t)
	r.cancel()
	waitFor(t, "Envoy got SIGTERM", func() bool { return strings.Contains(r.out.String(), "signal terminated") })
	r.stepTo(t, envoy.StopGrace)
	err := r.wait(t)
	var exit *envoy.ExitError
	if !errors.As(err, &exit) || exit.Signal != syscall.SIGKILL {
		t.Fatalf("Run: %v, want Envoy killed", err)
	}
	if len(r.logs.Records(t, "Envoy did not exit; killing it")) != 1 {
		t.Errorf("logs %s", r.logs)
	}
}

// Told to stop before Envoy started, the supervisor never starts it.
func TestSupervisorShutdownBeforeStart(t *testing.T) {
	r := startSupervisor(t, "", envoy.DrainConfig{})
	close(r.shutdown)
	if err := r.wait(t); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(r.out.String(), "args") {
		t.Error("Envoy started after shutdown")
	}
}

func TestActiveConnectionsCountsTheWorkloadsOnly(t *testing.T) {
	t.Parallel()
	admin := &fakeAdmin{connections: []int{5}}
	srv := httptest.NewServer(admin)
	defer srv.Close()
	n, err := envoy.NewAdmin(strings.TrimPrefix(srv.URL, "http://"), 15090).ActiveConnections(context.Background())
	if err != nil || n != 5 {
		t.Fatalf("ActiveConnections: %d, %v; want 5 (the admin's and the stats listener's left out)", n, err)
	}
	if _, err := envoy.NewAdmin("127.0.0.1:1", 0).Ready(context.Background()); err == nil || !strings.Contains(err.Error(), "does not accept connections") {
		t.Fatalf("Ready of a closed port: %v", err)
	}
}

// An admin on a port of the kernel's choosing is reached once Envoy has written its address;
// until then, and while the file is half written, the client says so.
func TestAdminAddressFromEnvoysFile(t *testing.T) {
	t.Parallel()
	admin := &fakeAdmin{ready: envoy.ReadyLive}
	srv := httptest.NewServer(admin)
	defer srv.Close()
	file := filepath.Join(t.TempDir(), "admin-address")
	a := envoy.NewAdminAt(file)
	if _, err := a.Ready(context.Background()); err == nil || !strings.Contains(err.Error(), "has not written its admin's address") {
		t.Fatalf("Ready before the file: %v", err)
	}
	if err := os.WriteFile(file, []byte("127.0.0."), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Addr(); err == nil {
		t.Fatal("a half-written address was taken")
	}
	addr := strings.TrimPrefix(srv.URL, "http://")
	if err := os.WriteFile(file, []byte(addr+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if state, err := a.Ready(context.Background()); err != nil || state != envoy.ReadyLive {
		t.Fatalf("Ready once the address is written: %q, %v", state, err)
	}
	if got, _ := a.Addr(); got != addr {
		t.Fatalf("Addr %q, want %q", got, addr)
	}
	if args := (envoy.Options{AdminAddressPath: file}).Args(); !slices.Contains(args, "--admin-address-path") || args[slices.Index(args, "--admin-address-path")+1] != file {
		t.Fatalf("Envoy is not told where to write its admin's address: %q", args)
	}
}
