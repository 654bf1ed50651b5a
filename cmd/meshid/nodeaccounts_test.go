package main

import (
	"slices"
	"strings"
	"testing"

	"github.com/meshid/meshid/cmd/internal/cli"
)

func TestCATrustedNodeAccounts(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name string
		env  map[string]string
		args []string
		want []string
	}{
		{"none", nil, nil, nil},
		{"flag", nil, []string{"--trusted-node-accounts", "istio-system/ztunnel, kube-system/meshid-node"},
			[]string{"istio-system/ztunnel", "kube-system/meshid-node"}},
		{"repeated flag", nil, []string{"--trusted-node-accounts", "a/b", "--trusted-node-accounts", "c/d"}, []string{"a/b", "c/d"}},
		{"istiod's variable", map[string]string{"CA_TRUSTED_NODE_ACCOUNTS": "istio-system/ztunnel,,kube-system/node "},
			nil, []string{"istio-system/ztunnel", "kube-system/node"}},
		{"the flag wins", map[string]string{"CA_TRUSTED_NODE_ACCOUNTS": "istio-system/ztunnel"},
			[]string{"--trusted-node-accounts", "kube-system/node"}, []string{"kube-system/node"}},
		{"empty variable", map[string]string{"CA_TRUSTED_NODE_ACCOUNTS": ""}, nil, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg, err := executeEnv(t, tt.env, append([]string{"ca", "--state-dir", "/s"}, tt.args...)...)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(cfg.TrustedNodeAccounts, tt.want) {
				t.Fatalf("TrustedNodeAccounts = %q, want %q", cfg.TrustedNodeAccounts, tt.want)
			}
		})
	}
}

func TestCATrustedNodeAccountsRefused(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name string
		env  map[string]string
		args []string
		want []string
	}{
		{"no slash", nil, []string{"--trusted-node-accounts", "ztunnel"}, []string{"--trusted-node-accounts", `"ztunnel"`, "NAMESPACE/SERVICE_ACCOUNT"}},
		{"bad namespace", nil, []string{"--trusted-node-accounts", "Istio_System/ztunnel"}, []string{"--trusted-node-accounts", "namespace"}},
		{"bad service account", nil, []string{"--trusted-node-accounts", "istio-system/zt/unnel"}, []string{"--trusted-node-accounts", "service account"}},
		{"one bad entry among good", map[string]string{"CA_TRUSTED_NODE_ACCOUNTS": "istio-system/ztunnel,/x"}, nil,
			[]string{`--trusted-node-accounts "/x" (CA_TRUSTED_NODE_ACCOUNTS)`, "namespace"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			code, stderr := mainMeshid(t, tt.env, append([]string{"ca", "--state-dir", t.TempDir()}, tt.args...)...)
			if code != cli.ExitUsage {
				t.Errorf("exit code %d, want %d; stderr:\n%s", code, cli.ExitUsage, stderr)
			}
			for _, w := range tt.want {
				if !strings.Contains(stderr, w) {
					t.Errorf("stderr does not say %q:\n%s", w, stderr)
				}
			}
		})
	}
}
