package cli

import (
	"context"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/agent/nodemode"
	"github.com/meshid/meshid/internal/attest"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/xdsproxy"
)

// stubEmbed stands for `meshid`'s embedded control plane; the command only checks it is there.
func stubEmbed(agent.EmbedConfig) (agent.ControlPlane, error) {
	return nil, errors.New("not started in this test")
}

// runAgentCommand parses args and env the way `meshid agent` does and returns the config that
// would be run.
func runAgentCommand(t *testing.T, env map[string]string, args ...string) (agent.Config, error) {
	t.Helper()
	return runAgentCommandWith(t, stubEmbed, env, args...)
}

// runAgentCommandWith is runAgentCommand for a binary with embed (nil: `meshid-agent`).
func runAgentCommandWith(t *testing.T, embed agent.EmbedFunc, env map[string]string, args ...string) (agent.Config, error) {
	t.Helper()
	var got agent.Config
	g := &Globals{}
	root := NewRoot("meshid", "", "", g)
	root.AddCommand(NewAgentCommand(g, func(_ context.Context, cfg agent.Config) error {
		got = cfg
		return nil
	}, func(k string) (string, bool) { v, ok := env[k]; return v, ok }, embed, nil, nodemode.New(testAttest)))
	root.SetArgs(append([]string{"agent"}, args...))
	err := root.ExecuteContext(t.Context())
	return got, err
}

func TestAgentEnvironmentAndFlags(t *testing.T) {
	t.Parallel()
	env := map[string]string{
		"CA_ADDR":                          "ca.example:15012",
		"CA_ROOT_CA":                       "/env/root.pem",
		"ISTIOD_SAN":                       "ca.example",
		"PROV_CERT":                        "/env/prov",
		"OUTPUT_CERTS":                     "/env/out",
		"SECRET_TTL":                       "2h",
		"SECRET_GRACE_PERIOD_RATIO":        "0.4",
		"SECRET_GRACE_PERIOD_RATIO_JITTER": "0.05",
		"TRUST_DOMAIN":                     "example.org",
		"POD_NAMESPACE":                    "shop",
		"SERVICE_ACCOUNT":                  "cart",
		"ISTIO_META_CLUSTER_ID":            "east",
		"ECC_SIGNATURE_ALGORITHM":          "RSA",
		"WORKLOAD_RSA_KEY_SIZE":            "3072",
		"CA_PROVIDER":                      "Citadel",
	}
	cfg, err := runAgentCommand(t, env)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.CA.Address != "ca.example:15012" || cfg.CA.RootCert != "/env/root.pem" || cfg.CA.ServerName != "ca.example" ||
		cfg.CA.ProvCert != "/env/prov" || cfg.Output.Dir != "/env/out" || cfg.Certificate.TTL != 2*time.Hour ||
		cfg.Certificate.GraceRatio != 0.4 || cfg.Certificate.GraceRatioJitter != 0.05 || cfg.Identity.TrustDomain != "example.org" ||
		cfg.Identity.Namespace != "shop" || cfg.Identity.ServiceAccount != "cart" || cfg.CA.ClusterID != "east" ||
		cfg.Certificate.KeyAlgorithm != pki.RSA || cfg.Certificate.RSAKeySize != 3072 {
		t.Fatalf("environment not applied: %+v", cfg)
	}
	if cfg.CA.TokenPath != "/var/run/secrets/tokens/istio-token" {
		t.Fatalf("token path %q, want Istio's default", cfg.CA.TokenPath)
	}

	// A flag wins over its variable.
	cfg, err = runAgentCommand(t, env, "--ca-addr", "127.0.0.1:1", "--namespace", "flagged", "--key-algorithm", "ECDSA",
		"--secret-ttl", "30s", "--root-dir", "/r")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.CA.Address != "127.0.0.1:1" || cfg.Identity.Namespace != "flagged" || cfg.Certificate.KeyAlgorithm != pki.ECDSA || cfg.Certificate.TTL != 30*time.Second {
		t.Fatalf("flags did not win: %+v", cfg)
	}
	if cfg.Identity.ServiceAccount != "cart" {
		t.Fatal("a variable without a flag was dropped")
	}
	if cfg.CA.TokenPath != "/r/var/run/secrets/tokens/istio-token" || cfg.RootDir != "/r" {
		t.Fatalf("token path %q under root dir %q", cfg.CA.TokenPath, cfg.RootDir)
	}
}

// Istio's credential fetcher variables reach agent.Config; the type's case is Istio's whatever
// the case given.
func TestAgentCredentialFetcher(t *testing.T) {
	t.Parallel()
	env := map[string]string{
		"CA_ADDR": "ca.example:15012", "POD_NAMESPACE": "shop", "SERVICE_ACCOUNT": "cart",
		"CREDENTIAL_FETCHER_TYPE": "googlecomputeengine", "CREDENTIAL_IDENTITY_PROVIDER": "istio-ca", "GCE_METADATA_HOST": "metadata.example:8080",
	}
	cfg, err := runAgentCommand(t, env)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.CA.CredentialFetcherType != agent.CredentialFetcherGCE || cfg.CA.CredentialIdentityProvider != "istio-ca" || cfg.CA.MetadataHost != "metadata.example:8080" {
		t.Fatalf("credential fetcher not applied: %+v", cfg.CA)
	}
	cfg, err = runAgentCommand(t, env, "--credential-identity-provider", "other", "--gce-metadata-host", "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.CA.CredentialIdentityProvider != "other" || cfg.CA.MetadataHost != "127.0.0.1" {
		t.Fatalf("flags did not win: %+v", cfg.CA)
	}
	cfg, err = runAgentCommand(t, map[string]string{"CA_ADDR": "ca.example:15012", "POD_NAMESPACE": "shop", "SERVICE_ACCOUNT": "cart", "CREDENTIAL_FETCHER_TYPE": "jwt"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.CA.CredentialFetcherType != agent.CredentialFetcherJWT {
		t.Fatalf("credential fetcher type %q, want JWT", cfg.CA.CredentialFetcherType)
	}
}

func TestAgentRefusesBadInput(t *testing.T) {
	t.Parallel()
	base := map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo"}
	with := func(k, v string) map[string]string {
		m := map[string]string{k: v}
		for a, b := range base {
			if a != k {
				m[a] = b
			}
		}
		return m
	}
	tests := []struct {
		name string
		env  map[string]string
		args []string
		want string
	}{
		{"GoogleCA in another case", with("CA_PROVIDER", "googleca"), nil, `--ca-provider (CA_PROVIDER) "googleca": write GoogleCA`},
		{"GKE cluster URL without GoogleCA", with("GKE_CLUSTER_URL", "https://container.googleapis.com/v1/projects/p/locations/l/clusters/c"), nil,
			"--gke-cluster-url (GKE_CLUSTER_URL) has no effect without --ca-provider (CA_PROVIDER) GoogleCA"},
		{"bad ratio variable", with("SECRET_GRACE_PERIOD_RATIO", "half"), nil, `SECRET_GRACE_PERIOD_RATIO="half"`},
		{"bad key algorithm", with("ECC_SIGNATURE_ALGORITHM", "DSA"), nil, "ECC_SIGNATURE_ALGORITHM"},
		{"no namespace", with("POD_NAMESPACE", ""), nil, "--namespace (POD_NAMESPACE) is required with --ca-addr"},
		{"no service account", with("SERVICE_ACCOUNT", ""), nil, "--service-account (SERVICE_ACCOUNT) is required with --ca-addr"},
		{"group read value", base, []string{"--output-certs", "/o", "--output-certs-group-read", "everyone"}, "--output-certs-group-read"},
		{"group read without output", base, []string{"--output-certs-group-read", "certs"}, "needs --output-certs"},
		{"ratio out of range", base, []string{"--grace-period-ratio", "1.2"}, "--grace-period-ratio"},
		{"no SDS streams", base, []string{"--sds-max-streams", "0"}, "--sds-max-streams 0 must be positive"},
		{"negative SDS streams per connection", base, []string{"--sds-max-streams-per-connection", "-1"}, "--sds-max-streams-per-connection -1 must be positive"},
		{"node mode with output certs", base, []string{"--workload-attestation", "/rules.yaml", "--output-certs", "/o"},
			"--workload-attestation serves each caller its own identity, so there is no one key pair to write to --output-certs (OUTPUT_CERTS)"},
		{"node mode with the Mesh CA", with("CA_PROVIDER", "GoogleCA"), []string{"--workload-attestation", "/rules.yaml"},
			"--ca-provider (CA_PROVIDER) GoogleCA cannot ask for another identity"},
		{"node mode with the xDS proxy asked for", base, []string{"--workload-attestation", "/rules.yaml", "--proxy-xds-via-agent"},
			"--workload-attestation serves each caller its own identity, but --proxy-xds-via-agent (PROXY_XDS_VIA_AGENT) would proxy every Envoy's xDS as the node agent's own identity"},
		{"node mode with PROXY_XDS_VIA_AGENT=true", with("PROXY_XDS_VIA_AGENT", "true"), []string{"--workload-attestation", "/rules.yaml"},
			"--workload-attestation serves each caller its own identity, but --proxy-xds-via-agent (PROXY_XDS_VIA_AGENT) would proxy"},
		{"node mode with an xDS proxy flag", base, []string{"--workload-attestation", "/rules.yaml", "--xds-socket", "/tmp/XDS"},
			"--xds-socket configures the xDS proxy, which node mode (--workload-attestation, --workload-attestation-pods) turns off"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := runAgentCommand(t, tt.env, tt.args...)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one mentioning %q", err, tt.want)
			}
		})
	}
	// No CA: the agent runs its own, with the default identity.
	cfg, err := runAgentCommand(t, map[string]string{})
	if err != nil {
		t.Fatalf("no CA address (embedded mode) refused: %v", err)
	}
	if id, err := cfg.SPIFFEID(); err != nil || id.String() != "spiffe://cluster.local/ns/default/sa/default" {
		t.Fatalf("embedded identity %v (%v)", id, err)
	}
	// OUTPUT_CERTS for a group.
	for flag, want := range map[string][2]bool{"none": {false, false}, "certs": {true, false}, "all": {true, true}} {
		cfg, err := runAgentCommand(t, base, "--output-certs", "/o", "--output-certs-group-read", flag)
		if err != nil {
			t.Fatal(err)
		}
		if got := [2]bool{cfg.Output.GroupRead, cfg.Output.KeyGroupRead}; got != want {
			t.Errorf("--output-certs-group-read %s: group read %v, want %v", flag, got, want)
		}
	}
	// Any provider but GoogleCA means Citadel, as in Istio.
	for _, p := range []string{"istiod", "Citadel", ""} {
		cfg, err := runAgentCommand(t, with("CA_PROVIDER", p))
		if err != nil {
			t.Fatalf("CA_PROVIDER=%s refused: %v", p, err)
		}
		if cfg.CA.Provider != agent.CAProviderCitadel {
			t.Errorf("CA_PROVIDER=%s: provider %q, want Citadel", p, cfg.CA.Provider)
		}
	}
}

// CA_PROVIDER=GoogleCA selects the Mesh CA protocol, with each credential type: none of them is
// refused with it (meshid ca authenticates both protocols alike), and GKE_CLUSTER_URL goes with
// it only.
func TestAgentGoogleCAProvider(t *testing.T) {
	t.Parallel()
	env := func(kv ...string) map[string]string {
		m := map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo", "CA_PROVIDER": "GoogleCA"}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	tests := []struct {
		name string
		env  map[string]string
		args []string
	}{
		{"token file", env(), nil},
		{"GCE identity token", env("CREDENTIAL_FETCHER_TYPE", "GoogleComputeEngine", "CREDENTIAL_IDENTITY_PROVIDER", "istio-ca"), nil},
		{"exchanged token", env(), []string{"--token-exchange-url", "http://127.0.0.1:1/token"}},
		{"flag", map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo"}, []string{"--ca-provider", "GoogleCA"}},
		{"embedded CA", map[string]string{"CA_PROVIDER": "GoogleCA"}, nil},
		{"file-mounted certificates", env("FILE_MOUNTED_CERTS", "true"), nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg, err := runAgentCommand(t, tt.env, tt.args...)
			if err != nil {
				t.Fatalf("refused: %v", err)
			}
			if cfg.CA.Provider != agent.CAProviderGoogleCA {
				t.Fatalf("provider %q, want GoogleCA", cfg.CA.Provider)
			}
		})
	}
	cfg, err := runAgentCommand(t, env("GKE_CLUSTER_URL", "https://container.googleapis.com/v1/projects/p/locations/us-central1-c/clusters/c"))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.CA.GKEClusterURL == "" {
		t.Fatal("GKE_CLUSTER_URL not read")
	}
	_, err = runAgentCommand(t, env("GKE_CLUSTER_URL", "https://container.googleapis.com/v1/projects/p/clusters/c"))
	if err == nil || !strings.Contains(err.Error(), "--gke-cluster-url") || !strings.Contains(err.Error(), "names no location") {
		t.Fatalf("a cluster URL without a location: error %v, want one naming --gke-cluster-url", err)
	}
}

// The SDS limits have defaults Envoy never reaches, and flags to change them.
func TestAgentSDSLimits(t *testing.T) {
	t.Parallel()
	env := map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo"}
	cfg, err := runAgentCommand(t, env)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.SDS.MaxStreams != sds.DefaultMaxStreams || cfg.SDS.MaxStreamsPerConnection != sds.DefaultMaxStreamsPerConnection {
		t.Fatalf("SDS limits %d, %d per connection; want the defaults", cfg.SDS.MaxStreams, cfg.SDS.MaxStreamsPerConnection)
	}
	cfg, err = runAgentCommand(t, env, "--sds-max-streams", "50", "--sds-max-streams-per-connection", "10")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.SDS.MaxStreams != 50 || cfg.SDS.MaxStreamsPerConnection != 10 {
		t.Fatalf("SDS limits %d, %d per connection; want 50, 10", cfg.SDS.MaxStreams, cfg.SDS.MaxStreamsPerConnection)
	}
}

// The Workload API is served by default; --workload-api=false turns it off.
func TestAgentWorkloadAPIFlag(t *testing.T) {
	t.Parallel()
	env := map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo"}
	for _, tc := range []struct {
		args []string
		want bool
	}{{nil, true}, {[]string{"--workload-api=false"}, false}} {
		cfg, err := runAgentCommand(t, env, tc.args...)
		if err != nil {
			t.Fatal(err)
		}
		if cfg.SDS.WorkloadAPI != tc.want {
			t.Fatalf("with %v: WorkloadAPI %t, want %t", tc.args, cfg.SDS.WorkloadAPI, tc.want)
		}
	}
	cfg, err := runAgentCommand(t, env, "--workload-attestation", "/etc/meshid/rules.yaml")
	if err != nil || cfg.SDS.WorkloadAttestation != "/etc/meshid/rules.yaml" {
		t.Fatalf("--workload-attestation: %q, %v", cfg.SDS.WorkloadAttestation, err)
	}
	// The xDS proxy, on by default, is off in node mode.
	if !agent.DefaultConfig("").XDS.Proxy || cfg.XDS.Proxy {
		t.Fatalf("node mode: xDS proxy %t, want off (the default is on: %t)", cfg.XDS.Proxy, agent.DefaultConfig("").XDS.Proxy)
	}
}

// Node mode's Kubernetes source: the flags, NODE_NAME under --node-name, alone or with the
// rules; NODE_NAME without the source is left alone (the downward API may set it in any pod).
func TestAgentWorkloadAttestationPodsFlags(t *testing.T) {
	t.Parallel()
	env := map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "istio-system", "SERVICE_ACCOUNT": "node-agent", "NODE_NAME": "env-node"}
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kubeconfig, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want agent.AttestPods
	}{
		{[]string{"--workload-attestation-pods", "--in-cluster"}, agent.AttestPods{Enabled: true, NodeName: "env-node", InCluster: true}},
		{[]string{"--workload-attestation-pods", "--node-name", "n1", "--kubeconfig", kubeconfig, "--workload-attestation", "/rules.yaml"},
			agent.AttestPods{Enabled: true, NodeName: "n1", Kubeconfig: kubeconfig}},
		{nil, agent.AttestPods{NodeName: "env-node"}},
	} {
		cfg, err := runAgentCommand(t, env, tc.args...)
		if err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if cfg.SDS.AttestPods != tc.want {
			t.Errorf("%v: %+v, want %+v", tc.args, cfg.SDS.AttestPods, tc.want)
		}
		// Node mode, from either source, turns the xDS proxy off.
		if cfg.XDS.Proxy != !tc.want.Enabled {
			t.Errorf("%v: xDS proxy %t, want %t", tc.args, cfg.XDS.Proxy, !tc.want.Enabled)
		}
	}
	if _, err := runAgentCommand(t, env, "--workload-attestation-pods", "--in-cluster", "--xds-socket", "/tmp/XDS"); err == nil ||
		!strings.Contains(err.Error(), "--xds-socket configures the xDS proxy, which node mode (--workload-attestation, --workload-attestation-pods) turns off") {
		t.Errorf("--xds-socket with the pods source: %v", err)
	}
}

// The xDS proxy's limits and its debug endpoint: defaults, flags, and refusals of what cannot
// work.
func TestAgentXDSProxyLimitsAndDebug(t *testing.T) {
	t.Parallel()
	env := map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo"}
	cfg, err := runAgentCommand(t, env)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.XDS.MaxStreams != xdsproxy.DefaultMaxStreams || cfg.XDS.MaxStreamsPerConnection != xdsproxy.DefaultMaxStreamsPerConnection || cfg.XDS.DebugTCP {
		t.Fatalf("xDS proxy limits %d, %d per connection, debug over TCP %v; want the defaults", cfg.XDS.MaxStreams, cfg.XDS.MaxStreamsPerConnection, cfg.XDS.DebugTCP)
	}
	cfg, err = runAgentCommand(t, env, "--xds-proxy-max-streams", "7", "--xds-proxy-max-streams-per-connection", "2",
		"--xds-debug-socket", "/tmp/dbg.sock", "--xds-debug-tcp")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.XDS.MaxStreams != 7 || cfg.XDS.MaxStreamsPerConnection != 2 || cfg.XDS.DebugSocket != "/tmp/dbg.sock" || !cfg.XDS.DebugTCP {
		t.Fatalf("flags not taken: %d, %d, %q, %v", cfg.XDS.MaxStreams, cfg.XDS.MaxStreamsPerConnection, cfg.XDS.DebugSocket, cfg.XDS.DebugTCP)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--xds-proxy-max-streams", "0"}, "--xds-proxy-max-streams"},
		{[]string{"--xds-proxy-max-streams-per-connection", "-1"}, "--xds-proxy-max-streams-per-connection"},
		{[]string{"--xds-debug-tcp", "--proxy-xds-debug-via-agent=false"}, "--xds-debug-tcp"},
		{[]string{"--xds-debug-socket", "/tmp/dbg.sock", "--proxy-xds-debug-via-agent=false"}, "--xds-debug-socket serves /debug/<type>"},
		{[]string{"--xds-debug-tcp", "--debug-addr", ""}, "--debug-addr"},
		{[]string{"--xds-debug-socket", "/tmp/" + strings.Repeat("d", 120)}, "--xds-debug-socket"},
	} {
		if _, err := runAgentCommand(t, env, tc.args...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want a refusal naming %s", tc.args, err, tc.want)
		}
	}
}

// The xDS proxy's flags and Istio's variables: CA_ADDR defaults to the discovery address; the
// proxy's settings are refused when it is off.
func TestAgentXDSProxyFlags(t *testing.T) {
	t.Parallel()
	base := map[string]string{"POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo"}
	cfg, err := runAgentCommand(t, base, "--discovery-addr", "istiod.example:15012")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.CA.Address != "istiod.example:15012" || !cfg.XDS.Proxy || !cfg.XDS.ProxyDebug {
		t.Errorf("CA address %q, proxy %v, debug %v", cfg.CA.Address, cfg.XDS.Proxy, cfg.XDS.ProxyDebug)
	}
	env := map[string]string{"PROXY_XDS_VIA_AGENT": "false", "CA_ADDR": "ca.example:15012", "XDS_ROOT_CA": "", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo"}
	if cfg, err = runAgentCommand(t, env); err != nil || cfg.XDS.Proxy || cfg.XDS.ProxyDebug {
		t.Errorf("PROXY_XDS_VIA_AGENT=false: proxy %v, debug %v, %v", cfg.XDS.Proxy, cfg.XDS.ProxyDebug, err)
	}
	for _, args := range [][]string{
		{"--proxy-xds-debug-via-agent=true"},
		{"--xds-socket", "/tmp/XDS"},
		{"--discovery-addr", "istiod.example:15012"},
		{"--xds-debug-socket", "/tmp/debug.sock"},
		{"--xds-debug-tcp"},
		{"--xds-proxy-max-streams", "5"},
	} {
		if _, err := runAgentCommand(t, env, args...); err == nil || !strings.Contains(err.Error(), "PROXY_XDS_VIA_AGENT") {
			t.Errorf("%v with the proxy off: %v, want a refusal naming PROXY_XDS_VIA_AGENT", args, err)
		}
	}
}

// ISTIO_PROMETHEUS_ANNOTATIONS reaches /stats/prometheus; the flag wins over it, and annotations
// the agent cannot use are refused (exit 2) naming the flag and the variable.
func TestAgentPrometheusAnnotations(t *testing.T) {
	t.Parallel()
	env := map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo",
		"ISTIO_PROMETHEUS_ANNOTATIONS": `{"scrape":"true","path":"/metrics","port":"9090"}`}
	cfg, err := runAgentCommand(t, env)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Servers.PrometheusAnnotations != env["ISTIO_PROMETHEUS_ANNOTATIONS"] {
		t.Fatalf("Servers.PrometheusAnnotations = %q, want the variable", cfg.Servers.PrometheusAnnotations)
	}
	flag := `{"scrape":"true","port":"8080"}`
	if cfg, err = runAgentCommand(t, env, "--istio-prometheus-annotations", flag); err != nil || cfg.Servers.PrometheusAnnotations != flag {
		t.Fatalf("the flag did not win: %q, %v", cfg.Servers.PrometheusAnnotations, err)
	}

	for _, tc := range []struct{ name, value, want string }{
		{"bad JSON", `{bad`, "--istio-prometheus-annotations (ISTIO_PROMETHEUS_ANNOTATIONS): want JSON"},
		{"port", `{"port":"http"}`, `--istio-prometheus-annotations (ISTIO_PROMETHEUS_ANNOTATIONS): port: "http": want a port number`},
		{"scrape", `{"scrape":"maybe"}`, `--istio-prometheus-annotations (ISTIO_PROMETHEUS_ANNOTATIONS): scrape: "maybe"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			code, stderr := mainAgent(t, map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo"},
				"--istio-prometheus-annotations", tc.value)
			if code != ExitUsage || !strings.Contains(stderr, tc.want) {
				t.Errorf("exit %d, want %d and %q:\n%s", code, ExitUsage, tc.want, stderr)
			}
		})
	}
}

// ISTIO_KUBE_APP_PROBERS reaches the status server's application probes; the flag wins over it,
// and a probe the agent cannot run is refused (exit 2) naming the flag, the variable and the path.
func TestAgentAppProbers(t *testing.T) {
	t.Parallel()
	env := map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo",
		"ISTIO_KUBE_APP_PROBERS": `{"/app-health/web/livez":{"tcpSocket":{"port":8080}}}`}
	cfg, err := runAgentCommand(t, env)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Servers.AppProbers != env["ISTIO_KUBE_APP_PROBERS"] {
		t.Fatalf("Servers.AppProbers = %q, want the variable", cfg.Servers.AppProbers)
	}
	flag := `{"/app-health/web/readyz":{"grpc":{"port":9090}}}`
	if cfg, err = runAgentCommand(t, env, "--istio-kube-app-probers", flag); err != nil || cfg.Servers.AppProbers != flag {
		t.Fatalf("the flag did not win: %q, %v", cfg.Servers.AppProbers, err)
	}

	for _, tc := range []struct{ name, value, want string }{
		{"bad JSON", `{bad`, "--istio-kube-app-probers (ISTIO_KUBE_APP_PROBERS): not a JSON object"},
		{"port", `{"/app-health/web/livez":{"httpGet":{"port":0}}}`, `--istio-kube-app-probers (ISTIO_KUBE_APP_PROBERS): "/app-health/web/livez": httpGet: 0 is out of range`},
		{"path", `{"/livez":{"tcpSocket":{"port":1}}}`, `"/livez": want /app-health/<container>/livez`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			code, stderr := mainAgent(t, map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo"},
				"--istio-kube-app-probers", tc.value)
			if code != ExitUsage || !strings.Contains(stderr, tc.want) {
				t.Errorf("exit %d, want %d and %q:\n%s", code, ExitUsage, tc.want, stderr)
			}
		})
	}
}

// --envoy-path runs Envoy: its flags and Istio's drain variables reach the config; without it
// each is refused, as a flag that would do nothing.
func TestAgentEnvoyFlags(t *testing.T) {
	t.Parallel()
	envoyBin := filepath.Join(t.TempDir(), "envoy")
	if err := os.WriteFile(envoyBin, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	notExecutable := filepath.Join(t.TempDir(), "envoy.txt")
	if err := os.WriteFile(notExecutable, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo",
		"MINIMUM_DRAIN_DURATION": "10s", "TERMINATION_DRAIN_DURATION_SECONDS": "20", "EXIT_ON_ZERO_ACTIVE_CONNECTIONS": "true"}
	cfg, err := runAgentCommand(t, env, "--envoy-path", envoyBin, "--concurrency", "4", "--proxy-log-level", "debug",
		"--envoy-bootstrap", "/tmp/b.json", "--envoy-drain-duration", "30s", "--envoy-admin-port", "15100")
	if err != nil {
		t.Fatal(err)
	}
	e := cfg.Envoy
	if e.Path != envoyBin || e.Concurrency != 4 || e.LogLevel != "debug" || e.BootstrapPath != "/tmp/b.json" || e.DrainDuration != 30*time.Second ||
		e.AdminPort != 15100 || e.MinimumDrainDuration != 10*time.Second || e.TerminationDrainDuration != 20*time.Second ||
		!e.ExitOnZeroActiveConnections || e.Stdout == nil || e.Signals == nil {
		t.Fatalf("Envoy config %+v", e)
	}
	if cfg, err := runAgentCommand(t, env, "--envoy-path", envoyBin, "--termination-drain-duration-seconds", "3"); err != nil || cfg.Envoy.TerminationDrainDuration != 3*time.Second {
		t.Fatalf("the flag did not win over TERMINATION_DRAIN_DURATION_SECONDS: %v, %v", cfg.Envoy.TerminationDrainDuration, err)
	}

	base := map[string]string{"CA_ADDR": "127.0.0.1:15012", "POD_NAMESPACE": "default", "SERVICE_ACCOUNT": "demo"}
	for _, tc := range []struct {
		name string
		env  map[string]string
		args []string
		want string
	}{
		{"seconds", map[string]string{"TERMINATION_DRAIN_DURATION_SECONDS": "5s"}, []string{"--envoy-path", envoyBin},
			`TERMINATION_DRAIN_DURATION_SECONDS="5s": invalid argument "5s" for "--termination-drain-duration-seconds" flag: "5s": want a whole number of seconds`},
		{"missing binary", nil, []string{"--envoy-path", "/nonexistent/envoy"}, `--envoy-path "/nonexistent/envoy": does not exist`},
		{"not executable", nil, []string{"--envoy-path", notExecutable}, `--envoy-path "` + notExecutable + `": is not executable`},
		{"concurrency", nil, []string{"--envoy-path", envoyBin, "--concurrency", "-1"}, "--concurrency -1 must be 0 (one per core) or more"},
		{"without Envoy", nil, []string{"--concurrency", "2"}, "--concurrency applies to the Envoy the agent starts with --envoy-path; here it would do nothing"},
		{"bootstrap without Envoy", nil, []string{"--envoy-admin-port", "15100"}, "--envoy-admin-port applies to the bootstrap"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			env := maps.Clone(base)
			maps.Copy(env, tc.env)
			code, stderr := mainAgent(t, env, tc.args...)
			if code != ExitUsage || !strings.Contains(stderr, tc.want) {
				t.Errorf("exit %d, want %d and %q:\n%s", code, ExitUsage, tc.want, stderr)
			}
		})
	}
}

// The token exchange flags reach agent.Config; no Istio variable sets them.
func TestAgentTokenExchangeFlags(t *testing.T) {
	t.Parallel()
	env := map[string]string{"CA_ADDR": "ca.example:15012", "POD_NAMESPACE": "shop", "SERVICE_ACCOUNT": "cart"}
	cfg, err := runAgentCommand(t, env, "--token-exchange-url", "https://sts.example/v1/token", "--token-exchange-audience", "mesh-ca")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.CA.TokenExchangeURL != "https://sts.example/v1/token" || cfg.CA.TokenExchangeAudience != "mesh-ca" || cfg.CA.TokenExchangeRootCert != "" {
		t.Fatalf("token exchange flags not applied: %+v", cfg.CA)
	}
	cfg, err = runAgentCommand(t, env, "--token-exchange-url", "http://127.0.0.1:8080/token")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.CA.TokenExchangeURL != "http://127.0.0.1:8080/token" || cfg.CA.TokenExchangeAudience != "" {
		t.Fatalf("loopback http token exchange: %+v", cfg.CA)
	}
}

// testAttest is meshid's attestor hook, which meshid-agent leaves out.
func testAttest(c agent.AttestConfig) (agent.Attestor, error) {
	a, err := attest.New(attest.Config{RulesFile: c.RulesFile, Clock: c.Clock, Logger: c.Logger, Registerer: c.Registerer})
	if err != nil {
		return nil, err
	}
	return a, nil
}
