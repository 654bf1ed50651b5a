package testutil

import (
	"os/exec"
	"strings"
	"testing"
	"time"
)

func TestProcessFindLine(t *testing.T) {
	t.Parallel()
	p := StartProcess(t, "sh", exec.Command("sh", "-c", "echo one; echo two >&2; echo three; exit 3"))
	at, err := p.FindLine(0, time.Minute, "two", func(l string) bool { return l == "two" })
	if err != nil || at != 1 {
		t.Fatalf("FindLine(two) = %d, %v; want 1", at, err)
	}
	if _, err := p.FindLine(at+1, time.Minute, "four", func(l string) bool { return l == "four" }); err == nil ||
		!strings.Contains(err.Error(), "ended without printing four") {
		t.Fatalf("FindLine(four) after the end: %v", err)
	}
	code, err := p.AwaitExit(time.Minute)
	if err != nil || code != 3 {
		t.Fatalf("AwaitExit = %d, %v; want 3", code, err)
	}
	if got := p.Lines(0, p.Mark()); strings.Join(got, ",") != "one,two,three" {
		t.Errorf("lines %q", got)
	}
}
