package cli

import (
	"bytes"
	"context"
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
	root.AddCommand(NewAgentCommand(g, startAndStop, func(k string) (string, bool) { v, ok := env[k]; return v, ok }, stubEmbed))
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
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			code, stderr := mainAgent(t, tt.env, tt.args...)
			checkRefused(t, code, stderr, tt.want...)
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
