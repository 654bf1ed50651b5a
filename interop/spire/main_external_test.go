//go:build external

package spire_test

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/testutil"
)

// spireBinEnv names the directory holding spire-agent: make test sets it from hack/spire-env.sh.
const spireBinEnv = "MESHID_SPIRE_BIN"

// helperBinEnv names the directory holding spiffe-helper: make test sets it from
// hack/spiffe-helper-env.sh.
const helperBinEnv = "MESHID_SPIFFE_HELPER_BIN"

// wait bounds, in real time, each wait for something that should happen: a process starting, a
// response, a rotation reaching a client. Reaching it fails the test.
const wait = 30 * time.Second

// binDir holds meshid, built once by TestMain from this checkout; empty when neither spire-agent
// nor spiffe-helper is to be had, and every test skips.
var binDir string

func TestMain(m *testing.M) {
	os.Exit(buildAndRun(m))
}

func buildAndRun(m *testing.M) int {
	if os.Getenv(spireBinEnv) == "" && os.Getenv(helperBinEnv) == "" {
		return m.Run() // each test says why it skips
	}
	dir, err := testutil.BuildCommands("./cmd/meshid")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer func() { _ = os.RemoveAll(dir) }()
	binDir = dir
	return m.Run()
}

// spireAgent returns the path of spire-agent, and skips the test when $MESHID_SPIRE_BIN is not
// set.
func spireAgent(t *testing.T) string {
	t.Helper()
	dir := os.Getenv(spireBinEnv)
	if dir == "" {
		t.Skipf("%s is not set: run make test, or %s=$(hack/spire-env.sh) go test -tags external ./interop/spire/", spireBinEnv, spireBinEnv)
	}
	return filepath.Join(dir, "spire-agent")
}

// spiffeHelper returns the path of spiffe-helper, and skips the test when
// $MESHID_SPIFFE_HELPER_BIN is not set.
func spiffeHelper(t *testing.T) string {
	t.Helper()
	dir := os.Getenv(helperBinEnv)
	if dir == "" {
		t.Skipf("%s is not set: run make test, or %s=$(hack/spiffe-helper-env.sh) go test -tags external ./interop/spire/", helperBinEnv, helperBinEnv)
	}
	return filepath.Join(dir, "spiffe-helper")
}

// process is a program running for a test (testutil.Process), its lines waited for.
type process struct{ *testutil.Process }

// start runs path with args; it is killed with the test binary, however that ends.
func start(t *testing.T, label, path string, args ...string) *process {
	t.Helper()
	cmd := exec.Command(path, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return &process{testutil.StartProcess(t, label, cmd)}
}

// awaitLine waits for the first line numbered from on that ok accepts, and returns its number.
// The process ending first, or wait passing, fails the test with what was looked for.
func (p *process) awaitLine(t *testing.T, from int, what string, ok func(string) bool) int {
	t.Helper()
	at, err := p.FindLine(from, wait, what, ok)
	if err != nil {
		t.Fatal(err)
	}
	return at
}

// awaitLog waits for the first JSON log record, from the start, whose msg is msg, and returns it.
func (p *process) awaitLog(t *testing.T, msg string) map[string]any {
	t.Helper()
	var rec map[string]any
	p.awaitLine(t, 0, fmt.Sprintf("the log record %q", msg), func(l string) bool {
		rec = nil
		return json.Unmarshal([]byte(l), &rec) == nil && rec["msg"] == msg
	})
	return rec
}

// span returns the lines numbered from to end (exclusive), which must have been read.
func (p *process) span(from, end int) []string { return p.Lines(from, end) }
