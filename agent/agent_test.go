package agent_test

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/secretmanager"
)

const demoID = "spiffe://cluster.local/ns/default/sa/demo"

// env is a real CA on 127.0.0.1:0 and a directory for one workload, on a shared fake clock.
type env struct {
	clock    *testutil.FakeClock
	ca       *controlplane.ControlPlane
	stateDir string
	dir      string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{clock: testutil.NewFakeClock(time.Now().Truncate(time.Second)), stateDir: t.TempDir(), dir: t.TempDir()}
	cfg := controlplane.DefaultConfig()
	cfg.StateDir = e.stateDir
	cfg.GRPCAddr = "127.0.0.1:0"
	cfg.MonitoringAddr = ""
	cfg.Clock = e.clock
	// The CA checks its root once an hour; the tests step the clock by less between renewals.
	e.ca = controlplanetest.Start(t, cfg)
	return e
}

func (e *env) tokenFile(t *testing.T) string {
	t.Helper()
	tok := controlplanetest.Token(t, e.stateDir, "default", "demo", e.clock.Now(), time.Hour)
	path := filepath.Join(e.dir, "istio-token")
	if err := os.WriteFile(path, []byte(tok), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func (e *env) config(t *testing.T, tokenPath string) agent.Config {
	cfg := agent.DefaultConfig(e.dir)
	cfg.Namespace, cfg.ServiceAccount = "default", "demo"
	cfg.CAAddress = e.ca.GRPCAddr()
	cfg.CARootCert = filepath.Join(e.stateDir, "root-cert.pem")
	cfg.TokenPath = tokenPath
	cfg.OutputCerts = filepath.Join(e.dir, "out")
	cfg.SecretTTL = 30 * time.Minute
	cfg.GraceRatioJitter = 0
	cfg.StatusAddr = "127.0.0.1:0"
	cfg.DebugAddr = "127.0.0.1:0"
	cfg.WorkloadSocketDir = testutil.ShortTempDir(t)
	cfg.Clock = e.clock
	return cfg
}

// start runs an agent until stop is called or the test ends, and returns a channel of the
// workload certificates it puts in service.
func start(t *testing.T, cfg agent.Config) (*agent.Agent, <-chan *secretmanager.Secret, func()) {
	t.Helper()
	a, err := agent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	issued := make(chan *secretmanager.Secret, 8)
	a.Secrets().Subscribe(func(s *secretmanager.Secret) {
		if s.Name == secretmanager.WorkloadCertName {
			issued <- s
		}
	})
	stop := runUntilCleanup(t, a.Run, nil)
	return a, issued, stop
}

func runUntilCleanup(t *testing.T, run func(context.Context) error, ready <-chan struct{}) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}
	t.Cleanup(stop)
	if ready != nil {
		select {
		case <-ready:
		case err := <-done:
			t.Fatalf("Run ended early: %v", err)
		}
	}
	return stop
}

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

func TestAgentKeepsOutputCertsFreshAndReportsStatus(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a, issued, _ := start(t, e.config(t, e.tokenFile(t)))
	first := <-issued
	if uri, serial := readPair(t, filepath.Join(e.dir, "out")); uri != demoID || serial != first.Version {
		t.Fatalf("OUTPUT_CERTS holds %s %s, want %s %s", uri, serial, demoID, first.Version)
	}
	base := "http://" + a.StatusAddr()
	if code, body := httpGet(t, base+"/healthz/ready"); code != http.StatusOK {
		t.Fatalf("/healthz/ready = %d %q", code, body)
	}
	// Nobody asks for the certificate; it is renewed anyway, and OUTPUT_CERTS follows.
	second := testutil.Drive(t, e.clock, time.Minute, 1, issued)
	if second.Version == first.Version {
		t.Fatal("renewal kept the same serial")
	}
	if got := second.CreatedAt.Sub(first.CreatedAt); got < 14*time.Minute || got > 16*time.Minute {
		t.Fatalf("renewed %s after the first, want about half of the 30m lifetime", got)
	}
	if _, serial := readPair(t, filepath.Join(e.dir, "out")); serial != second.Version {
		t.Fatal("OUTPUT_CERTS not rewritten on renewal")
	}
	_, metrics := httpGet(t, base+"/metrics")
	for _, want := range []string{
		"meshid_agent_cert_rotations_total 2",
		"meshid_agent_cert_renewal_failures_total 0",
		"meshid_agent_cert_expiry_timestamp_seconds ",
		`meshid_agent_ca_request_duration_seconds_count{code="OK"} 2`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
}

// A VM whose provisioned token is gone keeps renewing with the certificate it holds.
func TestAgentRenewsOverMTLSAfterTokenIsGone(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tokenPath := e.tokenFile(t)
	cfg := e.config(t, tokenPath)
	_, issued, stop := start(t, cfg)
	first := <-issued
	stop()

	if err := os.Remove(tokenPath); err != nil {
		t.Fatal(err)
	}
	_, issued, _ = start(t, cfg)
	restored := <-issued
	if restored.Source != "output-certs" || restored.Version != first.Version {
		t.Fatalf("after restart: %s from %s, want %s from output-certs, served at once", restored.Version, restored.Source, first.Version)
	}
	renewed := testutil.Drive(t, e.clock, time.Minute, 1, issued)
	if renewed.Source != "ca" || renewed.Version == first.Version {
		t.Fatalf("no renewal over mTLS: %s from %s", renewed.Version, renewed.Source)
	}
	if uri, _ := readPair(t, filepath.Join(e.dir, "out")); uri != demoID {
		t.Fatalf("renewed for %s", uri)
	}
}

// Without a token or a certificate, the CA refuses; the agent keeps running and says not ready.
func TestAgentNotReadyWithoutCertificate(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := e.config(t, filepath.Join(e.dir, "no-token"))
	a, _, _ := start(t, cfg)
	code, body := httpGet(t, "http://"+a.StatusAddr()+"/healthz/ready")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "no valid workload certificate") {
		t.Fatalf("/healthz/ready = %d %q, want 503", code, body)
	}
}

func TestCARootIsFoundInIstioOrder(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	prov := filepath.Join(root, "prov")
	mounted := filepath.Join(root, "var/run/secrets/istio/root-cert.pem")
	for _, p := range []string{filepath.Join(prov, "root-cert.pem"), mounted} {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name     string
		explicit string
		prov     string
		want     string
	}{
		{"CA_ROOT_CA wins", "/explicit/root.pem", prov, "/explicit/root.pem"},
		{"then PROV_CERT/root-cert.pem", "", prov, filepath.Join(prov, "root-cert.pem")},
		{"then the mounted config map", "", filepath.Join(root, "absent"), mounted},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := agent.DefaultConfig(root)
			cfg.CARootCert, cfg.ProvCert = tt.explicit, tt.prov
			if got := agent.CARootCert(cfg); got != tt.want {
				t.Fatalf("CA root %q, want %q", got, tt.want)
			}
		})
	}
	cfg := agent.DefaultConfig(t.TempDir())
	if got := agent.CARootCert(cfg); got != "" {
		t.Fatalf("with no root anywhere: %q, want the system roots (empty)", got)
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	good := func() agent.Config {
		c := agent.DefaultConfig("")
		c.Namespace, c.ServiceAccount, c.CAAddress = "default", "demo", "127.0.0.1:15012"
		return c
	}
	if c := good(); c.Validate() != nil {
		t.Fatalf("valid config refused: %v", c.Validate())
	}
	tests := []struct {
		name   string
		modify func(*agent.Config)
		want   string
	}{
		{"no namespace", func(c *agent.Config) { c.Namespace = "" }, "POD_NAMESPACE"},
		{"bad service account", func(c *agent.Config) { c.ServiceAccount = "Bad_Name" }, "SERVICE_ACCOUNT"},
		{"debug server off loopback", func(c *agent.Config) { c.DebugAddr = "0.0.0.0:15004" }, "loopback only"},
		{"socket path too long", func(c *agent.Config) { c.WorkloadSocketDir = "/" + strings.Repeat("d", 120) }, "kernel's limit"},
		{"negative drain", func(c *agent.Config) { c.DrainDuration = -time.Second }, "--drain-duration"},
		{"RSA too small", func(c *agent.Config) { c.KeyAlgorithm, c.RSAKeySize = pki.RSA, 1024 }, "WORKLOAD_RSA_KEY_SIZE"},
		{"ratio", func(c *agent.Config) { c.GraceRatio = 1 }, "--grace-period-ratio"},
		{"jitter", func(c *agent.Config) { c.GraceRatioJitter = 0.6 }, "--grace-period-ratio-jitter"},
		{"ttl", func(c *agent.Config) { c.SecretTTL = 0 }, "--secret-ttl"},
		{"status addr", func(c *agent.Config) { c.StatusAddr = "15020" }, "--status-addr"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := good()
			tt.modify(&c)
			if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one mentioning %q", err, tt.want)
			}
		})
	}
}
