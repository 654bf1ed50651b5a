package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
)

// Load and scale (issue 14): many agents on one CA, many streams on one agent.

// startLogged starts bin with args and JSON logs at info level, and returns once it has logged
// msg, with that record. Records at warning and above are copied to the benchmark's stderr; the
// process is killed when the benchmark ends.
func startLogged(b *testing.B, bin, msg string, args ...string) (*exec.Cmd, map[string]any) {
	b.Helper()
	cmd := exec.Command(bin, append(args, "--log-level", "info", "--log-format", "json")...)
	r, w, err := os.Pipe()
	if err != nil {
		b.Fatal(err)
	}
	cmd.Stderr = w
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	_ = w.Close()
	found := make(chan map[string]any, 1)
	drained := make(chan struct{})
	go func() {
		defer close(drained)
		defer func() { _ = r.Close() }()
		sc := bufio.NewScanner(r)
		sc.Buffer(nil, 1<<20)
		seen := false
		for sc.Scan() {
			var rec map[string]any
			if json.Unmarshal(sc.Bytes(), &rec) != nil {
				continue
			}
			if rec["msg"] == msg && !seen {
				found <- rec // buffered: never blocks
				seen = true
			}
			if lvl, _ := rec["level"].(string); lvl == "WARN" || lvl == "ERROR" {
				_, _ = fmt.Fprintln(os.Stderr, sc.Text())
			}
		}
	}()
	b.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		<-drained
	})
	select {
	case rec := <-found:
		return cmd, rec
	case <-drained:
		select {
		case rec := <-found: // logged, then ended at once
			return cmd, rec
		default:
		}
		b.Fatalf("%s %s ended before logging %q", bin, strings.Join(args, " "), msg)
	case <-time.After(30 * time.Second):
		b.Fatalf("%s did not log %q within 30 s", bin, msg)
	}
	return nil, nil
}

// caProcess is `meshid ca` run as a process on loopback.
type caProcess struct {
	cmd      *exec.Cmd
	addr     string
	monitor  string // its /metrics
	stateDir string
	minter   *token.Minter
}

// startCAProcess starts `meshid ca` with args after its state dir and addresses.
func startCAProcess(b *testing.B, args ...string) *caProcess {
	b.Helper()
	state := b.TempDir()
	cmd, rec := startLogged(b, agentBinary(b), "CA started", append([]string{"ca", "--state-dir", state,
		"--grpc-addr", "127.0.0.1:0", "--monitoring-addr", "127.0.0.1:0"}, args...)...)
	addr, _ := rec["address"].(string)
	monitor, _ := rec["monitoring_address"].(string)
	minter, err := token.LoadMinter(ca.TokenKeyPath(state))
	if err != nil {
		b.Fatal(err)
	}
	return &caProcess{cmd: cmd, addr: addr, monitor: monitor, stateDir: state, minter: minter}
}

func (ca *caProcess) rssMB(b *testing.B) float64 { return rssOf(b, ca.cmd.Process.Pid) / 1024 }

// heapMB is the CA's Go heap in use (go_memstats_heap_inuse_bytes): what of its resident memory
// the heap's live and not yet collected objects hold.
func (ca *caProcess) heapMB(b *testing.B) float64 {
	b.Helper()
	return scrape(b, ca.monitor, "go_memstats_heap_inuse_bytes") / (1 << 20)
}

// simAgent is one simulated agent: a CA client of its own (its own connection, the CA verified
// with its root), a token for its own service account, and a P-256 key and CSR for its identity.
type simAgent struct {
	client *caclient.Client
	csrs   [][]byte // one per round: every renewal is a new key
}

// retryCounter counts the CA client's "retrying" warnings: a retried failure is not an error the
// workload sees, but it is a sign of overload.
type retryCounter struct{ n atomic.Int64 }

func (c *retryCounter) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }
func (c *retryCounter) Handle(context.Context, slog.Record) error {
	c.n.Add(1)
	return nil
}
func (c *retryCounter) WithAttrs([]slog.Attr) slog.Handler { return c }
func (c *retryCounter) WithGroup(string) slog.Handler      { return c }

func newSimAgent(b *testing.B, ca *caProcess, i, rounds int, log *slog.Logger) *simAgent {
	b.Helper()
	id := pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: fmt.Sprintf("load-%d", i%10), ServiceAccount: fmt.Sprintf("agent-%d", i)}
	tok, err := ca.minter.Mint(token.MintParams{Issuer: token.DefaultIssuer, Audiences: []string{token.DefaultAudience},
		Namespace: id.Namespace, ServiceAccount: id.ServiceAccount, TTL: time.Hour, Now: time.Now()})
	if err != nil {
		b.Fatal(err)
	}
	client, err := caclient.New(caclient.Config{
		Address:      ca.addr,
		RootCertFile: filepath.Join(ca.stateDir, "root-cert.pem"),
		Token:        func(context.Context) (string, error) { return tok, nil },
		Logger:       log,
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = client.Close() })
	a := &simAgent{client: client}
	for range rounds {
		key, err := pki.GenerateKey(pki.ECDSA, 0)
		if err != nil {
			b.Fatal(err)
		}
		csr, err := pki.NewCSR(key, id)
		if err != nil {
			b.Fatal(err)
		}
		a.csrs = append(a.csrs, csr)
	}
	return a
}

// renewAll has every agent renew at once (released together) and returns the latency of each
// and the number that failed.
func renewAll(ctx context.Context, agents []*simAgent, round int) (latencies []time.Duration, errs int, firstErr error) {
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		release = make(chan struct{})
		lats    = make([]time.Duration, len(agents))
	)
	for i, a := range agents {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-release
			start := time.Now()
			_, err := a.client.Sign(ctx, a.csrs[round], time.Hour)
			lats[i] = time.Since(start)
			if err != nil {
				mu.Lock()
				errs++
				if firstErr == nil {
					firstErr = err
				}
				mu.Unlock()
			}
		}()
	}
	close(release)
	wg.Wait()
	return lats, errs, firstErr
}

// percentile of sorted durations, in milliseconds (nearest rank).
func percentile(sorted []time.Duration, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p*float64(len(sorted))+0.5) - 1
	i = min(max(i, 0), len(sorted)-1)
	return float64(sorted[i].Microseconds()) / 1000
}

// BenchmarkThousandAgents runs one `meshid ca` process and 1,000 simulated agents, each a real
// CA client with its own connection (TLS verified with the CA's root), its own token for its own
// service account and its own P-256 key, all renewing at once: a cold round (every connection
// dialed and its TLS handshake made under the load) and a warm one on the same connections.
// It reports each round's p50, p99 and max latency of Sign, the errors (which fail the benchmark)
// and the CA client's retries, and the CA's resident memory before and after. The baseline, in the
// same run and against the same CA, is one agent renewing alone (p50 of 100 warm renewals).
//
// The benchmark process holds the 1,000 connections (the CA too): Go raises the soft limit of
// open files to the hard one at start, and the benchmark fails at once if that is too low.
func BenchmarkThousandAgents(b *testing.B) {
	const n, rounds = 1000, 2
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		b.Fatal(err)
	}
	if lim.Cur < n+100 {
		b.Fatalf("RLIMIT_NOFILE is %d: %d agents' connections need more (ulimit -Hn)", lim.Cur, n)
	}
	ca := startCAProcess(b)
	retries := &retryCounter{}
	log := slog.New(retries)

	// The baseline: one agent alone, warm.
	alone := newSimAgent(b, ca, n, 1, log)
	if _, err := alone.client.Sign(b.Context(), alone.csrs[0], time.Hour); err != nil {
		b.Fatal(err)
	}
	var lats []time.Duration
	for range 100 {
		start := time.Now()
		if _, err := alone.client.Sign(b.Context(), alone.csrs[0], time.Hour); err != nil {
			b.Fatal(err)
		}
		lats = append(lats, time.Since(start))
	}
	slices.Sort(lats)
	aloneP50 := percentile(lats, 0.5)
	_ = alone.client.Close()

	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		agents := make([]*simAgent, n)
		for i := range agents {
			agents[i] = newSimAgent(b, ca, i, rounds, log)
		}
		rssBefore := ca.rssMB(b)
		retries.n.Store(0)
		b.StartTimer()
		for round, name := range []string{"cold", "warm"} {
			lats, errs, err := renewAll(b.Context(), agents, round)
			if errs > 0 {
				b.Fatalf("%s round: %d of %d renewals failed; the first: %v", name, errs, n, err)
			}
			slices.Sort(lats)
			b.ReportMetric(percentile(lats, 0.5), name+"-p50-ms")
			b.ReportMetric(percentile(lats, 0.99), name+"-p99-ms")
			b.ReportMetric(percentile(lats, 1), name+"-max-ms")
			b.ReportMetric(float64(errs), name+"-errors")
		}
		b.StopTimer()
		b.ReportMetric(float64(retries.n.Load()), "retries")
		b.ReportMetric(rssBefore, "ca-rss-before-MB")
		rssAfter := ca.rssMB(b)
		b.ReportMetric(rssAfter, "ca-rss-after-MB")
		b.ReportMetric((rssAfter-rssBefore)*1024/n, "ca-rss-kB/agent")
		b.ReportMetric(ca.heapMB(b), "ca-heap-after-MB")
		b.ReportMetric(aloneP50, "baseline-alone-p50-ms")
		for _, a := range agents {
			_ = a.client.Close()
		}
		b.StartTimer()
	}
}

// agentCounts is what the churn checks for leaks: the agent's goroutines (go_goroutines on its
// /metrics) and open file descriptors (/proc/PID/fd).
type agentCounts struct{ goroutines, fds int }

func (c agentCounts) within(base agentCounts, tolerance int) bool {
	return c.goroutines <= base.goroutines+tolerance && c.fds <= base.fds+tolerance
}

func countsOf(b *testing.B, pid int, statusAddr string) agentCounts {
	b.Helper()
	goroutines := scrape(b, statusAddr, "go_goroutines")
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		b.Fatal(err)
	}
	return agentCounts{goroutines: int(goroutines), fds: len(fds)}
}

// scrape reads the value of an unlabelled series from the /metrics at addr.
func scrape(b *testing.B, addr, series string) float64 {
	b.Helper()
	// A connection of its own each time, closed after the scrape, so that no keep-alive
	// connection to the process outlives it.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
	resp, err := client.Get("http://" + addr + "/metrics")
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			v, err := strconv.ParseFloat(rest, 64)
			if err != nil {
				b.Fatal(err)
			}
			return v
		}
	}
	b.Fatalf("no %s on %s/metrics", series, addr)
	return 0
}

// churnOnce is one connect/disconnect: a new connection, a StreamSecrets for "default", the
// first response, and the connection closed.
func churnOnce(ctx context.Context, socket string) error {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	s, err := openStream(ctx, conn, "churn", "default")
	if err != nil {
		return err
	}
	chain, err := s.next("default")
	if err == nil && chain == "" {
		err = errors.New("no default secret in the first response")
	}
	return err
}

// churnTolerance is how many goroutines and file descriptors more than before the churn the
// agent may hold once it settles: none. Right after the churn a reading is often one or two
// above (the previous scrape's connection, closed, still being torn down); that is why settle
// waits for the counts rather than reading them once.
const churnTolerance = 0

// BenchmarkStreamChurn opens and closes 10,000 SDS streams on one agent (serving mounted
// credential files, so no CA is involved), each on a connection of its own, 100 at a time, and
// checks that the agent's goroutines and file descriptors return to what they were before (a
// leak fails the benchmark). It reports both counts before and after, and connects per second.
// The counts before are taken after one connect/disconnect, so that what the first stream
// creates for good (the subscription's machinery, grpc's) is in the baseline.
func BenchmarkStreamChurn(b *testing.B) {
	const cycles, concurrency = 10000, 100
	creds, writePair := mountedCredentials(b)
	writePair()
	root := testutil.ShortTempDir(b)
	socketDir := filepath.Join(root, "uds")
	cmd, rec := startLogged(b, agentBinary(b, "--credentials-dir"), "agent started", "agent", "--root-dir", root,
		"--workload-socket-dir", socketDir, "--status-addr", "127.0.0.1:0", "--debug-addr", "", "--credentials-dir", creds)
	statusAddr, _ := rec["status_address"].(string)
	socket := filepath.Join(socketDir, sds.SocketName)
	ctx := b.Context()
	if err := churnOnce(ctx, socket); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer() // the build and the start are not the churn
	for range b.N {
		before := settle(b, cmd.Process.Pid, statusAddr, nil)
		start := time.Now()
		var (
			next   atomic.Int64
			failed atomic.Int64
			first  error
			once   sync.Once
			wg     sync.WaitGroup
		)
		for range concurrency {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for next.Add(1) <= cycles {
					if err := churnOnce(ctx, socket); err != nil {
						failed.Add(1)
						once.Do(func() { first = err })
					}
				}
			}()
		}
		wg.Wait()
		took := time.Since(start)
		if n := failed.Load(); n > 0 {
			b.Fatalf("%d of %d connects failed; the first: %v", n, cycles, first)
		}
		settleStart := time.Now()
		after := settle(b, cmd.Process.Pid, statusAddr, &before)
		b.ReportMetric(float64(time.Since(settleStart).Milliseconds()), "settle-ms")
		b.ReportMetric(float64(cycles)/took.Seconds(), "connects/s")
		b.ReportMetric(float64(before.goroutines), "goroutines-before")
		b.ReportMetric(float64(after.goroutines), "goroutines-after")
		b.ReportMetric(float64(before.fds), "fds-before")
		b.ReportMetric(float64(after.fds), "fds-after")
	}
}

// settle waits until the agent's counts are within churnTolerance of base (nil: until two
// readings in a row agree), and returns them. It fails after 30 s of real time: a leak.
func settle(b *testing.B, pid int, statusAddr string, base *agentCounts) agentCounts {
	b.Helper()
	deadline := time.Now().Add(30 * time.Second)
	last := countsOf(b, pid, statusAddr)
	for {
		c := countsOf(b, pid, statusAddr)
		if (base == nil && c == last) || (base != nil && c.within(*base, churnTolerance)) {
			return c
		}
		if time.Now().After(deadline) {
			if base == nil {
				b.Fatalf("the agent's counts do not settle: %+v then %+v", last, c)
			}
			b.Fatalf("leak: after the churn the agent holds %d goroutines and %d file descriptors, before it %d and %d (tolerance %d)",
				c.goroutines, c.fds, base.goroutines, base.fds, churnTolerance)
		}
		last = c
	}
}
