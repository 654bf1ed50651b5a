// Package envoytest runs a stand-in for Envoy in tests, e2e runs and benchmarks, where no Envoy
// binary can be installed: Build gives the path of a program that takes Envoy's command line and
// bootstrap, its configuration over ADS and its certificates over SDS, binds the listeners it is
// given, serves the admin endpoints an agent uses and exits on the signals Envoy exits on; Admin
// talks to its admin as the agent does. An agent runs it as its Envoy:
//
//	meshid agent --envoy-path <envoytest.Build(t)> ...
//
// What it does as Envoy does: the flags Envoy and Istio's agent use (an unknown one is a PARSE
// ERROR, exit 1); the bootstrap read and checked with ValidateAll (exit 1 naming the field), or
// only checked with --mode validate; ADS and SDS, state of the world or incremental, with ACKs,
// NACKs and reconnection; PRE_INITIALIZING, INITIALIZING, LIVE and DRAINING; LDS listeners bound
// and their connections held and counted; the admin's /ready, /server_info, /stats,
// /stats/prometheus, /listeners, /config_dump, /drain_listeners, /healthcheck/fail|ok and /quitquitquit; exit 0
// on SIGTERM and SIGINT, SIGUSR1 reopening --log-path.
//
// Where it differs: it serves no traffic (a connection is accepted and held, nothing proxied);
// static listeners are not bound; a graceful drain closes the listeners at once instead of after
// the drain time; LIVE waits for CDS and LDS to be accepted and for every secret, where Envoy
// also goes on after a rejected first update or an initial_fetch_timeout (15s by default); a
// state-of-the-world update with one bad resource is refused whole (an incremental one resource
// by resource, as Envoy); its admin refusals are counted as standin.admin_refused.
package envoytest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	"google.golang.org/protobuf/encoding/protojson"
)

// Package is the stand-in's import path, for go build.
const Package = "github.com/meshid/meshid/internal/envoytest/standin"

// builds holds the one build of the process: building is go build's seconds, and every test of
// every package that starts an Envoy needs the same binary.
var builds = sync.OnceValues(build) //nolint:gochecknoglobals // a once-per-process build cache

// buildDirPrefix names the build directories, with the building process's id after it.
const buildDirPrefix = "meshid-envoy-standin-"

func build() (string, error) {
	removeOrphanBuilds()
	// Not t.TempDir: the binary outlives the test that happened to build it. The directory
	// outlives the process too; the next build removes it (removeOrphanBuilds).
	dir, err := os.MkdirTemp("", buildDirPrefix+strconv.Itoa(os.Getpid())+"-")
	if err != nil {
		return "", fmt.Errorf("envoy stand-in: %w", err)
	}
	bin := filepath.Join(dir, "envoy")
	cmd := exec.Command("go", "build", "-o", bin, Package) //nolint:gosec // this module's own package
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS="+withoutRace(os.Getenv("GOFLAGS")))
	if out, err := cmd.CombinedOutput(); err != nil {
		_ = os.RemoveAll(dir)
		return "", fmt.Errorf("go build %s: %w: %s", Package, err, out)
	}
	return bin, nil
}

// withoutRace drops -race from GOFLAGS: the stand-in is a fixture, not the code under test, and
// is built once whatever the test's flags.
func withoutRace(goflags string) string {
	var keep []string
	for _, f := range strings.Fields(goflags) {
		if f != "-race" && f != "--race" && f != "-race=true" {
			keep = append(keep, f)
		}
	}
	return strings.Join(keep, " ")
}

// removeOrphanBuilds removes the build directories of test processes that have ended.
func removeOrphanBuilds() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), buildDirPrefix+"*"))
	for _, dir := range dirs {
		pid, _, ok := strings.Cut(strings.TrimPrefix(filepath.Base(dir), buildDirPrefix), "-")
		n, err := strconv.Atoi(pid)
		if !ok || err != nil || n <= 0 {
			continue
		}
		if errors.Is(syscall.Kill(n, 0), syscall.ESRCH) {
			_ = os.RemoveAll(dir)
		}
	}
}

// Build builds the stand-in once per test process (without -race, whatever the test's flags) and
// returns its path. It is safe for parallel tests.
func Build(tb testing.TB) string {
	tb.Helper()
	bin, err := builds()
	if err != nil {
		tb.Fatal(err)
	}
	return bin
}

// Eventually calls cond until it returns nil, failing the test with cond's last error when
// timeout has passed. It polls; it never waits for time itself to pass.
func Eventually(tb testing.TB, timeout time.Duration, cond func() error) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("condition not met within %v: %v", timeout, err)
		}
		<-tick.C
	}
}

// Admin is a client of an Envoy admin (the stand-in's or a real one) at a host:port.
type Admin struct {
	base   string
	client *http.Client
}

// NewAdmin returns a client of the admin at addr (host:port).
func NewAdmin(addr string) *Admin {
	return &Admin{base: "http://" + addr, client: &http.Client{Timeout: 10 * time.Second}}
}

// Do sends a request to the admin's path (with its query) and returns the status and the body.
func (a *Admin) Do(ctx context.Context, method, path string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, method, a.base+path, nil)
	if err != nil {
		return 0, "", fmt.Errorf("admin %s %s: %w", method, path, err)
	}
	resp, err := a.client.Do(req)
	if err != nil {
		return 0, "", fmt.Errorf("admin %s %s: %w", method, path, err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, "", fmt.Errorf("admin %s %s: %w", method, path, err)
	}
	return resp.StatusCode, string(body), nil
}

// Post asks a mutating admin endpoint, such as /drain_listeners?graceful or /quitquitquit.
func (a *Admin) Post(ctx context.Context, path string) (int, string, error) {
	return a.Do(ctx, http.MethodPost, path)
}

func (a *Admin) get(ctx context.Context, path string) (string, error) {
	code, body, err := a.Do(ctx, http.MethodGet, path)
	if err != nil {
		return "", err
	}
	if code != http.StatusOK {
		return "", fmt.Errorf("admin GET %s: %d %s", path, code, strings.TrimSpace(body))
	}
	return body, nil
}

// Ready is the admin's /ready: the server state's name ("LIVE", "INITIALIZING", ...) and
// whether it is LIVE (200).
func (a *Admin) Ready(ctx context.Context) (string, bool, error) {
	code, body, err := a.Do(ctx, http.MethodGet, "/ready")
	if err != nil {
		return "", false, err
	}
	return strings.TrimSpace(body), code == http.StatusOK, nil
}

// ServerInfo is the admin's /server_info.
func (a *Admin) ServerInfo(ctx context.Context) (*adminv3.ServerInfo, error) {
	body, err := a.get(ctx, "/server_info")
	if err != nil {
		return nil, err
	}
	info := &adminv3.ServerInfo{}
	if err := protojson.Unmarshal([]byte(body), info); err != nil {
		return nil, fmt.Errorf("admin /server_info: %w", err)
	}
	return info, nil
}

// Listeners is the admin's /listeners?format=json: the listeners bound and their addresses.
func (a *Admin) Listeners(ctx context.Context) (*adminv3.Listeners, error) {
	body, err := a.get(ctx, "/listeners?format=json")
	if err != nil {
		return nil, err
	}
	ls := &adminv3.Listeners{}
	if err := protojson.Unmarshal([]byte(body), ls); err != nil {
		return nil, fmt.Errorf("admin /listeners: %w", err)
	}
	return ls, nil
}

// ConfigDump is the admin's /config_dump (with include_eds).
func (a *Admin) ConfigDump(ctx context.Context) (*adminv3.ConfigDump, error) {
	body, err := a.get(ctx, "/config_dump?include_eds")
	if err != nil {
		return nil, err
	}
	dump := &adminv3.ConfigDump{}
	if err := protojson.Unmarshal([]byte(body), dump); err != nil {
		return nil, fmt.Errorf("admin /config_dump: %w", err)
	}
	return dump, nil
}

// Stats is the admin's /stats (text), as a map from stat name to value.
func (a *Admin) Stats(ctx context.Context) (map[string]int64, error) {
	body, err := a.get(ctx, "/stats")
	if err != nil {
		return nil, err
	}
	out := map[string]int64{}
	for _, line := range strings.Split(strings.TrimSpace(body), "\n") {
		name, value, ok := strings.Cut(line, ": ")
		if !ok {
			continue // histograms and other lines that are not "name: integer"
		}
		var v int64
		if _, err := fmt.Sscan(value, &v); err != nil {
			continue
		}
		out[name] = v
	}
	return out, nil
}

// Prometheus is the admin's /stats/prometheus, as text.
func (a *Admin) Prometheus(ctx context.Context) (string, error) {
	return a.get(ctx, "/stats/prometheus")
}

// Process is a stand-in started by Start, stopped when the test ends.
type Process struct {
	Cmd *exec.Cmd
	// Admin is its admin, at the address it wrote to --admin-address-path.
	Admin *Admin

	stdout *syncBuffer
	stderr *syncBuffer
	done   chan struct{}
	err    error
}

// Start runs the stand-in with args (Envoy's command line, -c included) and waits until its
// admin is up. Its stderr is kept (Stderr). It is killed, if still running, when the test ends.
func Start(tb testing.TB, args ...string) *Process {
	tb.Helper()
	p := start(tb, args...)
	addrPath := p.Cmd.Args[len(p.Cmd.Args)-1]
	Eventually(tb, 30*time.Second, func() error {
		select {
		case <-p.done:
			tb.Fatalf("envoy stand-in exited before its admin was up: %v\n%s", p.err, p.Stderr())
		default:
		}
		b, err := os.ReadFile(addrPath)
		if err != nil {
			return fmt.Errorf("admin address not written yet: %w", err)
		}
		p.Admin = NewAdmin(string(b))
		return nil
	})
	return p
}

// Run runs the stand-in with args until it exits (or timeout passes, which fails the test) and
// returns its exit code and what it printed, stdout then stderr: for a command line or bootstrap
// that must be refused, or for --mode validate, which checks a bootstrap as Envoy does and exits.
func Run(tb testing.TB, timeout time.Duration, args ...string) (int, string) {
	tb.Helper()
	p := start(tb, args...)
	code := p.Wait(tb, timeout)
	return code, p.Stdout() + p.Stderr()
}

func start(tb testing.TB, args ...string) *Process {
	tb.Helper()
	bin := Build(tb)
	args = append(args, "--admin-address-path", filepath.Join(tb.TempDir(), "admin-address"))
	cmd := exec.Command(bin, args...) //nolint:gosec // the stand-in just built, with the test's arguments
	p := &Process{Cmd: cmd, stdout: &syncBuffer{}, stderr: &syncBuffer{}, done: make(chan struct{})}
	p.Cmd.Stdout, p.Cmd.Stderr = p.stdout, p.stderr
	if err := p.Cmd.Start(); err != nil {
		tb.Fatalf("start envoy stand-in: %v", err)
	}
	go func() {
		p.err = p.Cmd.Wait()
		close(p.done)
	}()
	tb.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.Cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

// Signal sends sig to the stand-in.
func (p *Process) Signal(tb testing.TB, sig syscall.Signal) {
	tb.Helper()
	if err := p.Cmd.Process.Signal(sig); err != nil {
		tb.Fatalf("signal %v: %v", sig, err)
	}
}

// Wait waits up to timeout for the stand-in to exit and returns its exit code.
func (p *Process) Wait(tb testing.TB, timeout time.Duration) int {
	tb.Helper()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-p.done:
	case <-t.C:
		tb.Fatalf("envoy stand-in still running after %v\n%s", timeout, p.Stderr())
	}
	var exit *exec.ExitError
	if errors.As(p.err, &exit) {
		return exit.ExitCode()
	}
	if p.err != nil {
		tb.Fatalf("envoy stand-in: %v", p.err)
	}
	return 0
}

// Stderr is what the stand-in has logged so far.
func (p *Process) Stderr() string { return p.stderr.String() }

// Stdout is what the stand-in has printed so far (--mode validate's verdict).
func (p *Process) Stdout() string { return p.stdout.String() }

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
