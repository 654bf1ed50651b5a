package caclient_test

import (
	"bufio"
	"context"
	"crypto"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/internal/istio"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

const trustDomain = "cluster.local"

// backoffStep fires any backoff the client can schedule: at most 2 s, randomized by ±50 %.
const backoffStep = 5 * time.Second

func spiffeID(ns, sa string) pki.SPIFFEID {
	return pki.SPIFFEID{TrustDomain: trustDomain, Namespace: ns, ServiceAccount: sa}
}

// realCA is a `meshid ca` control plane serving on loopback until the test ends.
type realCA struct {
	stateDir   string
	rootFile   string
	addr       string
	monitoring string
}

func caConfig(stateDir, grpcAddr string) controlplane.Config {
	cfg := controlplane.DefaultConfig()
	cfg.StateDir = stateDir
	cfg.GRPCAddr = grpcAddr
	cfg.MonitoringAddr = "127.0.0.1:0"
	return cfg
}

// startCA runs a control plane with a fresh state directory on a free port.
func startCA(t *testing.T) *realCA {
	t.Helper()
	return startCAIn(t, t.TempDir(), "127.0.0.1:0")
}

// startCAIn runs a control plane on stateDir and grpcAddr until the test ends, and waits until it
// serves.
func startCAIn(t *testing.T, stateDir, grpcAddr string) *realCA {
	t.Helper()
	return startCAWith(t, caConfig(stateDir, grpcAddr))
}

// startCAWith runs a control plane configured by cfg until the test ends.
func startCAWith(t *testing.T, cfg controlplane.Config) *realCA {
	t.Helper()
	cp := controlplanetest.Start(t, cfg)
	return &realCA{
		stateDir:   cfg.StateDir,
		rootFile:   filepath.Join(cfg.StateDir, istio.RootCertFile),
		addr:       cp.GRPCAddr(),
		monitoring: cp.MonitoringAddr(),
	}
}

// token mints a service-account token for ns/sa with the CA's local token key.
func (c *realCA) token(t *testing.T, ns, sa string, now time.Time, ttl time.Duration) string {
	t.Helper()
	return controlplanetest.Token(t, c.stateDir, ns, sa, now, ttl)
}

// tokenFile writes a valid token for ns/sa to a new file and returns its path.
func (c *realCA) tokenFile(t *testing.T, ns, sa string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "token")
	writeFile(t, path, c.token(t, ns, sa, time.Now(), time.Hour))
	return path
}

// config is a client configuration for this CA: its address and root, no credentials.
func (c *realCA) config() caclient.Config {
	return caclient.Config{Address: c.addr, RootCertFile: c.rootFile}
}

// metric returns the value of one series on the CA's /metrics, or "" when it is absent.
func (c *realCA) metric(t *testing.T, series string) string {
	t.Helper()
	resp, err := http.Get("http://" + c.monitoring + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			return v
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return ""
}

func (c *realCA) root(t *testing.T) *x509.Certificate {
	t.Helper()
	data, err := os.ReadFile(c.rootFile)
	if err != nil {
		t.Fatal(err)
	}
	roots, err := pki.ParseCertificates(data)
	if err != nil {
		t.Fatal(err)
	}
	return roots[0]
}

func writeFile(t *testing.T, path, data string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
}

// newCSR returns a DER CSR for id and its key.
func newCSR(t *testing.T, alg pki.KeyAlgorithm, id pki.SPIFFEID) ([]byte, crypto.Signer) {
	t.Helper()
	key, err := pki.GenerateKey(alg, 0)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := pki.NewCSR(key, id)
	if err != nil {
		t.Fatal(err)
	}
	return csr, key
}

// closedAddr returns the address of a listener that is closed again: nothing accepts there.
func closedAddr(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	if err := lis.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}

// testClient is a Client on a fake clock. The client arms one timer on it per backoff wait, so
// the clock's Armed count is the number of retries.
type testClient struct {
	*caclient.Client
	clock *testutil.FakeClock
}

// newClient returns a client for cfg on a fake clock, closed when the test ends. A
// configuration without credentials gets a fixed token, for the CAs that do not check it.
func newClient(t *testing.T, cfg caclient.Config) *testClient {
	t.Helper()
	clk := testutil.NewFakeClock(time.Now())
	cfg.Clock = clk
	if cfg.Token == nil && cfg.TokenPath == "" && cfg.ClientCertificate == nil {
		cfg.Token = func(context.Context) (string, error) { return "unchecked-token", nil }
	}
	c, err := caclient.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return &testClient{Client: c, clock: clk}
}

type signed struct {
	chain    []*x509.Certificate
	err      error
	backoffs int // backoff waits during the call: attempts - 1
}

func (s signed) String() string {
	return fmt.Sprintf("chain of %d, error %v, %d backoffs", len(s.chain), s.err, s.backoffs)
}

// sign calls Sign and drives the fake clock through any backoff, so that a retrying client never
// waits and the test does not sleep.
func (c *testClient) sign(t *testing.T, csr []byte, ttl time.Duration) signed {
	t.Helper()
	before := c.clock.Armed()
	done := make(chan signed, 1)
	go func() {
		chain, err := c.Sign(t.Context(), csr, ttl)
		done <- signed{chain: chain, err: err}
	}()
	res := testutil.Drive(t, c.clock, backoffStep, 0, done)
	res.backoffs = c.clock.Armed() - before
	return res
}

// mustSign is sign for a call that must succeed without retries; it returns the leaf.
func (c *testClient) mustSign(t *testing.T, csr []byte, ttl time.Duration) *x509.Certificate {
	t.Helper()
	res := c.sign(t, csr, ttl)
	if res.err != nil {
		t.Fatalf("Sign: %v", res.err)
	}
	if res.backoffs != 0 {
		t.Fatalf("Sign succeeded after %d retries, want none", res.backoffs)
	}
	return res.chain[0]
}

// waitForBackoff returns once the client waits on a backoff timer; it fails the test if the call
// ends (on done) first.
func waitForBackoff[T any](t *testing.T, clk *testutil.FakeClock, done <-chan T) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	waited := make(chan error, 1)
	go func() { waited <- clk.WaitForTimers(ctx, 1) }()
	select {
	case err := <-waited:
		if err != nil {
			t.Fatal(err)
		}
	case v := <-done:
		t.Fatalf("Sign returned %+v without backing off", v)
	}
}

func leafID(t *testing.T, leaf *x509.Certificate) string {
	t.Helper()
	if len(leaf.URIs) != 1 {
		t.Fatalf("leaf has %d URI SANs, want 1", len(leaf.URIs))
	}
	return leaf.URIs[0].String()
}

func TestSignReturnsChainForTheTokenIdentity(t *testing.T) {
	t.Parallel()
	ca := startCA(t)
	root := ca.root(t)

	tests := []struct {
		name string
		alg  pki.KeyAlgorithm
		ttl  time.Duration
	}{
		{"P-256 one hour", pki.ECDSA, time.Hour},
		{"RSA 2048 one hour", pki.RSA, time.Hour},
		{"P-256 ten minutes", pki.ECDSA, 10 * time.Minute},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			id := spiffeID("ns1", "sa1")
			cfg := ca.config()
			cfg.TokenPath = ca.tokenFile(t, "ns1", "sa1")
			c := newClient(t, cfg)
			csr, key := newCSR(t, tt.alg, id)

			before := time.Now()
			res := c.sign(t, csr, tt.ttl)
			after := time.Now()
			if res.err != nil {
				t.Fatal(res.err)
			}
			checkIssued(t, res.chain, id.String(), key, root)
			// Certificate times have whole seconds, rounded up: the TTL is never cut.
			lo, hi := before.Add(tt.ttl), after.Add(tt.ttl).Add(time.Second)
			if leaf := res.chain[0]; leaf.NotAfter.Before(lo) || leaf.NotAfter.After(hi) {
				t.Errorf("NotAfter %s, want between %s and %s", leaf.NotAfter, lo, hi)
			}
		})
	}
}

func TestTokenFileIsReadOnEveryCall(t *testing.T) {
	t.Parallel()
	ca := startCA(t)
	cfg := ca.config()
	cfg.TokenPath = filepath.Join(t.TempDir(), "token")
	writeFile(t, cfg.TokenPath, ca.token(t, "ns1", "first", time.Now(), time.Hour))
	c := newClient(t, cfg)

	first, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "first"))
	if got := leafID(t, c.mustSign(t, first, time.Hour)); got != spiffeID("ns1", "first").String() {
		t.Fatalf("first leaf names %s", got)
	}
	// Had the client kept the first token, the CA would refuse this CSR for another identity.
	writeFile(t, cfg.TokenPath, ca.token(t, "ns1", "second", time.Now(), time.Hour))
	second, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "second"))
	if got := leafID(t, c.mustSign(t, second, time.Hour)); got != spiffeID("ns1", "second").String() {
		t.Fatalf("second leaf names %s, want the identity of the replaced token", got)
	}
}

// A token that cannot be read fails the call before anything is sent, naming the file, when no
// certificate can authenticate it instead (grpc used to turn it into an opaque Internal error).
func TestTokenProblemsFailBeforeDialing(t *testing.T) {
	t.Parallel()
	ca := startCA(t)
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty-token")
	writeFile(t, empty, " \n")
	tests := []struct {
		name, path string
		want       []string
	}{
		{"missing", filepath.Join(dir, "absent"), []string{filepath.Join(dir, "absent"), "no such file"}},
		{"empty", empty, []string{empty, "is empty"}},
		{"unreadable", dir, []string{dir, "is a directory"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := ca.config()
			cfg.TokenPath = tt.path
			c := newClient(t, cfg)
			csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))
			res := c.sign(t, csr, time.Hour)
			if !errors.Is(res.err, caclient.ErrNoCredentials) {
				t.Fatalf("error %v, want ErrNoCredentials", res.err)
			}
			if status.Code(res.err) == codes.Internal {
				t.Errorf("error %v is an Internal status", res.err)
			}
			for _, want := range tt.want {
				if !strings.Contains(res.err.Error(), want) {
					t.Errorf("error %q does not mention %q", res.err, want)
				}
			}
			if res.backoffs != 0 {
				t.Errorf("a local credential problem was retried %d times", res.backoffs)
			}
		})
	}
	// Nothing reached the CA.
	if got := ca.metric(t, `meshid_ca_requests_refused_total{code="Unauthenticated",reason="no_credentials"}`); got != "" {
		t.Errorf("the CA counted %q requests without credentials, want none sent", got)
	}
}

func TestRefusalsAreExplainedAndNotRetried(t *testing.T) {
	t.Parallel()
	ca := startCA(t)
	id := spiffeID("ns1", "sa1")

	tests := []struct {
		name     string
		token    string
		csr      []byte
		wantCode codes.Code
		wantText string
		series   string // on the CA's /metrics: must read 1, one request seen
	}{
		{
			name:     "expired token",
			token:    ca.token(t, "ns1", "sa1", time.Now().Add(-2*time.Hour), time.Hour),
			csr:      func() []byte { csr, _ := newCSR(t, pki.ECDSA, id); return csr }(),
			wantCode: codes.Unauthenticated,
			wantText: "did not accept the token",
			series:   `meshid_ca_requests_refused_total{code="Unauthenticated",reason="token_expired"}`,
		},
		{
			name:     "CSR for another identity",
			token:    ca.token(t, "ns1", "sa1", time.Now(), time.Hour),
			csr:      func() []byte { csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "someone-else")); return csr }(),
			wantCode: codes.PermissionDenied,
			wantText: "refused to sign",
			series:   `meshid_ca_requests_refused_total{code="PermissionDenied",reason="csr_identity"}`,
		},
		{
			name:     "malformed CSR",
			token:    ca.token(t, "ns1", "sa1", time.Now(), time.Hour),
			csr:      []byte("not a certificate request"),
			wantCode: codes.InvalidArgument,
			wantText: "found the request invalid",
			series:   `meshid_ca_requests_refused_total{code="InvalidArgument",reason="csr_malformed"}`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := ca.config()
			cfg.TokenPath = filepath.Join(t.TempDir(), "token")
			writeFile(t, cfg.TokenPath, tt.token)
			cfg.MaxAttempts = 5
			c := newClient(t, cfg)

			res := c.sign(t, tt.csr, time.Hour)
			assertRejectedOnce(t, res, ca, tt.wantCode, tt.wantText, tt.series)
		})
	}
}

func TestUnreachableCA(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name         string
		maxAttempts  int
		wantBackoffs int
	}{
		{"one attempt", 1, 0},
		{"three attempts", 3, 2},
		{"default attempts", 0, caclient.DefaultMaxAttempts - 1},
		{"five attempts", 5, 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			addr := closedAddr(t)
			reg := prometheus.NewRegistry()
			c := newClient(t, caclient.Config{Address: addr, MaxAttempts: tt.maxAttempts, Registerer: reg})
			csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))

			res := c.sign(t, csr, time.Hour)
			if got := outcomeOf(res.err); got != unreachable {
				t.Fatalf("error %v: %s, want %s", res.err, got, unreachable)
			}
			if status.Code(res.err) != codes.Unavailable {
				t.Errorf("code %s, want Unavailable", status.Code(res.err))
			}
			if !strings.Contains(res.err.Error(), addr) {
				t.Errorf("error %q does not name the address %s", res.err, addr)
			}
			if res.backoffs != tt.wantBackoffs {
				t.Errorf("%d backoff waits, want %d", res.backoffs, tt.wantBackoffs)
			}
			if got, want := requestCount(t, reg, "Unavailable"), uint64(tt.wantBackoffs+1); got != want {
				t.Errorf("%d attempts observed, want %d", got, want)
			}
		})
	}
}

func TestCancelDuringBackoffEndsSign(t *testing.T) {
	t.Parallel()
	c := newClient(t, caclient.Config{Address: closedAddr(t), MaxAttempts: 5})
	csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		_, err := c.Sign(ctx, csr, time.Hour)
		done <- err
	}()
	waitForBackoff(t, c.clock, done)
	cancel()
	// Were the cancellation ignored, driving the clock would end Sign with another error.
	if err := testutil.Drive(t, c.clock, backoffStep, 0, done); !errors.Is(err, context.Canceled) {
		t.Fatalf("error %v, want context.Canceled", err)
	}
	if n := c.clock.Armed(); n != 1 {
		t.Errorf("%d backoff waits, want the one that was cancelled", n)
	}
}

func TestRetryUntilTheCAStarts(t *testing.T) {
	t.Parallel()
	// A first run creates the root and the token key; the CA then comes back on a port that
	// refused the client's first attempt.
	stateDir := t.TempDir()
	first := startCAIn(t, stateDir, "127.0.0.1:0")
	tokenPath := first.tokenFile(t, "ns1", "sa1")
	addr := closedAddr(t)

	c := newClient(t, caclient.Config{
		Address: addr, RootCertFile: filepath.Join(stateDir, istio.RootCertFile),
		TokenPath: tokenPath, MaxAttempts: 5,
	})
	csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))
	done := make(chan signed, 1)
	go func() {
		chain, err := c.Sign(t.Context(), csr, time.Hour)
		done <- signed{chain: chain, err: err}
	}()
	waitForBackoff(t, c.clock, done) // the first attempt failed
	startCAIn(t, stateDir, addr)
	res := testutil.Drive(t, c.clock, backoffStep, 0, done)
	if res.err != nil {
		t.Fatalf("Sign after the CA started: %v", res.err)
	}
	if got := leafID(t, res.chain[0]); got != spiffeID("ns1", "sa1").String() {
		t.Errorf("leaf names %s", got)
	}
	if n := c.clock.Armed(); n != 1 {
		t.Errorf("%d backoff waits, want 1: the second attempt should succeed", n)
	}
}

func TestRootFileIsReadBeforeEachCall(t *testing.T) {
	t.Parallel()
	ca := startCA(t)
	rootFile := filepath.Join(t.TempDir(), "root-cert.pem")
	other := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "not the mesh root"})
	writeFile(t, rootFile, string(testutil.CertPEM(other.Cert)))
	c := newClient(t, caclient.Config{
		Address: ca.addr, RootCertFile: rootFile, TokenPath: ca.tokenFile(t, "ns1", "sa1"), MaxAttempts: 2,
	})
	csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))

	res := c.sign(t, csr, time.Hour)
	if res.err == nil {
		t.Fatal("Sign succeeded with a root that does not verify the CA")
	}
	if !strings.Contains(res.err.Error(), "certificate signed by unknown authority") {
		t.Errorf("error %q does not explain the TLS failure", res.err)
	}
	if status.Code(res.err) != codes.Unavailable || res.backoffs != 1 {
		t.Errorf("code %s after %d retries, want Unavailable after MaxAttempts-1 = 1", status.Code(res.err), res.backoffs)
	}

	writeFile(t, rootFile, string(testutil.CertPEM(ca.root(t))))
	if got := leafID(t, c.mustSign(t, csr, time.Hour)); got != spiffeID("ns1", "sa1").String() {
		t.Errorf("leaf names %s", got)
	}
}

// The CA's serving certificate is verified on the client's clock: a CA and an agent that share a
// clock ahead of the machine's (as every test with a fake clock does after a rotation) agree.
func TestCACertificateIsVerifiedOnTheClientsClock(t *testing.T) {
	t.Parallel()
	ahead := testutil.NewFakeClock(time.Now().Add(48 * time.Hour))
	cfg := caConfig(t.TempDir(), "127.0.0.1:0")
	cfg.Clock = ahead
	ca := startCAWith(t, cfg)
	c, err := caclient.New(caclient.Config{
		Address: ca.addr, RootCertFile: ca.rootFile, Clock: ahead, MaxAttempts: 1,
		Token: func(context.Context) (string, error) {
			return ca.token(t, "ns1", "sa1", ahead.Now(), time.Hour), nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))
	chain, err := c.Sign(t.Context(), csr, time.Hour)
	if err != nil {
		t.Fatalf("Sign with the CA and the client on one clock: %v", err)
	}
	if !chain[0].NotAfter.After(ahead.Now()) {
		t.Fatalf("leaf expires %s, before the shared clock's now %s", chain[0].NotAfter, ahead.Now())
	}
}

func TestUnusableRootFileFailsAtOnce(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	noCert := filepath.Join(dir, "no-cert.pem")
	writeFile(t, noCert, "this is not PEM\n")
	missing := filepath.Join(dir, "missing.pem")

	tests := []struct {
		name     string
		rootFile string
		want     []string
	}{
		{"no certificate in it", noCert, []string{noCert, "holds no certificate"}},
		{"missing", missing, []string{missing, "read the CA root"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := newClient(t, caclient.Config{Address: closedAddr(t), RootCertFile: tt.rootFile})
			csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))
			res := c.sign(t, csr, time.Hour)
			if res.err == nil {
				t.Fatal("Sign succeeded")
			}
			for _, want := range tt.want {
				if !strings.Contains(res.err.Error(), want) {
					t.Errorf("error %q does not mention %q", res.err, want)
				}
			}
			if res.backoffs != 0 {
				t.Errorf("a local configuration error was retried %d times", res.backoffs)
			}
		})
	}
}

func TestServerNameIsVerified(t *testing.T) {
	t.Parallel()
	ca := startCA(t)
	tokenPath := ca.tokenFile(t, "ns1", "sa1")

	tests := []struct {
		name       string
		serverName string
		wantErr    string // "" for success
	}{
		{"default istiod.istio-system.svc", "", ""},
		{"explicit istiod.istio-system.svc", caclient.DefaultServerName, ""},
		{"another name of the CA", "localhost", ""},
		{"a name the CA does not hold", "wrong.example", "wrong.example"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := ca.config()
			cfg.TokenPath = tokenPath
			cfg.ServerName = tt.serverName
			c := newClient(t, cfg)
			csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))
			res := c.sign(t, csr, time.Hour)
			if tt.wantErr == "" {
				if res.err != nil {
					t.Fatal(res.err)
				}
				return
			}
			if res.err == nil {
				t.Fatal("Sign succeeded although the server name does not match")
			}
			if !strings.Contains(res.err.Error(), "x509") || !strings.Contains(res.err.Error(), tt.wantErr) {
				t.Errorf("error %q is not a certificate name mismatch for %s", res.err, tt.wantErr)
			}
		})
	}
}

// requestCount reads meshid_agent_ca_request_duration_seconds_count{code=code} from reg.
func requestCount(t *testing.T, reg *prometheus.Registry, code string) uint64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "meshid_agent_ca_request_duration_seconds" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "code" && l.GetValue() == code {
					return m.GetHistogram().GetSampleCount()
				}
			}
		}
	}
	return 0
}

func TestRequestDurationMetric(t *testing.T) {
	t.Parallel()
	ca := startCA(t)
	reg := prometheus.NewRegistry()
	cfg := ca.config()
	cfg.TokenPath = filepath.Join(t.TempDir(), "token")
	cfg.Registerer = reg
	c := newClient(t, cfg)
	csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))

	writeFile(t, cfg.TokenPath, ca.token(t, "ns1", "sa1", time.Now(), time.Hour))
	c.mustSign(t, csr, time.Hour)
	if ok, refused := requestCount(t, reg, "OK"), requestCount(t, reg, "Unauthenticated"); ok != 1 || refused != 0 {
		t.Fatalf("after a success: OK %d, Unauthenticated %d; want 1, 0", ok, refused)
	}

	writeFile(t, cfg.TokenPath, ca.token(t, "ns1", "sa1", time.Now().Add(-2*time.Hour), time.Hour))
	if res := c.sign(t, csr, time.Hour); status.Code(res.err) != codes.Unauthenticated {
		t.Fatalf("expired token: %v, want Unauthenticated", res.err)
	}
	if ok, refused := requestCount(t, reg, "OK"), requestCount(t, reg, "Unauthenticated"); ok != 1 || refused != 1 {
		t.Fatalf("after a refusal: OK %d, Unauthenticated %d; want 1, 1", ok, refused)
	}
}

func TestNewValidates(t *testing.T) {
	t.Parallel()
	if _, err := caclient.New(caclient.Config{}); err == nil || !strings.Contains(err.Error(), "address") {
		t.Errorf("New with no address: %v, want an error about the address", err)
	}
	reg := prometheus.NewRegistry()
	if _, err := caclient.New(caclient.Config{Address: "127.0.0.1:1", Registerer: reg}); err != nil {
		t.Fatal(err)
	}
	if _, err := caclient.New(caclient.Config{Address: "127.0.0.1:1", Registerer: reg}); err == nil {
		t.Error("a second client registered the same metric on one registry without error")
	}
}

// assertRejectedOnce checks a refusal as the client reports it: rejected, not retried, with the
// CA's code and an error naming the CA and why, and the one request counted by the CA in series.
func assertRejectedOnce(t *testing.T, res signed, ca *realCA, code codes.Code, why, series string) {
	t.Helper()
	if got := outcomeOf(res.err); got != rejected {
		t.Fatalf("error %v: %s, want %s", res.err, got, rejected)
	}
	if got := status.Code(res.err); got != code {
		t.Errorf("code %s, want %s", got, code)
	}
	for _, want := range []string{ca.addr, why} {
		if !strings.Contains(res.err.Error(), want) {
			t.Errorf("error %q does not mention %q", res.err, want)
		}
	}
	if res.backoffs != 0 {
		t.Errorf("the client backed off %d times before giving up, want no retry", res.backoffs)
	}
	if got := ca.metric(t, series); got != "1" {
		t.Errorf("%s = %q, want 1: the CA must see exactly one request", series, got)
	}
}

// checkIssued checks a chain the CA signed for a CSR of key: the leaf names id and carries key,
// and the chain, leaf first, ends with root and verifies to it.
func checkIssued(t *testing.T, chain []*x509.Certificate, id string, key crypto.Signer, root *x509.Certificate) {
	t.Helper()
	if len(chain) < 2 {
		t.Fatalf("chain of %d certificates, want leaf and root at least", len(chain))
	}
	leaf := chain[0]
	if got := leafID(t, leaf); got != id {
		t.Errorf("leaf names %s, want %s", got, id)
	}
	if !pki.PublicKeysEqual(leaf.PublicKey, key.Public()) {
		t.Error("leaf does not carry the CSR's key")
	}
	if !chain[len(chain)-1].Equal(root) {
		t.Error("chain does not end with the root in root-cert.pem")
	}
	roots, inter := x509.NewCertPool(), x509.NewCertPool()
	roots.AddCert(root)
	for _, c := range chain[1 : len(chain)-1] {
		inter.AddCert(c)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter}); err != nil {
		t.Errorf("leaf does not verify to the root: %v", err)
	}
}
