package cli

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/configerr"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// The agent keys what Validate refuses by the field's path in its Config; the command renders
// each with the flag and the variable that set it. These are agent's TestConfigValidate cases
// whose text the rendering now makes, with the assertions they had there.
func TestAgentConfigErrorsNameFlagsAndVariables(t *testing.T) {
	t.Parallel()
	good := func() agent.Config {
		c := agent.DefaultConfig("")
		c.Identity.Namespace, c.Identity.ServiceAccount, c.CA.Address = "default", "demo", "127.0.0.1:15012"
		return c
	}
	tests := []struct {
		name   string
		modify func(*agent.Config)
		want   string
	}{
		{"negative drain", func(c *agent.Config) { c.SDS.DrainDuration = -time.Second }, "--drain-duration"},
		{"RSA too small", func(c *agent.Config) { c.Certificate.KeyAlgorithm, c.Certificate.RSAKeySize = pki.RSA, 1024 }, "WORKLOAD_RSA_KEY_SIZE"},
		{"ratio", func(c *agent.Config) { c.Certificate.GraceRatio = 1 }, "--grace-period-ratio"},
		{"jitter", func(c *agent.Config) { c.Certificate.GraceRatioJitter = 0.6 }, "--grace-period-ratio-jitter"},
		{"ttl", func(c *agent.Config) { c.Certificate.TTL = 0 }, "--secret-ttl"},
		{"status addr", func(c *agent.Config) { c.Servers.StatusAddr = "15020" }, "--status-addr"},
		{"CA address, relative Unix socket", func(c *agent.Config) { c.CA.Address = "unix://ca.sock" }, `--ca-addr "unix://ca.sock" (CA_ADDR): a Unix socket needs an absolute path`},
		{"discovery address, no host", func(c *agent.Config) { c.XDS.DiscoveryAddress = ":15012" }, `--discovery-addr ":15012": no host`},
		{"every address at once", func(c *agent.Config) {
			c.Servers.StatusAddr, c.Servers.DebugAddr, c.CA.Address, c.XDS.DiscoveryAddress = "127.0.0.1:99999", "localhost", "https://ca:15012", "istiod"
		}, "--status-addr \"127.0.0.1:99999\": port \"99999\": want a number from 0 to 65535\n" +
			"--debug-addr \"localhost\": no port: give HOST:PORT, as in \"localhost:PORT\"\n" +
			"--ca-addr \"https://ca:15012\" (CA_ADDR): https:// is not part of an address: give HOST:PORT, as in \"ca:15012\"\n" +
			"--discovery-addr \"istiod\": no port: give HOST:PORT, as in \"istiod:PORT\""},
		{"no SDS streams", func(c *agent.Config) { c.SDS.MaxStreams = 0 }, "--sds-max-streams 0 must be positive"},
		{"key algorithm", func(c *agent.Config) { c.Certificate.KeyAlgorithm = "DSA" }, `--key-algorithm "DSA" (ECC_SIGNATURE_ALGORITHM): want ECDSA or RSA`},
		// Rules over several fields name each with its flag and variable.
		{"no namespace", func(c *agent.Config) { c.Identity.Namespace = "" }, "--namespace (POD_NAMESPACE) is required with --ca-addr (CA_ADDR): the CA signs"},
		{"no service account", func(c *agent.Config) { c.Identity.ServiceAccount = "" }, "--service-account (SERVICE_ACCOUNT) is required with --ca-addr (CA_ADDR)"},
		{"bad service account", func(c *agent.Config) { c.Identity.ServiceAccount = "Bad_Name" },
			`workload identity (--trust-domain (TRUST_DOMAIN), --namespace (POD_NAMESPACE), --service-account (SERVICE_ACCOUNT)): service account "Bad_Name"`},
		{"group-readable key alone", func(c *agent.Config) { c.Output.KeyGroupRead = true },
			"--output-certs-group-read: a group-readable --output-certs (OUTPUT_CERTS) key needs group-readable directories too"},
		{"xDS debug on TCP without the debug endpoint", func(c *agent.Config) { c.XDS.DebugTCP, c.XDS.ProxyDebug = true, false },
			"--xds-debug-tcp serves the xDS debug endpoint, which --proxy-xds-debug-via-agent=false (PROXY_XDS_DEBUG_VIA_AGENT) turns off"},
		{"xDS debug on TCP without a debug server", func(c *agent.Config) { c.XDS.DebugTCP, c.Servers.DebugAddr = true, "" },
			"--xds-debug-tcp serves /debug/<type> on --debug-addr, which is empty"},
		// Attack: a file-root: or file-cert: resource reading the embedded CA's keys.
		{"file resource dir is the CA state dir", func(c *agent.Config) { c.SDS.FileResourceDirs = []string{"/etc/certs", "/var/lib/meshid"} },
			"--file-resource-dirs: /var/lib/meshid overlaps the embedded CA's state dir /var/lib/meshid"},
		{"file resource dir holds the CA state dir", func(c *agent.Config) { c.SDS.FileResourceDirs = []string{"/var/lib/"} },
			"--file-resource-dirs: /var/lib/ overlaps the embedded CA's state dir /var/lib/meshid"},
		{"file resource dir is the root", func(c *agent.Config) { c.SDS.FileResourceDirs = []string{"/"} }, "--file-resource-dirs: / overlaps"},
		{"file resource dir inside the CA state dir", func(c *agent.Config) { c.SDS.FileResourceDirs = []string{"/var/lib/meshid/sub"} },
			"--file-resource-dirs: /var/lib/meshid/sub"},
		{"file resource dir holds the CA state dir under the root dir", func(c *agent.Config) {
			c.RootDir, c.SDS.FileResourceDirs = "/r", []string{"/r/var"}
		}, "--file-resource-dirs: /r/var overlaps the embedded CA's state dir /r/var/lib/meshid"},
		{"default file resource dirs hold the CA state dir", func(c *agent.Config) { c.SDS.CredentialsDir = "/var" },
			"--file-resource-dirs (default: the credentials dir and <root-dir>/etc/certs): /var overlaps"},
		{"embedded, file resource dir holds the CA state dir", func(c *agent.Config) { c.CA.Address, c.SDS.FileResourceDirs = "", []string{"/var"} },
			"--file-resource-dirs: /var overlaps"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := good()
			tt.modify(&c)
			if err := RenderConfigErrors(c.Validate(), agentFields()); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one mentioning %q", err, tt.want)
			}
		})
	}
}

// A bad grace period ratio, from the flag or from the variable, is refused naming both.
func TestAgentBadGraceRatioNamesFlagAndVariable(t *testing.T) {
	t.Parallel()
	for name, run := range map[string]func() error{
		"flag": func() error {
			_, err := runAgentCommand(t, nil, "--grace-period-ratio", "2")
			return err
		},
		"variable": func() error {
			_, err := runAgentCommand(t, map[string]string{"SECRET_GRACE_PERIOD_RATIO": "2"})
			return err
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			err := run()
			if err == nil {
				t.Fatal("a grace period ratio of 2 was accepted")
			}
			for _, want := range []string{"--grace-period-ratio", "SECRET_GRACE_PERIOD_RATIO", "grace period ratio 2"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not name %q", err, want)
				}
			}
			if strings.Contains(err.Error(), "Certificate.GraceRatio") {
				t.Errorf("error %q names the Config field, not the flag", err)
			}
		})
	}
}

// Every field the agent may name has a flag of the agent command.
func TestAgentFieldFlagsExist(t *testing.T) {
	t.Parallel()
	cmd := NewAgentCommand(&Globals{}, nil, func(string) (string, bool) { return "", false }, stubEmbed, nil, nil)
	for field, flag := range agentFieldFlags() {
		if cmd.Flags().Lookup(flag) == nil {
			t.Errorf("%s: no flag --%s", field, flag)
		}
	}
}

// Attack: a file resource dir that reaches the embedded CA's state dir through a symlink.
func TestAgentFileResourceDirLinkedToCAStateNamesTheFlag(t *testing.T) {
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
	err := RenderConfigErrors(c.Validate(), agentFields())
	if err == nil || !strings.Contains(err.Error(), "--file-resource-dirs: "+link) || !strings.Contains(err.Error(), filepath.Join(root, "var/lib/meshid")) {
		t.Fatalf("a file resource dir linked to the CA state dir's parent: %v, want a refusal naming --file-resource-dirs, %s and the state dir", err, link)
	}
}

// What agent.New refuses is rendered as Validate's is: the second agent on one root dir is told
// to give each its own --root-dir, and exits 2.
func TestAgentSecondOnOneRootDirNamesTheFlag(t *testing.T) {
	t.Parallel()
	root := testutil.ShortTempDir(t)
	state := filepath.Join(root, agent.DefaultEmbeddedDir)
	if err := os.MkdirAll(state, 0o700); err != nil {
		t.Fatal(err)
	}
	unlock, err := fsutil.TryLockPID(filepath.Join(state, "agent.lock"))
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	code, stderr := mainAgent(t, nil, "--root-dir", root)
	if code != ExitUsage {
		t.Errorf("exit code %d, want %d", code, ExitUsage)
	}
	for _, want := range []string{"another agent", "pid " + strconv.Itoa(os.Getpid()), "give each agent its own --root-dir"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("stderr %q does not say %q", stderr, want)
		}
	}
}

// Every field the agent's configuration refusals name, Validate's and New's, is one of
// agentFieldFlags, and so has a flag of the agent command (TestAgentFieldFlagsExist): the
// table is the keys, each with a configuration that makes the agent name it.
func TestAgentFieldKeysHaveFlags(t *testing.T) {
	t.Parallel()
	fix := t.TempDir()
	missing := filepath.Join(fix, "missing")
	testutil.WriteFiles(t, filepath.Join(fix, "partial"), map[string][]byte{"key.pem": []byte("x")})
	good := func() agent.Config {
		c := agent.DefaultConfig(testutil.ShortTempDir(t))
		c.Identity.Namespace, c.Identity.ServiceAccount, c.CA.Address = "default", "demo", "127.0.0.1:15012"
		c.Servers.StatusAddr, c.Servers.DebugAddr = "127.0.0.1:0", ""
		return c
	}
	long := "/" + strings.Repeat("d", 120)
	tests := []struct {
		key    string
		modify func(*agent.Config)
		new    bool // refused by New, not Validate
	}{
		{"Identity.Namespace", func(c *agent.Config) { c.Identity.Namespace = "" }, false},
		{"Identity.ServiceAccount", func(c *agent.Config) { c.Identity.ServiceAccount = "" }, false},
		{"Identity.TrustDomain", func(c *agent.Config) { c.Identity.TrustDomain = "Not Valid" }, false},
		{"Identity.InstanceIP", func(c *agent.Config) { c.Identity.InstanceIP = "pod-1" }, false},
		{"Output.KeyGroupRead", func(c *agent.Config) { c.Output.KeyGroupRead = true }, false},
		{"SDS.SocketDir", func(c *agent.Config) { c.SDS.SocketDir = long }, false},
		{"SDS.DrainDuration", func(c *agent.Config) { c.SDS.DrainDuration = -time.Second }, false},
		{"SDS.MaxStreams", func(c *agent.Config) { c.SDS.MaxStreams = 0 }, false},
		{"SDS.MaxStreamsPerConnection", func(c *agent.Config) { c.SDS.MaxStreamsPerConnection = 0 }, false},
		{"SDS.FileResourceDirs", func(c *agent.Config) { c.SDS.FileResourceDirs = []string{"/"} }, false},
		{"Certificate.RSAKeySize", func(c *agent.Config) { c.Certificate.KeyAlgorithm, c.Certificate.RSAKeySize = pki.RSA, 1024 }, false},
		{"Certificate.KeyAlgorithm", func(c *agent.Config) { c.Certificate.KeyAlgorithm = "DSA" }, false},
		{"Certificate.TTL", func(c *agent.Config) { c.Certificate.TTL = 0 }, false},
		{"Certificate.GraceRatio", func(c *agent.Config) { c.Certificate.GraceRatio = 2 }, false},
		{"Certificate.GraceRatioJitter", func(c *agent.Config) { c.Certificate.GraceRatioJitter = 0.6 }, false},
		{"XDS.MaxStreams", func(c *agent.Config) { c.XDS.MaxStreams = 0 }, false},
		{"XDS.MaxStreamsPerConnection", func(c *agent.Config) { c.XDS.MaxStreamsPerConnection = 0 }, false},
		{"XDS.DebugTCP", func(c *agent.Config) { c.XDS.DebugTCP, c.XDS.ProxyDebug = true, false }, false},
		{"XDS.ProxyDebug", func(c *agent.Config) { c.XDS.DebugTCP, c.XDS.ProxyDebug = true, false }, false},
		{"XDS.DebugSocket", func(c *agent.Config) { c.XDS.DebugSocket = long }, false},
		{"XDS.DiscoveryAddress", func(c *agent.Config) { c.XDS.DiscoveryAddress = "istiod" }, false},
		{"Servers.StatusAddr", func(c *agent.Config) { c.Servers.StatusAddr = "15020" }, false},
		{"Servers.DebugAddr", func(c *agent.Config) { c.Servers.DebugAddr = "0.0.0.0:15004" }, false},
		{"CA.Address", func(c *agent.Config) { c.CA.Address = "https://ca:15012" }, false},
		{"Envoy.AdminPort", func(c *agent.Config) { c.Envoy.AdminPort = 0 }, false},
		{"Envoy.PrometheusPort", func(c *agent.Config) { c.Envoy.PrometheusPort = -1 }, false},
		{"Envoy.PrometheusPort", func(c *agent.Config) { c.Envoy.PrometheusPort = c.Envoy.AdminPort }, false},
		{"Envoy.BootstrapOverride", func(c *agent.Config) { c.Envoy.BootstrapOverride = missing }, false},
		{"SDS.CredentialsDir", func(c *agent.Config) { c.SDS.CredentialsDir = missing }, true},
		{"SDS.CredentialsDir", func(c *agent.Config) { c.SDS.CredentialsDir = filepath.Join(fix, "partial") }, true},
		{"CA.ProvCert", func(c *agent.Config) { c.CA.ProvCert = missing }, true},
		{"Output.Dir", func(c *agent.Config) { c.CA.ProvCert = missing }, true},
		{"CA.RootCert", func(c *agent.Config) { c.CA.RootCert = missing }, true},
		{"XDS.RootCert", func(c *agent.Config) { c.XDS.RootCert = missing }, true},
		{"CA.Address", func(c *agent.Config) { c.CA.Address = "" }, true}, // no CA to embed
		{"RootDir", func(c *agent.Config) { // the embedded CA's socket path is too long
			c.CA.Address, c.CA.Embed, c.RootDir = "", stubEmbed, long
			c.SDS.SocketDir, c.XDS.Proxy, c.XDS.ProxyDebug = testutil.ShortTempDir(t), false, false
			c.SDS.CredentialsDir = filepath.Join(fix, "nocredentials")
			if err := os.MkdirAll(c.SDS.CredentialsDir, 0o700); err != nil {
				t.Fatal(err)
			}
		}, true},
	}
	flags := agentFieldFlags()
	for _, tt := range tests {
		c := good()
		tt.modify(&c)
		var err error
		if tt.new {
			_, err = agent.New(c)
		} else {
			err = c.Validate()
		}
		fields := configerr.Fields(err)
		if !slices.Contains(fields, tt.key) {
			t.Errorf("%s: error %v names %v", tt.key, err, fields)
		}
		for _, field := range fields {
			if _, ok := flags[field]; !ok {
				t.Errorf("%s: error %v names %s, which agentFieldFlags lacks", tt.key, err, field)
			}
		}
	}
}
