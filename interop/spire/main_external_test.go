//go:build external

package spire_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// spireBinEnv names the directory holding spire-agent: make test sets it from hack/spire-env.sh.
const spireBinEnv = "MESHID_SPIRE_BIN"

// wait bounds, in real time, each wait for something that should happen: a process starting, a
// response, a rotation reaching a client. Reaching it fails the test.
const wait = 30 * time.Second

// binDir holds meshid, built once by TestMain from this checkout; empty when spire-agent is not
// to be had, and every test skips.
var binDir string

func TestMain(m *testing.M) {
	os.Exit(buildAndRun(m))
}

func buildAndRun(m *testing.M) int {
	if os.Getenv(spireBinEnv) == "" {
		return m.Run() // each test says why it skips
	}
	dir, err := os.MkdirTemp("", "meshid-spire-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer func() { _ = os.RemoveAll(dir) }()
	root, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}").Output()
	if err != nil {
		fmt.Fprintln(os.Stderr, "go list -m:", err)
		return 1
	}
	build := exec.Command("go", "build", "-o", dir+string(filepath.Separator), "./cmd/meshid")
	build.Dir = strings.TrimSpace(string(root))
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "go build: %v\n%s", err, out)
		return 1
	}
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

// process is a program running for a test, its output (stdout and stderr) kept line by line, to
// be waited for and printed when the test fails. It is killed when the test ends.
type process struct {
	label string

	mu    sync.Mutex
	lines []string
	grew  chan struct{} // closed and replaced at every new line
	ended chan struct{} // closed when the output ends: the process is gone
}

// start runs path with args.
func start(t *testing.T, label, path string, args ...string) *process {
	t.Helper()
	p := &process{label: label, grew: make(chan struct{}), ended: make(chan struct{})}
	cmd := exec.Command(path, args...)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = w, w
	// Killed with the test binary, however it ends.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		_ = r.Close()
		_ = w.Close()
		t.Fatalf("start %s: %v", label, err)
	}
	_ = w.Close()
	go p.read(r)
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait() // killed at the end: how it ended says nothing
		close(exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
		<-p.ended
		if t.Failed() {
			t.Logf("---- %s (%s %s) ----\n%s", label, filepath.Base(path), strings.Join(args, " "), p.String())
		}
	})
	return p
}

func (p *process) read(r io.ReadCloser) {
	defer close(p.ended)
	defer func() { _ = r.Close() }()
	sc := bufio.NewScanner(r)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		p.mu.Lock()
		p.lines = append(p.lines, sc.Text())
		close(p.grew)
		p.grew = make(chan struct{})
		p.mu.Unlock()
	}
}

func (p *process) String() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Join(p.lines, "\n")
}

// mark is the number of lines so far: awaitLine from there waits for what comes after.
func (p *process) mark() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.lines)
}

// awaitLine waits for the first line numbered from on that ok accepts, and returns its number.
// The process ending first, or wait passing, fails the test with what was looked for.
func (p *process) awaitLine(t *testing.T, from int, what string, ok func(string) bool) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	for {
		p.mu.Lock()
		for ; from < len(p.lines); from++ {
			if ok(p.lines[from]) {
				p.mu.Unlock()
				return from
			}
		}
		grew := p.grew
		p.mu.Unlock()
		select {
		case <-grew:
		case <-p.ended:
			// Lines read before the end are all in; one more look.
			if p.mark() == from {
				t.Fatalf("%s ended without printing %s", p.label, what)
			}
		case <-ctx.Done():
			t.Fatalf("%s did not print %s within %s", p.label, what, wait)
		}
	}
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
func (p *process) span(from, end int) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.lines[from:end])
}
