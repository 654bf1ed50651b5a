package cli

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/testutil"
)

// mainAgent runs `meshid agent` as the process does: through Main, which chooses the exit code,
// and the production runner, on a context that has already ended, so that a configuration it
// accepts starts and stops at once. Its root dir, status and debug addresses are private to the
// test unless args give others. It returns the exit code and what was written to stderr.
func mainAgent(t *testing.T, env map[string]string, args ...string) (int, string) {
	t.Helper()
	g := &Globals{}
	root := NewRoot("meshid", "", "", g)
	startAndStop := func(ctx context.Context, cfg agent.Config) error {
		ctx, cancel := context.WithCancel(ctx)
		cancel()
		return RunAgent(ctx, cfg)
	}
	root.AddCommand(NewAgentCommand(g, startAndStop, func(k string) (string, bool) { v, ok := env[k]; return v, ok }, stubEmbed, nil, nil))
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs(append([]string{"agent", "--root-dir", testutil.ShortTempDir(t), "--status-addr", "127.0.0.1:0", "--debug-addr", ""}, args...))
	return Main(root), out.String()
}

// A newcomer's mistakes are refused at start, exit 2 (README: refused as called), with a
// message naming the flag, its variable and the value, instead of an agent that looks healthy
// while it cannot work, or a failure (exit 1) once it runs.
func TestAgentMistakesExitTwo(t *testing.T) {
	t.Parallel()
	identity := map[string]string{"POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo"}
	withIdentity := func(kv ...string) map[string]string {
		env := map[string]string{}
		for k, v := range identity {
			env[k] = v
		}
		for i := 0; i+1 < len(kv); i += 2 {
			env[kv[i]] = kv[i+1]
		}
		return env
	}
	// $FIX in a row's env, args or want is a directory holding a root (root.pem), a file that is
	// not PEM (notes.txt), a credentials dir with one file of three (partial/), a provisioned
	// key pair's dir (prov/) and a dir without any credential file (nocredentials/).
	fix := t.TempDir()
	ca := testutil.NewRootCA(t, testutil.CAOptions{})
	testutil.WriteFiles(t, fix, map[string][]byte{"root.pem": testutil.CertPEM(ca.Cert), "notes.txt": []byte("the CA's root goes here\n")})
	testutil.WriteFiles(t, filepath.Join(fix, "partial"), map[string][]byte{"cert-chain.pem": testutil.CertPEM(ca.Cert)})
	testutil.WriteFiles(t, filepath.Join(fix, "prov"), map[string][]byte{"cert-chain.pem": testutil.CertPEM(ca.Cert)})
	testutil.WriteFiles(t, filepath.Join(fix, "nocredentials"), map[string][]byte{".keep": nil})
	withCA := func(kv ...string) map[string]string {
		return withIdentity(append([]string{"CA_ADDR", "127.0.0.1:15012"}, kv...)...)
	}
	tests := []struct {
		name string
		env  map[string]string
		args []string
		want []string // each in the message
	}{
		// Item 2: addresses are HOST:PORT.
		{"CA address without a port", identity, []string{"--ca-addr", "127.0.0.1"},
			[]string{"--ca-addr", "CA_ADDR", `"127.0.0.1"`, "no port", "HOST:PORT"}},
		{"CA address with a scheme", withIdentity("CA_ADDR", "https://ca.example:15012"), nil,
			[]string{"--ca-addr", "CA_ADDR", "https://", `give HOST:PORT, as in "ca.example:15012"`}},
		{"discovery address without a port", identity, []string{"--discovery-addr", "istiod.example"},
			[]string{"--discovery-addr", `"istiod.example"`, "no port", "HOST:PORT"}},
		{"discovery address with a scheme", identity, []string{"--discovery-addr", "https://istiod.example:15012"},
			[]string{"--discovery-addr", "https://", "HOST:PORT"}},
		{"status port out of range", identity, []string{"--ca-addr", "127.0.0.1:15012", "--status-addr", "127.0.0.1:99999"},
			[]string{"--status-addr", `"127.0.0.1:99999"`, "from 0 to 65535"}},
		{"debug port out of range", identity, []string{"--ca-addr", "127.0.0.1:15012", "--debug-addr", "127.0.0.1:99999"},
			[]string{"--debug-addr", `"127.0.0.1:99999"`, "from 0 to 65535"}},
		// Item 1: a directory given explicitly exists; a typo does not silently change the source.
		{"credentials dir typo", withCA(), []string{"--credentials-dir", "$FIX/credentals-typo"},
			[]string{"--credentials-dir $FIX/credentals-typo does not exist"}},
		{"credentials dir typo, no CA address", nil, []string{"--credentials-dir", "$FIX/credentals-typo"},
			[]string{"--credentials-dir $FIX/credentals-typo does not exist"}},
		{"credentials dir is a file", withCA(), []string{"--credentials-dir", "$FIX/notes.txt"},
			[]string{"--credentials-dir $FIX/notes.txt is not a directory"}},
		{"provisioned key pair typo", withCA("PROV_CERT", "$FIX/porv"), nil,
			[]string{"--prov-cert (PROV_CERT) $FIX/porv does not exist"}},
		// Item 3: a root file given explicitly exists and holds a PEM certificate.
		{"CA root missing", withCA("CA_ROOT_CA", "$FIX/missing.pem"), nil,
			[]string{"--ca-root-cert (CA_ROOT_CA) $FIX/missing.pem does not exist"}},
		{"CA root not PEM", withCA(), []string{"--ca-root-cert", "$FIX/notes.txt"},
			[]string{"--ca-root-cert (CA_ROOT_CA) $FIX/notes.txt holds no PEM certificate"}},
		{"CA root is a directory", withCA("CA_ROOT_CA", "$FIX/prov"), nil,
			[]string{"--ca-root-cert (CA_ROOT_CA) $FIX/prov", "is a directory"}},
		{"xDS root missing", withCA("XDS_ROOT_CA", "$FIX/missing.pem"), nil,
			[]string{"--xds-root-cert (XDS_ROOT_CA) $FIX/missing.pem does not exist"}},
		{"xDS root not PEM", withCA(), []string{"--xds-root-cert", "$FIX/notes.txt"},
			[]string{"--xds-root-cert (XDS_ROOT_CA) $FIX/notes.txt holds no PEM certificate"}},
		{"every path at once", withCA("CA_ROOT_CA", "$FIX/missing.pem", "PROV_CERT", "$FIX/porv", "XDS_ROOT_CA", "$FIX/notes.txt"),
			[]string{"--credentials-dir", "$FIX/credentals-typo"},
			[]string{"--credentials-dir $FIX/credentals-typo", "--prov-cert (PROV_CERT) $FIX/porv", "--ca-root-cert (CA_ROOT_CA) $FIX/missing.pem", "--xds-root-cert (XDS_ROOT_CA) $FIX/notes.txt"}},
		// Item 7: Istio's provider variables take only what meshid does.
		{"GCE credential fetcher without an audience", withCA("CREDENTIAL_FETCHER_TYPE", "GoogleComputeEngine"), nil,
			[]string{"--credential-identity-provider (CREDENTIAL_IDENTITY_PROVIDER) is required with --credential-fetcher-type (CREDENTIAL_FETCHER_TYPE) GoogleComputeEngine"}},
		{"GCE credential fetcher without a CA", withIdentity("CREDENTIAL_FETCHER_TYPE", "GoogleComputeEngine", "CREDENTIAL_IDENTITY_PROVIDER", "istio-ca"), nil,
			[]string{"--credential-fetcher-type (CREDENTIAL_FETCHER_TYPE) GoogleComputeEngine needs --ca-addr (CA_ADDR)"}},
		{"GCE credential fetcher and a token path", withCA("CREDENTIAL_FETCHER_TYPE", "GoogleComputeEngine", "CREDENTIAL_IDENTITY_PROVIDER", "istio-ca"),
			[]string{"--token-path", "$FIX/token"},
			[]string{"--token-path is ignored with --credential-fetcher-type (CREDENTIAL_FETCHER_TYPE) GoogleComputeEngine"}},
		{"GCE metadata host with a scheme", withCA("CREDENTIAL_FETCHER_TYPE", "googlecomputeengine", "CREDENTIAL_IDENTITY_PROVIDER", "istio-ca", "GCE_METADATA_HOST", "http://metadata.google.internal"), nil,
			[]string{"--gce-metadata-host", "(GCE_METADATA_HOST)", "without a scheme"}},
		{"GCE metadata host without the fetcher", withCA("GCE_METADATA_HOST", "metadata.google.internal"), nil,
			[]string{"--gce-metadata-host", "(GCE_METADATA_HOST) has no effect without --credential-fetcher-type (CREDENTIAL_FETCHER_TYPE) GoogleComputeEngine"}},
		{"unknown credential fetcher", withCA(), []string{"--credential-fetcher-type", "Vault"},
			[]string{"--credential-fetcher-type", "(CREDENTIAL_FETCHER_TYPE)", "Vault", "is unknown", "JWT"}},
		{"credential identity provider without the fetcher", withCA("CREDENTIAL_IDENTITY_PROVIDER", "GoogleComputeEngine"), nil,
			[]string{"--credential-identity-provider", "(CREDENTIAL_IDENTITY_PROVIDER) has no effect without --credential-fetcher-type (CREDENTIAL_FETCHER_TYPE) GoogleComputeEngine"}},
		{"credential identity provider with JWT", withCA("CREDENTIAL_FETCHER_TYPE", "JWT"), []string{"--credential-identity-provider", "istio-ca"},
			[]string{"--credential-identity-provider", "(CREDENTIAL_IDENTITY_PROVIDER) has no effect"}},
		{"token exchange over http to another host", withCA(), []string{"--token-exchange-url", "http://sts.example/v1/token"},
			[]string{"--token-exchange-url", `"http://sts.example/v1/token"`, "in clear", "want https"}},
		{"token exchange URL not absolute", withCA(), []string{"--token-exchange-url", "sts.example/v1/token"},
			[]string{"--token-exchange-url", "want an absolute URL"}},
		{"token exchange without a CA", withIdentity(), []string{"--token-exchange-url", "https://sts.example/v1/token"},
			[]string{"--token-exchange-url needs --ca-addr (CA_ADDR)"}},
		{"token exchange audience alone", withCA(), []string{"--token-exchange-audience", "istio-ca"},
			[]string{"--token-exchange-audience has no effect without --token-exchange-url"}},
		{"token exchange root missing", withCA(), []string{"--token-exchange-url", "https://sts.example/v1/token", "--token-exchange-root-cert", "$FIX/missing.pem"},
			[]string{"--token-exchange-root-cert $FIX/missing.pem does not exist"}},
		{"Kubernetes cert provider", withCA("PILOT_CERT_PROVIDER", "kubernetes"), nil,
			[]string{"--pilot-cert-provider (PILOT_CERT_PROVIDER) kubernetes is not supported", "--xds-root-cert (XDS_ROOT_CA)"}},
		{"Kubernetes signer cert provider", withCA("PILOT_CERT_PROVIDER", "kubernetes:example.com/signer"), nil,
			[]string{"--pilot-cert-provider (PILOT_CERT_PROVIDER) kubernetes:example.com/signer is not supported"}},
		{"custom cert provider", withCA(), []string{"--pilot-cert-provider", "custom"},
			[]string{"--pilot-cert-provider (PILOT_CERT_PROVIDER) custom is not supported", "--ca-root-cert (CA_ROOT_CA)"}},
		{"no cert provider", withCA("PILOT_CERT_PROVIDER", "none"), nil,
			[]string{"--pilot-cert-provider (PILOT_CERT_PROVIDER) none is not supported"}},
		{"unknown cert provider", withCA("PILOT_CERT_PROVIDER", "vault"), nil,
			[]string{"--pilot-cert-provider (PILOT_CERT_PROVIDER) \"vault\" is unknown", "istiod"}},
		{"every provider at once", withCA("CREDENTIAL_FETCHER_TYPE", "Vault", "CREDENTIAL_IDENTITY_PROVIDER", "GoogleComputeEngine", "PILOT_CERT_PROVIDER", "kubernetes", "CA_PROVIDER", "googleCA"), nil,
			[]string{"CREDENTIAL_FETCHER_TYPE", "CREDENTIAL_IDENTITY_PROVIDER", "PILOT_CERT_PROVIDER", `--ca-provider (CA_PROVIDER) "googleCA"`}},
		// Item 4: some of the three credential files but not all.
		{"incomplete credentials dir", withCA(), []string{"--credentials-dir", "$FIX/partial"},
			[]string{"--credentials-dir $FIX/partial holds cert-chain.pem but not key.pem, root-cert.pem"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			expand := func(s string) string { return strings.ReplaceAll(s, "$FIX", fix) }
			env := map[string]string{}
			for k, v := range tt.env {
				env[k] = expand(v)
			}
			var args, want []string
			for _, a := range tt.args {
				args = append(args, expand(a))
			}
			for _, w := range tt.want {
				want = append(want, expand(w))
			}
			code, stderr := mainAgent(t, env, args...)
			checkRefused(t, code, stderr, want...)
		})
	}
	// What stays accepted: a credentials dir without credentials (an optional secret not there
	// yet: the CA serves), a PROV_CERT that is also OUTPUT_CERTS (the agent creates and fills it, as
	// Istio's VMs use it), real roots, and the defaults, which may be absent.
	for name, tt := range map[string]struct {
		env  map[string]string
		args []string
	}{
		"credentials dir without credentials": {withCA(), []string{"--credentials-dir", "$FIX/nocredentials"}},
		"PROV_CERT is OUTPUT_CERTS":           {withCA("PROV_CERT", "$OUT/certs", "OUTPUT_CERTS", "$OUT/certs/"), nil},
		"roots given":                         {withCA("CA_ROOT_CA", "$FIX/root.pem", "XDS_ROOT_CA", "$FIX/root.pem", "PROV_CERT", "$FIX/prov"), nil},
		"defaults absent":                     {withCA(), nil},
		"Istio's injected providers":          {withCA("PILOT_CERT_PROVIDER", "istiod", "CREDENTIAL_FETCHER_TYPE", "JWT"), nil},
		"providers as flags":                  {withCA(), []string{"--pilot-cert-provider", "istiod", "--credential-fetcher-type", "JWT", "--credential-identity-provider", ""}},
		"GCE credential fetcher": {withCA("CREDENTIAL_FETCHER_TYPE", "GoogleComputeEngine", "CREDENTIAL_IDENTITY_PROVIDER", "istio-ca",
			"GCE_METADATA_HOST", "127.0.0.1:1"), nil},
		"a flag wins over its variable": {withCA("PILOT_CERT_PROVIDER", "kubernetes", "CREDENTIAL_FETCHER_TYPE", "Vault"),
			[]string{"--pilot-cert-provider", "istiod", "--credential-fetcher-type", "JWT"}},
		"defaults absent, embedded CA": {nil, []string{"--proxy-xds-via-agent=false"}},
	} {
		t.Run("accepted/"+name, func(t *testing.T) {
			t.Parallel()
			out := t.TempDir()
			expand := func(s string) string { return strings.ReplaceAll(strings.ReplaceAll(s, "$FIX", fix), "$OUT", out) }
			env := map[string]string{}
			for k, v := range tt.env {
				env[k] = expand(v)
			}
			var args []string
			for _, a := range tt.args {
				args = append(args, expand(a))
			}
			code, stderr := mainAgent(t, env, args...)
			if code == ExitUsage || strings.Contains(stderr, "does not exist") || strings.Contains(stderr, "no PEM") {
				t.Errorf("refused, exit code %d:\n%s", code, stderr)
			}
		})
	}
}

// checkRefused fails the test unless the exit code is ExitUsage and stderr says each of want.
func checkRefused(t *testing.T, code int, stderr string, want ...string) {
	t.Helper()
	var missing []string
	for _, w := range want {
		if !strings.Contains(stderr, w) {
			missing = append(missing, w)
		}
	}
	if code != ExitUsage || len(missing) > 0 {
		t.Errorf("exit code %d, want %d; stderr does not say %q:\n%s", code, ExitUsage, missing, stderr)
	}
}

// Istio's variables that meshid does not implement are named in one warning at start, never
// ignored silently; variables meshid implements are never in the list.
func TestAgentWarnsOfIstioVariablesItIgnores(t *testing.T) {
	t.Parallel()
	const warning = `level=WARN msg="set but not implemented by meshid; ignored"`
	env := map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo"}
	for _, name := range unimplementedIstioEnv() {
		env[name] = "x"
	}
	code, stderr := mainAgent(t, env)
	var lines []string
	for _, line := range strings.Split(stderr, "\n") {
		if strings.Contains(line, warning) {
			lines = append(lines, line)
		}
	}
	if code != 0 || len(lines) != 1 {
		t.Fatalf("exit code %d, %d warnings; want 0 and one:\n%s", code, len(lines), stderr)
	}
	for _, name := range unimplementedIstioEnv() {
		if !strings.Contains(lines[0], name) {
			t.Errorf("the warning does not name %s: %s", name, lines[0])
		}
	}

	// Only the variables that are set, with a value, and also when the agent is refused.
	env = map[string]string{"ISTIO_BOOTSTRAP_OVERRIDE": "/etc/istio/custom-bootstrap/custom_bootstrap.json", "JWT_POLICY": "third-party-jwt",
		"ECC_CURVE": "", "CA_ADDR": "127.0.0.1", "MINIMUM_DRAIN_DURATION": "10s", "EXIT_ON_ZERO_ACTIVE_CONNECTIONS": "true"}
	code, stderr = mainAgent(t, env)
	if code != ExitUsage || !strings.Contains(stderr, warning+" variables=[JWT_POLICY]") {
		t.Errorf("exit code %d; want %d and a warning naming JWT_POLICY only:\n%s", code, ExitUsage, stderr)
	}
	// The agent starts no Envoy: the bootstrap's and the drain's variables do nothing, and that is
	// said once.
	if n := strings.Count(stderr, `level=WARN msg="set for the Envoy the agent starts with --envoy-path, which this agent does not start: ignored" variables="[ISTIO_BOOTSTRAP_OVERRIDE MINIMUM_DRAIN_DURATION EXIT_ON_ZERO_ACTIVE_CONNECTIONS]"`); n != 1 {
		t.Errorf("%d warnings about the Envoy variables, want one:\n%s", n, stderr)
	}
	if code, stderr = mainAgent(t, map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo"}); code != 0 || strings.Contains(stderr, "level=WARN") {
		t.Errorf("exit code %d, a warning with no such variable set:\n%s", code, stderr)
	}

	listed := map[string]bool{}
	for _, name := range unimplementedIstioEnv() {
		listed[name] = true
	}
	for _, b := range agentEnv() {
		if listed[b.env] {
			t.Errorf("%s is bound to --%s and listed as not implemented", b.env, b.flag)
		}
	}
	for _, name := range []string{"PROXY_CONFIG",
		"JWT_POLICY", "ISTIO_META_DNS_CAPTURE", "ISTIO_META_DNS_AUTO_ALLOCATE", "PROXY_XDS_DEBUG_VIA_AGENT_PORT", "ECC_CURVE",
		"ISTIO_META_CERT_SIGNER", "WORKLOAD_IDENTITY_SOCKET_FILE"} {
		if !listed[name] {
			t.Errorf("%s, which Istio's injector or pilot-agent's users set, is not warned about", name)
		}
	}
}
