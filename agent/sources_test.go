package agent_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	spiffeapi "github.com/spiffe/go-spiffe/v2/workloadapi"
	"google.golang.org/grpc/codes"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds/sdsclient"
	"github.com/meshid/meshid/sds/sdstest"
)

// sdsGet fetches names from the socket with the production client of `meshid certs`.
func sdsGet(t *testing.T, socket string, names ...string) map[string]*tlsv3.Secret {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	got, err := sdsclient.Get(ctx, socket, "test", names...)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

const sourceChosen = "SDS source chosen"

func TestAgentSourceDecisionFlow(t *testing.T) {
	t.Parallel()
	filesCA := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "files root"})
	tests := []struct {
		name   string
		source agent.Source
		reason string
		// setup prepares the directories and the configuration, and returns the checks to run
		// against the running agent.
		setup func(t *testing.T, cfg *agent.Config) func(t *testing.T, a *agent.Agent, logs *logSink)
	}{
		{
			name:   "live external socket",
			source: agent.SourceExternalSDS,
			reason: "another server answers on ",
			setup: func(t *testing.T, cfg *agent.Config) func(*testing.T, *agent.Agent, *logSink) {
				// The external server is another agent, serving its files on the same socket.
				theirs := newCredentials(t, filesCA, "spiffe://cluster.local/ns/default/sa/theirs")
				extCfg := testConfig(t, newFakeClock(), nil, nil)
				extCfg.SDS.SocketDir = cfg.SDS.SocketDir
				extCfg.SDS.CredentialsDir = credentialsDir(t, theirs)
				stopExternal := runAgent(t, newAgent(t, extCfg))
				// Ours would serve other files, were it to serve at all.
				cfg.SDS.CredentialsDir = credentialsDir(t, newCredentials(t, filesCA, "spiffe://cluster.local/ns/default/sa/ours"))
				return func(t *testing.T, a *agent.Agent, logs *logSink) {
					if a.Secrets() != nil {
						t.Fatal("the agent built a secret manager although another server serves SDS")
					}
					if n := len(logs.records(t, "Workload API not served: another server answers on the SDS socket")); n != 1 {
						t.Fatalf("%d lines say the Workload API is not served, want 1", n)
					}
					if got := serialOf(workloadChain(t, sdsGet(t, a.SocketPath(), "default")["default"])); got != theirs.serial {
						t.Fatalf("the socket serves %s, want the external server's %s", got, theirs.serial)
					}
					ready := "http://" + a.StatusAddr() + "/healthz/ready"
					if code, body := httpGet(t, ready); code != http.StatusOK {
						t.Fatalf("/healthz/ready with the external socket answering = %d %q, want 200", code, body)
					}
					if err := stopExternal(); err != nil {
						t.Fatal(err)
					}
					if code, body := httpGet(t, ready); code != http.StatusServiceUnavailable || !strings.Contains(body, "does not accept connections") {
						t.Fatalf("/healthz/ready with the external socket closed = %d %q, want 503 with the reason", code, body)
					}
				}
			},
		},
		{
			name:   "stale socket file is removed",
			source: agent.SourceFiles,
			reason: "credential files found in ",
			setup: func(t *testing.T, cfg *agent.Config) func(*testing.T, *agent.Agent, *logSink) {
				path := filepath.Join(cfg.SDS.SocketDir, "socket")
				lis, err := net.Listen("unix", path)
				if err != nil {
					t.Fatal(err)
				}
				lis.(*net.UnixListener).SetUnlinkOnClose(false)
				if err := lis.Close(); err != nil {
					t.Fatal(err)
				}
				if _, err := os.Lstat(path); err != nil {
					t.Fatalf("no stale socket left: %v", err)
				}
				creds := newCredentials(t, filesCA, embeddedID)
				cfg.SDS.CredentialsDir = credentialsDir(t, creds)
				return func(t *testing.T, a *agent.Agent, logs *logSink) {
					if n := len(logs.records(t, "removed a stale socket")); n != 1 {
						t.Fatalf("stale socket removal logged %d times, want 1", n)
					}
					if got := serialOf(workloadChain(t, sdsGet(t, a.SocketPath(), "default")["default"])); got != creds.serial {
						t.Fatalf("serves %s, want %s", got, creds.serial)
					}
				}
			},
		},
		{
			name:   "credential files",
			source: agent.SourceFiles,
			reason: "credential files found in ",
			setup: func(t *testing.T, cfg *agent.Config) func(*testing.T, *agent.Agent, *logSink) {
				creds := newCredentials(t, filesCA, "spiffe://cluster.local/ns/shop/sa/cart")
				cfg.SDS.CredentialsDir = credentialsDir(t, creds)
				cfg.CA.Address = closedAddress(t) // never contacted: a CA request would never succeed
				cfg.Identity.Namespace, cfg.Identity.ServiceAccount = "shop", "cart"
				return func(t *testing.T, a *agent.Agent, logs *logSink) {
					got := sdsGet(t, a.SocketPath(), secretNames...)
					if serial := serialOf(workloadChain(t, got["default"])); serial != creds.serial {
						t.Fatalf("serves %s, want the files' %s", serial, creds.serial)
					}
					// The Workload API serves the files' identity too.
					ctx, cancel := context.WithTimeout(t.Context(), wait)
					defer cancel()
					x509ctx, err := spiffeapi.FetchX509Context(ctx, spiffeapi.WithAddr("unix://"+a.SocketPath()))
					if err != nil || len(x509ctx.SVIDs) != 1 || serialOf(x509ctx.SVIDs[0].Certificates) != creds.serial {
						t.Fatalf("FetchX509Context: %v, %v; want the files' %s", x509ctx, err, creds.serial)
					}
					if roots := sdstest.Roots(t, got["ROOTCA"]); len(roots) != 1 || !roots[0].Equal(creds.root) {
						t.Fatalf("ROOTCA holds %d roots, want root-cert.pem's", len(roots))
					}
					if n := len(logs.records(t, "CA source")); n != 0 {
						t.Fatal("the agent set up a CA client in file mode")
					}
				}
			},
		},
		{
			name:   "FILE_MOUNTED_CERTS serves etc/certs",
			source: agent.SourceFiles,
			reason: "FILE_MOUNTED_CERTS is set",
			setup: func(t *testing.T, cfg *agent.Config) func(*testing.T, *agent.Agent, *logSink) {
				mounted := newCredentials(t, filesCA, "spiffe://cluster.local/ns/shop/sa/mounted")
				testutil.WriteFiles(t, filepath.Join(cfg.RootDir, "etc/certs"), mounted.files)
				cfg.SDS.CredentialsDir = credentialsDir(t, newCredentials(t, filesCA, "spiffe://cluster.local/ns/shop/sa/other"))
				cfg.SDS.FileMountedCerts = true
				return func(t *testing.T, a *agent.Agent, _ *logSink) {
					if got := serialOf(workloadChain(t, sdsGet(t, a.SocketPath(), "default")["default"])); got != mounted.serial {
						t.Fatalf("serves %s, want etc/certs' %s", got, mounted.serial)
					}
				}
			},
		},
		{
			name:   "a CA address and no credential files",
			source: agent.SourceCA,
			reason: "no credential files in ",
			setup: func(t *testing.T, cfg *agent.Config) func(*testing.T, *agent.Agent, *logSink) {
				e := newEnv(t)
				cfg.Clock = e.clock
				cfg.Identity.Namespace, cfg.Identity.ServiceAccount = "default", "demo"
				cfg.CA.Address = e.ca.GRPCAddr()
				cfg.CA.RootCert = filepath.Join(e.stateDir, "root-cert.pem")
				cfg.CA.TokenPath = e.tokenFile(t, "default", "demo")
				return func(t *testing.T, a *agent.Agent, logs *logSink) {
					if r := logs.records(t, sourceChosen); !strings.Contains(fmt.Sprint(r[0]["reason"]), e.ca.GRPCAddr()) {
						t.Fatalf("the reason %q does not name the CA", r[0]["reason"])
					}
					got := sdsGet(t, a.SocketPath(), secretNames...)
					chain := workloadChain(t, got["default"])
					checkVerifies(t, chain, readRoots(t, cfg.CA.RootCert), demoID, e.clock.Now())
					checkVerifies(t, chain, sdstest.Roots(t, got["ROOTCA"]), demoID, e.clock.Now())
				}
			},
		},
		{
			name:   "no CA address: the embedded CA",
			source: agent.SourceEmbeddedCA,
			reason: "running the control plane in-process",
			setup: func(t *testing.T, cfg *agent.Config) func(*testing.T, *agent.Agent, *logSink) {
				return func(t *testing.T, a *agent.Agent, _ *logSink) {
					got := sdsGet(t, a.SocketPath(), secretNames...)
					chain := workloadChain(t, got["default"])
					roots := sdstest.Roots(t, got["ROOTCA"])
					now := cfg.Clock.Now()
					checkVerifies(t, chain, roots, embeddedID, now)
					// The trust bundle is the embedded CA's, from its state dir under --root-dir.
					stateRoots := readRoots(t, filepath.Join(cfg.RootDir, "var/lib/meshid/root-cert.pem"))
					if len(roots) != len(stateRoots) || !roots[0].Equal(stateRoots[0]) {
						t.Fatal("ROOTCA is not the embedded CA's root")
					}
					ctx, cancel := context.WithTimeout(t.Context(), wait)
					defer cancel()
					report, err := sdsclient.Inspect(ctx, a.SocketPath(), now)
					if err != nil {
						t.Fatal(err)
					}
					if !report.Verified || report.SPIFFEID != embeddedID || report.Serial != serialOf(chain) {
						t.Fatalf("Inspect: %+v", report)
					}
				}
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			logs := newLogSink(t)
			cfg := testConfig(t, newFakeClock(), logs, nil)
			check := tt.setup(t, &cfg)
			a := newAgent(t, cfg)
			if a.Source() != tt.source {
				t.Fatalf("source %s, want %s", a.Source(), tt.source)
			}
			chosen := logs.records(t, sourceChosen)
			if len(chosen) != 1 {
				t.Fatalf("%q logged %d times, want once", sourceChosen, len(chosen))
			}
			if chosen[0]["source"] != string(tt.source) || !strings.Contains(fmt.Sprint(chosen[0]["reason"]), tt.reason) {
				t.Fatalf("logged source %v, reason %q; want %s, a reason with %q", chosen[0]["source"], chosen[0]["reason"], tt.source, tt.reason)
			}
			runAgent(t, a)
			check(t, a, logs)
		})
	}
}

// closedAddress returns a loopback address nothing listens on.
func closedAddress(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	_ = lis.Close()
	return addr
}

// An independent Envoy-style client gets default and ROOTCA from the embedded pipeline by
// StreamSecrets, DeltaSecrets and FetchSecrets, sees rotations pushed with a short TTL, and sees
// a NACK answered with silence.
func TestEnvoyStyleClientAgainstEmbeddedAgent(t *testing.T) {
	t.Parallel()
	clk := newFakeClock() // shared by the agent and its embedded CA
	cfg := testConfig(t, clk, newLogSink(t), nil)
	cfg.Certificate.TTL = time.Minute
	a := newAgent(t, cfg)
	runAgent(t, a)
	envoy := sdstest.Dial(t, a.SocketPath())

	sotw := envoy.StreamSecrets()
	sotw.Subscribe(secretNames...)
	last, initial := sotw.RecvAll(secretNames...)
	sotw.Ack(last, secretNames...)
	roots := sdstest.Roots(t, initial["ROOTCA"])
	chain := workloadChain(t, initial["default"])
	checkVerifies(t, chain, roots, embeddedID, clk.Now())
	serial0 := serialOf(chain)
	if life := chain[0].NotAfter.Sub(clk.Now()); life > time.Minute || life < 50*time.Second {
		t.Fatalf("certificate valid for %s more, want the 1m SECRET_TTL", life)
	}

	delta := envoy.DeltaSecrets()
	delta.Subscribe(secretNames...)
	last, _, viaDelta := delta.RecvAll(secretNames...)
	delta.Ack(last)
	if got := serialOf(workloadChain(t, viaDelta["default"])); got != serial0 {
		t.Fatalf("DeltaSecrets default %s, StreamSecrets %s", got, serial0)
	}
	if got := sdstest.Roots(t, viaDelta["ROOTCA"]); len(got) != len(roots) || !got[0].Equal(roots[0]) {
		t.Fatal("DeltaSecrets ROOTCA differs from StreamSecrets'")
	}
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	fetched, err := envoy.Fetch(ctx, secretNames...)
	if err != nil {
		t.Fatal(err)
	}
	if got := serialOf(workloadChain(t, fetched["default"])); got != serial0 {
		t.Fatalf("FetchSecrets default %s, StreamSecrets %s", got, serial0)
	}
	if got := sdstest.Roots(t, fetched["ROOTCA"]); len(got) != len(roots) || !got[0].Equal(roots[0]) {
		t.Fatal("FetchSecrets ROOTCA differs from StreamSecrets'")
	}

	// A rotation reaches both open streams, with a new serial.
	rotate(t, clk, a)
	p1 := sotw.Recv()
	if p1.Secrets["default"] == nil {
		t.Fatalf("rotation pushed %v, not default", p1.Names())
	}
	chain1 := workloadChain(t, p1.Secrets["default"])
	checkVerifies(t, chain1, roots, embeddedID, clk.Now())
	serial1 := serialOf(chain1)
	if serial1 == serial0 {
		t.Fatal("the rotation pushed the same serial")
	}
	d1 := delta.Recv()
	delta.Ack(d1)
	if got := serialOf(workloadChain(t, d1.Secrets["default"])); got != serial1 {
		t.Fatalf("DeltaSecrets got %s on rotation, StreamSecrets %s", got, serial1)
	}

	// Envoy rejects it: no reply until the secret changes, so the next response is the next
	// rotation, not the rejected certificate sent again.
	sotw.Nack(p1, last.Version, "rejected by the test", secretNames...)
	awaitNACKs(t, a, 1)
	rotate(t, clk, a)
	p2 := sotw.Recv()
	if p2.Secrets["default"] == nil {
		t.Fatalf("after the NACK: pushed %v, not default", p2.Names())
	}
	serial2 := serialOf(workloadChain(t, p2.Secrets["default"]))
	if serial2 == serial1 {
		t.Fatal("the NACKed certificate was sent again")
	}
	d2 := delta.Recv()
	if got := serialOf(workloadChain(t, d2.Secrets["default"])); got != serial2 {
		t.Fatalf("DeltaSecrets got %s on the second rotation, StreamSecrets %s", got, serial2)
	}
}

// awaitNACKs returns once the agent has counted n NACKs (meshid_sds_nacks_total on /metrics).
func awaitNACKs(t *testing.T, a *agent.Agent, n int) {
	t.Helper()
	giveUp := time.Now().Add(wait)
	for metric(t, a, "meshid_sds_nacks_total") != strconv.Itoa(n) {
		if time.Now().After(giveUp) {
			t.Fatalf("meshid_sds_nacks_total never reached %d", n)
		}
		runtime.Gosched()
	}
}

// received is a response read off the test's goroutine, or the error that ended the stream.
type received struct {
	push sdstest.Push
	err  error
}

// pump reads s's responses on a goroutine, acknowledging none, until the stream ends.
func pump(s *sdstest.Stream) <-chan received {
	ch := make(chan received, 16)
	go func() {
		for {
			resp, err := s.Stream.Recv()
			if err != nil {
				ch <- received{err: err}
				return
			}
			secrets, err := sdstest.Parse(nil, resp.GetResources())
			ch <- received{push: sdstest.Push{Version: resp.GetVersionInfo(), Nonce: resp.GetNonce(), Secrets: secrets}, err: err}
			if err != nil {
				return
			}
		}
	}()
	return ch
}

// Credential files swapped the Kubernetes way reach an open stream, each push a matching pair.
func TestFileModeSwapsArePushed(t *testing.T) {
	t.Parallel()
	const swaps = 10
	ca := testutil.NewRootCA(t, testutil.CAOptions{})
	id := "spiffe://cluster.local/ns/shop/sa/cart"
	clk := newFakeClock() // the file watcher debounces on it
	cfg := testConfig(t, clk, newLogSink(t), nil)
	mount := testutil.NewSecretVolume(t, filepath.Join(t.TempDir(), "credentials"))
	first := newCredentials(t, ca, id)
	mount.Update(first.files)
	cfg.SDS.CredentialsDir = mount.Dir
	a := newAgent(t, cfg)
	if a.Source() != agent.SourceFiles {
		t.Fatalf("source %s, want files", a.Source())
	}
	runAgent(t, a)
	sotw := sdstest.Dial(t, a.SocketPath()).StreamSecrets()
	sotw.Subscribe(secretNames...)
	initial := sotw.Collect(secretNames...)
	if got := serialOf(workloadChain(t, initial["default"])); got != first.serial {
		t.Fatalf("serves %s, want %s", got, first.serial)
	}
	pushes := pump(sotw)

	// The loader re-reads a key pair when it expires: that timer stays pending all along.
	const longLived = 1
	for i := range swaps {
		want := newCredentials(t, ca, id)
		mount.Update(want.files)
		// Drive the debounce until the new pair arrives; anything pushed on the way must be a
		// matching pair too (workloadChain checks it).
		for {
			r := testutil.Drive(t, clk, 100*time.Millisecond, longLived, pushes)
			if r.err != nil {
				t.Fatalf("swap %d: %v", i+1, r.err)
			}
			sotw.Ack(r.push, secretNames...)
			if r.push.Secrets["default"] == nil {
				t.Fatalf("swap %d pushed %v, not default", i+1, r.push.Names())
			}
			got := serialOf(workloadChain(t, r.push.Secrets["default"]))
			if got == want.serial {
				break
			}
			t.Logf("swap %d: pushed %s while waiting for %s", i+1, got, want.serial)
		}
	}
}

func TestDebugSecretsShowsSecretsAndStreams(t *testing.T) {
	t.Parallel()
	clk := newFakeClock()
	cfg := testConfig(t, clk, newLogSink(t), nil)
	a := newAgent(t, cfg)
	runAgent(t, a)
	envoy := sdstest.Dial(t, a.SocketPath())
	both := envoy.StreamSecrets()
	both.Subscribe(secretNames...)
	chain := workloadChain(t, both.Collect(secretNames...)["default"])
	roots := envoy.StreamSecrets()
	roots.Subscribe("ROOTCA")
	roots.Collect("ROOTCA")
	delta := envoy.DeltaSecrets() // SotW and delta number their streams apart
	delta.Subscribe("default")
	delta.RecvAll("default")

	source, secrets := debugSecrets(t, a)
	if source != string(agent.SourceEmbeddedCA) {
		t.Errorf("source %q, want %s", source, agent.SourceEmbeddedCA)
	}
	seen := map[string]bool{}
	for _, s := range secrets {
		seen[s.Name] = true
		switch s.Name {
		case "default":
			leaf := chain[0]
			if !s.Valid || s.Error != "" || s.SPIFFEID != embeddedID || s.Serial != serialOf(chain) || !s.NotAfter.Equal(leaf.NotAfter) || s.Source != "ca" {
				t.Errorf("default: %+v, want a valid %s %s until %s from ca", s, embeddedID, serialOf(chain), leaf.NotAfter)
			}
			// Half of the lifetime, counted from when it was received (now: the clock stands still).
			if want := leaf.NotAfter.Add(-leaf.NotAfter.Sub(clk.Now()) / 2); !s.NextRotation.Equal(want) {
				t.Errorf("default: next rotation %s, want %s", s.NextRotation, want)
			}
			if s.Streams != 2 {
				t.Errorf("default: %d subscribed streams, want 2", s.Streams)
			}
		case "ROOTCA":
			if !s.Valid || s.Roots != 1 || s.Streams != 2 {
				t.Errorf("ROOTCA: %+v, want valid, 1 root and 2 subscribed streams", s)
			}
		default:
			t.Errorf("unexpected secret %q", s.Name)
		}
	}
	if !seen["default"] || !seen["ROOTCA"] {
		t.Fatalf("/debug/secrets lacks default or ROOTCA: %+v", secrets)
	}
	if code, _ := httpGet(t, "http://"+a.StatusAddr()+"/debug/secrets"); code != http.StatusNotFound {
		t.Errorf("the status server answers /debug/secrets with %d, want 404: it is reachable off the host", code)
	}
}

func TestMetricsCountStreamsAndPushes(t *testing.T) {
	t.Parallel()
	a := newAgent(t, testConfig(t, newFakeClock(), newLogSink(t), nil))
	runAgent(t, a)
	envoy := sdstest.Dial(t, a.SocketPath())
	sotw := envoy.StreamSecrets()
	sotw.Subscribe(secretNames...)
	sotw.Collect(secretNames...)
	delta := envoy.DeltaSecrets()
	delta.Subscribe("default")
	delta.RecvAll("default")
	// Both secrets are cached now: a new stream gets them in one response, counted as two pushes.
	again := envoy.StreamSecrets()
	again.Subscribe(secretNames...)
	if p := again.Recv(); len(p.Secrets) != 2 {
		t.Fatalf("a stream opened once both secrets exist got %v in its first response", p.Names())
	}
	for series, want := range map[string]string{
		`meshid_sds_streams{protocol="sotw"}`:  "2",
		`meshid_sds_streams{protocol="delta"}`: "1",
		"meshid_sds_secrets_pushed_total":      "5",
	} {
		if got := metric(t, a, series); got != want {
			t.Errorf("%s = %q, want %s", series, got, want)
		}
	}
}

// Cancelling Run with a stream open ends the stream and returns promptly with DrainDuration 0,
// leaving nothing that accepts connections on the socket.
func TestShutdownEndsOpenStreams(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t, newFakeClock(), newLogSink(t), nil)
	cfg.SDS.DrainDuration = 0
	a := newAgent(t, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	sotw := sdstest.Dial(t, a.SocketPath()).StreamSecrets()
	sotw.Subscribe(secretNames...)
	sotw.Collect(secretNames...)

	cancel()
	giveUp := time.NewTimer(wait) // generous: this is not a timing test
	defer giveUp.Stop()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-giveUp.C:
		t.Fatalf("Run still running %s after its context ended, with a stream open", wait)
	}
	if st := sotw.RecvErr(); st.Code() != codes.Unavailable {
		t.Fatalf("the open stream ended with %v, want Unavailable", st)
	}
	if conn, err := net.Dial("unix", a.SocketPath()); err == nil {
		_ = conn.Close()
		t.Fatal("the SDS socket still accepts connections after Run returned")
	}
}
