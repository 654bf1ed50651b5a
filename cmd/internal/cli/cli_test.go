package cli

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"testing"

	"github.com/spf13/cobra"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/agent/envoy"
	"github.com/meshid/meshid/internal/fsutil"
)

func TestNewLogger(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	log, err := NewLogger(&buf, "warn", "json")
	if err != nil {
		t.Fatal(err)
	}
	log.Info("hidden")
	log.Warn("shown", "k", "v")
	if got := buf.String(); strings.Contains(got, "hidden") || !strings.Contains(got, `"msg":"shown"`) || !strings.Contains(got, `"k":"v"`) {
		t.Fatalf("json logger at warn wrote %q", got)
	}
	for _, bad := range [][2]string{{"verbose", "text"}, {"info", "yaml"}} {
		if _, err := NewLogger(&buf, bad[0], bad[1]); err == nil {
			t.Errorf("NewLogger(%q, %q) accepted", bad[0], bad[1])
		}
	}
}

func TestMainPrintsErrorAndExitsOne(t *testing.T) {
	t.Parallel()
	g := &Globals{}
	root := NewRoot("tool", "short", "long", g)
	root.AddCommand(&cobra.Command{Use: "fail", RunE: func(*cobra.Command, []string) error { return errors.New("it broke") }})
	root.AddCommand(&cobra.Command{Use: "ok", RunE: func(*cobra.Command, []string) error { return nil }})
	var stderr bytes.Buffer
	root.SetErr(&stderr)

	root.SetArgs([]string{"fail"})
	if code := Main(root); code != 1 {
		t.Fatalf("exit code %d, want 1", code)
	}
	if got := stderr.String(); got != "tool: it broke\n" {
		t.Fatalf("stderr %q", got)
	}
	root.SetArgs([]string{"ok"})
	if code := Main(root); code != 0 {
		t.Fatalf("exit code %d, want 0", code)
	}
}

// A command refused as it was called exits 2 (flag parsers' convention), whatever refused it;
// a failure while running exits 1.
func TestMainExitsTwoForUsageErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want int
	}{
		{[]string{"run", "--bogus"}, ExitUsage},
		{[]string{"--log-level", "loud", "run"}, ExitUsage},
		{[]string{"bogus"}, ExitUsage},
		{[]string{"run", "extra"}, ExitUsage},
		{[]string{"run", "--refuse"}, ExitUsage},
		{[]string{"run", "--fail"}, 1},
		{[]string{"run"}, 0},
		{nil, 0},
	} {
		g := &Globals{}
		root := NewRoot("tool", "short", "long", g)
		var refuse, fail bool
		run := &cobra.Command{
			Use:     "run",
			Args:    cobra.NoArgs,
			PreRunE: func(*cobra.Command, []string) error { return map[bool]error{true: errors.New("refused")}[refuse] },
			RunE:    func(*cobra.Command, []string) error { return map[bool]error{true: errors.New("it broke")}[fail] },
		}
		run.Flags().BoolVar(&refuse, "refuse", false, "")
		run.Flags().BoolVar(&fail, "fail", false, "")
		root.AddCommand(run)
		root.SetOut(new(bytes.Buffer))
		root.SetErr(new(bytes.Buffer))
		root.SetArgs(tc.args)
		if code := Main(root); code != tc.want {
			t.Errorf("tool %v: exit code %d, want %d", tc.args, code, tc.want)
		}
	}
}

// What is refused because of how a command was called, found only once it runs (a state dir
// another user could write in, a directory another agent holds, no CA to turn to), exits 2 like
// any other refusal; a failure while running still exits 1.
func TestRefusedAsCalled(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		err  error
		want int
	}{
		{"no CA", fmt.Errorf("no credential files: %w", agent.ErrNoCA), ExitUsage},
		{"not owned", fmt.Errorf("--state-dir: %w", fsutil.ErrNotOwned), ExitUsage},
		{"locked", fmt.Errorf("OUTPUT_CERTS: %w", fsutil.ErrLocked), ExitUsage},
		{"failure", errors.New("it broke"), 1},
		{"success", nil, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			root := NewRoot("tool", "short", "long", &Globals{})
			root.AddCommand(&cobra.Command{Use: "run", RunE: func(*cobra.Command, []string) error { return RefusedAsCalled(tc.err) }})
			var stderr bytes.Buffer
			root.SetErr(&stderr)
			root.SetArgs([]string{"run"})
			if code := Main(root); code != tc.want {
				t.Errorf("exit code %d, want %d", code, tc.want)
			}
			if tc.err != nil && stderr.String() != "tool: "+tc.err.Error()+"\n" {
				t.Errorf("stderr %q, want the error as it is", stderr.String())
			}
		})
	}
}

// An error carrying a child's exit status (Envoy's, under the agent) ends the process with it,
// so that the kubelet or systemd sees what Envoy said.
func TestMainExitsWithAChildsStatus(t *testing.T) {
	t.Parallel()
	root := NewRoot("tool", "short", "long", &Globals{})
	root.AddCommand(&cobra.Command{Use: "child", RunE: func(*cobra.Command, []string) error {
		return fmt.Errorf("supervising: %w", &envoy.ExitError{Code: 137, Signal: syscall.SIGKILL})
	}})
	root.SetErr(&bytes.Buffer{})
	root.SetArgs([]string{"child"})
	if code := Main(root); code != 137 {
		t.Fatalf("exit code %d, want Envoy's 137", code)
	}
}
