package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshid/meshid/ca/controller/kube/kubetest"
	"github.com/meshid/meshid/cmd/internal/cli"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds/sdstest"
)

// TestHelperProcess is `meshid` itself when the test binary is run with MESHID_AS_PROCESS=1; the
// arguments follow "--".
// helperProcessEnv, set to 1, makes the test binary run as meshid (TestHelperProcess).
const helperProcessEnv = "MESHID_AS_PROCESS"

func TestHelperProcess(t *testing.T) {
	if os.Getenv(helperProcessEnv) != "1" {
		t.Skip("run as a helper process only")
	}
	args := os.Args
	for i, a := range args {
		if a == "--" {
			args = args[i+1:]
			break
		}
	}
	root := newRootCommand(runCA, cli.RunAgent, os.LookupEnv, os.Environ)
	root.SetArgs(args)
	os.Exit(cli.Main(root))
}

// logLines delivers the JSON log records a process writes, by message, and its other lines.
func logLines(t *testing.T, r io.Reader) <-chan map[string]any {
	t.Helper()
	ch := make(chan map[string]any, 256)
	go func() {
		defer close(ch)
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			rec := map[string]any{}
			if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
				rec = map[string]any{"msg": "", "line": sc.Text()}
			}
			ch <- rec
		}
	}()
	return ch
}

// await returns the first record for which match is true, failing after a real-time bound.
func await(t *testing.T, lines <-chan map[string]any, what string, match func(map[string]any) bool) map[string]any {
	t.Helper()
	giveUp := time.After(30 * time.Second)
	for {
		select {
		case rec, ok := <-lines:
			if !ok {
				t.Fatalf("the process ended before %s", what)
			}
			if match(rec) {
				return rec
			}
		case <-giveUp:
			t.Fatalf("no %s", what)
		}
	}
}

func msgIs(msg string) func(map[string]any) bool {
	return func(rec map[string]any) bool { return rec["msg"] == msg }
}

// The first SIGTERM starts the drain, and says so; a second ends the process at once, though a
// stream is still open and the drain has an hour to go.
func TestSecondSignalEndsTheDrain(t *testing.T) {
	t.Parallel()
	root := testutil.ShortTempDir(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "--",
		"agent", "--root-dir", root, "--status-addr", "127.0.0.1:0", "--debug-addr", "",
		"--drain-duration", "1h", "--log-format", "json")
	cmd.Env = append(os.Environ(), helperProcessEnv+"=1")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	lines := logLines(t, stderr)

	started := await(t, lines, "agent started", msgIs("agent started"))
	socket, _ := started["sds_socket"].(string)
	stream := sdstest.Dial(t, socket).StreamSecrets()
	stream.Subscribe("default")
	stream.Recv()

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	await(t, lines, "the drain's start", func(rec map[string]any) bool {
		return strings.HasPrefix(rec["msg"].(string), "SDS draining")
	})
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	await(t, lines, "the word that it stops now", func(rec map[string]any) bool {
		line, _ := rec["line"].(string)
		return strings.Contains(line, "again: stopping now")
	})
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 128+int(syscall.SIGTERM) {
			t.Fatalf("exit: %v, want code %d", err, 128+int(syscall.SIGTERM))
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the process did not stop after the second signal")
	}
	// With -tags external this binary's TestMain starts an API server, which the helper, a
	// process of meshid's, neither needs nor stops: it would be left behind.
	if dirs := kubetest.DirsOf(cmd.Process.Pid); len(dirs) > 0 {
		t.Errorf("the helper process started an API server and left %v", dirs)
	}
}
