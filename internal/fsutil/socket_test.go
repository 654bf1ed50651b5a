package fsutil

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/testutil"
)

func TestListenSocketRefusesALiveServerAndRemovesAStaleSocket(t *testing.T) {
	t.Parallel()
	path := filepath.Join(shortDir(t), "sub", "socket")
	live, err := ListenSocket(path, 0o660, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ListenSocket(path, 0o660, nil); !errors.Is(err, ErrSocketInUse) {
		t.Fatalf("a second server on a live socket: %v, want ErrSocketInUse", err)
	}
	// Killed without cleaning up: the file stays, nothing answers.
	_ = live.Listener().Close()
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("closing the listener removed the file: %v", err)
	}
	s, err := ListenSocket(path, 0o660, nil)
	if err != nil {
		t.Fatalf("a stale socket was not replaced: %v", err)
	}
	checkSocket(t, path, 0o660)
	if err := s.Check(); err != nil {
		t.Fatalf("Check of a socket that is ours: %v", err)
	}
	s.Close()
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Close left the socket file: %v", err)
	}
}

// takeOver puts a socket of another server at path in one step (a rename over it), as a second
// server started later can; its listener does not remove the file on close.
func takeOver(t *testing.T, path string) net.Listener {
	t.Helper()
	lis, err := net.Listen("unix", path+".new")
	if err != nil {
		t.Fatal(err)
	}
	lis.(*net.UnixListener).SetUnlinkOnClose(false)
	if err := os.Rename(path+".new", path); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lis.Close() })
	return lis
}

func TestSocketCheckSaysWhatTookThePath(t *testing.T) {
	t.Parallel()
	path := filepath.Join(shortDir(t), "socket")
	s, err := ListenSocket(path, 0o660, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	intruder := takeOver(t, path)
	err = s.Check()
	if !errors.Is(err, ErrSocketTaken) || !strings.Contains(err.Error(), "served by pid="+strconv.Itoa(os.Getpid())) {
		t.Fatalf("Check after a takeover: %v, want ErrSocketTaken naming the server's process", err)
	}
	// Ours is done: it must not remove the socket of the server that took the path.
	s.Close()
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("closing the taken socket removed the other server's: %v", err)
	}
	_ = intruder.Close()
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := s.Check(); !errors.Is(err, ErrSocketTaken) || !strings.Contains(err.Error(), "removed") {
		t.Fatalf("Check of a removed socket: %v", err)
	}
}

// The guard, looked at step by step: a takeover is reported once; nothing is done while the
// other server answers; once it is gone, the path is listened on again, served, and reported.
func TestSocketGuardReportsATakeoverAndTakesThePathBack(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// leave ends the other server: removing its socket, or dying and leaving the file.
		leave func(other net.Listener, path string)
		gone  string
	}{
		{"the other server removes its socket", func(other net.Listener, path string) {
			_ = other.Close()
			_ = os.Remove(path)
		}, "removed"},
		{"the other server dies", func(other net.Listener, _ string) { _ = other.Close() }, "nothing answers on"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			path := filepath.Join(shortDir(t), "socket")
			s, err := ListenSocket(path, 0o660, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			var reports []error
			var served []net.Listener
			g := s.Guard(func(l net.Listener) { served = append(served, l) }, func(err error) { reports = append(reports, err) })

			g.Look()
			if len(reports) != 0 {
				t.Fatalf("reported %v while the path is ours", reports)
			}
			intruder := takeOver(t, path)
			g.Look()
			if len(reports) != 1 || !errors.Is(reports[0], ErrSocketTaken) || !strings.Contains(reports[0].Error(), "served by") {
				t.Fatalf("takeover reported as %v", reports)
			}
			g.Look()
			g.Look()
			if len(reports) != 1 || len(served) != 0 {
				t.Fatalf("reported again (%v) or served (%d) while nothing changed", reports, len(served))
			}
			tc.leave(intruder, path)
			g.Look()
			if len(reports) != 3 || !strings.Contains(reports[1].Error(), tc.gone) || reports[2] != nil {
				t.Fatalf("the other server's end reported as %v, want %q then nil", reports, tc.gone)
			}
			if len(served) != 1 {
				t.Fatalf("%d listeners served, want the one taken back", len(served))
			}
			if err := s.Check(); err != nil {
				t.Fatalf("Check after the path was taken back: %v", err)
			}
			accepted := make(chan error, 1)
			go func() {
				c, err := served[0].Accept()
				if err == nil {
					_ = c.Close()
				}
				accepted <- err
			}()
			conn, err := net.Dial("unix", path)
			if err != nil {
				t.Fatalf("dial the socket taken back: %v", err)
			}
			_ = conn.Close()
			if err := <-accepted; err != nil {
				t.Fatalf("the served listener did not take the connection: %v", err)
			}
		})
	}
}

// Serve serves the socket, looks at the path on its clock, serves what it takes back, and hands
// its caller what each serve ended with.
func TestServeGuardsThePathUntilTheContextEnds(t *testing.T) {
	t.Parallel()
	path := filepath.Join(shortDir(t), "socket")
	s, err := ListenSocket(path, 0o660, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	listeners := make(chan net.Listener, 2)
	serve := func(l net.Listener) error {
		listeners <- l
		for {
			c, err := l.Accept()
			if err != nil {
				return err
			}
			_, _ = c.Write([]byte("ours"))
			_ = c.Close()
		}
	}
	reports := make(chan error, 4)
	var taken atomic.Int32
	clk := testutil.NewFakeClock(time.Now())
	ctx, cancel := context.WithCancel(context.Background())
	type result struct {
		wait func() error
		err  error
	}
	done := make(chan result, 1)
	go func() {
		wait, err := s.Serve(ctx, serve, Guarding{Clock: clk, Interval: time.Second,
			Taken: func() { taken.Add(1) }, Report: func(err error) { reports <- err }})
		done <- result{wait, err}
	}()
	first := <-listeners
	// look lets Serve look once, and returns when it has: its next timer is armed after the look.
	waitForLook := func() {
		t.Helper()
		if err := clk.WaitForTimers(ctx, 1); err != nil {
			t.Fatal(err)
		}
	}
	look := func() {
		t.Helper()
		clk.Advance(time.Second)
		waitForLook()
	}
	waitForLook()

	intruder := takeOver(t, path)
	look()
	if err := <-reports; !errors.Is(err, ErrSocketTaken) {
		t.Fatalf("takeover reported as %v", err)
	}
	_ = intruder.Close()
	_ = os.Remove(path)
	look()
	if err := <-reports; err == nil || !strings.Contains(err.Error(), "removed") {
		t.Fatalf("the path's removal reported as %v", err)
	}
	if err := <-reports; err != nil {
		t.Fatalf("the path taken back reported as %v, want nil", err)
	}
	second := <-listeners
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(c)
	_ = c.Close()
	if err != nil || string(got) != "ours" {
		t.Fatalf("a client of the path taken back read %q, %v", got, err)
	}

	if n := taken.Load(); n != 2 {
		t.Errorf("Taken called %d times, want 2: the takeover and the removal", n)
	}
	cancel()
	r := <-done
	if r.err != nil {
		t.Fatalf("Serve after ctx ended: %v, want nil", r.err)
	}
	_ = first.Close()
	_ = second.Close()
	if err := r.wait(); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("wait: %v, want the first serve's error", err)
	}
}

// A serve that fails ends Serve at once, with its error.
func TestServeReturnsWhenServeFails(t *testing.T) {
	t.Parallel()
	s, err := ListenSocket(filepath.Join(shortDir(t), "socket"), 0o660, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	failed := errors.New("cannot serve")
	wait, err := s.Serve(context.Background(), func(net.Listener) error { return failed },
		Guarding{Clock: testutil.NewFakeClock(time.Now()), Interval: time.Second})
	if !errors.Is(err, failed) || !errors.Is(wait(), failed) {
		t.Fatalf("Serve %v, wait %v; want the serve's error from both", err, wait())
	}
}
