//go:build linux

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/sds/sdstest"
)

// istioBinEnv names the directory holding pilot-agent, as make test and make bench set it from
// hack/istio-env.sh.
const istioBinEnv = "MESHID_ISTIO_BIN"

// BenchmarkRotationFanout renews the workload certificate under n SDS streams, on meshid-agent
// and on Istio's pilot-agent in the same run, each the same way on both, with two triggers:
//
//   - renewal: both agents get their certificates from one CA (meshid's, in process, on
//     loopback) with a lifetime of renewalTTL and renew at half of it (SECRET_TTL,
//     SECRET_GRACE_PERIOD_RATIO and no jitter, on both); the streams wait for a certificate
//     other than their first. Neither agent reads anything per stream: this is the fan-out.
//   - files: both serve mounted credential files (meshid-agent's --credentials-dir,
//     pilot-agent's ./var/run/secrets/workload-spiffe-credentials), which are rewritten (key,
//     chain, root, each renamed into place). meshid-agent's file watcher waits for them to stay
//     quiet 100 ms (filewatch.DefaultDebounce); pilot-agent reacts to the chain's rename at once,
//     and then reads and parses the files again for each stream it pushes to.
//
// It reports fanout-ms, from the first stream to receive the new certificate to the last (the
// time an agent takes to reach them all once it has the new certificate), and µs/stream, the
// same divided by n; agent-cpu-µs/stream, the agent's CPU time from just before the first
// stream's receipt to the last's, divided by n (the steadier figure on a shared machine: the
// wall time moves with the other work on it); client-cpu-µs/stream, the benchmark process's
// (the clients') from the first receipt to the last, divided by n; for
// files also write-to-first-ms and write-to-last-ms, from the rewrite, where the debounce shows.
// On pilot-agent's lines meshid/pilot is the ratio of the two agents' fanout-ms in this run.
// The clients compare bytes: a response counts when its encoding does not contain the stream's
// first leaf (PEM); once its time is taken the client acknowledges it, as Envoy does (reading
// only the version and nonce from the encoding), so that the agent handles the ACKs during the
// rotation as it would in a pod.
//
// pilot-agent comes from $MESHID_ISTIO_BIN (make bench sets it from hack/istio-env.sh); without
// it its half is skipped.
func BenchmarkRotationFanout(b *testing.B) {
	pilotDir := os.Getenv(istioBinEnv)
	ca := startRenewalCA(b)
	for _, trigger := range []string{"renewal", "files"} {
		for _, n := range []int{1000, 10000} {
			b.Run(fmt.Sprintf("%s/streams-%d", trigger, n), func(b *testing.B) {
				var meshidFanout float64
				b.Run("meshid-agent", func(b *testing.B) {
					start := func(b *testing.B) agentRun { return startMeshidFiles(b, n) }
					if trigger == "renewal" {
						start = func(b *testing.B) agentRun { return startMeshidRenewal(b, n, ca) }
					}
					meshidFanout = fanoutRuns(b, n, start)
				})
				b.Run("pilot-agent", func(b *testing.B) {
					if pilotDir == "" {
						// On stderr: go test prints a skipped benchmark's message only with -v.
						fmt.Fprintf(os.Stderr, "%s: pilot-agent half skipped: %s is not set; run make bench, or go test with %s=$(hack/istio-env.sh)\n",
							b.Name(), istioBinEnv, istioBinEnv)
						b.SkipNow()
					}
					start := func(b *testing.B) agentRun { return startPilotAgent(b, pilotDir, ca, true) }
					if trigger == "renewal" {
						start = func(b *testing.B) agentRun { return startPilotAgent(b, pilotDir, ca, false) }
					}
					pilot := fanoutRuns(b, n, start)
					if meshidFanout > 0 && pilot > 0 {
						b.ReportMetric(meshidFanout/pilot, "meshid/pilot")
					}
				})
			})
		}
	}
}

// agentRun is a started agent: its SDS socket, and rotate, which rewrites its credential files
// (nil when the agent renews from the CA by itself).
type agentRun struct {
	socket string
	rotate func()
	pid    int
}

// fanoutRuns runs b.N rotations, each on a fresh agent, reports the means, and returns the mean
// fanout in ms.
func fanoutRuns(b *testing.B, n int, start func(*testing.B) agentRun) float64 {
	b.Helper()
	var fanout, first, last, cpu, clientCPU time.Duration
	files := false
	for range b.N {
		run := start(b)
		files = run.rotate != nil
		t := rotationOnce(b, n, run)
		fanout, first, last, cpu, clientCPU = fanout+t.fanout, first+t.toFirst, last+t.toLast, cpu+t.cpu, clientCPU+t.clientCPU
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 / float64(b.N) }
	b.ReportMetric(ms(fanout), "fanout-ms")
	b.ReportMetric(float64(cpu.Nanoseconds())/1000/float64(b.N*n), "agent-cpu-µs/stream")
	b.ReportMetric(float64(clientCPU.Nanoseconds())/1000/float64(b.N*n), "client-cpu-µs/stream")
	if files {
		b.ReportMetric(ms(first), "write-to-first-ms")
		b.ReportMetric(ms(last), "write-to-last-ms")
	}
	b.ReportMetric(float64(fanout.Microseconds())/float64(b.N*n), "µs/stream")
	return ms(fanout)
}

// rotationTimes are one rotation's figures, as BenchmarkRotationFanout describes them.
type rotationTimes struct {
	fanout, toFirst, toLast time.Duration
	cpu                     time.Duration // the agent's, from just before the first stream's receipt to the last's
	clientCPU               time.Duration // the benchmark process's (the clients'), from the first receipt to the last
}

// cpuSampling is how often the agent's CPU time is read while a renewal is awaited.
const cpuSampling = 2 * time.Millisecond

// rotationOnce opens n streams on 1 + n/1000 connections to run, rotates (or waits for the
// renewal) and returns the times described at BenchmarkRotationFanout.
func rotationOnce(b *testing.B, n int, run agentRun) rotationTimes {
	b.Helper()
	b.StopTimer()
	defer b.StartTimer()
	conns := make([]*grpc.ClientConn, 1+n/1000)
	for i := range conns {
		conns[i] = dial(b, run.socket)
		defer func() { _ = conns[i].Close() }()
	}
	ctx, cancel := context.WithTimeout(b.Context(), 5*renewalTTL)
	defer cancel()

	var opened, rotated sync.WaitGroup
	opened.Add(n)
	rotated.Add(n)
	rotating := make(chan struct{})
	firstLeaves := make([][]byte, n)
	received := make([]time.Time, n)
	errs := make(chan error, n)
	// The agent's CPU is counted from just before the rotation reaches the first stream: for
	// files from before the rewrite; for a renewal, which the agent times itself, from the last
	// of the samples taken every cpuSampling until the first stream has the new certificate.
	// Either way it includes making the new certificate ready (reading the files, or the key,
	// CSR and call to the CA), the same work for both agents.
	var cpuSample atomic.Int64
	var cpuStart, clientStart time.Duration
	var firstOnce sync.Once
	firstReceived := make(chan struct{})
	for i := range n {
		go func() {
			defer rotated.Done()
			s, leaf, err := openRawStream(ctx, conns[i%len(conns)], fmt.Sprintf("envoy-%d", i))
			firstLeaves[i] = leaf
			opened.Done()
			if err != nil {
				errs <- err
				return
			}
			<-rotating
			at, raw, err := s.await(leaf)
			if err != nil {
				errs <- err
				return
			}
			received[i] = at
			firstOnce.Do(func() {
				cpuStart = time.Duration(cpuSample.Load())
				clientStart = processCPU()
				close(firstReceived)
			})
			// Envoy acknowledges it, and the agent handles that during the rotation.
			if err := s.ackRaw(raw); err != nil {
				errs <- err
			}
		}()
	}
	opened.Wait()
	select {
	case err := <-errs:
		b.Fatal(err)
	default:
	}
	for _, leaf := range firstLeaves {
		if !bytes.Equal(leaf, firstLeaves[0]) {
			b.Fatal("the certificate was renewed before every stream was open: raise renewalTTL")
		}
	}

	cpu, err := cpuOf(run.pid)
	if err != nil {
		b.Fatal(err)
	}
	cpuSample.Store(int64(cpu))
	var sampler sync.WaitGroup
	if run.rotate == nil {
		sampler.Go(func() {
			tick := time.NewTicker(cpuSampling)
			defer tick.Stop()
			for {
				select {
				case <-firstReceived:
					return
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				if cpu, err := cpuOf(run.pid); err == nil {
					cpuSample.Store(int64(cpu))
				}
			}
		})
	}
	began := time.Now()
	if run.rotate != nil {
		run.rotate()
	}
	close(rotating)
	rotated.Wait()
	clientCPU := processCPU() - clientStart
	sampler.Wait()
	if cpu, err = cpuOf(run.pid); err != nil {
		b.Fatal(err)
	}
	cpu -= cpuStart
	select {
	case err := <-errs:
		b.Fatal(err)
	default:
	}
	first, last := received[0], received[0]
	for _, at := range received {
		if at.Before(first) {
			first = at
		}
		if at.After(last) {
			last = at
		}
	}
	return rotationTimes{fanout: last.Sub(first), toFirst: first.Sub(began), toLast: last.Sub(began), cpu: cpu, clientCPU: clientCPU}
}

// processCPU is the CPU time the benchmark process (its clients) has used; getrusage of the
// calling process does not fail.
func processCPU() time.Duration {
	var u syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &u)
	return time.Duration(u.Utime.Nano() + u.Stime.Nano())
}

// cpuOf is the CPU time process pid has used, the sum of its threads' (schedstat, in ns: the
// process's stat counts in clock ticks, too coarse for a rotation).
func cpuOf(pid int) (time.Duration, error) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return 0, err
	}
	var sum time.Duration
	for _, task := range tasks {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/schedstat", pid, task.Name()))
		if err != nil {
			continue // the thread ended
		}
		fields := strings.Fields(string(data))
		if len(fields) == 0 {
			return 0, fmt.Errorf("schedstat of %d/%s: %q", pid, task.Name(), data)
		}
		ns, err := strconv.ParseInt(fields[0], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("schedstat of %d/%s: %w", pid, task.Name(), err)
		}
		sum += time.Duration(ns)
	}
	return sum, nil
}

// rawStream is an Envoy-style SDS stream whose responses are kept as their encoding.
type rawStream struct {
	grpc.ClientStream
	node string
}

var streamSecrets = &grpc.StreamDesc{StreamName: "StreamSecrets", ServerStreams: true, ClientStreams: true}

// openRawStream subscribes to "default", acknowledges the first response, and returns the leaf
// (PEM) it carries.
func openRawStream(ctx context.Context, conn *grpc.ClientConn, node string) (*rawStream, []byte, error) {
	cs, err := conn.NewStream(ctx, streamSecrets, "/envoy.service.secret.v3.SecretDiscoveryService/StreamSecrets",
		grpc.ForceCodecV2(sdstest.RawCodec{}))
	if err != nil {
		return nil, nil, err
	}
	s := &rawStream{ClientStream: cs, node: node}
	if err := s.SendMsg(&discovery.DiscoveryRequest{Node: &core.Node{Id: node}, ResourceNames: []string{"default"},
		TypeUrl: sds.SecretTypeURL}); err != nil {
		return nil, nil, err
	}
	var raw sdstest.RawMessage
	if err := s.RecvMsg(&raw); err != nil {
		return nil, nil, err
	}
	resp, err := s.ack(raw)
	if err != nil {
		return nil, nil, err
	}
	var secret tlsv3.Secret
	if err := resp.GetResources()[0].UnmarshalTo(&secret); err != nil {
		return nil, nil, err
	}
	chain := secret.GetTlsCertificate().GetCertificateChain().GetInlineBytes()
	const end = "-----END CERTIFICATE-----"
	i := bytes.Index(chain, []byte(end))
	if i < 0 {
		return nil, nil, errors.New("the first response holds no certificate chain")
	}
	return s, chain[:i+len(end)], nil
}

// ack answers a response, as Envoy does.
func (s *rawStream) ack(raw sdstest.RawMessage) (*discovery.DiscoveryResponse, error) {
	var resp discovery.DiscoveryResponse
	if err := proto.Unmarshal(raw, &resp); err != nil {
		return nil, err
	}
	if len(resp.GetResources()) == 0 {
		return nil, errors.New("a response holds no secret")
	}
	return &resp, s.SendMsg(&discovery.DiscoveryRequest{VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce(),
		ResourceNames: []string{"default"}, TypeUrl: sds.SecretTypeURL})
}

// ackRaw answers a response from its encoding: only its version_info and nonce are read, not
// its resources.
func (s *rawStream) ackRaw(raw sdstest.RawMessage) error {
	version, nonce, err := versionAndNonce(raw)
	if err != nil {
		return err
	}
	return s.SendMsg(&discovery.DiscoveryRequest{VersionInfo: version, ResponseNonce: nonce,
		ResourceNames: []string{"default"}, TypeUrl: sds.SecretTypeURL})
}

// versionAndNonce reads a DiscoveryResponse's version_info (field 1) and nonce (field 5) from
// its encoding, skipping every other field.
func versionAndNonce(raw []byte) (version, nonce string, err error) {
	for len(raw) > 0 {
		num, typ, n := protowire.ConsumeTag(raw)
		if n < 0 {
			return "", "", protowire.ParseError(n)
		}
		raw = raw[n:]
		if typ == protowire.BytesType && (num == 1 || num == 5) {
			v, n := protowire.ConsumeString(raw)
			if n < 0 {
				return "", "", protowire.ParseError(n)
			}
			if num == 1 {
				version = v
			} else {
				nonce = v
			}
			raw = raw[n:]
			continue
		}
		if n = protowire.ConsumeFieldValue(num, typ, raw); n < 0 {
			return "", "", protowire.ParseError(n)
		}
		raw = raw[n:]
	}
	return version, nonce, nil
}

// await receives until a response does not carry the leaf (PEM) the stream had, and returns
// when it came, and the response. Another response (pilot-agent may push the same certificate
// again) is acknowledged.
func (s *rawStream) await(leaf []byte) (time.Time, sdstest.RawMessage, error) {
	for {
		var raw sdstest.RawMessage
		if err := s.RecvMsg(&raw); err != nil {
			return time.Time{}, nil, err
		}
		if !bytes.Contains(raw, leaf) {
			return time.Now(), raw, nil
		}
		if err := s.ackRaw(raw); err != nil {
			return time.Time{}, nil, err
		}
	}
}

// renewalTTL is the certificates' lifetime in the renewal case: they are renewed at half of it,
// by when every stream must be open.
const renewalTTL = 20 * time.Second

// renewalCA is meshid's CA, in process on loopback, with a token for default/bench.
type renewalCA struct {
	addr, rootFile, tokenFile string
}

func startRenewalCA(b *testing.B) renewalCA {
	b.Helper()
	cfg := controlplanetest.Config(b)
	cp := controlplanetest.Start(b, cfg)
	tokenFile := filepath.Join(b.TempDir(), "token")
	tok := controlplanetest.Token(b, cfg.StateDir, "default", "bench", time.Now(), 24*time.Hour)
	if err := os.WriteFile(tokenFile, []byte(tok), 0o600); err != nil {
		b.Fatal(err)
	}
	return renewalCA{addr: cp.GRPCAddr(), rootFile: filepath.Join(cfg.StateDir, "root-cert.pem"), tokenFile: tokenFile}
}

// startMeshidRenewal starts meshid-agent against ca, renewing at half of renewalTTL, with the
// stream limits raised for n streams (as BenchmarkStreams does).
func startMeshidRenewal(b *testing.B, n int, ca renewalCA) agentRun {
	b.Helper()
	p := startAgent(b, "--ca-addr", ca.addr, "--ca-root-cert", ca.rootFile, "--token-path", ca.tokenFile,
		"--namespace", "default", "--service-account", "bench",
		"--secret-ttl", renewalTTL.String(), "--grace-period-ratio", "0.5", "--grace-period-ratio-jitter", "0",
		"--sds-max-streams", strconv.Itoa(2*n), "--sds-max-streams-per-connection", "1000")
	return agentRun{socket: p.socket, pid: p.cmd.Process.Pid}
}

// startMeshidFiles starts meshid-agent on mounted credential files, with the stream limits
// raised for n streams.
func startMeshidFiles(b *testing.B, n int) agentRun {
	b.Helper()
	creds := b.TempDir()
	rotate := credentialWriter(b, creds)
	rotate()
	p := startAgent(b, "--credentials-dir", creds, "--sds-max-streams", strconv.Itoa(2*n),
		"--sds-max-streams-per-connection", "1000")
	return agentRun{socket: p.socket, rotate: rotate, pid: p.cmd.Process.Pid}
}

// startPilotAgent starts Istio's pilot-agent (from dir) in a working directory of its own, which
// it resolves its paths against: with files, serving mounted credential files from it, as on
// Kubernetes with a workload-spiffe-credentials volume; else renewing from ca at half of
// renewalTTL, with a token and the CA's root where Istio mounts them. Its status server listens
// on every interface on a fixed port, here one the kernel had free. Its xDS proxy has no
// discovery server (ca serves none): it retries in the background, which SDS does not wait for.
// Envoy is the smallest Go program, which only sleeps: pilot-agent serves SDS only while it runs
// an Envoy.
func startPilotAgent(b *testing.B, dir string, ca renewalCA, files bool) agentRun {
	b.Helper()
	work := testutil.ShortTempDir(b)
	bootstrap := filepath.Join(work, "envoy.json")
	if err := os.WriteFile(bootstrap, []byte("{}"), 0o600); err != nil {
		b.Fatal(err)
	}
	proxyConfig, err := json.Marshal(map[string]any{
		"discoveryAddress": ca.addr, "binaryPath": sleeperBinary(b), "customConfigFile": bootstrap,
		"statusPort": freePort(b),
	})
	if err != nil {
		b.Fatal(err)
	}
	env := []string{
		"HOME=" + work,
		"POD_NAMESPACE=default",
		"POD_NAME=bench-1",
		"SERVICE_ACCOUNT=bench",
		"INSTANCE_IP=127.0.0.1",
		"PROXY_CONFIG=" + string(proxyConfig),
	}
	run := agentRun{socket: filepath.Join(work, "var/run/secrets/workload-spiffe-uds/socket")}
	if files {
		creds := filepath.Join(work, "var/run/secrets/workload-spiffe-credentials")
		if err := os.MkdirAll(creds, 0o750); err != nil {
			b.Fatal(err)
		}
		run.rotate = credentialWriter(b, creds)
		run.rotate()
		env = append(env, "XDS_ROOT_CA="+filepath.Join(creds, "root-cert.pem"))
	} else {
		root, err := os.ReadFile(ca.rootFile)
		if err != nil {
			b.Fatal(err)
		}
		token, err := os.ReadFile(ca.tokenFile)
		if err != nil {
			b.Fatal(err)
		}
		for path, data := range map[string][]byte{"var/run/secrets/istio/root-cert.pem": root, "var/run/secrets/tokens/istio-token": token} {
			path = filepath.Join(work, path)
			if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
				b.Fatal(err)
			}
			if err := os.WriteFile(path, data, 0o600); err != nil {
				b.Fatal(err)
			}
		}
		env = append(env, "CA_ADDR="+ca.addr, "PILOT_CERT_PROVIDER=istiod", "SECRET_TTL="+renewalTTL.String(),
			"SECRET_GRACE_PERIOD_RATIO=0.5", "SECRET_GRACE_PERIOD_RATIO_JITTER=0")
	}
	log, err := os.Create(filepath.Join(b.TempDir(), "pilot-agent.log"))
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = log.Close() }()
	cmd := exec.Command(filepath.Join(dir, "pilot-agent"), "proxy", "sidecar")
	cmd.Dir = work
	cmd.Env = env // only what the scenario means: pilot-agent reads dozens of variables
	cmd.Stdout, cmd.Stderr = log, log
	// A process group of its own, to kill its Envoy with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		b.Fatalf("start pilot-agent: %v", err)
	}
	run.pid = cmd.Process.Pid
	b.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
		if b.Failed() {
			out, _ := os.ReadFile(log.Name())
			b.Logf("pilot-agent's log:\n%s", out)
		}
	})
	return run
}

// freePort returns a TCP port the kernel has free on every interface.
func freePort(b *testing.B) int {
	b.Helper()
	l, err := net.Listen("tcp", ":0")
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = l.Close() }()
	return l.Addr().(*net.TCPAddr).Port
}

// credentialWriter returns a function that writes a new workload key pair and its root into dir
// as mountedCredentials does.
func credentialWriter(b *testing.B, dir string) func() {
	b.Helper()
	root := testutil.NewRootCA(b, testutil.CAOptions{})
	return func() {
		leaf, key := root.IssueWorkload(b, "spiffe://cluster.local/ns/default/sa/bench", time.Hour)
		writeCredentials(b, dir, map[string][]byte{
			"cert-chain.pem": testutil.CertPEM(leaf, root.Cert),
			"key.pem":        testutil.KeyPEM(b, key),
			"root-cert.pem":  testutil.CertPEM(root.Cert),
		})
	}
}

// The benchmark's clients acknowledge from the encoding what a decoder would read.
func TestVersionAndNonce(t *testing.T) {
	t.Parallel()
	resource, err := anypb.New(&tlsv3.Secret{Name: "default"})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []*discovery.DiscoveryResponse{
		{VersionInfo: "2026-11-27T13:00:00Z/7", Resources: []*anypb.Any{resource}, TypeUrl: sds.SecretTypeURL, Nonce: "5f0c"},
		{Resources: []*anypb.Any{resource, resource}, Nonce: "12", ControlPlane: &core.ControlPlane{Identifier: "x"}},
		{VersionInfo: "a"},
	} {
		raw, err := proto.Marshal(want)
		if err != nil {
			t.Fatal(err)
		}
		version, nonce, err := versionAndNonce(raw)
		if err != nil || version != want.GetVersionInfo() || nonce != want.GetNonce() {
			t.Errorf("versionAndNonce = %q, %q, %v; want %q, %q", version, nonce, err, want.GetVersionInfo(), want.GetNonce())
		}
	}
	if _, _, err := versionAndNonce([]byte{0x0a, 0x05, 'a'}); err == nil {
		t.Error("a truncated field was read")
	}
}
