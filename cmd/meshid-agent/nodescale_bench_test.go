package main

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// Issue 28's scale: one node agent (`meshid agent --workload-attestation`) serving 500
// identities, 20 SDS streams each, against 500 sidecar agents (`meshid-agent`) serving the same
// streams, each side with a CA process of its own.

const (
	nodeScaleIdentities = 500
	nodeScaleStreams    = 20
	// nodeScaleTTL is the workload certificates' lifetime: with the default grace ratio (0.5)
	// and no jitter each identity renews once, TTL/2 after it got its first certificate, long
	// after all are served.
	nodeScaleTTL = time.Minute
	// The node agent's own account, which the CA trusts as a node account.
	nodeScaleNamespace, nodeScaleServiceAccount = "meshid-system", "node-agent"
	// sidecarBudgetKB is what one sidecar agent and its streams may take of the machine's
	// available memory (about 17 MB RSS idle), with room: the baseline runs as many at once as
	// MemAvailable allows, less 2 GB.
	sidecarBudgetKB = 40 << 10
	// sidecarInotify is the inotify instances a sidecar agent holds (its secret manager's
	// watcher); inotifyMargin is left to what else runs as this user.
	sidecarInotify, inotifyMargin = 1, 20
)

// nodeClientSource is a workload of the node agent: one connection to the socket of
// NODECLIENT_SOCKET, which it opens once the benchmark writes a line to its stdin, and
// NODECLIENT_STREAMS streams on it for "default", each acknowledging what it gets. It prints
// "ready" once started, then a line "chain STREAM UNIXNANO HASH SPIFFEID" whenever a stream
// receives a certificate chain other than its last (the time taken before the leaf is parsed),
// and "error STREAM MESSAGE" when a stream ends.
const nodeClientSource = `package main

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/sds/sdsclient"
)

var (
	mu  sync.Mutex
	ids = map[string]string{}
)

func report(format string, args ...any) {
	mu.Lock()
	defer mu.Unlock()
	fmt.Printf(format+"\n", args...)
}

// identity is the leaf's URI SAN, parsed once per chain.
func identity(hash string, chain []byte) string {
	mu.Lock()
	defer mu.Unlock()
	if id, ok := ids[hash]; ok {
		return id
	}
	id := "unparsable"
	if certs, err := pki.ParseCertificates(chain); err == nil && len(certs) > 0 && len(certs[0].URIs) == 1 {
		id = certs[0].URIs[0].String()
	}
	ids[hash] = id
	return id
}

func follow(client *sdsclient.Client, i int) error {
	s, err := client.StreamSecrets(context.Background())
	if err != nil {
		return err
	}
	if err := s.Subscribe("default"); err != nil {
		return err
	}
	last := ""
	for {
		resp, err := s.Recv()
		if err != nil {
			return err
		}
		if err := s.Ack(resp, "default"); err != nil {
			return err
		}
		chain := resp.Secrets["default"].GetTlsCertificate().GetCertificateChain().GetInlineBytes()
		if chain == nil {
			continue
		}
		at := time.Now().UnixNano()
		sum := sha256.Sum256(chain)
		if hash := hex.EncodeToString(sum[:8]); hash != last {
			last = hash
			report("chain %d %d %s %s", i, at, hash, identity(hash, chain))
		}
	}
}

func main() {
	socket := os.Getenv("NODECLIENT_SOCKET")
	n, err := strconv.Atoi(os.Getenv("NODECLIENT_STREAMS"))
	if socket == "" || err != nil {
		fmt.Fprintln(os.Stderr, "NODECLIENT_SOCKET and NODECLIENT_STREAMS are required")
		os.Exit(2)
	}
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	report("ready")
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		os.Exit(0) // the benchmark went before releasing us
	}
	client := sdsclient.New(conn, sdsclient.WithNode(&core.Node{Id: "nodeclient"}))
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			report("error %d %v", i, follow(client, i))
		}()
	}
	wg.Wait()
	os.Exit(1)
}
`

// chainSeen is a certificate chain as one stream first received it.
type chainSeen struct {
	at       time.Time
	hash, id string
}

// chainTracker gathers the chains each stream of each workload received.
type chainTracker struct {
	want []string // the SPIFFE ID each workload must get

	mu       sync.Mutex
	chains   [][][]chainSeen   // [workload][stream]: the distinct chains in order
	atLeast  [3]int            // streams that have received at least 1 and 2 chains
	ids      map[string]string // leafID's
	err      error
	progress chan struct{} // signalled on every change
}

func newChainTracker(want []string, streams int) *chainTracker {
	t := &chainTracker{want: want, chains: make([][][]chainSeen, len(want)), ids: map[string]string{}, progress: make(chan struct{}, 1)}
	for i := range t.chains {
		t.chains[i] = make([][]chainSeen, streams)
	}
	return t
}

func (t *chainTracker) signal() {
	select {
	case t.progress <- struct{}{}:
	default:
	}
}

// add records that stream of workload received the chain of hash for id at at.
func (t *chainTracker) add(workload, stream int, c chainSeen) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if c.id != t.want[workload] && t.err == nil {
		t.err = fmt.Errorf("workload %d got a certificate for %s, want %s", workload, c.id, t.want[workload])
	}
	seen := t.chains[workload][stream]
	if n := len(seen); n > 0 && seen[n-1].hash == c.hash {
		return
	}
	t.chains[workload][stream] = append(seen, c)
	if n := len(t.chains[workload][stream]); n < len(t.atLeast) {
		t.atLeast[n]++
	}
	t.signal()
}

// leafID is the URI SAN of the chain's leaf, parsed once per chain: the streams compare chains,
// and 10,000 of them parsing each would be most of the benchmark process's work.
func (t *chainTracker) leafID(hash, chain string) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	if id, ok := t.ids[hash]; ok {
		return id
	}
	id := "unparsable"
	if certs, err := pki.ParseCertificates([]byte(chain)); err == nil && len(certs) > 0 && len(certs[0].URIs) == 1 {
		id = certs[0].URIs[0].String()
	}
	t.ids[hash] = id
	return id
}

func (t *chainTracker) fail(err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.err == nil {
		t.err = err
	}
	t.signal()
}

// waitFor waits until every stream has received gen chains, and fails the benchmark on a
// stream's error or after timeout.
func (t *chainTracker) waitFor(b *testing.B, gen int, timeout time.Duration) {
	b.Helper()
	total := len(t.chains) * len(t.chains[0])
	deadline := time.After(timeout)
	for {
		t.mu.Lock()
		got, err := t.atLeast[gen], t.err
		t.mu.Unlock()
		if err != nil {
			b.Fatal(err)
		}
		if got == total {
			return
		}
		select {
		case <-t.progress:
		case <-deadline:
			b.Fatalf("after %s, %d of %d streams have received %d certificates", timeout, got, total, gen)
		}
	}
}

// served is what the tracker saw, once every stream has received its first chain and, when
// rotated, its second.
type served struct {
	// Per workload, since the start: when its first stream had its first chain, and when its
	// last stream had it.
	first, all []time.Duration
	// Per workload, how long its second chain took to reach all its streams: from the first
	// of them to get it to the last.
	spread  []time.Duration
	last    time.Time     // when the last stream had its first chain
	window  time.Duration // from the first second chain anywhere to the last
	rotated int           // streams that received a second chain, every one the same as their workload's others
}

// servedSince checks that the streams of each workload received the same first chain and, when
// rotated, the same second one, and returns what they saw, counted from start.
func (t *chainTracker) servedSince(b *testing.B, start time.Time, rotated bool) served {
	b.Helper()
	t.mu.Lock()
	defer t.mu.Unlock()
	var (
		r                 served
		rotFirst, rotLast time.Time
	)
	for w, streams := range t.chains {
		var first, second []time.Time
		for s, seen := range streams {
			if seen[0].hash != streams[0][0].hash {
				b.Fatalf("workload %d: stream %d got chain %s, stream 0 %s", w, s, seen[0].hash, streams[0][0].hash)
			}
			first = append(first, seen[0].at)
			if rotated {
				if seen[1].hash != streams[0][1].hash {
					b.Fatalf("workload %d: stream %d got second chain %s, stream 0 %s", w, s, seen[1].hash, streams[0][1].hash)
				}
				second = append(second, seen[1].at)
				r.rotated++
			}
		}
		f0, f1 := slices.MinFunc(first, time.Time.Compare), slices.MaxFunc(first, time.Time.Compare)
		r.first, r.all = append(r.first, f0.Sub(start)), append(r.all, f1.Sub(start))
		if f1.After(r.last) {
			r.last = f1
		}
		if !rotated {
			continue
		}
		s0, s1 := slices.MinFunc(second, time.Time.Compare), slices.MaxFunc(second, time.Time.Compare)
		r.spread = append(r.spread, s1.Sub(s0))
		if rotFirst.IsZero() || s0.Before(rotFirst) {
			rotFirst = s0
		}
		if s1.After(rotLast) {
			rotLast = s1
		}
	}
	r.window = rotLast.Sub(rotFirst)
	return r
}

// merge adds o's workloads to r (the sidecars' batches).
func (r *served) merge(o served, start time.Time) {
	r.first, r.all, r.spread = append(r.first, o.first...), append(r.all, o.all...), append(r.spread, o.spread...)
	r.window = max(r.window, o.window)
	r.rotated += o.rotated
	r.last = r.last.Add(o.last.Sub(start)) // the batches' serving times, added up
}

// report reports what r saw; the time to serve all is r.last since start.
func (r served) report(report metricFunc, start time.Time) {
	report(float64(r.last.Sub(start).Milliseconds()), "serve-all-ms")
	reportDurations(report, r.first, "identity-first-stream")
	reportDurations(report, r.all, "identity-all-streams")
	if len(r.spread) > 0 {
		reportDurations(report, r.spread, "rotation-spread")
		report(float64(r.window.Milliseconds()), "rotation-window-ms")
		report(float64(r.rotated), "streams-rotated")
	}
}

// metricFunc reports a metric of a benchmark, its unit prefixed with the part measured.
type metricFunc func(v float64, unit string)

func prefixed(b *testing.B, prefix string) metricFunc {
	return func(v float64, unit string) { b.ReportMetric(v, prefix+unit) }
}

// reportDurations reports p50, p99 and max of ds under name.
func reportDurations(report metricFunc, ds []time.Duration, name string) {
	slices.Sort(ds)
	report(percentile(ds, 0.5), name+"-p50-ms")
	report(percentile(ds, 0.99), name+"-p99-ms")
	report(percentile(ds, 1), name+"-max-ms")
}

// cpuSeconds is the CPU time the process's threads have run, from each thread's
// /proc/PID/task/TID/schedstat (nanoseconds; /proc/PID/stat counts 10 ms ticks, too coarse for
// a workload that runs a few milliseconds). A thread that has ended is not counted: Go's rarely
// do. A process gone reads as 0.
func cpuSeconds(b *testing.B, pid int) float64 {
	b.Helper()
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return 0
	}
	var ns float64
	for _, task := range tasks {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/schedstat", pid, task.Name()))
		if err != nil {
			continue // the thread ended
		}
		fields := strings.Fields(string(data))
		if len(fields) != 3 {
			b.Fatalf("/proc/%d/task/%s/schedstat: %q", pid, task.Name(), data)
		}
		v, err := strconv.ParseFloat(fields[0], 64)
		if err != nil {
			b.Fatal(err)
		}
		ns += v
	}
	return ns / 1e9
}

// memAvailableKB reads MemAvailable from /proc/meminfo.
func memAvailableKB(b *testing.B) float64 {
	b.Helper()
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		b.Fatal(err)
	}
	for line := range strings.Lines(string(data)) {
		if rest, ok := strings.CutPrefix(line, "MemAvailable:"); ok {
			kb, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			if err != nil {
				b.Fatal(err)
			}
			return kb
		}
	}
	b.Fatal("no MemAvailable in /proc/meminfo")
	return 0
}

// inotifyInstances is how many inotify instances the process holds (its descriptors that are
// one).
func inotifyInstances(pid int) int {
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return 0 // gone, or not ours to read
	}
	n := 0
	for _, fd := range fds {
		if target, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name())); err == nil && target == "anon_inode:inotify" {
			n++
		}
	}
	return n
}

// inotifyFree is how many more inotify instances this user may make: fs.inotify.max_user_instances
// less those its processes hold. The node agent makes one per identity and each sidecar one.
func inotifyFree(b *testing.B) (limit, free int) {
	b.Helper()
	data, err := os.ReadFile("/proc/sys/fs/inotify/max_user_instances")
	if err != nil {
		b.Fatal(err)
	}
	limit, err = strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		b.Fatal(err)
	}
	procs, err := os.ReadDir("/proc")
	if err != nil {
		b.Fatal(err)
	}
	used, uid := 0, uint32(os.Getuid())
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		if info, err := p.Info(); err == nil {
			if st, ok := info.Sys().(*syscall.Stat_t); ok && st.Uid == uid {
				used += inotifyInstances(pid)
			}
		}
	}
	return limit, limit - used
}

// caCost is the CA's CPU time and memory at one moment.
type caCost struct{ cpu, rssMB, heapMB float64 }

func (ca *caProcess) cost(b *testing.B) caCost {
	b.Helper()
	return caCost{cpu: cpuSeconds(b, ca.cmd.Process.Pid), rssMB: ca.rssMB(b), heapMB: ca.memory(b).heapMB}
}

// reportCA reports the CA's CPU time for the signings (start → all served) and the renewals
// (all served → all rotated), and its memory after the renewals.
func reportCA(report metricFunc, start, served, rotated caCost) {
	report((served.cpu-start.cpu)*1000, "ca-cpu-sign-ms")
	report((rotated.cpu-served.cpu)*1000, "ca-cpu-renew-ms")
	report(start.rssMB, "ca-rss-start-MB")
	report(served.rssMB, "ca-rss-served-MB")
	report(rotated.rssMB, "ca-rss-rotated-MB")
	report(rotated.heapMB, "ca-heap-rotated-MB")
}

// writeToken mints a token for namespace/serviceAccount with the CA's key into a file.
func writeToken(b *testing.B, ca *caProcess, dir, namespace, serviceAccount string) string {
	b.Helper()
	tok, err := ca.minter.Mint(token.MintParams{Issuer: token.DefaultIssuer, Audiences: []string{token.DefaultAudience},
		Namespace: namespace, ServiceAccount: serviceAccount, TTL: time.Hour, Now: time.Now()})
	if err != nil {
		b.Fatal(err)
	}
	path := filepath.Join(dir, namespace+"."+serviceAccount+".token")
	if err := os.WriteFile(path, []byte(tok), 0o600); err != nil {
		b.Fatal(err)
	}
	return path
}

// workloadID is the identity of workload i, the same on both sides.
func workloadID(i int) pki.SPIFFEID {
	return pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: fmt.Sprintf("tenant-%d", i%10), ServiceAccount: fmt.Sprintf("w-%d", i)}
}

// BenchmarkNodeAgent runs issue 28's scale comparison; see BENCHMARKS.md ("Issue 28: one node
// agent for 500 workloads") for what each figure is.
func BenchmarkNodeAgent(b *testing.B) {
	if runtime.GOOS != "linux" {
		b.Skip("reads /proc: Linux only")
	}
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		b.Fatal(err)
	}
	// The benchmark holds two pipes per workload and one connection per sidecar; the node agent
	// a connection per workload.
	if need := uint64(4*nodeScaleIdentities + 200); lim.Cur < need {
		b.Skipf("RLIMIT_NOFILE is %d: %d workloads need %d (ulimit -Hn)", lim.Cur, nodeScaleIdentities, need)
	}
	want := make([]string, nodeScaleIdentities)
	for i := range want {
		want[i] = workloadID(i).String()
	}
	if _, err := sidecarBatch(b, len(want)); err != nil {
		b.Skip(err)
	}
	// One benchmark, not three: each part takes from seconds to minutes, and as a benchmark of
	// its own the shortest would be run again and again to fill -benchtime. Each part stops what
	// it started before the next begins.
	for range b.N {
		nodeAgentOnce(b, want, nodeScaleStreams, true, prefixed(b, "node-"))
		// The same workloads with one stream each, not rotated: what an identity and its
		// connection cost the node agent, apart from the streams.
		nodeAgentOnce(b, want, 1, false, prefixed(b, "node1-"))
		sidecarsOnce(b, want, prefixed(b, "sidecars-"))
	}
}

// nodeClient is one workload of the node agent, started and waiting to be released.
type nodeClient struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
}

// startNodeClients starts the workloads, workload i as the hard link links[i], and returns once
// each has said it is ready. Their chains go to t; a workload that ends before done is set is a
// failure.
func startNodeClients(b *testing.B, links []string, socket string, streams int, t *chainTracker, done *atomic.Bool) []*nodeClient {
	b.Helper()
	clients := make([]*nodeClient, len(links))
	var ready sync.WaitGroup
	for i, link := range links {
		cmd := exec.Command(link)
		cmd.Env = append(os.Environ(), "NODECLIENT_SOCKET="+socket, "NODECLIENT_STREAMS="+strconv.Itoa(streams))
		cmd.Stderr = os.Stderr
		stdin, err := cmd.StdinPipe()
		if err != nil {
			b.Fatal(err)
		}
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			b.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		})
		clients[i] = &nodeClient{cmd: cmd, stdin: stdin}
		ready.Add(1)
		go func() {
			readyOnce := sync.OnceFunc(ready.Done)
			defer readyOnce()
			sc := bufio.NewScanner(stdout)
			for sc.Scan() {
				f := strings.Fields(sc.Text())
				switch {
				case len(f) == 1 && f[0] == "ready":
					readyOnce()
				case len(f) == 5 && f[0] == "chain":
					stream, err1 := strconv.Atoi(f[1])
					nanos, err2 := strconv.ParseInt(f[2], 10, 64)
					if err1 != nil || err2 != nil || stream < 0 || stream >= streams {
						t.fail(fmt.Errorf("workload %d: bad line %q", i, sc.Text()))
						continue
					}
					t.add(i, stream, chainSeen{at: time.Unix(0, nanos), hash: f[3], id: f[4]})
				default:
					if !done.Load() {
						t.fail(fmt.Errorf("workload %d: %s", i, sc.Text()))
					}
				}
			}
			if !done.Load() {
				t.fail(fmt.Errorf("workload %d ended", i))
			}
		}()
	}
	ready.Wait()
	return clients
}

// nodeAgentOnce: one `meshid agent` in node mode, its rules giving each of 500 hard links of one
// client program its own identity; the clients started, then released at once to open their
// streams.
func nodeAgentOnce(b *testing.B, want []string, streams int, rotate bool, report metricFunc) {
	b.Helper()
	ca := startCAProcess(b, "--trusted-node-accounts", nodeScaleNamespace+"/"+nodeScaleServiceAccount)
	client := overlayBinary(b, "nodeclient", nodeClientSource)
	bin, err := filepath.EvalSymlinks(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	links := make([]string, len(want))
	var rules strings.Builder
	rules.WriteString("rules:\n")
	for i := range links {
		links[i] = filepath.Join(bin, fmt.Sprintf("w-%d", i))
		if err := os.Link(client, links[i]); err != nil {
			b.Fatal(err)
		}
		id := workloadID(i)
		fmt.Fprintf(&rules, "  - {path: %q, namespace: %s, serviceAccount: %s}\n", links[i], id.Namespace, id.ServiceAccount)
	}
	root := testutil.ShortTempDir(b)
	rulesFile := filepath.Join(root, "rules.yaml")
	if err := os.WriteFile(rulesFile, []byte(rules.String()), 0o600); err != nil {
		b.Fatal(err)
	}
	tok := writeToken(b, ca, root, nodeScaleNamespace, nodeScaleServiceAccount)
	socketDir := filepath.Join(root, "uds")
	agent, _ := startLogged(b, agentBinary(b), "agent started", "agent", "--root-dir", root,
		"--workload-socket-dir", socketDir, "--status-addr", "127.0.0.1:0", "--debug-addr", "",
		"--ca-addr", ca.addr, "--ca-root-cert", filepath.Join(ca.stateDir, "root-cert.pem"), "--token-path", tok,
		"--namespace", nodeScaleNamespace, "--service-account", nodeScaleServiceAccount, "--workload-attestation", rulesFile,
		"--secret-ttl", nodeScaleTTL.String(), "--grace-period-ratio-jitter", "0",
		// Every workload's streams and connection, with room.
		"--sds-max-streams", strconv.Itoa(len(want)*(streams+1)+100))
	agentPid := agent.Process.Pid

	t := newChainTracker(want, streams)
	var done atomic.Bool
	clients := startNodeClients(b, links, filepath.Join(socketDir, "socket"), streams, t, &done)
	defer func() { // the cleanups wait for them
		done.Store(true)
		for _, c := range clients {
			_ = c.cmd.Process.Kill()
		}
		_ = agent.Process.Kill()
		_ = ca.cmd.Process.Kill()
	}()
	idle, agentCPUIdle := memoryOf(b, agentPid), cpuSeconds(b, agentPid)
	caStart := ca.cost(b)
	workloadsCPU := 0.0
	for _, c := range clients {
		workloadsCPU -= cpuSeconds(b, c.cmd.Process.Pid)
	}

	release := time.Now()
	for _, c := range clients {
		if _, err := io.WriteString(c.stdin, "go\n"); err != nil {
			b.Fatal(err)
		}
	}
	t.waitFor(b, 1, time.Minute)
	caServed := ca.cost(b)
	mem := memoryOf(b, agentPid)
	agentCPUServed := cpuSeconds(b, agentPid)
	var workloadsPSS float64
	for _, c := range clients {
		workloadsPSS += smapsKB(b, c.cmd.Process.Pid, "Pss")
		workloadsCPU += cpuSeconds(b, c.cmd.Process.Pid)
	}
	report(idle.rss/1024, "agent-rss-idle-MB")
	report(idle.pss/1024, "agent-pss-idle-MB")
	report(mem.rss/1024, "agent-rss-MB")
	report(mem.pss/1024, "agent-pss-MB")
	report(mem.anon/1024, "agent-anon-MB")
	report((agentCPUServed-agentCPUIdle)*1000, "agent-cpu-serve-ms")
	report(float64(inotifyInstances(agentPid)), "agent-inotify")
	report(workloadsPSS/1024, "workloads-pss-sum-MB")
	report(workloadsCPU*1000, "workloads-cpu-serve-sum-ms")
	if !rotate {
		t.servedSince(b, release, false).report(report, release)
		report((caServed.cpu-caStart.cpu)*1000, "ca-cpu-sign-ms")
		return
	}
	t.waitFor(b, 2, nodeScaleTTL)
	caRotated := ca.cost(b)
	t.servedSince(b, release, true).report(report, release)
	report((cpuSeconds(b, agentPid)-agentCPUServed)*1000, "agent-cpu-rotate-ms")
	reportCA(report, caStart, caServed, caRotated)
}

// memory is a process's resident memory, from /proc, in kB.
type memory struct{ rss, pss, anon float64 }

func memoryOf(b *testing.B, pid int) memory {
	b.Helper()
	return memory{rss: rssOf(b, pid), pss: smapsKB(b, pid, "Pss"), anon: smapsKB(b, pid, "Anonymous")}
}

func (m *memory) add(o memory) { m.rss, m.pss, m.anon = m.rss+o.rss, m.pss+o.pss, m.anon+o.anon }

// sidecarsOnce: 500 `meshid-agent` processes, each with its own token for its own identity,
// each with the same 20 streams, opened by the benchmark process on one connection per agent.
// As many run at once as the machine's available memory allows (all of them on the usual
// machine); the memory of one does not depend on its neighbours.
func sidecarsOnce(b *testing.B, want []string, report metricFunc) {
	b.Helper()
	batch, err := sidecarBatch(b, len(want))
	if err != nil {
		b.Fatal(err)
	}
	ca := startCAProcess(b, "--trusted-node-accounts", nodeScaleNamespace+"/"+nodeScaleServiceAccount)
	defer func() { _ = ca.cmd.Process.Kill() }() // the cleanup waits for it
	tokens := b.TempDir()
	var (
		mem                       memory
		cpuServe, cpuRotate       float64
		inotify                   int
		all                       served
		epoch                     = time.Now() // the batches' serving times are added to it
		caStart, caServed, caLast = ca.cost(b), caCost{}, caCost{}
		signCPU, renewCPU         float64
	)
	all.last = epoch
	for from := 0; from < len(want); from += batch {
		ids := want[from:min(from+batch, len(want))]
		before := ca.cost(b)
		start := time.Now()
		agents := make([]*process, len(ids))
		for i := range ids {
			id := workloadID(from + i)
			agents[i] = startAgent(b, "--ca-addr", ca.addr, "--ca-root-cert", filepath.Join(ca.stateDir, "root-cert.pem"),
				"--token-path", writeToken(b, ca, tokens, id.Namespace, id.ServiceAccount),
				"--namespace", id.Namespace, "--service-account", id.ServiceAccount,
				"--secret-ttl", nodeScaleTTL.String(), "--grace-period-ratio-jitter", "0")
		}
		t := newChainTracker(ids, nodeScaleStreams)
		ctx, cancel := context.WithCancel(b.Context())
		var done atomic.Bool
		conns := make([]*grpc.ClientConn, len(agents))
		for i, p := range agents {
			conns[i] = dial(b, p.socket)
			for s := range nodeScaleStreams {
				go followChains(ctx, conns[i], i, s, t, &done)
			}
		}
		t.waitFor(b, 1, time.Minute)
		caAtServed := ca.cost(b)
		cpuAtServed := make([]float64, len(agents))
		for i, p := range agents {
			mem.add(memoryOf(b, p.cmd.Process.Pid))
			cpuAtServed[i] = cpuSeconds(b, p.cmd.Process.Pid)
			cpuServe += cpuAtServed[i]
			inotify = max(inotify, inotifyInstances(p.cmd.Process.Pid))
		}
		t.waitFor(b, 2, nodeScaleTTL)
		rotated := ca.cost(b)
		signCPU += caAtServed.cpu - before.cpu
		renewCPU += rotated.cpu - caAtServed.cpu
		caServed.rssMB, caLast.rssMB = max(caServed.rssMB, caAtServed.rssMB), max(caLast.rssMB, rotated.rssMB)
		caLast.heapMB = max(caLast.heapMB, rotated.heapMB)
		all.merge(t.servedSince(b, start, true), start)
		done.Store(true)
		cancel()
		for i, p := range agents {
			cpuRotate += cpuSeconds(b, p.cmd.Process.Pid) - cpuAtServed[i]
			_ = conns[i].Close()
			p.stop()
		}
	}
	report(float64(batch), "at-once")
	report(float64(inotify), "agent-inotify-max")
	all.report(report, epoch)
	report(mem.rss/1024, "agents-rss-sum-MB")
	report(mem.pss/1024, "agents-pss-sum-MB")
	report(mem.anon/1024, "agents-anon-sum-MB")
	// From exec: a sidecar's start is what it costs to serve its workload.
	report(cpuServe*1000, "agents-cpu-serve-sum-ms")
	report(cpuRotate*1000, "agents-cpu-rotate-sum-ms")
	caServed.cpu, caLast.cpu = caStart.cpu+signCPU, caStart.cpu+signCPU+renewCPU
	reportCA(report, caStart, caServed, caLast)
}

// sidecarBatch is how many sidecars run at once: as many as the machine's available memory, less
// 2 GB, and the inotify instances free allow, at most n; at least 10, else an error.
func sidecarBatch(b *testing.B, n int) (int, error) {
	b.Helper()
	_, free := inotifyFree(b)
	avail := memAvailableKB(b)
	batch := min(n, int((avail-2<<20)/sidecarBudgetKB), (free-inotifyMargin)/sidecarInotify)
	if batch < 10 {
		return 0, fmt.Errorf("%.0f MB available and %d inotify instances free: too little to run the sidecars", avail/1024, free)
	}
	return batch, nil
}

// followChains is one sidecar's stream for "default", recording each chain it receives as
// stream s of workload w until ctx ends.
func followChains(ctx context.Context, conn *grpc.ClientConn, w, s int, t *chainTracker, done *atomic.Bool) {
	st, err := openStream(ctx, conn, fmt.Sprintf("sidecar-%d", w), "default")
	for err == nil {
		var chain string
		if chain, err = st.next("default"); err != nil || chain == "" {
			continue
		}
		at := time.Now()
		sum := sha256.Sum256([]byte(chain))
		hash := hex.EncodeToString(sum[:8])
		t.add(w, s, chainSeen{at: at, hash: hash, id: t.leafID(hash, chain)})
	}
	if !done.Load() {
		t.fail(fmt.Errorf("sidecar %d, stream %d: %w", w, s, err))
	}
}
