package sds_test

import (
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/sds/sdstest"
)

// Attack: whoever can write in the socket directory swaps the new socket for a symlink to another
// file (here, a CA key) in the moment between the listen and the setting of the socket's mode,
// and that file took the socket's mode: the key went 0600 → 0660. The server sets the mode as the
// socket is created, so there is no such moment: however the swap falls, the key keeps its mode.
func TestNewSocketModeFollowsNoSymlink(t *testing.T) {
	t.Parallel()
	const attempts = 200
	victim := filepath.Join(t.TempDir(), "ca-key.pem")
	testutil.WriteFiles(t, filepath.Dir(victim), map[string][]byte{filepath.Base(victim): []byte("key")})
	if err := os.Chmod(victim, 0o600); err != nil {
		t.Fatal(err)
	}
	f := newFakeSecrets()
	for i := range attempts {
		path := filepath.Join(testutil.ShortTempDir(t), sds.SocketName)
		// The racer polls without pause and swaps the socket the moment it appears.
		stop, swapped := make(chan struct{}), make(chan bool, 1)
		go func() {
			for {
				select {
				case <-stop:
					swapped <- false
					return
				default:
				}
				if info, err := os.Lstat(path); err == nil && info.Mode().Type() == os.ModeSocket {
					_ = os.Remove(path)
					swapped <- os.Symlink(victim, path) == nil
					return
				}
			}
		}()
		srv, err := sds.New(sds.Config{SocketPath: path, Secrets: f})
		close(stop)
		<-swapped
		if err == nil {
			srv.Close()
		}
		info, err := os.Stat(victim)
		if err != nil {
			t.Fatal(err)
		}
		if info.Mode().Perm() != 0o600 {
			t.Fatalf("attempt %d: the symlink swap made the CA key %v", i, info.Mode().Perm())
		}
	}
}

// A socket directory writable by everyone (a Kubernetes emptyDir is 0777) is served, with a
// warning naming it: any local user could replace the socket there.
func TestNewWarnsOfASharedSocketDir(t *testing.T) {
	t.Parallel()
	dir := testutil.ShortTempDir(t)
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	logs := &testutil.SyncBuffer{}
	srv, err := sds.New(sds.Config{
		SocketPath: filepath.Join(dir, sds.SocketName),
		Secrets:    newFakeSecrets(),
		Logger:     slog.New(slog.NewTextHandler(logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	srv.Close()
	if got := logs.String(); !strings.Contains(got, "writable by every user") || !strings.Contains(got, "dir="+dir) {
		t.Fatalf("no warning naming %s:\n%s", dir, got)
	}
}

// Another SDS server (spire-agent, say) that binds the socket path after this one started takes
// every new connection of Envoy's (istio#61343). The server notices at its next look: logged once
// with who serves the path now, counted, and reported (the agent is not ready then); streams
// already open go on; once the other server is gone the path is taken back and served again.
func TestServerNoticesItsSocketTakenAndTakesItBack(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1 := p.workload(t)
	f.Publish(d1)
	clk := testutil.NewFakeClock(time.Now())
	changes := make(chan error, 10)
	h := startServer(t, f, func(c *sds.Config) {
		c.SocketClock = clk
		c.OnSocket = func(err error) { changes <- err }
	})
	open := h.sotw()
	open.Subscribe(dflt)
	first := open.Recv()
	expect(t, first, d1)
	open.Ack(first, dflt)

	// In one step, so that the path is never missing: a rename of its socket over the path.
	other, err := net.Listen("unix", h.socket+".new")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(h.socket+".new", h.socket); err != nil {
		t.Fatal(err)
	}
	err = testutil.Drive(t, clk, sds.SocketCheckInterval, 0, changes)
	if !errors.Is(err, fsutil.ErrSocketTaken) || !strings.Contains(err.Error(), "served by pid="+strconv.Itoa(os.Getpid())) {
		t.Fatalf("the takeover reported as %v, want ErrSocketTaken naming the other server", err)
	}
	if !errors.Is(h.server.SocketProblem(), fsutil.ErrSocketTaken) {
		t.Fatalf("SocketProblem() = %v while the path is taken", h.server.SocketProblem())
	}
	if got := h.counter(t, "meshid_sds_socket_taken_total")[""]; got != 1 {
		t.Fatalf("meshid_sds_socket_taken_total = %v, want 1", got)
	}
	if n := strings.Count(h.logs.String(), "the socket path was taken"); n != 1 {
		t.Fatalf("the takeover logged %d times, want once:\n%s", n, h.logs)
	}
	// The stream opened before goes on.
	d2 := p.workload(t)
	f.Publish(d2)
	expect(t, open.Recv(), d2)

	_ = other.Close()
	if err := os.Remove(h.socket); err != nil {
		t.Fatal(err)
	}
	if err := testutil.Drive(t, clk, sds.SocketCheckInterval, 0, changes); !errors.Is(err, fsutil.ErrSocketTaken) {
		t.Fatalf("the other server's end reported as %v", err)
	}
	if err := <-changes; err != nil {
		t.Fatalf("the path taken back reported as %v, want nil", err)
	}
	if err := h.server.SocketProblem(); err != nil {
		t.Fatalf("SocketProblem() = %v once the path is taken back", err)
	}
	again := sdstest.Dial(t, h.socket).StreamSecrets()
	again.Subscribe(dflt)
	expect(t, again.Recv(), d2)
}
