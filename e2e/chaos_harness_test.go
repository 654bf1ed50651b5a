package e2e_test

// The fault suite's harness: a CA that can be killed and restarted on the same port, a TCP proxy
// that injects faults between an agent and its CA, an agent on a tmpfs of its own, and the two
// invariant checkers every scenario runs: an SDS client that checks every secret it receives,
// and a reader of OUTPUT_CERTS that checks the files at random moments.

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds/sdsclient"
)

// chaosLong selects the long form of the fault suite (`make chaos`): more iterations, longer
// outages. MESHID_CHAOS=long does the same. The short form runs in `make test`.
var chaosLong = flag.Bool("chaos.long", false, "run the fault suite's long form")

// long says whether the long form runs.
func long() bool { return *chaosLong || os.Getenv("MESHID_CHAOS") == "long" }

// form picks the short or the long form's value.
func form[T any](short, longValue T) T {
	if long() {
		return longValue
	}
	return short
}

// ---- a CA that is killed and restarted ----

// chaosCA is `meshid ca` on a port of its own, fixed at the first start so that a restart
// listens where the agents look for it, with an empty --cacerts-dir and a trust bundle that keeps
// a replaced root for an hour. It logs at debug level: "certificate issued" marks the moment a
// signed certificate is on its way back.
type chaosCA struct {
	*caProcess
	args []string
}

func startChaosCA(t *testing.T) *chaosCA {
	t.Helper()
	dir := t.TempDir()
	ca := &chaosCA{caProcess: &caProcess{
		stateDir: filepath.Join(dir, "state"),
		cacerts:  testutil.NewSecretVolume(t, filepath.Join(dir, "cacerts")),
		addr:     freePort(t),
	}}
	ca.args = []string{"ca",
		"--state-dir", ca.stateDir,
		"--grpc-addr", ca.addr,
		"--monitoring-addr", "127.0.0.1:0",
		"--cacerts-dir", ca.cacerts.Dir,
		"--trust-bundle-overlap", "1h",
		"--log-level", "debug",
	}
	ca.launch(t)
	return ca
}

// freePort is a loopback address whose port was free a moment ago.
func freePort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}

// launch starts the CA on its address. Another process may have taken the port since it was
// chosen (or since the CA was killed): then it tries again until the port is free.
func (ca *chaosCA) launch(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(wait)
	for {
		p := start(t, "meshid ca", "meshid", ca.args...)
		started, _, err := p.findLog(0, "CA started", nil)
		if err == nil {
			ca.process = p
			ca.monitoringAddr = started["monitoring_address"].(string)
			if got := started["address"]; got != ca.addr {
				t.Fatalf("the CA listens on %v, not %s", got, ca.addr)
			}
			return
		}
		if !strings.Contains(p.String(), "address already in use") || time.Now().After(deadline) {
			t.Fatalf("%v\n%s", err, p.String())
		}
		t.Logf("%s is taken; trying again", ca.addr)
		// Polling: nothing tells when another process lets a port go.
		time.Sleep(100 * time.Millisecond)
	}
}

// roots is the CA's trust bundle now, as clients read it.
func (ca *chaosCA) roots(t *testing.T) []*x509.Certificate {
	t.Helper()
	return readRoots(t, ca.rootFile())
}

// ready is what /healthz/ready answers: its status code and body.
func (a *agentProcess) ready(t *testing.T) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+a.statusAddr+"/healthz/ready", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, strings.TrimSpace(string(body))
}

// serialOf reads the serial in a "workload certificate in service" record.
func serialOf(rec map[string]any) string { s, _ := rec["serial"].(string); return s }

// ---- the SDS invariant checker ----

// receiptSlack is how late after a certificate's NotAfter a receipt may come and still count as
// received while valid: NotAfter is a whole second, and the push takes its time on the way.
const receiptSlack = time.Second

// sdsWatch is an Envoy-like SDS client that checks every secret it receives. It opens streams on
// one connection to an agent's socket, each a StreamSecrets for default and ROOTCA, ACKs every
// push, and, when a stream ends (the agent killed), opens it again and waits for the agent to
// come back. On every receipt of default it checks that the key matches the leaf, that the leaf
// is within its validity, that its SPIFFE ID is the workload's, and that the chain verifies up to
// a root of the stream's ROOTCA (strict) or, failing that, of the CA's trust bundle at that
// moment. Any violation fails the test.
type sdsWatch struct {
	t      *testing.T
	id     string
	bundle func() []*x509.Certificate // the CA's trust bundle now; nil: the stream's ROOTCA only
	strict bool                       // also check, at every ROOTCA, the default the stream holds

	mu      sync.Mutex
	streams []*watchedStream
	changed chan struct{} // closed and replaced at every receipt
}

// watchedStream is what one stream holds, and everything it received.
type watchedStream struct {
	n        int
	opened   int // how many times it was (re)opened
	leaf     *x509.Certificate
	chain    []*x509.Certificate
	version  string
	roots    []*x509.Certificate
	receipts []receipt
}

// receipt is one secret received.
type receipt struct {
	at      time.Time
	name    string
	version string
	leaf    *x509.Certificate   // default
	chain   []*x509.Certificate // default, leaf first
	roots   []*x509.Certificate // ROOTCA
	// heldExpired: the default held until this one had expired before it came.
	heldExpired time.Duration
}

// watchSDS opens n streams on the agent's socket and waits until each holds both secrets.
func watchSDS(t *testing.T, socket, id string, n int, bundle func() []*x509.Certificate, strict bool) *sdsWatch {
	t.Helper()
	w := openSDSWatch(t, socket, id, n, bundle, strict)
	w.await(t, "every stream holds default and ROOTCA", func() bool {
		return w.countLocked(func(s *watchedStream) bool { return s.leaf != nil && s.roots != nil }) == n
	})
	return w
}

// openSDSWatch is watchSDS that does not wait.
func openSDSWatch(t *testing.T, socket, id string, n int, bundle func() []*x509.Certificate, strict bool) *sdsWatch {
	t.Helper()
	w := &sdsWatch{t: t, id: id, bundle: bundle, strict: strict, changed: make(chan struct{})}
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()),
		// An agent killed and restarted is back within a second: reconnect at that pace, not
		// grpc's default, which backs off to two minutes.
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 500 * time.Millisecond}, MinConnectTimeout: 5 * time.Second}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var streams sync.WaitGroup
	t.Cleanup(func() {
		cancel()
		streams.Wait()
		_ = conn.Close()
	})
	for i := range n {
		s := &watchedStream{n: i}
		w.streams = append(w.streams, s)
		client := sdsclient.New(conn, sdsclient.WithNode(sdsNode(i)))
		streams.Go(func() { w.follow(ctx, client, s) })
	}
	return w
}

// sdsNode is the node stream n sends.
func sdsNode(n int) *corev3.Node {
	return &corev3.Node{Id: fmt.Sprintf("sidecar~127.0.0.1~chaos-%d.default~default.svc.cluster.local", n), Cluster: "chaos"}
}

// follow keeps stream s open, opening it again whenever the agent comes back, until ctx ends.
func (w *sdsWatch) follow(ctx context.Context, client *sdsclient.Client, s *watchedStream) {
	opened := func() {
		w.mu.Lock()
		s.opened++
		s.leaf, s.chain, s.version, s.roots = nil, nil, "", nil // a new stream holds nothing yet
		w.mu.Unlock()
	}
	received := func(r sdsclient.Response) error { w.receive(s, r); return nil }
	if err := client.Follow(ctx, []string{"default", "ROOTCA"}, opened, received); ctx.Err() == nil {
		w.t.Errorf("SDS stream %d: %v", s.n, err)
	}
}

// receive applies one response to what s holds and checks the result.
func (w *sdsWatch) receive(s *watchedStream, resp sdsclient.Response) {
	at := time.Now()
	var bundle []*x509.Certificate
	if w.bundle != nil {
		bundle = w.bundle()
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	var problems []string
	gotDefault, gotRoots := false, false
	// ROOTCA first: a response that carries both is checked as the stream holds it after.
	secrets := slices.Collect(maps.Values(resp.Secrets))
	slices.SortFunc(secrets, func(a, b *tlsv3.Secret) int { return strings.Compare(b.GetName(), a.GetName()) }) // ROOTCA < default
	for _, sec := range secrets {
		switch sec.GetName() {
		case "ROOTCA":
			roots, err := pki.ParseCertificates(sec.GetValidationContext().GetTrustedCa().GetInlineBytes())
			if err != nil || len(roots) == 0 {
				problems = append(problems, fmt.Sprintf("ROOTCA holds no roots (%v)", err))
				continue
			}
			s.roots, gotRoots = roots, true
			s.receipts = append(s.receipts, receipt{at: at, name: "ROOTCA", version: resp.Version, roots: roots})
		case "default":
			tc := sec.GetTlsCertificate()
			chainPEM, keyPEM := tc.GetCertificateChain().GetInlineBytes(), tc.GetPrivateKey().GetInlineBytes()
			chain, err := pki.ParseCertificates(chainPEM)
			if err != nil || len(chain) == 0 {
				problems = append(problems, fmt.Sprintf("default: no chain (%v)", err))
				continue
			}
			leaf := chain[0]
			var heldExpired time.Duration
			if s.leaf != nil && at.After(s.leaf.NotAfter) {
				heldExpired = at.Sub(s.leaf.NotAfter)
			}
			s.leaf, s.chain, s.version, gotDefault = leaf, chain, leaf.SerialNumber.Text(16), true
			s.receipts = append(s.receipts, receipt{at: at, name: "default", version: s.version, leaf: leaf, chain: chain, heldExpired: heldExpired})
			if _, err := tls.X509KeyPair(chainPEM, keyPEM); err != nil {
				problems = append(problems, fmt.Sprintf("default: the key does not match the leaf: %v", err))
			}
			if at.Before(leaf.NotBefore) || at.After(leaf.NotAfter.Add(receiptSlack)) {
				problems = append(problems, fmt.Sprintf("default: received outside its validity [%s, %s]", leaf.NotBefore.Format(time.RFC3339Nano), leaf.NotAfter.Format(time.RFC3339)))
			}
			if len(leaf.URIs) != 1 || leaf.URIs[0].String() != w.id {
				problems = append(problems, fmt.Sprintf("default: identity %v, want %s", leaf.URIs, w.id))
			}
		default:
			problems = append(problems, fmt.Sprintf("a secret not asked for: %q", sec.GetName()))
		}
	}
	if gotDefault || (gotRoots && w.strict && s.leaf != nil) {
		if err := verifyTo(s.chain, s.roots); err != nil {
			if w.strict || bundle == nil {
				problems = append(problems, fmt.Sprintf("default %s does not verify to the stream's ROOTCA (%d roots): %v", s.version, len(s.roots), err))
			} else if err2 := verifyTo(s.chain, bundle); err2 != nil {
				problems = append(problems, fmt.Sprintf("default %s verifies neither to the stream's ROOTCA (%v) nor to the CA's trust bundle (%v)", s.version, err, err2))
			}
		}
	}
	for _, p := range problems {
		w.t.Errorf("SDS stream %d, response %q received at %s: %s", s.n, resp.Version, at.Format(time.RFC3339Nano), p)
	}
	close(w.changed)
	w.changed = make(chan struct{})
}

// verifyTo checks chain up to one of roots, at a moment within the leaf's validity: whether it
// is still valid now is the receipt check's business.
func verifyTo(chain, roots []*x509.Certificate) error {
	if len(chain) == 0 || len(roots) == 0 {
		return errors.New("nothing to verify")
	}
	pool, intermediates := x509.NewCertPool(), x509.NewCertPool()
	for _, r := range roots {
		pool.AddCert(r)
	}
	for _, c := range chain[1:] {
		intermediates.AddCert(c)
	}
	leaf := chain[0]
	_, err := leaf.Verify(x509.VerifyOptions{Roots: pool, Intermediates: intermediates,
		CurrentTime: leaf.NotAfter.Add(-time.Second), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}})
	return err
}

// await waits until cond, called under the lock, holds; it is checked at every receipt.
func (w *sdsWatch) await(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.After(wait)
	for {
		w.mu.Lock()
		ok, changed := cond(), w.changed
		w.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("SDS: waited %s for %s", wait, what)
		}
	}
}

// awaitNewDefault waits until stream 0 holds a default other than version, and returns its serial.
func (w *sdsWatch) awaitNewDefault(t *testing.T, version string) string {
	t.Helper()
	var got string
	w.await(t, "a default other than "+version, func() bool {
		got = w.streams[0].version
		return got != "" && got != version
	})
	return got
}

// countLocked counts the streams ok accepts; call it with w.mu held (in await's cond).
func (w *sdsWatch) countLocked(ok func(*watchedStream) bool) int {
	n := 0
	for _, s := range w.streams {
		if ok(s) {
			n++
		}
	}
	return n
}

// opened is how many times stream 0 was opened so far.
func (w *sdsWatch) opened() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.streams[0].opened
}

// awaitReopened waits until stream 0, opened n times before, was opened again and holds default.
func (w *sdsWatch) awaitReopened(t *testing.T, n int) {
	t.Helper()
	w.await(t, "stream 0 open again, with a default", func() bool { return w.streams[0].opened > n && w.streams[0].leaf != nil })
}

// firstDefault is the version of the first default stream 0 received.
func (w *sdsWatch) firstDefault() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, r := range w.streams[0].receipts {
		if r.name == "default" {
			return r.version
		}
	}
	return ""
}

// stepCounts counts, of a move from root old to root next, the streams that received a ROOTCA
// with both, and the streams that received a default under next.
func (w *sdsWatch) stepCounts(old, next *x509.Certificate) [2]int {
	w.mu.Lock()
	defer w.mu.Unlock()
	var counts [2]int
	for _, s := range w.streams {
		var both, under bool
		for _, r := range s.receipts {
			both = both || (r.name == "ROOTCA" && slices.ContainsFunc(r.roots, old.Equal) && slices.ContainsFunc(r.roots, next.Equal))
			under = under || (r.name == "default" && verifyTo(r.chain, []*x509.Certificate{next}) == nil)
		}
		if both {
			counts[0]++
		}
		if under {
			counts[1]++
		}
	}
	return counts
}

// held is the version stream 0 holds now, and its leaf.
func (w *sdsWatch) held() (string, *x509.Certificate) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.streams[0].version, w.streams[0].leaf
}

// defaults counts the defaults stream 0 received.
func (w *sdsWatch) defaults() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, r := range w.streams[0].receipts {
		if r.name == "default" {
			n++
		}
	}
	return n
}

// expiredGaps lists the times a stream held an expired default before the next came.
func (w *sdsWatch) expiredGaps() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var gaps []string
	for _, s := range w.streams {
		for _, r := range s.receipts {
			if r.heldExpired > 0 {
				gaps = append(gaps, fmt.Sprintf("stream %d held an expired default for %s before %s", s.n, r.heldExpired, r.version))
			}
		}
	}
	return gaps
}

// ---- the OUTPUT_CERTS checker ----

// outputState is what a reader finds in OUTPUT_CERTS: nothing yet, or one whole generation.
type outputState struct {
	generation string
	leaf       *x509.Certificate
}

// readOutput reads OUTPUT_CERTS as a reader that follows the layout does: every visible name
// must be a symlink through ..data, and the three files are read from the one generation ..data
// points at, resolved once. It checks that the key matches the leaf, that the leaf is the
// workload's, and that the chain verifies to a root of root-cert.pem. Before the first write
// the files may be missing (whole reports whether they all are there).
func readOutput(dir, id string) (st outputState, whole bool, err error) {
	names := []string{"key.pem", "cert-chain.pem", "root-cert.pem"}
	present := 0
	for _, name := range names {
		target, err := os.Readlink(filepath.Join(dir, name))
		switch {
		case errors.Is(err, os.ErrNotExist):
			continue
		case err != nil:
			return st, false, fmt.Errorf("%s is not a symlink: %w", name, err)
		case target != filepath.Join("..data", name):
			return st, false, fmt.Errorf("%s links to %s, not through ..data", name, target)
		}
		present++
	}
	if present < len(names) {
		return st, false, nil
	}
	// The writer may swap ..data and remove the generation read between the two steps: read
	// again then.
	for range 10 {
		gen, err := os.Readlink(filepath.Join(dir, "..data"))
		if err != nil {
			return st, false, fmt.Errorf("..data: %w", err)
		}
		files := map[string][]byte{}
		for _, name := range names {
			data, err := os.ReadFile(filepath.Join(dir, gen, name))
			if errors.Is(err, os.ErrNotExist) {
				files = nil
				break
			}
			if err != nil {
				return st, true, err
			}
			files[name] = data
		}
		if files == nil {
			continue
		}
		if _, err := tls.X509KeyPair(files["cert-chain.pem"], files["key.pem"]); err != nil {
			return st, true, fmt.Errorf("generation %s: key.pem does not match cert-chain.pem: %w", gen, err)
		}
		chain, err := pki.ParseCertificates(files["cert-chain.pem"])
		if err != nil {
			return st, true, fmt.Errorf("generation %s: cert-chain.pem: %w", gen, err)
		}
		roots, err := pki.ParseCertificates(files["root-cert.pem"])
		if err != nil {
			return st, true, fmt.Errorf("generation %s: root-cert.pem: %w", gen, err)
		}
		if err := verifyTo(chain, roots); err != nil {
			return st, true, fmt.Errorf("generation %s: cert-chain.pem does not verify to root-cert.pem: %w", gen, err)
		}
		if len(chain[0].URIs) != 1 || chain[0].URIs[0].String() != id {
			return st, true, fmt.Errorf("generation %s: identity %v, want %s", gen, chain[0].URIs, id)
		}
		return outputState{generation: gen, leaf: chain[0]}, true, nil
	}
	return st, true, errors.New("..data kept moving under ten reads")
}

// outputWatch reads OUTPUT_CERTS at random moments in the background and fails the test on a
// partial or mismatched set. Once the three files have been there, they must always be.
type outputWatch struct {
	mu    sync.Mutex
	reads int
	whole bool
	stop  func()
}

func watchOutput(t *testing.T, dir func() string, id string) *outputWatch {
	t.Helper()
	o := &outputWatch{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	o.stop = sync.OnceFunc(func() {
		cancel()
		<-done
	})
	t.Cleanup(o.stop)
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			o.check(t, dir(), id)
			// Polling, at random moments: nothing announces the moment a reader would pick.
			select {
			case <-ctx.Done():
			case <-time.After(time.Duration(rand.IntN(20)) * time.Millisecond):
			}
		}
	}()
	return o
}

// check reads OUTPUT_CERTS once, as the background reader does; tests call it after a restart.
// count is how many times OUTPUT_CERTS was read.
func (o *outputWatch) count() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.reads
}

func (o *outputWatch) check(t *testing.T, dir, id string) outputState {
	st, whole, err := readOutput(dir, id)
	o.mu.Lock()
	defer o.mu.Unlock()
	o.reads++
	switch {
	case err != nil:
		t.Errorf("OUTPUT_CERTS at %s: %v", time.Now().Format(time.RFC3339Nano), err)
	case !whole && o.whole:
		t.Errorf("OUTPUT_CERTS at %s: files missing after they had all been written", time.Now().Format(time.RFC3339Nano))
	case whole:
		o.whole = true
	}
	return st
}

// generations lists the generation directories in OUTPUT_CERTS.
func generations(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var gens []string
	for _, e := range entries {
		if e.IsDir() && strings.HasPrefix(e.Name(), "..meshid_") {
			gens = append(gens, e.Name())
		}
	}
	return gens
}

// ---- a fault-injecting proxy ----

// proxyMode is what faultProxy does with a connection.
type proxyMode int

const (
	pass   proxyMode = iota // forward both ways
	hold                    // accept, forward nothing, never close: the client's deadline fires
	refuse                  // close at once
)

func (m proxyMode) String() string { return [...]string{"pass", "hold", "refuse"}[m] }

// faultProxy stands between an agent and its CA on 127.0.0.1:0. A change of mode closes every
// connection it has, so that the next one meets the new mode.
type faultProxy struct {
	addr   string
	target string

	mu       sync.Mutex
	mode     proxyMode
	conns    map[net.Conn]struct{}
	accepted map[proxyMode]int
}

func startFaultProxy(t *testing.T, target string) *faultProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &faultProxy{addr: ln.Addr().String(), target: target, conns: map[net.Conn]struct{}{}, accepted: map[proxyMode]int{}}
	var conns sync.WaitGroup
	t.Cleanup(func() {
		_ = ln.Close()
		p.closeAll()
		conns.Wait()
	})
	conns.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Go(func() { p.handle(c) })
		}
	})
	return p
}

func (p *faultProxy) handle(c net.Conn) {
	p.mu.Lock()
	mode := p.mode
	p.accepted[mode]++
	if mode == refuse {
		p.mu.Unlock()
		_ = c.Close()
		return
	}
	p.conns[c] = struct{}{}
	p.mu.Unlock()
	if mode == hold {
		return // closed at the next change of mode
	}
	up, err := net.Dial("tcp", p.target)
	if err != nil {
		_ = c.Close()
		return
	}
	p.mu.Lock()
	if _, ok := p.conns[c]; !ok { // the mode changed meanwhile
		p.mu.Unlock()
		_ = up.Close()
		return
	}
	p.conns[up] = struct{}{}
	p.mu.Unlock()
	var copies sync.WaitGroup
	copies.Go(func() { _, _ = io.Copy(up, c); _ = up.Close() })
	copies.Go(func() { _, _ = io.Copy(c, up); _ = c.Close() })
	copies.Wait()
}

func (p *faultProxy) set(mode proxyMode) {
	p.mu.Lock()
	p.mode = mode
	p.mu.Unlock()
	p.closeAll()
}

func (p *faultProxy) closeAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		_ = c.Close()
		delete(p.conns, c)
	}
}

func (p *faultProxy) count(mode proxyMode) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.accepted[mode]
}

// ---- an agent on a tmpfs of its own ----

// tmpfsWrapperEnv makes the test binary the wrapper of an agent: its value is where to mount a
// size-limited tmpfs (the agent's OUTPUT_CERTS), and the binary's arguments are the agent's.
const tmpfsWrapperEnv = "MESHID_E2E_TMPFS"

// tmpfsSize is the tmpfs's size: room for a few generations of three small files (a page each).
const tmpfsSize = "64k"

// tmpfsWrapper runs in a user and mount namespace of its own, as root there: it mounts a tmpfs at
// dir, runs the agent, and stays to remount the tmpfs read-only on SIGUSR1 and read-write on
// SIGUSR2. File permissions do not stop root, a full or read-only file system does.
func tmpfsWrapper(dir string, agent []string) int {
	say := func(msg string, attrs ...any) {
		rec := map[string]any{"msg": msg, "component": "tmpfs-wrapper"}
		for i := 0; i+1 < len(attrs); i += 2 {
			rec[attrs[i].(string)] = attrs[i+1]
		}
		line, _ := json.Marshal(rec)
		_, _ = os.Stdout.Write(append(line, '\n'))
	}
	// Our mounts must not propagate to the parent's namespace.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		say("tmpfs wrapper failed", "error", "make / private: "+err.Error())
		return 1
	}
	const flags = unix.MS_NOSUID | unix.MS_NODEV
	if err := unix.Mount("tmpfs", dir, "tmpfs", flags, "size="+tmpfsSize+",mode=0700"); err != nil {
		say("tmpfs wrapper failed", "error", "mount: "+err.Error())
		return 1
	}
	say("tmpfs mounted", "path", dir, "size", tmpfsSize)
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGTERM, syscall.SIGINT)
	cmd := exec.Command(agent[0], agent[1:]...)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // dies with the wrapper
	if err := cmd.Start(); err != nil {
		say("tmpfs wrapper failed", "error", err.Error())
		return 1
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	for {
		select {
		case err := <-done:
			if err != nil {
				return 1
			}
			return 0
		case sig := <-sigs:
			switch sig {
			case syscall.SIGUSR1, syscall.SIGUSR2:
				readOnly := sig == syscall.SIGUSR1
				remount := uintptr(unix.MS_REMOUNT | flags)
				if readOnly {
					remount |= unix.MS_RDONLY
				}
				if err := unix.Mount("", dir, "", remount, "size="+tmpfsSize); err != nil {
					say("tmpfs remount failed", "read_only", readOnly, "error", err.Error())
					continue
				}
				say("tmpfs remounted", "read_only", readOnly)
			default:
				_ = cmd.Process.Signal(sig)
			}
		}
	}
}

// tmpfsAgent is an agent whose OUTPUT_CERTS is a tmpfs in a mount namespace of its own, seen
// from here through /proc/<wrapper>/root.
type tmpfsAgent struct {
	*agentProcess
	mountpoint string // in the agent's namespace
}

// startTmpfsAgent runs an agent through the wrapper, in a new user and mount namespace mapped to
// root, with OUTPUT_CERTS on a tmpfs of tmpfsSize. It fails the test when no namespace can be
// made: the scenario cannot be run otherwise, since root writes past file permissions.
func startTmpfsAgent(t *testing.T, ca *caProcess, w workload, o agentOptions) *tmpfsAgent {
	t.Helper()
	mountpoint := filepath.Join(testutil.ShortTempDir(t), "certs")
	if err := os.Mkdir(mountpoint, 0o700); err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	o.path = self
	o.configure = func(cmd *exec.Cmd) {
		cmd.Env = append(os.Environ(), tmpfsWrapperEnv+"="+mountpoint)
		cmd.SysProcAttr = &syscall.SysProcAttr{
			Cloneflags:                 syscall.CLONE_NEWUSER | syscall.CLONE_NEWNS,
			UidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}},
			GidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}},
			GidMappingsEnableSetgroups: false,
			Pdeathsig:                  syscall.SIGKILL,
		}
	}
	o.extraArgs = append(o.extraArgs, "--output-certs", mountpoint)
	o.started = func(p *process) {
		if _, _, err := p.findLog(0, "tmpfs mounted", nil); err != nil {
			t.Fatalf("cannot run the agent on a tmpfs in a user and mount namespace of its own (root writes past file permissions, "+
				"so a full or read-only OUTPUT_CERTS needs a file system): %v\n%s\nThis needs user namespaces: check "+
				"kernel.unprivileged_userns_clone, user.max_user_namespaces and any seccomp or AppArmor profile that forbids unshare.", err, p.String())
		}
	}
	return &tmpfsAgent{agentProcess: startAgentWith(t, ca, w, o), mountpoint: mountpoint}
}

// outputDir is OUTPUT_CERTS as seen from the test.
func (a *tmpfsAgent) outputDir() string {
	return filepath.Join("/proc", fmt.Sprint(a.Pid), "root", a.mountpoint)
}

// fill writes a filler file on the tmpfs until it is full, and returns its path.
func (a *tmpfsAgent) fill(t *testing.T) string {
	t.Helper()
	path := filepath.Join(a.outputDir(), "filler")
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	chunk := bytes.Repeat([]byte{'x'}, 4096)
	for {
		if _, err := f.Write(chunk); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("fill the tmpfs: %v", err)
			}
			return path
		}
	}
}
