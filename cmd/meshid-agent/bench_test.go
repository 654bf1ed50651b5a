package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/sds/sdsclient"
	"github.com/meshid/meshid/secretmanager"
)

// These benchmarks run the binaries as a user does: built with `make build`'s flags, started as
// a process, talked to over the SDS socket. The slim meshid-agent needs a CA; the embedded
// control plane is measured with meshid, which carries it.

// binaries holds the binaries built once per test binary.
type binaries struct {
	sync.Once
	dir, slim, full string
	err             error
}

var built binaries

// TestMain removes the binaries agentBinary built, about 80 MB a run, once everything has run.
func TestMain(m *testing.M) {
	code := m.Run()
	if built.dir != "" {
		_ = os.RemoveAll(built.dir)
	}
	os.Exit(code)
}

// agentBinary builds meshid-agent and meshid once per test binary, as `make build` does, and
// returns the one that runs args: meshid-agent given a CA address or credential files, else
// meshid (the embedded control plane).
func agentBinary(b *testing.B, args ...string) string {
	b.Helper()
	built.Do(func() {
		dir, err := os.MkdirTemp("", "meshid-bench")
		if err != nil {
			built.err = err
			return
		}
		built.dir, built.slim, built.full = dir, filepath.Join(dir, "meshid-agent"), filepath.Join(dir, "meshid")
		for out, pkg := range map[string]string{built.slim: ".", built.full: "../meshid"} {
			cmd := exec.Command("go", "build", "-trimpath", "-tags", "grpcnotrace", "-ldflags", "-s -w", "-o", out, pkg)
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			if output, err := cmd.CombinedOutput(); err != nil {
				built.err = fmt.Errorf("go build %s: %w: %s", pkg, err, output)
				return
			}
		}
	})
	if built.err != nil {
		b.Fatal(built.err)
	}
	if slices.Contains(args, "--ca-addr") || slices.Contains(args, "--credentials-dir") {
		return built.slim
	}
	return built.full
}

// process is a running meshid-agent.
type process struct {
	cmd    *exec.Cmd
	socket string
}

// startAgent starts the agent under a fresh root dir.
func startAgent(b *testing.B, args ...string) *process {
	b.Helper()
	return startAgentIn(b, testutil.ShortTempDir(b), args...)
}

// startAgentIn starts the agent under root, which may hold an earlier run's state.
func startAgentIn(b *testing.B, root string, args ...string) *process {
	b.Helper()
	socketDir := filepath.Join(root, "uds")
	args = append([]string{"agent", "--root-dir", root, "--workload-socket-dir", socketDir,
		"--status-addr", "127.0.0.1:0", "--debug-addr", "", "--log-level", "warn"}, args...)
	cmd := exec.Command(agentBinary(b, args...), args...)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	p := &process{cmd: cmd, socket: filepath.Join(socketDir, sds.SocketName)}
	b.Cleanup(p.stop)
	return p
}

func (p *process) stop() {
	_ = p.cmd.Process.Kill()
	_ = p.cmd.Wait()
}

// rssKB reads the process's resident set (VmRSS) in kB.
func (p *process) rssKB(b *testing.B) float64 {
	b.Helper()
	return rssOf(b, p.cmd.Process.Pid)
}

func rssOf(b *testing.B, pid int) float64 {
	b.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if rest, ok := strings.CutPrefix(s.Text(), "VmRSS:"); ok {
			kb, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			if err != nil {
				b.Fatal(err)
			}
			return kb
		}
	}
	b.Fatal("no VmRSS")
	return 0
}

// dial waits for the socket to accept connections (polling: the process is starting) and
// returns a client connection to it.
func dial(b *testing.B, socket string) *grpc.ClientConn {
	b.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; {
		if c, err := net.Dial("unix", socket); err == nil {
			_ = c.Close()
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("nothing listens on %s", socket)
		}
		time.Sleep(100 * time.Microsecond)
	}
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	return conn
}

// stream is one Envoy-style SDS stream that keeps acknowledging what it gets.
type stream struct {
	sds *sdsclient.Stream
}

func openStream(ctx context.Context, conn *grpc.ClientConn, node string, names ...string) (*stream, error) {
	s, err := sdsclient.New(conn, sdsclient.WithNode(&core.Node{Id: node})).StreamSecrets(ctx)
	if err != nil {
		return nil, err
	}
	return &stream{sds: s}, s.Subscribe(names...)
}

// next receives a response, acknowledges it, and returns the default secret's certificate chain
// (PEM), or "" when the response has none. The chain is compared, not parsed: at 10,000 streams
// the benchmark's own X.509 parsing would be most of the rotation time it reports.
func (s *stream) next(names ...string) (string, error) {
	resp, err := s.sds.Recv()
	if err != nil {
		return "", err
	}
	if err := s.sds.Ack(resp, names...); err != nil {
		return "", err
	}
	for _, sec := range resp.Secrets {
		if chain := sec.GetTlsCertificate().GetCertificateChain().GetInlineBytes(); chain != nil {
			return string(chain), nil
		}
	}
	return "", nil
}

// BenchmarkFirstSecret measures exec → first "default" received over SDS, with the CA on loopback
// (an in-process `meshid ca`) and with the agent's embedded control plane, for P-256 and RSA 2048
// workload keys. "embedded-first-run" starts on a fresh root dir each time, so the CA's root and
// token key are generated and persisted too; "embedded-restart" reuses one, as a restarted sidecar
// does. "floor-ca-sign" is the least any agent of this design does, exec'ed the same way: a
// program of the caclient and pki packages alone that makes a P-256 key and CSR, signs it once
// with the same CA, and exits. "ca-loopback-output-certs" has no SDS client: it measures exec → the key pair and trust
// bundle readable in OUTPUT_CERTS, as a VM's workload sees them. The baseline is the same binary
// exec'ed to print its version, in the same run. "ca-loopback-output-certs-sds" (OUTPUT_CERTS set)
// and "ca-loopback-ready" (not set) report exec → "default" over SDS and exec → ready, quiet and
// under diskContention, alternating, with the ratios of the same run; so does the baseline.
func BenchmarkFirstSecret(b *testing.B) {
	bin := agentBinary(b, "--ca-addr")
	b.Run("baseline-exec-version", func(b *testing.B) {
		for range b.N {
			if err := exec.Command(bin, "version").Run(); err != nil {
				b.Fatal(err)
			}
		}
	})
	// What the disk contention costs a process that never touches the disk: exec, the runtime's
	// start, the CPU the generator takes.
	b.Run("baseline-exec-version-contended", func(b *testing.B) {
		quietAndContended(b, func() map[string]float64 {
			start := time.Now()
			if err := exec.Command(bin, "version").Run(); err != nil {
				b.Fatal(err)
			}
			return map[string]float64{"exec": ms(time.Since(start))}
		})
	})
	caArgs := startCA(b)
	b.Run("floor-ca-sign/p256", func(b *testing.B) {
		bin := floorBinary(b)
		b.ResetTimer()
		for range b.N {
			cmd := exec.Command(bin, caArgs...)
			if out, err := cmd.CombinedOutput(); err != nil {
				b.Fatalf("%v: %s", err, out)
			}
		}
	})
	b.Run("ca-loopback-output-certs/p256", func(b *testing.B) {
		for range b.N {
			firstOutput(b, caArgs...)
		}
	})
	// Exec → "default" over SDS and exec → ready, quiet and with the disk busy, alternating.
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"ca-loopback-output-certs-contended/p256", append([]string{"--output-certs", ""}, caArgs...)},
		{"ca-loopback-contended/p256", caArgs},
	} {
		b.Run(tc.name, func(b *testing.B) {
			bin := agentBinary(b, tc.args...)
			quietAndContended(b, func() map[string]float64 { return secretAndReady(b, bin, tc.args) })
		})
	}
	for _, tc := range []struct {
		name  string
		args  []string
		reuse bool
	}{
		{"ca-loopback/p256", caArgs, false},
		{"ca-loopback/rsa2048", append([]string{"--key-algorithm", "RSA"}, caArgs...), false},
		{"embedded-first-run/p256", nil, false},
		{"embedded-first-run/rsa2048", []string{"--key-algorithm", "RSA"}, false},
		{"embedded-restart/p256", nil, true},
		{"embedded-restart/rsa2048", []string{"--key-algorithm", "RSA"}, true},
	} {
		b.Run(tc.name, func(b *testing.B) {
			root := ""
			if tc.reuse {
				root = testutil.ShortTempDir(b)
				firstSecret(b, root, tc.args...) // the first run creates the state
				b.ResetTimer()
			}
			for range b.N {
				firstSecret(b, root, tc.args...)
			}
		})
	}
}

func firstSecret(b *testing.B, root string, args ...string) {
	b.Helper()
	if root == "" {
		b.StopTimer()
		root = testutil.ShortTempDir(b)
		b.StartTimer()
	}
	p := startAgentIn(b, root, args...)
	conn := dial(b, p.socket)
	defer func() { _ = conn.Close() }()
	s, err := openStream(b.Context(), conn, "bench", "default")
	if err != nil {
		b.Fatal(err)
	}
	if chain, err := s.next("default"); err != nil || chain == "" {
		b.Fatalf("first secret: no certificate chain (%v)", err)
	}
	b.StopTimer()
	p.stop()
	b.StartTimer()
}

// floorSource is the program of "floor-ca-sign": the agent's CA flags, nothing else.
const floorSource = `package main

import (
	"context"
	"flag"
	"os"
	"time"

	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/internal/pki"
)

func main() {
	addr := flag.String("ca-addr", "", "")
	root := flag.String("ca-root-cert", "", "")
	token := flag.String("token-path", "", "")
	ns := flag.String("namespace", "", "")
	sa := flag.String("service-account", "", "")
	flag.Parse()
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		panic(err)
	}
	csr, err := pki.NewCSR(key, pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: *ns, ServiceAccount: *sa})
	if err != nil {
		panic(err)
	}
	c, err := caclient.New(caclient.Config{Address: *addr, RootCertFile: *root, TokenPath: *token})
	if err != nil {
		panic(err)
	}
	if _, err := c.Sign(context.Background(), csr, time.Hour); err != nil {
		os.Stderr.WriteString(err.Error())
		os.Exit(1)
	}
}
`

// floorBinary builds floorSource as the binaries are built.
func floorBinary(b *testing.B) string {
	b.Helper()
	return overlayBinary(b, "floor", floorSource)
}

// overlayBinary builds the program src as the binaries are built, as the package
// cmd/meshid-agent/<name> of this module that exists only in a build overlay: nothing is
// written into the tree.
func overlayBinary(b *testing.B, name, src string) string {
	b.Helper()
	dir := b.TempDir()
	file, pkgDir := filepath.Join(dir, "main.go"), filepath.Join(moduleRoot(b), "cmd", "meshid-agent", name)
	if err := os.WriteFile(file, []byte(src), 0o600); err != nil {
		b.Fatal(err)
	}
	overlay, err := json.Marshal(map[string]map[string]string{"Replace": {filepath.Join(pkgDir, "main.go"): file}})
	if err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "overlay.json"), overlay, 0o600); err != nil {
		b.Fatal(err)
	}
	bin := filepath.Join(dir, name)
	cmd := exec.Command("go", "build", "-overlay", filepath.Join(dir, "overlay.json"), "-trimpath", "-tags", "grpcnotrace",
		"-ldflags", "-s -w", "-o", bin, "./"+name)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("build the %s program: %v: %s", name, err, out)
	}
	return bin
}

// moduleRoot is the directory of go.mod.
func moduleRoot(b *testing.B) string {
	b.Helper()
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		b.Fatal(err)
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}

// firstOutput starts the agent with --output-certs and returns once the key pair and the trust
// bundle are readable there.
func firstOutput(b *testing.B, args ...string) {
	b.Helper()
	b.StopTimer()
	root := testutil.ShortTempDir(b)
	out := filepath.Join(root, "out")
	names := []string{secretmanager.KeyFile, secretmanager.CertChainFile, secretmanager.RootCertFile}
	b.StartTimer()
	p := startAgentIn(b, root, append([]string{"--output-certs", out}, args...)...)
	for deadline := time.Now().Add(30 * time.Second); ; {
		if slices.IndexFunc(names, func(name string) bool {
			_, err := os.Stat(filepath.Join(out, name))
			return err != nil
		}) < 0 {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("no key pair in %s", out)
		}
		time.Sleep(100 * time.Microsecond)
	}
	b.StopTimer()
	p.stop()
	b.StartTimer()
}

// startCA runs `meshid ca` in process on loopback with a token for default/demo, and returns the
// agent flags that use it.
func startCA(b *testing.B) []string {
	b.Helper()
	cfg := controlplanetest.Config(b)
	ca := controlplanetest.Start(b, cfg)
	tokenFile := filepath.Join(b.TempDir(), "token")
	tok := controlplanetest.Token(b, cfg.StateDir, "default", "demo", time.Now(), 24*time.Hour)
	if err := os.WriteFile(tokenFile, []byte(tok), 0o600); err != nil {
		b.Fatal(err)
	}
	return []string{"--ca-addr", ca.GRPCAddr(), "--ca-root-cert", filepath.Join(cfg.StateDir, "root-cert.pem"),
		"--token-path", tokenFile, "--namespace", "default", "--service-account", "demo"}
}

// BenchmarkIdleRSS measures the agent's resident set (VmRSS) with one SDS stream open after 10 s
// idle, against the CA on loopback and with the embedded control plane. The baseline is the
// smallest Go program (it only sleeps), built and measured in the same run.
func BenchmarkIdleRSS(b *testing.B) {
	b.Run("baseline-go-sleep", func(b *testing.B) {
		bin := sleeperBinary(b)
		for range b.N {
			cmd := exec.Command(bin)
			if err := cmd.Start(); err != nil {
				b.Fatal(err)
			}
			time.Sleep(10 * time.Second) // the measurement is of an idle process
			b.ReportMetric(rssOf(b, cmd.Process.Pid), "rss-kB")
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	caArgs := startCA(b)
	for _, tc := range []struct {
		name string
		args []string
	}{{"ca-loopback", caArgs}, {"embedded", nil}} {
		b.Run(tc.name, func(b *testing.B) {
			for range b.N {
				p := startAgent(b, tc.args...)
				conn := dial(b, p.socket)
				s, err := openStream(b.Context(), conn, "bench", "default", "ROOTCA")
				if err != nil {
					b.Fatal(err)
				}
				if _, err := s.next("default", "ROOTCA"); err != nil {
					b.Fatal(err)
				}
				time.Sleep(10 * time.Second) // the measurement is of an idle agent
				b.ReportMetric(p.rssKB(b), "rss-kB")
				// Anonymous memory is the agent's own; the rest of RSS is the binary's pages,
				// which pods running the same image share.
				b.ReportMetric(anonKB(b, p.cmd.Process.Pid), "anon-kB")
				_ = conn.Close()
				p.stop()
			}
		})
	}
}

// anonKB reads the process's anonymous resident memory (smaps_rollup's Anonymous) in kB.
func anonKB(b *testing.B, pid int) float64 {
	b.Helper()
	return smapsKB(b, pid, "Anonymous")
}

// smapsKB reads one field of the process's /proc/PID/smaps_rollup (Pss, Anonymous, ...) in kB.
func smapsKB(b *testing.B, pid int, field string) float64 {
	b.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		b.Fatal(err)
	}
	for line := range strings.Lines(string(data)) {
		if rest, ok := strings.CutPrefix(line, field+":"); ok {
			kb, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			if err != nil {
				b.Fatal(err)
			}
			return kb
		}
	}
	b.Fatalf("no %s in smaps_rollup", field)
	return 0
}

// sleeperBinary builds the smallest Go program that stays up: the floor of any Go process's RSS.
func sleeperBinary(b *testing.B) string {
	b.Helper()
	dir := b.TempDir()
	src := "package main\n\nimport \"time\"\n\nfunc main() { time.Sleep(time.Hour) }\n"
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(src), 0o644); err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module sleeper\n\ngo 1.26\n"), 0o644); err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w", "-o", "sleeper", ".")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("build sleeper: %v: %s", err, out)
	}
	return filepath.Join(dir, "sleeper")
}

// BenchmarkStreams opens 1,000 and 10,000 concurrent SDS streams on one agent (serving mounted
// credential files), reports the agent's resident memory per stream, and the time from a
// rotation of the files to the moment every stream has received the new certificate. That time
// includes the file watcher's 100 ms debounce; the baseline is the same rotation reaching a single
// stream, measured in the same run.
func BenchmarkStreams(b *testing.B) {
	for _, n := range []int{1, 1000, 10000} {
		b.Run(fmt.Sprintf("streams-%d", n), func(b *testing.B) {
			for range b.N {
				streamsOnce(b, n)
			}
		})
	}
}

func streamsOnce(b *testing.B, n int) {
	b.Helper()
	creds, writePair := mountedCredentials(b)
	first := writePair()
	// The limits are raised above the defaults (1000 streams, 100 per connection) to measure
	// what 10,000 streams cost on a few connections.
	p := startAgent(b, "--credentials-dir", creds, "--sds-max-streams", strconv.Itoa(2*n),
		"--sds-max-streams-per-connection", "1000")

	// Envoy holds one connection; here a few carry the streams, as many Envoys' worth.
	conns := make([]*grpc.ClientConn, 1+n/1000)
	for i := range conns {
		conns[i] = dial(b, p.socket)
		defer func() { _ = conns[i].Close() }()
	}
	rssBefore := p.rssKB(b)
	ctx, cancel := context.WithCancel(b.Context())
	defer cancel()
	var opened, rotated sync.WaitGroup
	opened.Add(n)
	rotated.Add(n)
	var nextChain string
	rotate := make(chan struct{}) // closed once nextChain is set
	errs := make(chan error, n)
	for i := range n {
		go func() {
			s, err := openStream(ctx, conns[i%len(conns)], fmt.Sprintf("envoy-%d", i), "default")
			if err == nil {
				var chain string
				chain, err = s.next("default")
				if err == nil && chain != first {
					err = errors.New("the first secret is not the mounted one")
				}
			}
			opened.Done()
			if err != nil {
				errs <- err
				rotated.Done()
				return
			}
			<-rotate
			for {
				chain, err := s.next("default")
				if err != nil {
					errs <- err
					break
				}
				if chain == nextChain {
					break
				}
			}
			rotated.Done()
		}()
	}
	opened.Wait()
	select {
	case err := <-errs:
		b.Fatal(err)
	default:
	}
	rssAfter := p.rssKB(b)

	start := time.Now()
	nextChain = writePair()
	close(rotate)
	rotated.Wait()
	took := time.Since(start)
	select {
	case err := <-errs:
		b.Fatal(err)
	default:
	}
	b.ReportMetric(float64(took.Microseconds())/1000, "rotation-ms")
	if n > 1 {
		b.ReportMetric((rssAfter-rssBefore)/float64(n), "kB/stream")
	}
	b.ReportMetric(rssAfter, "rss-kB")
}

// mountedCredentials returns a directory for --credentials-dir and a function that writes a new
// workload key pair (and its root) into it, each file renamed into place, and returns the chain
// as written.
func mountedCredentials(b *testing.B) (dir string, writePair func() string) {
	b.Helper()
	root := testutil.NewRootCA(b, testutil.CAOptions{})
	dir = b.TempDir()
	writePair = func() string {
		leaf, key := root.IssueWorkload(b, "spiffe://cluster.local/ns/default/sa/bench", time.Hour)
		files := map[string][]byte{
			"cert-chain.pem": testutil.CertPEM(leaf, root.Cert),
			"key.pem":        testutil.KeyPEM(b, key),
			"root-cert.pem":  testutil.CertPEM(root.Cert),
		}
		writeCredentials(b, dir, files)
		return string(files["cert-chain.pem"])
	}
	return dir, writePair
}

// quietAndContended runs measure (figures in ms by name) b.N times with the disk quiet and b.N
// times under diskContention, alternating, so that both see the same machine; it reports the
// median of each figure quiet and contended (NAME-quiet-ms, NAME-contended-ms) and the ratio of
// the medians (NAME-x-quiet). ns/op covers one quiet and one contended measurement.
func quietAndContended(b *testing.B, measure func() map[string]float64) {
	b.Helper()
	b.StopTimer()
	disk := diskContention(b, 3)
	defer disk.stop()
	quiet, contended := map[string][]float64{}, map[string][]float64{}
	b.StartTimer()
	for range b.N {
		for name, v := range measure() {
			quiet[name] = append(quiet[name], v)
		}
		b.StopTimer()
		disk.resume()
		b.StartTimer()
		for name, v := range measure() {
			contended[name] = append(contended[name], v)
		}
		b.StopTimer()
		disk.pause()
		b.StartTimer()
	}
	b.StopTimer()
	for name := range quiet {
		q, c := median(quiet[name]), median(contended[name])
		b.ReportMetric(q, name+"-quiet-ms")
		b.ReportMetric(c, name+"-contended-ms")
		b.ReportMetric(c/q, name+"-x-quiet")
	}
}

func median(v []float64) float64 {
	slices.Sort(v)
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// secretAndReady starts the agent under a fresh root dir and returns the times from exec to the
// first "default" over SDS ("sds") and to /healthz/ready answering 200 ("ready"), in ms. An
// empty --output-certs is given a directory under the root dir.
func secretAndReady(b *testing.B, bin string, args []string) map[string]float64 {
	b.Helper()
	b.StopTimer()
	root := testutil.ShortTempDir(b)
	socketDir := filepath.Join(root, "uds")
	args = slices.Clone(args)
	if i := slices.Index(args, "--output-certs"); i >= 0 && args[i+1] == "" {
		args[i+1] = filepath.Join(root, "out")
	}
	args = append([]string{"agent", "--root-dir", root, "--workload-socket-dir", socketDir,
		"--status-addr", "127.0.0.1:0", "--debug-addr", ""}, args...)
	b.StartTimer()
	start := time.Now()
	// The status address is the kernel's choice: the agent logs it once it serves.
	cmd, started := startLogged(b, bin, "agent started", args...)
	conn := dial(b, filepath.Join(socketDir, sds.SocketName))
	defer func() { _ = conn.Close() }()
	s, err := openStream(b.Context(), conn, "bench", "default")
	if err != nil {
		b.Fatal(err)
	}
	if chain, err := s.next("default"); err != nil || chain == "" {
		b.Fatalf("first secret: no certificate chain (%v)", err)
	}
	sdsTook := time.Since(start)
	ready(b, started["status_address"].(string))
	readyTook := time.Since(start)
	b.StopTimer()
	stopProcess(cmd)
	b.StartTimer()
	return map[string]float64{"sds": ms(sdsTook), "ready": ms(readyTook)}
}

// writeCredentials writes the key first, then the chain, then the root, each file renamed into
// place.
func writeCredentials(b *testing.B, dir string, files map[string][]byte) {
	b.Helper()
	for _, name := range []string{"key.pem", "cert-chain.pem", "root-cert.pem"} {
		tmp := filepath.Join(dir, "."+name+".tmp")
		if err := os.WriteFile(tmp, files[name], 0o600); err != nil {
			b.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
			b.Fatal(err)
		}
	}
}
