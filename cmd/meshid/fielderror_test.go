package main

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/cmd/internal/cli"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/configerr"
	"github.com/meshid/meshid/internal/pki"
)

// caTestConfig is a configuration `meshid ca` accepts, with a state dir of the test's.
func caTestConfig(t *testing.T) controlplane.Config {
	t.Helper()
	cfg := controlplane.DefaultConfig()
	cfg.StateDir = filepath.Join(t.TempDir(), "state")
	cfg.GRPCAddr, cfg.MonitoringAddr = "127.0.0.1:0", ""
	return cfg
}

// The control plane keys what it refuses by the field's path in its Config; `meshid ca` renders
// each with its flag. These are controlplane's TestNewFailsClearly and refused-dirs cases whose
// text the rendering now makes, with the assertions they had there.
func TestCAConfigErrorsNameFlags(t *testing.T) {
	t.Parallel()
	base := t.TempDir()
	cacerts, manifests := filepath.Join(base, "cacerts"), filepath.Join(base, "manifests")
	tests := []struct {
		name   string
		modify func(*controlplane.Config)
		want   []string
	}{
		{"bad address", func(c *controlplane.Config) { c.GRPCAddr = "15012" }, []string{"--grpc-addr"}},
		{"port out of range", func(c *controlplane.Config) { c.GRPCAddr = "127.0.0.1:99999" }, []string{`--grpc-addr "127.0.0.1:99999": port "99999": want a number from 0 to 65535`}},
		{"monitoring address with a scheme", func(c *controlplane.Config) { c.MonitoringAddr = "http://127.0.0.1:9093" },
			[]string{`--monitoring-addr "http://127.0.0.1:9093": http:// is not part of an address`}},
		{"bad trust domain", func(c *controlplane.Config) { c.TrustDomain = "Not Valid" }, []string{"--trust-domain: "}},
		{"max below default ttl", func(c *controlplane.Config) { c.MaxWorkloadCertTTL = time.Minute }, []string{"--max-workload-cert-ttl 1m0s is below --workload-cert-ttl 24h0m0s"}},
		{"JWT-SVID lifetime too long", func(c *controlplane.Config) { c.JWTSVIDTTL = 48 * time.Hour }, []string{"--jwt-svid-ttl 48h0m0s is not in (0, 24h0m0s]"}},
		{"no discovery streams", func(c *controlplane.Config) { c.XDSMaxStreams = 0 }, []string{"--xds-max-streams 0 must be positive"}},
		{"no discovery streams per credential", func(c *controlplane.Config) { c.XDSMaxStreamsPerCredential = -1 }, []string{"--xds-max-streams-per-credential -1 must be positive"}},
		{"no connection age", func(c *controlplane.Config) { c.MaxConnectionAge = 0 }, []string{"--max-connection-age 0s must be positive"}},
		{"no state dir", func(c *controlplane.Config) { c.StateDir = "" }, []string{"--state-dir is required"}},
		{"RSA too small", func(c *controlplane.Config) { c.SelfSigned.KeyAlgorithm, c.SelfSigned.RSAKeySize = pki.RSA, 1024 }, []string{"--key-size: "}},
		{"two Kubernetes APIs", func(c *controlplane.Config) { c.Kubernetes.Kubeconfig, c.Kubernetes.InCluster = "/k", true },
			[]string{"--kubeconfig and --in-cluster both name the Kubernetes API: give one"}},
		{"two stores", func(c *controlplane.Config) { c.Kubernetes.InCluster, c.Manifests = true, manifests },
			[]string{"--manifests and the Kubernetes API (--kubeconfig, --in-cluster) are two stores of namespaces: give one"}},
		{"liveness file on Kubernetes", func(c *controlplane.Config) {
			c.Kubernetes.InCluster, c.Secrets.LivenessProbePath, c.Secrets.LivenessProbeInterval = true, "/tmp/alive", time.Minute
		}, []string{"--liveness-probe-path works with --manifests only"}},
		{"custom DNS names alone", func(c *controlplane.Config) { c.Secrets.AppendDNSNames, c.Secrets.CustomDNSNames = false, "a.b:c.d" },
			[]string{"--custom-dns-names needs --append-dns-names"}},
		{"liveness interval alone", func(c *controlplane.Config) { c.Secrets.LivenessProbeInterval = time.Minute }, []string{"--liveness-probe-interval needs --liveness-probe-path"}},
		{"liveness file alone", func(c *controlplane.Config) { c.Secrets.LivenessProbePath = "/tmp/alive" },
			[]string{"--liveness-probe-interval 0s must be positive with --liveness-probe-path"}},
		{"grace ratio", func(c *controlplane.Config) { c.Secrets.GracePeriodRatio = 2 }, []string{"--workload-cert-grace-period-ratio 2: want above 0 and below 1"}},
		{"listened namespace", func(c *controlplane.Config) { c.Secrets.ListenedNamespace = "Bad_NS" }, []string{"--listened-namespace (NAMESPACE): "}},
		{"missing dirs", func(c *controlplane.Config) { c.CACertsDir, c.Manifests = cacerts, manifests },
			[]string{"--cacerts-dir: plugged-in CA directory " + cacerts, "--manifests " + manifests + " does not exist"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := caTestConfig(t)
			tt.modify(&cfg)
			err := cfg.Validate()
			if err == nil {
				_, err = controlplane.New(t.Context(), cfg)
			}
			err = cli.RenderConfigErrors(err, caFields())
			for _, want := range tt.want {
				if err == nil || !strings.Contains(err.Error(), want) {
					t.Errorf("error %v, want one mentioning %q", err, want)
				}
			}
		})
	}
	_, err := controlplane.Targets(t.Context(), controlplane.TargetsConfig{Manifests: manifests, CANamespace: "istio-system"})
	if err = cli.RenderConfigErrors(err, targetsFields()); !errors.Is(err, controlplane.ErrConfigRefused) || !strings.Contains(err.Error(), "--manifests "+manifests) {
		t.Fatalf("targets: %v, want ErrConfigRefused naming --manifests", err)
	}
	_, err = controlplane.Targets(t.Context(), controlplane.TargetsConfig{CANamespace: "Bad_NS"})
	if err = cli.RenderConfigErrors(err, targetsFields()); err == nil || !strings.Contains(err.Error(), "--ca-namespace: ") {
		t.Fatalf("a bad CA namespace: %v", err)
	}
}

// Every field the control plane's refusals name is one of caFieldFlags, each a flag of `meshid
// ca`: the table is the keys, each with a configuration that makes the control plane name it.
func TestCAFieldKeysHaveFlags(t *testing.T) {
	t.Parallel()
	base := t.TempDir()
	notDir := filepath.Join(base, "file")
	if err := os.WriteFile(notDir, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		key    string
		modify func(*controlplane.Config)
	}{
		{"StateDir", func(c *controlplane.Config) { c.StateDir = "" }},
		{"GRPCAddr", func(c *controlplane.Config) { c.GRPCAddr = "unix://relative.sock" }},
		{"GRPCAddr", func(c *controlplane.Config) { c.GRPCAddr = "15012" }},
		{"MonitoringAddr", func(c *controlplane.Config) { c.MonitoringAddr = "9093" }},
		{"TrustDomain", func(c *controlplane.Config) { c.TrustDomain = "Not Valid" }},
		{"CANamespace", func(c *controlplane.Config) { c.CANamespace = "Bad_NS" }},
		{"JWTAudience", func(c *controlplane.Config) { c.JWTAudience = "" }},
		{"WorkloadCertTTL", func(c *controlplane.Config) { c.WorkloadCertTTL = 0 }},
		{"MaxWorkloadCertTTL", func(c *controlplane.Config) { c.MaxWorkloadCertTTL = time.Minute }},
		{"JWTSVIDTTL", func(c *controlplane.Config) { c.JWTSVIDTTL = 0 }},
		{"SelfSigned.TTL", func(c *controlplane.Config) { c.SelfSigned.TTL = 0 }},
		{"RootCheckInterval", func(c *controlplane.Config) { c.RootCheckInterval = 0 }},
		{"RootRotationThreshold", func(c *controlplane.Config) { c.RootRotationThreshold = 2 }},
		{"XDSMaxStreams", func(c *controlplane.Config) { c.XDSMaxStreams = 0 }},
		{"XDSMaxStreamsPerCredential", func(c *controlplane.Config) { c.XDSMaxStreamsPerCredential = 0 }},
		{"MaxConnectionAge", func(c *controlplane.Config) { c.MaxConnectionAge = 0 }},
		{"TrustBundleOverlap", func(c *controlplane.Config) { c.TrustBundleOverlap = -time.Second }},
		{"SelfSigned.RSAKeySize", func(c *controlplane.Config) { c.SelfSigned.KeyAlgorithm, c.SelfSigned.RSAKeySize = pki.RSA, 1024 }},
		{"SelfSigned.KeyAlgorithm", func(c *controlplane.Config) { c.SelfSigned.KeyAlgorithm = "DSA" }},
		{"Secrets.ListenedNamespace", func(c *controlplane.Config) { c.Secrets.ListenedNamespace = "Bad_NS" }},
		{"Secrets.GracePeriodRatio", func(c *controlplane.Config) { c.Secrets.GracePeriodRatio = 0 }},
		{"Secrets.MinGracePeriod", func(c *controlplane.Config) { c.Secrets.MinGracePeriod = -time.Second }},
		{"Secrets.CustomDNSNames", func(c *controlplane.Config) { c.Secrets.CustomDNSNames = "bad" }},
		{"Secrets.AppendDNSNames", func(c *controlplane.Config) { c.Secrets.AppendDNSNames, c.Secrets.CustomDNSNames = false, "a.b:c.d" }},
		{"Secrets.LivenessProbeInterval", func(c *controlplane.Config) { c.Secrets.LivenessProbeInterval = time.Minute }},
		{"Secrets.LivenessProbePath", func(c *controlplane.Config) { c.Secrets.LivenessProbePath = "/tmp/alive" }},
		{"Kubernetes.Kubeconfig", func(c *controlplane.Config) { c.Kubernetes.Kubeconfig, c.Kubernetes.InCluster = "/k", true }},
		{"Kubernetes.InCluster", func(c *controlplane.Config) { c.Kubernetes.InCluster, c.Manifests = true, base }},
		{"Secrets.LivenessProbePath", func(c *controlplane.Config) {
			c.Kubernetes.InCluster, c.Secrets.LivenessProbePath, c.Secrets.LivenessProbeInterval = true, "/tmp/alive", time.Minute
		}},
		{"CACertsDir", func(c *controlplane.Config) { c.CACertsDir = filepath.Join(base, "missing") }},
		{"Manifests", func(c *controlplane.Config) { c.Manifests = notDir }},
	}
	cmd := newCACommand(&cli.Globals{}, nil, func(string) (string, bool) { return "", false })
	flags := caFieldFlags()
	for _, tt := range tests {
		cfg := caTestConfig(t)
		tt.modify(&cfg)
		err := cfg.Validate()
		if err == nil {
			_, err = controlplane.New(t.Context(), cfg)
		}
		fields := configerr.Fields(err)
		if !slices.Contains(fields, tt.key) {
			t.Errorf("%s: error %v names %v", tt.key, err, fields)
		}
		for _, field := range fields {
			if flag, ok := flags[field]; !ok || cmd.Flags().Lookup(flag) == nil {
				t.Errorf("%s: error %v names %s, which has no flag (%q)", tt.key, err, field, flag)
			}
		}
	}
	for field, flag := range flags {
		if cmd.Flags().Lookup(flag) == nil {
			t.Errorf("%s: no flag --%s", field, flag)
		}
	}
	targets := newCATargetsCommand(&cli.Globals{})
	for field, flag := range targetsFields().Flags {
		if targets.Flags().Lookup(flag) == nil {
			t.Errorf("ca targets: %s: no flag --%s", field, flag)
		}
	}
}
