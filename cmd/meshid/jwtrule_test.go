package main

import (
	"strings"
	"testing"

	"github.com/meshid/meshid/cmd/internal/cli"
)

const testRule = `[{"issuer": "https://issuer.test", "jwksUri": "https://issuer.test/jwks", "audiences": ["meshid-ca"],
	"claimToNamespace": "tenant", "claimToServiceAccount": "workload"}]`

func TestCAJWTRule(t *testing.T) {
	t.Parallel()
	cfg, err := executeEnv(t, nil, "ca", "--state-dir", "/s", "--jwt-rule", testRule, "--jwt-rule-root-cert", "/r.pem")
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.JWTRules) != 1 || cfg.JWTRules[0].Issuer != "https://issuer.test" || cfg.JWTRules[0].ClaimToServiceAccount != "workload" ||
		cfg.JWTRuleRootCert != "/r.pem" {
		t.Fatalf("--jwt-rule not applied: %+v, %q", cfg.JWTRules, cfg.JWTRuleRootCert)
	}
	// istiod's JWT_RULE: one rule, not a list.
	one := `{"issuer": "https://env.test", "jwksUri": "https://env.test/jwks", "audiences": ["a"]}`
	cfg, err = executeEnv(t, map[string]string{"JWT_RULE": one}, "ca", "--state-dir", "/s")
	if err != nil || len(cfg.JWTRules) != 1 || cfg.JWTRules[0].Issuer != "https://env.test" {
		t.Fatalf("JWT_RULE not applied: %+v, %v", cfg.JWTRules, err)
	}
	cfg, err = executeEnv(t, map[string]string{"JWT_RULE": one}, "ca", "--state-dir", "/s", "--jwt-rule", testRule)
	if err != nil || len(cfg.JWTRules) != 1 || cfg.JWTRules[0].Issuer != "https://issuer.test" {
		t.Fatalf("the flag does not win over JWT_RULE: %+v, %v", cfg.JWTRules, err)
	}
}

func TestCAJWTRuleRefused(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name string
		env  map[string]string
		args []string
		want []string
	}{
		{"bad JSON", nil, []string{"--jwt-rule", `[{"issuer":`}, []string{"--jwt-rule", "parse the JWT rules"}},
		{"bad JSON in JWT_RULE", map[string]string{"JWT_RULE": "{"}, nil, []string{"JWT_RULE", "parse the JWT rule"}},
		{"unknown field", nil, []string{"--jwt-rule", `[{"issuer": "i", "jwks": "{}"}]`}, []string{"--jwt-rule", `unknown field "jwks"`}},
		{"missing fields", nil, []string{"--jwt-rule", `[{"issuer": "https://i"}]`},
			[]string{"--jwt-rule", `rule 1 (issuer "https://i")`, "jwksUri: required", "audiences"}},
		{"http", map[string]string{"JWT_RULE": `[{"issuer": "i", "jwksUri": "http://i/k", "audiences": ["a"]}]`}, nil,
			[]string{"--jwt-rule (JWT_RULE)", `rule 1 (issuer "i")`, "https"}},
		{"root without rules", nil, []string{"--jwt-rule-root-cert", "/r.pem"}, []string{"--jwt-rule-root-cert needs --jwt-rule"}},
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
