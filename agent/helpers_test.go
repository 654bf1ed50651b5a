package agent_test

import (
	"bufio"
	"context"
	"crypto/x509"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/internal/configerr"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds/sdstest"
	"github.com/meshid/meshid/secretmanager"
)

const (
	demoID     = "spiffe://cluster.local/ns/default/sa/demo"
	embeddedID = "spiffe://cluster.local/ns/default/sa/default"
	// wait bounds, in real time, how long a test waits for something that should come at once.
	wait = 30 * time.Second
)

var secretNames = []string{"default", "ROOTCA"}

// ---- a real CA, and an agent in front of it ----

// env is a real CA on 127.0.0.1:0 and a directory for one workload, on a shared fake clock.
type env struct {
	clock    *testutil.FakeClock
	ca       *controlplane.ControlPlane
	stateDir string
	dir      string
}

func newEnv(t *testing.T, mutate ...func(*controlplane.Config)) *env {
	t.Helper()
	e := &env{clock: newFakeClock(), stateDir: t.TempDir(), dir: t.TempDir()}
	cfg := controlplane.DefaultConfig()
	cfg.StateDir = e.stateDir
	cfg.GRPCAddr = "127.0.0.1:0"
	cfg.MonitoringAddr = ""
	cfg.Clock = e.clock
	for _, m := range mutate {
		m(&cfg)
	}
	// The CA checks its root once an hour; the tests step the clock by less between renewals.
	e.ca = controlplanetest.Start(t, cfg)
	return e
}

// newXDSEnv is newEnv whose CA serves xdsE2EConfig to Envoy's ADS.
func newXDSEnv(t *testing.T) *env {
	t.Helper()
	xdsConfig := filepath.Join(t.TempDir(), "xds.yaml")
	if err := os.WriteFile(xdsConfig, []byte(xdsE2EConfig), 0o600); err != nil {
		t.Fatal(err)
	}
	return newEnv(t, func(c *controlplane.Config) { c.XDSConfig = xdsConfig })
}

// certificateAndClusters runs the agent of cfg until it holds demo's certificate, and checks
// that an ADS stream through its XDS socket gets xdsE2EConfig's cluster.
func certificateAndClusters(t *testing.T, cfg agent.Config) {
	t.Helper()
	a := newAgent(t, cfg)
	certs := issued(t, a)
	runAgent(t, a)
	if s := receive(t, certs, "certificate"); s.KeyPair.Chain[0].URIs[0].String() != demoID {
		t.Fatalf("certificate for %v, want %s", s.KeyPair.Chain[0].URIs, demoID)
	}
	stream, err := xdsClient(t, cfg).StreamAggregatedResources(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if got := names(t, stream, resource.ClusterType); len(got) != 1 || got[0] != "backend" {
		t.Fatalf("clusters through the proxy: %v, want [backend]", got)
	}
}

// withCA gives a config a CA and the workload's identity, so that Validate has nothing else to
// say of it.
func withCA(c *agent.Config) {
	c.CA.Address = "ca.example:15012"
	c.Identity.Namespace, c.Identity.ServiceAccount = "ns", "sa"
}

// refusal is a config Validate must refuse: edit applied to the default one, refused for field
// with a message holding want.
type refusal struct {
	name  string
	edit  func(*agent.Config)
	field string
	want  string
}

func wantRefused(t *testing.T, cases []refusal) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := agent.DefaultConfig(t.TempDir())
			tc.edit(&cfg)
			err := cfg.Validate()
			if err == nil || !slices.Contains(configerr.Fields(err), tc.field) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate: %v; want %s: %q", err, tc.field, tc.want)
			}
		})
	}
}

// tokenFile writes a token for ns/sa and returns its path.
func (e *env) tokenFile(t *testing.T, ns, sa string) string {
	t.Helper()
	tok := controlplanetest.Token(t, e.stateDir, ns, sa, e.clock.Now(), time.Hour)
	path := filepath.Join(e.dir, "istio-token")
	if err := os.WriteFile(path, []byte(tok), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// config is an agent of default/demo using the CA with the token at tokenPath, writing
// OUTPUT_CERTS to <dir>/out.
func (e *env) config(t *testing.T, tokenPath string, ev *events) agent.Config {
	t.Helper()
	cfg := testConfig(t, e.clock, nil, ev)
	cfg.Identity.Namespace, cfg.Identity.ServiceAccount = "default", "demo"
	cfg.CA.Address = e.ca.GRPCAddr()
	cfg.CA.RootCert = filepath.Join(e.stateDir, "root-cert.pem")
	cfg.CA.TokenPath = tokenPath
	cfg.Output.Dir = filepath.Join(e.dir, "out")
	cfg.Certificate.TTL = 30 * time.Minute
	return cfg
}

// testConfig is an agent in fresh short directories (the embedded CA's socket lives under the
// root dir), on clk, with its servers on loopback ports chosen by the kernel. With nothing
// more it runs the embedded control plane.
func testConfig(t *testing.T, clk *testutil.FakeClock, logs *logSink, ev *events) agent.Config {
	t.Helper()
	cfg := agent.DefaultConfig(testutil.ShortTempDir(t))
	cfg.CA.Embed = controlplanetest.Embed
	cfg.SDS.SocketDir = testutil.ShortTempDir(t)
	cfg.Servers.StatusAddr, cfg.Servers.DebugAddr = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Certificate.GraceRatioJitter = 0
	cfg.Clock = clk
	if logs != nil {
		cfg.Logger = logs.logger()
	}
	if ev != nil {
		cfg.OnEvent = ev.record
	}
	return cfg
}

func newFakeClock() *testutil.FakeClock {
	return testutil.NewFakeClock(time.Now().Truncate(time.Second))
}

func newAgent(t *testing.T, cfg agent.Config) *agent.Agent {
	t.Helper()
	a, err := agent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// runAgent runs a until stop is called or the test ends; stop returns Run's result.
func runAgent(t *testing.T, a *agent.Agent) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	var (
		once sync.Once
		err  error
	)
	stop = func() error {
		once.Do(func() {
			cancel()
			err = <-done
		})
		return err
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return stop
}

// issued subscribes to the workload certificates a puts in service, before it runs.
func issued(t *testing.T, a *agent.Agent) <-chan *secretmanager.Secret {
	t.Helper()
	ch := make(chan *secretmanager.Secret, 16)
	cancel, err := a.Secrets().Subscribe("default", func(s *secretmanager.Secret, _ error) {
		if s != nil {
			ch <- s
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cancel)
	return ch
}

// receive returns the next value from ch, failing after wait.
func receive[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(wait):
		t.Fatalf("no %s", what)
		panic("unreachable")
	}
}

// rotate moves the fake clock to the renewal time of the certificate in service, once its
// renewal timer is armed (the CA's hourly root check is the other pending timer), so that
// exactly one renewal fires.
func rotate(t *testing.T, clk *testutil.FakeClock, a *agent.Agent) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	if err := clk.WaitForTimers(ctx, 2); err != nil {
		t.Fatalf("the renewal timer was never armed: %v", err)
	}
	for _, s := range a.Secrets().Snapshot() {
		if s.Name == "default" && s.Valid {
			clk.Advance(s.Secret.RenewAt.Sub(clk.Now()))
			return
		}
	}
	t.Fatal("no workload certificate in service")
}

// ---- the secret manager's events ----

// events records what the agent's secret manager reports and lets a test wait for one.
type events struct {
	mu      sync.Mutex
	seen    []secretmanager.Event
	changed chan struct{} // closed and replaced at every event
}

func newEvents() *events { return &events{changed: make(chan struct{})} }

func (e *events) record(ev secretmanager.Event) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.seen = append(e.seen, ev)
	close(e.changed)
	e.changed = make(chan struct{})
}

// channel delivers, from now on, each event match accepts; for testutil.Drive.
func (e *events) channel(t *testing.T, match func(secretmanager.Event) bool) <-chan secretmanager.Event {
	t.Helper()
	out := make(chan secretmanager.Event, 64)
	e.mu.Lock()
	from := len(e.seen)
	e.mu.Unlock()
	done := make(chan struct{})
	t.Cleanup(func() { close(done) })
	go func() {
		for {
			e.mu.Lock()
			seen, changed := e.seen[from:], e.changed
			from = len(e.seen)
			e.mu.Unlock()
			for _, ev := range seen {
				if match(ev) {
					out <- ev
				}
			}
			select {
			case <-changed:
			case <-done:
				return
			}
		}
	}()
	return out
}

// await returns the first event, from the start, that match accepts.
func (e *events) await(t *testing.T, what string, match func(secretmanager.Event) bool) secretmanager.Event {
	t.Helper()
	giveUp := time.NewTimer(wait)
	defer giveUp.Stop()
	for i := 0; ; {
		e.mu.Lock()
		seen, changed := e.seen[i:], e.changed
		i = len(e.seen)
		e.mu.Unlock()
		for _, ev := range seen {
			if match(ev) {
				return ev
			}
		}
		select {
		case <-changed:
		case <-giveUp.C:
			t.Fatalf("no %s", what)
		}
	}
}

// ---- logs ----

// logSink captures an agent's logs as JSON lines, for tests that check what was said.
type logSink struct {
	buf testutil.SyncBuffer
}

func newLogSink(t *testing.T) *logSink {
	s := &logSink{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("agent logs:\n%s", s.buf.String())
		}
	})
	return s
}

func (s *logSink) logger() *slog.Logger {
	return slog.New(slog.NewJSONHandler(&s.buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// records returns the decoded log records whose message is msg.
func (s *logSink) records(t *testing.T, msg string) []map[string]any {
	t.Helper()
	return s.buf.Records(t, msg)
}

// ---- key material and checks ----

// credentials is a workload key pair and its root, as files for --credentials-dir.
type credentials struct {
	files  map[string][]byte
	serial string
	root   *x509.Certificate
}

func newCredentials(t *testing.T, ca *testutil.CA, id string) credentials {
	t.Helper()
	leaf, key := ca.IssueWorkload(t, id, 24*time.Hour)
	return credentials{
		files: map[string][]byte{
			"cert-chain.pem": testutil.CertPEM(leaf, ca.Cert),
			"key.pem":        testutil.KeyPEM(t, key),
			"root-cert.pem":  testutil.CertPEM(ca.Cert),
		},
		serial: leaf.SerialNumber.Text(16),
		root:   ca.Cert,
	}
}

// credentialsDir writes c into a fresh directory and returns it.
func credentialsDir(t *testing.T, c credentials) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "credentials")
	testutil.WriteFiles(t, dir, c.files)
	return dir
}

// workloadChain parses a tls_certificate secret and fails unless its key matches its leaf.
func workloadChain(t *testing.T, s *tlsv3.Secret) []*x509.Certificate {
	t.Helper()
	chain, _ := sdstest.KeyPair(t, s)
	return chain
}

func serialOf(chain []*x509.Certificate) string { return chain[0].SerialNumber.Text(16) }

// checkVerifies fails unless chain names id and verifies against roots at now.
func checkVerifies(t *testing.T, chain, roots []*x509.Certificate, id string, now time.Time) {
	t.Helper()
	if len(chain[0].URIs) != 1 || chain[0].URIs[0].String() != id {
		t.Fatalf("leaf names %v, want %s", chain[0].URIs, id)
	}
	rootPool, inter := x509.NewCertPool(), x509.NewCertPool()
	for _, r := range roots {
		rootPool.AddCert(r)
	}
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	if _, err := chain[0].Verify(x509.VerifyOptions{Roots: rootPool, Intermediates: inter, CurrentTime: now,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Fatalf("the chain of %s does not verify against ROOTCA: %v", serialOf(chain), err)
	}
}

func readRoots(t *testing.T, path string) []*x509.Certificate {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	roots, err := pki.ParseCertificates(data)
	if err != nil {
		t.Fatal(err)
	}
	return roots
}

// readPair reads OUTPUT_CERTS in dir and returns its leaf's SPIFFE ID and serial, failing unless
// the key matches.
func readPair(t *testing.T, dir string) (leafURI, serial string) {
	t.Helper()
	chainPEM, err := os.ReadFile(filepath.Join(dir, "cert-chain.pem"))
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, err := os.ReadFile(filepath.Join(dir, "key.pem"))
	if err != nil {
		t.Fatal(err)
	}
	chain, err := pki.ParseCertificates(chainPEM)
	if err != nil {
		t.Fatal(err)
	}
	key, err := pki.ParsePrivateKey(keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	if !pki.KeyMatchesCertificate(key, chain[0]) {
		t.Fatal("OUTPUT_CERTS holds a key that does not match its certificate")
	}
	return chain[0].URIs[0].String(), chain[0].SerialNumber.Text(16)
}

// ---- HTTP ----

func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// unixGet is httpGet through the Unix socket at socket, with Host "localhost".
func unixGet(t *testing.T, socket, path string) (int, string) {
	t.Helper()
	client := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", socket)
	}}}
	defer client.CloseIdleConnections()
	resp, err := client.Get("http://localhost" + path)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// metric returns the value of one series on the agent's /metrics, or "" when it is absent.
func metric(t *testing.T, a *agent.Agent, series string) string {
	t.Helper()
	_, body := httpGet(t, "http://"+a.StatusAddr()+"/metrics")
	sc := bufio.NewScanner(strings.NewReader(body))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			return v
		}
	}
	return ""
}
