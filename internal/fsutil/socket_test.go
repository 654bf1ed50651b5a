package fsutil

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/filewatch"
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

// guard runs s.Guard with a real watch of the socket's directory on a fake clock, and returns
// what it reports and serves.
func guard(t *testing.T, s *Socket, clk *testutil.FakeClock) (reports chan error, served chan net.Listener) {
	t.Helper()
	w, err := filewatch.New(filewatch.Config{Paths: []string{s.Path()}, Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	reports, served = make(chan error, 10), make(chan net.Listener, 10)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- s.Guard(ctx, w, clk, 2*time.Second, func(l net.Listener) { served <- l }, func(err error) { reports <- err })
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Guard: %v", err)
		}
	})
	select {
	case <-w.Ready():
	case <-time.After(10 * time.Second):
		t.Fatal("the watch did not start")
	}
	return reports, served
}

// Guard, on the fake clock: a takeover is reported once, as it happens; nothing is done while the
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
			clk := testutil.NewFakeClock(time.Unix(1_700_000_000, 0))
			reports, served := guard(t, s, clk)

			intruder := takeOver(t, path)
			if err := testutil.Drive(t, clk, 100*time.Millisecond, 0, reports); !errors.Is(err, ErrSocketTaken) || !strings.Contains(err.Error(), "served by") {
				t.Fatalf("takeover reported as %v", err)
			}
			// Retried while taken, and not reported again while nothing changes. Each look is
			// over once the retry is armed again.
			for range 3 {
				if err := clk.WaitForTimers(context.Background(), 1); err != nil {
					t.Fatal(err)
				}
				clk.Advance(2 * time.Second)
			}
			if err := clk.WaitForTimers(context.Background(), 1); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-reports:
				t.Fatalf("reported again while nothing changed: %v", err)
			default:
			}
			tc.leave(intruder, path)
			if err := testutil.Drive(t, clk, 100*time.Millisecond, 0, reports); !errors.Is(err, ErrSocketTaken) || !strings.Contains(err.Error(), tc.gone) {
				t.Fatalf("the other server's end reported as %v, want %q", err, tc.gone)
			}
			if err := <-reports; err != nil {
				t.Fatalf("the path taken back reported as %v, want nil", err)
			}
			lis := <-served
			if err := s.Check(); err != nil {
				t.Fatalf("Check after the path was taken back: %v", err)
			}
			accepted := make(chan error, 1)
			go func() {
				c, err := lis.Accept()
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
