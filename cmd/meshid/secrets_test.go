package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/controlplane"
)

// executeEnv is execute with an environment.
func executeEnv(t *testing.T, env map[string]string, args ...string) (controlplane.Config, error) {
	t.Helper()
	var got controlplane.Config
	root := newRootCommand(func(_ context.Context, cfg controlplane.Config) error {
		got = cfg
		return nil
	}, func(context.Context, agent.Config) error { return nil }, func(k string) (string, bool) {
		v, ok := env[k]
		return v, ok
	}, nil)
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs(args)
	err := root.ExecuteContext(t.Context())
	return got, err
}

func TestCASecretFlags(t *testing.T) {
	t.Parallel()
	cfg, err := executeEnv(t, nil, "ca", "--state-dir", "/s", "--manifests", "/m")
	if err != nil {
		t.Fatal(err)
	}
	if s := cfg.Secrets; s.ListenedNamespace != "" || s.GracePeriodRatio != 0.5 || s.MinGracePeriod != 10*time.Minute || !s.AppendDNSNames {
		t.Fatalf("defaults not applied: %+v", s)
	}

	cfg, err = executeEnv(t, map[string]string{"NAMESPACE": "from-env"}, "ca", "--state-dir", "/s", "--manifests", "/m",
		"--workload-cert-grace-period-ratio", "0.3", "--workload-cert-min-grace-period", "1h",
		"--custom-dns-names", "pilot.istio-system:istio-pilot.istio-system",
		"--liveness-probe-path", "/tmp/alive", "--liveness-probe-interval", "30s")
	if err != nil {
		t.Fatal(err)
	}
	s := cfg.Secrets
	if s.ListenedNamespace != "from-env" || s.GracePeriodRatio != 0.3 || s.MinGracePeriod != time.Hour ||
		s.CustomDNSNames != "pilot.istio-system:istio-pilot.istio-system" || s.LivenessProbePath != "/tmp/alive" || s.LivenessProbeInterval != 30*time.Second {
		t.Fatalf("flags not applied: %+v", s)
	}

	cfg, err = executeEnv(t, map[string]string{"NAMESPACE": "from-env"}, "ca", "--state-dir", "/s", "--manifests", "/m", "--listened-namespace", "flag")
	if err != nil || cfg.Secrets.ListenedNamespace != "flag" {
		t.Fatalf("the flag does not win over NAMESPACE: %q, %v", cfg.Secrets.ListenedNamespace, err)
	}
}

func TestCASecretFlagsRefused(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name string
		args []string
		want string
	}{
		{"without manifests", []string{"--listened-namespace", "prod"}, "--listened-namespace configures the secret controller, which runs only with a store of service accounts: --manifests, --kubeconfig or --in-cluster"},
		{"custom names without manifests", []string{"--custom-dns-names", "a.b:c"}, "only with a store of service accounts"},
		{"custom names without append", []string{"--manifests", "/m", "--append-dns-names=false", "--custom-dns-names", "a.b:c"}, "--custom-dns-names needs --append-dns-names"},
		{"malformed custom names", []string{"--manifests", "/m", "--custom-dns-names", "a.b"}, "--custom-dns-names"},
		{"ratio", []string{"--manifests", "/m", "--workload-cert-grace-period-ratio", "1"}, "--workload-cert-grace-period-ratio"},
		{"probe interval without path", []string{"--manifests", "/m", "--liveness-probe-interval", "1s"}, "needs --liveness-probe-path"},
		{"probe path without interval", []string{"--manifests", "/m", "--liveness-probe-path", "/a"}, "--liveness-probe-interval"},
		{"bad listened namespace", []string{"--manifests", "/m", "--listened-namespace", "Not_A_Namespace"}, "--listened-namespace"},
		{"two stores", []string{"--manifests", "/m", "--kubeconfig", "/k"}, "--manifests and the Kubernetes API (--kubeconfig, --in-cluster) are two stores"},
		{"two Kubernetes APIs", []string{"--kubeconfig", "/k", "--in-cluster"}, "--kubeconfig and --in-cluster both name the Kubernetes API"},
		{"probe file on Kubernetes", []string{"--in-cluster", "--liveness-probe-path", "/a", "--liveness-probe-interval", "1s"}, "--liveness-probe-path works with --manifests only"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := executeEnv(t, nil, append([]string{"ca", "--state-dir", "/s"}, tt.args...)...)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want %q", err, tt.want)
			}
		})
	}
}

func TestCAXDSConfigFlag(t *testing.T) {
	t.Parallel()
	cfg, err := executeEnv(t, nil, "ca", "--state-dir", "/s", "--xds-config", "/etc/meshid/xds.yaml")
	if err != nil || cfg.XDSConfig != "/etc/meshid/xds.yaml" {
		t.Fatalf("--xds-config: %q, %v", cfg.XDSConfig, err)
	}
}

// Without --xds-config the discovery server still runs, on an empty configuration: its bounds
// apply, so their flags are taken.
func TestCAXDSBoundsWithoutAConfig(t *testing.T) {
	t.Parallel()
	cfg, err := executeEnv(t, nil, "ca", "--state-dir", "/s", "--xds-max-streams", "50", "--xds-max-streams-per-credential", "5")
	if err != nil || cfg.XDSConfig != "" || cfg.XDSMaxStreams != 50 || cfg.XDSMaxStreamsPerCredential != 5 {
		t.Fatalf("--xds-max-streams without --xds-config: %q %d %d, %v", cfg.XDSConfig, cfg.XDSMaxStreams, cfg.XDSMaxStreamsPerCredential, err)
	}
}

// On Kubernetes the secret controller runs over the API: its flags and $NAMESPACE apply.
func TestCAKubernetesFlags(t *testing.T) {
	t.Parallel()
	cfg, err := executeEnv(t, map[string]string{"NAMESPACE": "prod"}, "ca", "--state-dir", "/s", "--kubeconfig", "/k",
		"--workload-cert-grace-period-ratio", "0.3")
	if err != nil {
		t.Fatal(err)
	}
	if k := cfg.Kubernetes; k.Kubeconfig != "/k" || k.InCluster || !k.Enabled() {
		t.Fatalf("Kubernetes config %+v", k)
	}
	if cfg.Secrets.ListenedNamespace != "prod" || cfg.Secrets.GracePeriodRatio != 0.3 {
		t.Fatalf("secret controller config %+v", cfg.Secrets)
	}
	cfg, err = executeEnv(t, nil, "ca", "--state-dir", "/s", "--in-cluster")
	if err != nil || !cfg.Kubernetes.InCluster {
		t.Fatalf("--in-cluster: %+v, %v", cfg.Kubernetes, err)
	}
}

// `meshid probe --probe-path FILE --interval D`: Citadel's liveness check of a file.
func TestProbeFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	fresh, stale := filepath.Join(dir, "fresh"), filepath.Join(dir, "stale")
	for _, p := range []string{fresh, stale} {
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	old := time.Now().Add(-time.Hour)
	if err := os.Chtimes(stale, old, old); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name string
		args []string
		want string // "" means success
	}{
		{"fresh", []string{"--probe-path", fresh, "--interval", "1m"}, ""},
		// The age is counted on the real clock, to the second: a loaded machine may run the probe
		// a second or two after the file was dated.
		{"stale", []string{"--probe-path", stale, "--interval", "1m"}, "last updated 1h0m"},
		{"missing", []string{"--probe-path", filepath.Join(dir, "none"), "--interval", "1m"}, "no such file"},
		{"no interval", []string{"--probe-path", fresh}, "--interval must be positive"},
		{"interval alone", []string{"--addr", "127.0.0.1:1", "--interval", "1m"}, "--interval needs --probe-path"},
		{"both", []string{"--addr", "127.0.0.1:1", "--probe-path", fresh, "--interval", "1m"}, "not both"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, _, _, err := execute(t, append([]string{"probe"}, tt.args...)...)
			if tt.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want %q", err, tt.want)
			}
		})
	}
}
