package testutil

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// BuildCommands builds the module's commands pkgs (such as "./cmd/meshid") from the module root
// into a new temporary directory, and returns it; remove it when done. It is for TestMain, which
// has no testing.TB.
func BuildCommands(pkgs ...string) (string, error) {
	dir, err := os.MkdirTemp("", "meshid-bin")
	if err != nil {
		return "", err
	}
	root, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}").Output()
	if err != nil {
		_ = os.RemoveAll(dir)
		return "", fmt.Errorf("go list -m: %w", err)
	}
	build := exec.Command("go", append([]string{"build", "-o", dir + string(filepath.Separator)}, pkgs...)...) //nolint:gosec // the calling test's own package paths
	build.Dir = strings.TrimSpace(string(root))
	if out, err := build.CombinedOutput(); err != nil {
		_ = os.RemoveAll(dir)
		return "", fmt.Errorf("go build: %w\n%s", err, out)
	}
	return dir, nil
}

// Process is a program run for a test. Its output (stdout and stderr) is kept line by line, can
// be waited for, and is printed when the test fails; it is killed when the test ends.
type Process struct {
	Label string
	Pid   int

	exited chan struct{} // closed once the process has been waited for; code is then set
	code   int

	mu    sync.Mutex
	lines []string
	grew  chan struct{} // closed and replaced at every new line
	ended chan struct{} // closed when the output ends: the process is gone
}

// StartProcess starts cmd, which must not have been started and whose Stdout and Stderr it sets.
func StartProcess(t testing.TB, label string, cmd *exec.Cmd) *Process {
	t.Helper()
	p := &Process{Label: label, exited: make(chan struct{}), grew: make(chan struct{}), ended: make(chan struct{})}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = w, w
	if err := cmd.Start(); err != nil {
		_ = r.Close()
		_ = w.Close()
		t.Fatalf("start %s: %v", label, err)
	}
	_ = w.Close()
	p.Pid = cmd.Process.Pid
	go p.read(r)
	go func() {
		_ = cmd.Wait()
		p.code = cmd.ProcessState.ExitCode()
		close(p.exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.exited
		<-p.ended
		if t.Failed() {
			t.Logf("---- %s (%s) ----\n%s", label, strings.Join(cmd.Args, " "), p.String())
		}
	})
	return p
}

func (p *Process) read(r io.ReadCloser) {
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

// String is the output so far.
func (p *Process) String() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Join(p.lines, "\n")
}

// Mark is the number of lines so far: FindLine from there looks at what comes after.
func (p *Process) Mark() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.lines)
}

// Lines returns the lines numbered from to end (exclusive), which must have been read.
func (p *Process) Lines(from, end int) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.lines[from:end])
}

// FindLine waits, up to wait, for the first line numbered from on that ok accepts, and returns
// its number; what names it in the error when the output ends or wait passes first.
func (p *Process) FindLine(from int, wait time.Duration, what string, ok func(string) bool) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	for {
		p.mu.Lock()
		for ; from < len(p.lines); from++ {
			if ok(p.lines[from]) {
				p.mu.Unlock()
				return from, nil
			}
		}
		grew := p.grew
		p.mu.Unlock()
		select {
		case <-grew:
		case <-p.ended:
			// Lines read before the end are all in; one more look.
			if p.Mark() == from {
				return 0, fmt.Errorf("%s ended without printing %s", p.Label, what)
			}
		case <-ctx.Done():
			return 0, fmt.Errorf("%s did not print %s within %s", p.Label, what, wait)
		}
	}
}

// Exited is closed once the process has ended and been waited for.
func (p *Process) Exited() <-chan struct{} { return p.exited }

// AwaitExit waits, up to wait, for the process to end and its output with it, and returns its
// exit status (-1: killed by a signal).
func (p *Process) AwaitExit(wait time.Duration) (int, error) {
	select {
	case <-p.exited:
	case <-time.After(wait):
		return 0, fmt.Errorf("%s did not exit within %s", p.Label, wait)
	}
	<-p.ended
	return p.code, nil
}
