package agent_test

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds/sdstest"
	"github.com/meshid/meshid/secretmanager"
)

func TestAgentKeepsOutputCertsFreshAndReportsStatus(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ev := newEvents()
	a := newAgent(t, e.config(t, e.tokenFile(t, "default", "demo"), ev))
	certs := issued(t, a)
	runAgent(t, a)
	first := receive(t, certs, "first certificate")
	ev.await(t, "OUTPUT_CERTS written", func(x secretmanager.Event) bool {
		return x.Kind == secretmanager.EventOutputWritten && x.Version == first.Version
	})
	if uri, serial := readPair(t, filepath.Join(e.dir, "out")); uri != demoID || serial != first.Version {
		t.Fatalf("OUTPUT_CERTS holds %s %s, want %s %s", uri, serial, demoID, first.Version)
	}
	base := "http://" + a.StatusAddr()
	if code, body := httpGet(t, base+"/healthz/ready"); code != http.StatusOK {
		t.Fatalf("/healthz/ready = %d %q", code, body)
	}
	// Nobody asks for the certificate; it is renewed anyway, and OUTPUT_CERTS follows.
	written := ev.channel(t, func(x secretmanager.Event) bool {
		return x.Kind == secretmanager.EventOutputWritten && x.Version != first.Version
	})
	second := testutil.Drive(t, e.clock, time.Minute, 1, certs)
	if second.Version == first.Version {
		t.Fatal("renewal kept the same serial")
	}
	if got := second.Received.Sub(first.Received); got < 14*time.Minute || got > 16*time.Minute {
		t.Fatalf("renewed %s after the first, want about half of the 30m lifetime", got)
	}
	receive(t, written, "OUTPUT_CERTS rewritten")
	if _, serial := readPair(t, filepath.Join(e.dir, "out")); serial != second.Version {
		t.Fatal("OUTPUT_CERTS not rewritten on renewal")
	}
	for series, want := range map[string]string{
		"meshid_agent_cert_rotations_total":                         "2",
		"meshid_agent_cert_renewal_failures_total":                  "0",
		"meshid_agent_cert_valid":                                   "1",
		`meshid_agent_ca_request_duration_seconds_count{code="OK"}`: "2",
		"meshid_agent_output_certs_write_failures_total":            "0",
	} {
		if got := metric(t, a, series); got != want {
			t.Errorf("%s = %q, want %s", series, got, want)
		}
	}
}

// A VM whose provisioned token is gone keeps renewing with the certificate it holds, after a
// restart too.
func TestAgentRenewsOverMTLSAfterTokenIsGone(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tokenPath := e.tokenFile(t, "default", "demo")
	cfg := e.config(t, tokenPath, nil)
	a := newAgent(t, cfg)
	certs := issued(t, a)
	stop := runAgent(t, a)
	first := receive(t, certs, "first certificate")
	if err := stop(); err != nil {
		t.Fatal(err)
	}

	if err := os.Remove(tokenPath); err != nil {
		t.Fatal(err)
	}
	a = newAgent(t, cfg)
	certs = issued(t, a)
	runAgent(t, a)
	restored := receive(t, certs, "certificate after the restart")
	if restored.Source != secretmanager.SourceOutputCerts || restored.Version != first.Version {
		t.Fatalf("after restart: %s from %s, want %s from output-certs, served at once", restored.Version, restored.Source, first.Version)
	}
	renewed := testutil.Drive(t, e.clock, time.Minute, 1, certs)
	if renewed.Source != secretmanager.SourceCA || renewed.Version == first.Version {
		t.Fatalf("no renewal over mTLS: %s from %s", renewed.Version, renewed.Source)
	}
	if uri, _ := readPair(t, filepath.Join(e.dir, "out")); uri != demoID {
		t.Fatalf("renewed for %s", uri)
	}
}

// The certificate held in memory authenticates renewals: nothing on disk is needed once the
// token is gone (the agent used to present only what OUTPUT_CERTS held).
func TestAgentRenewsOverMTLSWithoutOutputCerts(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tokenPath := e.tokenFile(t, "default", "demo")
	cfg := e.config(t, tokenPath, nil)
	cfg.Output.Dir = ""
	a := newAgent(t, cfg)
	certs := issued(t, a)
	runAgent(t, a)
	first := receive(t, certs, "first certificate")
	if err := os.Remove(tokenPath); err != nil {
		t.Fatal(err)
	}
	rotate(t, e.clock, a)
	renewed := receive(t, certs, "renewed certificate")
	if renewed.Source != secretmanager.SourceCA || renewed.Version == first.Version {
		t.Fatalf("no renewal over mTLS: %s from %s", renewed.Version, renewed.Source)
	}
	if got := metric(t, a, "meshid_agent_cert_renewal_failures_total"); got != "0" {
		t.Errorf("%s renewals failed, want none", got)
	}
}

// While no valid certificate is held the agent keeps running and says why it is not ready;
// /healthz/ready, /debug/secrets and the metrics agree: without a token or a certificate (no
// request is sent), and when the CA refuses from the start.
func TestNotReadyWithoutAValidCertificate(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	missing := filepath.Join(e.dir, "no-token")
	for _, tc := range []struct {
		name  string
		token string
		why   string
	}{
		{"no token", missing, missing},
		{"the CA refuses", e.tokenFile(t, "kube-system", "demo"), "PermissionDenied"}, // not our namespace
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ev := newEvents()
			cfg := e.config(t, tc.token, ev)
			cfg.Output.Dir = filepath.Join(t.TempDir(), "out")
			a := newAgent(t, cfg)
			runAgent(t, a)
			ev.await(t, "the state of default", func(x secretmanager.Event) bool {
				return x.Kind == secretmanager.EventChanged && x.Name == "default" && x.Err != nil
			})
			code, body := httpGet(t, "http://"+a.StatusAddr()+"/healthz/ready")
			if code != http.StatusServiceUnavailable || !strings.Contains(body, "no valid workload certificate") || !strings.Contains(body, tc.why) {
				t.Fatalf("/healthz/ready = %d %q, want 503 naming %q", code, body, tc.why)
			}
			if st := debugSecret(t, a, "default"); st.Valid || !strings.Contains(st.Error, tc.why) {
				t.Fatalf("/debug/secrets default: %+v, want not valid, naming %q", st, tc.why)
			}
			if got := metric(t, a, "meshid_agent_cert_valid"); got != "0" {
				t.Errorf("meshid_agent_cert_valid %q, want 0", got)
			}
		})
	}
}

// OUTPUT_CERTS is the VM's product: while it cannot be written the agent is not ready (SDS still
// serves), and the write is retried until it succeeds.
func TestUnwritableOutputCertsKeepTheAgentNotReady(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ev := newEvents()
	cfg := e.config(t, e.tokenFile(t, "default", "demo"), ev)
	blocker := filepath.Join(e.dir, "not-a-dir")
	if err := os.WriteFile(blocker, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	cfg.Output.Dir = filepath.Join(blocker, "out")
	a := newAgent(t, cfg)
	runAgent(t, a)
	ev.await(t, "a failed write", func(x secretmanager.Event) bool { return x.Kind == secretmanager.EventOutputFailed })

	code, body := httpGet(t, "http://"+a.StatusAddr()+"/healthz/ready")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "OUTPUT_CERTS") || !strings.Contains(body, cfg.Output.Dir) {
		t.Fatalf("/healthz/ready = %d %q, want 503 naming OUTPUT_CERTS", code, body)
	}
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	got, err := sdstest.Dial(t, a.SocketPath()).Fetch(ctx, "default")
	if err != nil || got["default"] == nil {
		t.Fatalf("SDS while OUTPUT_CERTS fails: %v", err)
	}

	if err := os.Remove(blocker); err != nil {
		t.Fatal(err)
	}
	written := ev.channel(t, func(x secretmanager.Event) bool { return x.Kind == secretmanager.EventOutputWritten })
	// The CA's root check and the renewal are the long-lived timers; the retry is the third.
	testutil.Drive(t, e.clock, time.Second, 2, written)
	if code, body := httpGet(t, "http://"+a.StatusAddr()+"/healthz/ready"); code != http.StatusOK {
		t.Fatalf("/healthz/ready after the write = %d %q", code, body)
	}
	if uri, _ := readPair(t, cfg.Output.Dir); uri != demoID {
		t.Fatalf("OUTPUT_CERTS holds %s", uri)
	}
	if got := metric(t, a, "meshid_agent_output_certs_write_failures_total"); got == "0" || got == "" {
		t.Errorf("write failures counted %q", got)
	}
}

// While the disk holds the flush of OUTPUT_CERTS, Envoy gets "default" over SDS all the same and
// only readiness waits, until every file is flushed and swapped in.
func TestOutputCertsFlushHoldsOnlyReadiness(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ev := newEvents()
	cfg := e.config(t, e.tokenFile(t, "default", "demo"), ev)
	started, release := make(chan struct{}), make(chan struct{})
	var startOnce sync.Once
	cfg.Output.Sync = func(f *os.File) error {
		startOnce.Do(func() { close(started) })
		<-release
		return f.Sync()
	}
	a := newAgent(t, cfg)
	runAgent(t, a)
	select {
	case <-started:
	case <-time.After(wait):
		t.Fatal("OUTPUT_CERTS was never flushed")
	}
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	got, err := sdstest.Dial(t, a.SocketPath()).Fetch(ctx, "default")
	if err != nil || got["default"] == nil {
		t.Fatalf("SDS while OUTPUT_CERTS is being flushed: %v", err)
	}
	code, body := httpGet(t, "http://"+a.StatusAddr()+"/healthz/ready")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "OUTPUT_CERTS") {
		t.Fatalf("/healthz/ready during the flush = %d %q, want 503 naming OUTPUT_CERTS", code, body)
	}
	if _, err := os.Lstat(filepath.Join(cfg.Output.Dir, "..data")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("..data visible before its generation was flushed (%v)", err)
	}

	written := ev.channel(t, func(x secretmanager.Event) bool { return x.Kind == secretmanager.EventOutputWritten })
	close(release)
	select {
	case <-written:
	case <-time.After(wait):
		t.Fatal("OUTPUT_CERTS not written once the flush was let go")
	}
	if code, body := httpGet(t, "http://"+a.StatusAddr()+"/healthz/ready"); code != http.StatusOK {
		t.Fatalf("/healthz/ready after the flush = %d %q", code, body)
	}
	if uri, _ := readPair(t, cfg.Output.Dir); uri != demoID {
		t.Fatalf("OUTPUT_CERTS holds %s", uri)
	}
}

// --output-certs-group-read: the group reads the certificates, and the key only when asked.
func TestOutputCertsGroupModes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name               string
		group, key         bool
		dir, cert, keyMode os.FileMode
	}{
		{"private", false, false, 0o700, 0o644, 0o600},
		{"certificates", true, false, 0o750, 0o640, 0o600},
		{"all", true, true, 0o750, 0o640, 0o640},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			ev := newEvents()
			cfg := e.config(t, e.tokenFile(t, "default", "demo"), ev)
			cfg.Output.GroupRead, cfg.Output.KeyGroupRead = tc.group, tc.key
			runAgent(t, newAgent(t, cfg))
			ev.await(t, "OUTPUT_CERTS written", func(x secretmanager.Event) bool { return x.Kind == secretmanager.EventOutputWritten })
			generation, err := filepath.EvalSymlinks(filepath.Join(cfg.Output.Dir, "..data"))
			if err != nil {
				t.Fatal(err)
			}
			for path, want := range map[string]os.FileMode{
				cfg.Output.Dir: tc.dir, generation: tc.dir,
				filepath.Join(generation, "cert-chain.pem"): tc.cert,
				filepath.Join(generation, "root-cert.pem"):  tc.cert,
				filepath.Join(generation, "key.pem"):        tc.keyMode,
			} {
				info, err := os.Stat(path)
				if err != nil {
					t.Fatal(err)
				}
				if got := info.Mode().Perm(); got != want {
					t.Errorf("%s: mode %v, want %v", path, got, want)
				}
			}
		})
	}
}

// debugStatus is one secret of /debug/secrets, as an operator's script reads it.
type debugStatus struct {
	Name         string    `json:"name"`
	Valid        bool      `json:"valid"`
	Error        string    `json:"error"`
	SPIFFEID     string    `json:"spiffe_id"`
	Serial       string    `json:"serial"`
	NotAfter     time.Time `json:"not_after"`
	NextRotation time.Time `json:"next_rotation"`
	Roots        int       `json:"roots"`
	Source       string    `json:"source"`
	Streams      int       `json:"subscribed_streams"`
}

// debugSecrets reads /debug/secrets.
func debugSecrets(t *testing.T, a *agent.Agent) (source string, secrets []debugStatus) {
	t.Helper()
	code, body := httpGet(t, "http://"+a.DebugAddr()+"/debug/secrets")
	if code != http.StatusOK {
		t.Fatalf("/debug/secrets = %d %q", code, body)
	}
	var got struct {
		Source  string        `json:"source"`
		Secrets []debugStatus `json:"secrets"`
	}
	if err := json.Unmarshal([]byte(body), &got); err != nil {
		t.Fatalf("/debug/secrets is not JSON: %v\n%s", err, body)
	}
	return got.Source, got.Secrets
}

func debugSecret(t *testing.T, a *agent.Agent, name string) debugStatus {
	t.Helper()
	_, all := debugSecrets(t, a)
	for _, s := range all {
		if s.Name == name {
			return s
		}
	}
	t.Fatalf("/debug/secrets lacks %s: %+v", name, all)
	return debugStatus{}
}

// A credentials dir with some of the three files is a mistake, not a reason to use a CA.
func TestPartialCredentialsDirIsRefused(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	testutil.WriteFiles(t, dir, map[string][]byte{"cert-chain.pem": []byte("x")})
	cfg := testConfig(t, newFakeClock(), nil, nil)
	cfg.SDS.CredentialsDir = dir
	_, err := agent.New(cfg)
	if err == nil {
		t.Fatal("an agent started with a credentials dir missing key.pem and root-cert.pem")
	}
	for _, want := range []string{dir, "cert-chain.pem", "key.pem", "root-cert.pem"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}

// A path given explicitly that cannot be what it names is refused before anything starts, as
// ErrConfigRefused, which cmd turns into exit 2: a typo must not turn the agent to its embedded
// CA, under another identity, nor leave it looking healthy while every CA request fails.
func TestGivenPathsAreRefused(t *testing.T) {
	t.Parallel()
	fix := t.TempDir()
	testutil.WriteFiles(t, fix, map[string][]byte{"notes.txt": []byte("not a certificate")})
	testutil.WriteFiles(t, filepath.Join(fix, "partial"), map[string][]byte{"key.pem": []byte("x")})
	missing := filepath.Join(fix, "missing")
	tests := []struct {
		name   string
		modify func(*agent.Config)
		want   string
	}{
		{"credentials dir", func(c *agent.Config) { c.SDS.CredentialsDir = missing }, "SDS.CredentialsDir " + missing + " does not exist"},
		{"provisioned pair", func(c *agent.Config) { c.CA.ProvCert = missing }, "CA.ProvCert " + missing + " does not exist (it may be absent only when it is Output.Dir too"},
		{"CA root", func(c *agent.Config) { c.CA.RootCert = missing }, "CA.RootCert " + missing + " does not exist"},
		{"xDS root", func(c *agent.Config) { c.XDS.RootCert = filepath.Join(fix, "notes.txt") }, "XDS.RootCert " + fix + "/notes.txt holds no PEM certificate"},
		{"incomplete credentials dir", func(c *agent.Config) { c.SDS.CredentialsDir = filepath.Join(fix, "partial") }, "holds key.pem but not cert-chain.pem, root-cert.pem"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := testConfig(t, newFakeClock(), nil, nil) // embedded
			tt.modify(&cfg)
			_, err := agent.New(cfg)
			if !errors.Is(err, agent.ErrConfigRefused) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want ErrConfigRefused saying %q", err, tt.want)
			}
			if _, err := os.Stat(filepath.Join(cfg.RootDir, agent.DefaultEmbeddedDir)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the refused agent made the embedded CA's state dir (stat: %v)", err)
			}
		})
	}
}

// Two agents on one root dir: the second is refused, and the first keeps its embedded CA (the
// second used to take over its socket and delete it on exit).
func TestSecondAgentOnOneRootDirIsRefused(t *testing.T) {
	t.Parallel()
	clk := newFakeClock()
	cfg := testConfig(t, clk, newLogSink(t), nil)
	first := newAgent(t, cfg)
	certs := issued(t, first)
	runAgent(t, first)
	serial0 := receive(t, certs, "first certificate").Version

	second := cfg
	second.SDS.SocketDir = testutil.ShortTempDir(t)
	second.Servers.StatusAddr, second.Servers.DebugAddr = "127.0.0.1:0", ""
	if _, err := agent.New(second); err == nil || !strings.Contains(err.Error(), "another agent") || !strings.Contains(err.Error(), "give each agent its own RootDir") {
		t.Fatalf("second agent on the same root dir: %v, want a refusal naming RootDir", err)
	} else if !errors.Is(err, fsutil.ErrLocked) || !strings.Contains(err.Error(), "pid "+strconv.Itoa(os.Getpid())) {
		t.Errorf("second agent on the same root dir: %v, want ErrLocked (exit 2) naming the first agent's pid", err)
	}
	rotate(t, clk, first)
	if renewed := receive(t, certs, "renewal after the refusal"); renewed.Version == serial0 {
		t.Fatal("no new certificate")
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
			cfg.CA.RootCert, cfg.CA.ProvCert = tt.explicit, tt.prov
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

// A problem with one field of the Config is a *agent.FieldError keyed by the field's path, which
// cmd renders with the field's flag and variable.
func TestConfigValidateKeysErrorsByField(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		field  string
		modify func(*agent.Config)
	}{
		{"Certificate.GraceRatio", func(c *agent.Config) { c.Certificate.GraceRatio = 2 }},
		{"Certificate.GraceRatioJitter", func(c *agent.Config) { c.Certificate.GraceRatioJitter = 0.6 }},
		{"Certificate.TTL", func(c *agent.Config) { c.Certificate.TTL = -time.Second }},
		{"Certificate.KeyAlgorithm", func(c *agent.Config) { c.Certificate.KeyAlgorithm = "DSA" }},
		{"SDS.MaxStreams", func(c *agent.Config) { c.SDS.MaxStreams = 0 }},
		{"XDS.MaxStreamsPerConnection", func(c *agent.Config) { c.XDS.MaxStreamsPerConnection = -1 }},
		{"Servers.StatusAddr", func(c *agent.Config) { c.Servers.StatusAddr = "15020" }},
		{"CA.Address", func(c *agent.Config) { c.CA.Address = "https://ca:15012" }},
		{"Servers.AppProbers", func(c *agent.Config) { c.Servers.AppProbers = `{bad` }},
		{"Identity.InstanceIP", func(c *agent.Config) { c.Identity.InstanceIP = "pod-1" }},
		{"Servers.AppProbers", func(c *agent.Config) {
			c.Servers.AppProbers = `{"/app-health/web/livez":{"tcpSocket":{"port":0}}}`
		}},
	} {
		t.Run(tt.field, func(t *testing.T) {
			t.Parallel()
			c := agent.DefaultConfig("")
			c.Identity.Namespace, c.Identity.ServiceAccount, c.CA.Address = "default", "demo", "127.0.0.1:15012"
			tt.modify(&c)
			var fe *agent.FieldError
			if err := c.Validate(); !errors.As(err, &fe) || fe.Field != tt.field {
				t.Fatalf("Validate() = %v, want a *agent.FieldError for %s", err, tt.field)
			}
		})
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	good := func() agent.Config {
		c := agent.DefaultConfig("")
		c.Identity.Namespace, c.Identity.ServiceAccount, c.CA.Address = "default", "demo", "127.0.0.1:15012"
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
		{"no namespace", func(c *agent.Config) { c.Identity.Namespace = "" }, "Identity.Namespace is required with CA.Address"},
		{"no service account", func(c *agent.Config) { c.Identity.ServiceAccount = "" }, "Identity.ServiceAccount is required with CA.Address"},
		{"group-readable key alone", func(c *agent.Config) { c.Output.KeyGroupRead = true }, "group-readable"},
		{"bad service account", func(c *agent.Config) { c.Identity.ServiceAccount = "Bad_Name" }, "Identity.ServiceAccount): service account \"Bad_Name\""},
		{"debug server off loopback", func(c *agent.Config) { c.Servers.DebugAddr = "0.0.0.0:15004" }, "loopback only"},
		{"socket path too long", func(c *agent.Config) { c.SDS.SocketDir = "/" + strings.Repeat("d", 120) }, "kernel's limit"},
		// The agent names a field by its path in Config; cmd renders it with its flag and variable
		// (cmd/internal/cli's TestAgentConfigErrorsNameFlagsAndVariables has these cases rendered).
		{"negative drain", func(c *agent.Config) { c.SDS.DrainDuration = -time.Second }, "SDS.DrainDuration -1s must not be negative"},
		{"RSA too small", func(c *agent.Config) { c.Certificate.KeyAlgorithm, c.Certificate.RSAKeySize = pki.RSA, 1024 }, "Certificate.RSAKeySize: RSA key size 1024"},
		{"ratio", func(c *agent.Config) { c.Certificate.GraceRatio = 1 }, "Certificate.GraceRatio: grace period ratio 1 must be between 0 and 1"},
		{"jitter", func(c *agent.Config) { c.Certificate.GraceRatioJitter = 0.6 }, "Certificate.GraceRatioJitter: grace period ratio jitter 0.6"},
		{"ttl", func(c *agent.Config) { c.Certificate.TTL = 0 }, "Certificate.TTL 0s must be positive"},
		{"status addr", func(c *agent.Config) { c.Servers.StatusAddr = "15020" }, `Servers.StatusAddr "15020": no port`},
		{"CA address, relative Unix socket", func(c *agent.Config) { c.CA.Address = "unix://ca.sock" }, `CA.Address "unix://ca.sock": a Unix socket needs an absolute path`},
		{"discovery address, no host", func(c *agent.Config) { c.XDS.DiscoveryAddress = ":15012" }, `XDS.DiscoveryAddress ":15012": no host`},
		{"every address at once", func(c *agent.Config) {
			c.Servers.StatusAddr, c.Servers.DebugAddr, c.CA.Address, c.XDS.DiscoveryAddress = "127.0.0.1:99999", "localhost", "https://ca:15012", "istiod"
		}, "Servers.StatusAddr \"127.0.0.1:99999\": port \"99999\": want a number from 0 to 65535\n" +
			"Servers.DebugAddr \"localhost\": no port: give HOST:PORT, as in \"localhost:PORT\"\n" +
			"CA.Address \"https://ca:15012\": https:// is not part of an address: give HOST:PORT, as in \"ca:15012\"\n" +
			"XDS.DiscoveryAddress \"istiod\": no port: give HOST:PORT, as in \"istiod:PORT\""},
		// Attack: a file-root: or file-cert: resource reading the embedded CA's keys.
		{"file resource dir is the CA state dir", func(c *agent.Config) { c.SDS.FileResourceDirs = []string{"/etc/certs", "/var/lib/meshid"} },
			"SDS.FileResourceDirs: /var/lib/meshid overlaps the embedded CA's state dir /var/lib/meshid"},
		{"file resource dir holds the CA state dir", func(c *agent.Config) { c.SDS.FileResourceDirs = []string{"/var/lib/"} },
			"SDS.FileResourceDirs: /var/lib/ overlaps the embedded CA's state dir /var/lib/meshid"},
		{"file resource dir is the root", func(c *agent.Config) { c.SDS.FileResourceDirs = []string{"/"} }, "SDS.FileResourceDirs: / overlaps"},
		{"file resource dir inside the CA state dir", func(c *agent.Config) { c.SDS.FileResourceDirs = []string{"/var/lib/meshid/sub"} },
			"SDS.FileResourceDirs: /var/lib/meshid/sub"},
		{"file resource dir holds the CA state dir under the root dir", func(c *agent.Config) {
			c.RootDir, c.SDS.FileResourceDirs = "/r", []string{"/r/var"}
		}, "SDS.FileResourceDirs: /r/var overlaps the embedded CA's state dir /r/var/lib/meshid"},
		{"default file resource dirs hold the CA state dir", func(c *agent.Config) { c.SDS.CredentialsDir = "/var" },
			"SDS.FileResourceDirs (default: the credentials dir and <root-dir>/etc/certs): /var overlaps"},
		{"embedded, file resource dir holds the CA state dir", func(c *agent.Config) { c.CA.Address, c.SDS.FileResourceDirs = "", []string{"/var"} },
			"SDS.FileResourceDirs: /var overlaps"},
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
	for name, modify := range map[string]func(*agent.Config){
		"CA on a Unix socket": func(c *agent.Config) { c.CA.Address = "unix:///run/meshid/ca.sock" },
		"discovery address, CA's too": func(c *agent.Config) {
			c.CA.Address, c.XDS.DiscoveryAddress = "istiod.example:15012", "istiod.example:15012"
		},
		"status on every interface":      func(c *agent.Config) { c.Servers.StatusAddr = ":15020" },
		"ports picked by the kernel":     func(c *agent.Config) { c.Servers.StatusAddr, c.Servers.DebugAddr = "127.0.0.1:0", "[::1]:0" },
		"debug server on localhost":      func(c *agent.Config) { c.Servers.DebugAddr = "localhost:15004" },
		"debug server off":               func(c *agent.Config) { c.Servers.DebugAddr = "" },
		"discovery server at an IPv6 IP": func(c *agent.Config) { c.XDS.DiscoveryAddress = "[fd00::1]:15012" },
	} {
		t.Run("accepted/"+name, func(t *testing.T) {
			t.Parallel()
			c := good()
			modify(&c)
			if err := c.Validate(); err != nil {
				t.Fatalf("refused: %v", err)
			}
		})
	}
	for name, dirs := range map[string][]string{
		"next to the CA state dir":           {"/var/lib/meshid-certs", "/etc/certs"},
		"inside a dir next to the state dir": {"/var/lib/other/certs"},
	} {
		t.Run("accepted/"+name, func(t *testing.T) {
			t.Parallel()
			c := good()
			c.SDS.FileResourceDirs = dirs
			if err := c.Validate(); err != nil {
				t.Fatalf("file resource dirs %q refused: %v", dirs, err)
			}
		})
	}
}

// Attack: a file resource dir that reaches the embedded CA's state dir through a symlink.
func TestConfigRefusesFileResourceDirLinkedToCAState(t *testing.T) {
	t.Parallel()
	root := testutil.ShortTempDir(t)
	if err := os.MkdirAll(filepath.Join(root, "var/lib/meshid"), 0o700); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(root, "etc-certs")
	if err := os.Symlink(filepath.Join(root, "var/lib"), link); err != nil {
		t.Fatal(err)
	}
	c := agent.DefaultConfig(root)
	c.SDS.FileResourceDirs = []string{link}
	err := c.Validate()
	if err == nil || !strings.Contains(err.Error(), "SDS.FileResourceDirs: "+link) || !strings.Contains(err.Error(), filepath.Join(root, "var/lib/meshid")) {
		t.Fatalf("a file resource dir linked to the CA state dir's parent: %v, want a refusal naming SDS.FileResourceDirs, %s and the state dir", err, link)
	}
}
