package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds/sdsclient"
)

// runTestAgent runs a real agent until the test ends: the embedded control plane under a short
// root dir, or, when credentials is set, those files; adjust changes the rest. It returns the SDS
// socket's path.
func runTestAgent(t *testing.T, credentials map[string][]byte, adjust ...func(*agent.Config)) string {
	t.Helper()
	root := testutil.ShortTempDir(t)
	cfg := agent.DefaultConfig(root)
	cfg.Servers.StatusAddr, cfg.Servers.DebugAddr = "127.0.0.1:0", "127.0.0.1:0"
	cfg.CA.Embed = controlplanetest.Embed
	// The certificates' validity is checked by `certs` on the real clock; this one stands still at
	// the real time of the start, so that no renewal or debounce happens behind the test's back.
	cfg.Clock = testutil.NewFakeClock(time.Now())
	if credentials != nil {
		cfg.SDS.CredentialsDir = filepath.Join(t.TempDir(), "credentials")
		testutil.WriteFiles(t, cfg.SDS.CredentialsDir, credentials)
	}
	for _, fn := range adjust {
		fn(&cfg)
	}
	a, err := agent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("agent Run: %v", err)
		}
	})
	return a.SocketPath()
}

// certsCommand runs `meshid certs args...` and returns its output and error.
func certsCommand(t *testing.T, args ...string) (string, error) {
	t.Helper()
	root := NewRoot("meshid", "", "", &Globals{})
	root.AddCommand(NewCertsCommand())
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs(append([]string{"certs", "--timeout", "30s"}, args...))
	err := root.ExecuteContext(t.Context())
	return out.String(), err
}

func TestCertsCommand(t *testing.T) {
	t.Parallel()
	socket := runTestAgent(t, nil)
	const id = "spiffe://cluster.local/ns/default/sa/default"

	t.Run("text", func(t *testing.T) {
		t.Parallel()
		out, err := certsCommand(t, "--socket", socket)
		if err != nil {
			t.Fatalf("certs: %v\n%s", err, out)
		}
		for _, want := range []string{"SPIFFE ID:   " + id + "\n", "verifies against ROOTCA: yes\n"} {
			if !strings.Contains(out, want) {
				t.Errorf("output lacks %q:\n%s", want, out)
			}
		}
	})
	t.Run("json", func(t *testing.T) {
		t.Parallel()
		out, err := certsCommand(t, "--socket", socket, "-o", "json")
		if err != nil {
			t.Fatalf("certs -o json: %v\n%s", err, out)
		}
		var report sdsclient.CertReport
		if err := json.Unmarshal([]byte(out), &report); err != nil {
			t.Fatalf("-o json output does not decode: %v\n%s", err, out)
		}
		if !report.Verified || report.SPIFFEID != id || report.Serial == "" || report.ChainLen < 2 || len(report.Roots) != 1 || report.Socket != socket {
			t.Fatalf("report %+v", report)
		}
		if left := time.Until(report.NotAfter); left < 23*time.Hour || left > 24*time.Hour+time.Second {
			t.Fatalf("valid for %s more, want the default 24h", left)
		}
	})
	t.Run("yaml is refused", func(t *testing.T) {
		t.Parallel()
		if out, err := certsCommand(t, "--socket", socket, "-o", "yaml"); err == nil || !strings.Contains(err.Error(), "-o") {
			t.Fatalf("certs -o yaml: error %v, output %q; want a refusal naming -o", err, out)
		}
	})
}

func TestCertsCommandNothingListening(t *testing.T) {
	t.Parallel()
	path := filepath.Join(testutil.ShortTempDir(t), "socket")
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	lis.(*net.UnixListener).SetUnlinkOnClose(false)
	_ = lis.Close()
	for _, socket := range []string{path, filepath.Join(filepath.Dir(path), "absent")} {
		if out, err := certsCommand(t, "--socket", socket); err == nil {
			t.Fatalf("certs against %s, where nothing listens, succeeded:\n%s", socket, out)
		}
	}
}

// A chain that does not verify against ROOTCA: exit 1, and the text says NO.
func TestCertsCommandChainDoesNotVerify(t *testing.T) {
	t.Parallel()
	issuer := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "issuer"})
	other := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "another root"})
	leaf, key := issuer.IssueWorkload(t, "spiffe://cluster.local/ns/shop/sa/cart", time.Hour)
	socket := runTestAgent(t, map[string][]byte{
		"cert-chain.pem": testutil.CertPEM(leaf, issuer.Cert),
		"key.pem":        testutil.KeyPEM(t, key),
		"root-cert.pem":  testutil.CertPEM(other.Cert),
	})

	g := &Globals{}
	root := NewRoot("meshid", "", "", g)
	root.AddCommand(NewCertsCommand())
	var stdout, stderr bytes.Buffer
	root.SetOut(&stdout)
	root.SetErr(&stderr)
	root.SetArgs([]string{"certs", "--socket", socket, "--timeout", "30s"})
	if code := Main(root); code != 1 {
		t.Fatalf("exit code %d, want 1; output:\n%s", code, stdout.String())
	}
	if !strings.Contains(stdout.String(), "verifies against ROOTCA: NO") {
		t.Errorf("output does not say NO:\n%s", stdout.String())
	}
	if !strings.Contains(stdout.String(), "spiffe://cluster.local/ns/shop/sa/cart") {
		t.Errorf("output lacks the SPIFFE ID:\n%s", stdout.String())
	}
	if !strings.Contains(stderr.String(), "does not verify") {
		t.Errorf("stderr %q does not say why", stderr.String())
	}

	out, err := certsCommand(t, "--socket", socket, "-o", "json")
	var report sdsclient.CertReport
	if err == nil || json.Unmarshal([]byte(out), &report) != nil || report.Verified || report.VerifyError == "" {
		t.Fatalf("certs -o json: error %v, report %+v; want an error and verified false with the reason", err, report)
	}
}

// An agent that holds no valid certificate answers at once with the reason, rather than leaving
// `certs` to its deadline (it used to wait out its 10 s and say "context deadline exceeded").
func TestCertsCommandAgentWithoutCertificate(t *testing.T) {
	t.Parallel()
	var tokenPath string
	socket := runTestAgent(t, nil, func(cfg *agent.Config) {
		cfg.CA.Address = "127.0.0.1:1"
		cfg.Identity.Namespace, cfg.Identity.ServiceAccount = "shop", "cart"
		tokenPath = filepath.Join(cfg.RootDir, "no-token")
		cfg.CA.TokenPath = tokenPath
	})
	// The deadline is far off: only the agent's answer can end the command in time.
	out, err := certsCommand(t, "--socket", socket)
	if err == nil {
		t.Fatalf("certs succeeded against an agent without a certificate:\n%s", out)
	}
	for _, want := range []string{"Unavailable", "no credentials for the CA", tokenPath} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}
