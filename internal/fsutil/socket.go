//go:build unix

package fsutil

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
)

// Errors of a server's socket path.
var (
	// ErrSocketInUse reports a socket path that another server already answers on.
	ErrSocketInUse = errors.New("another server listens on the socket")
	// ErrSocketTaken reports that a server's socket path no longer leads to its socket: it was
	// removed, or another socket (or file) was put there, so new clients reach someone else.
	ErrSocketTaken = errors.New("the socket path no longer leads to this server")
)

// SocketServing reports whether something accepts connections on the Unix socket at path.
func SocketServing(path string) bool {
	conn, err := net.DialTimeout("unix", path, time.Second)
	if err != nil {
		return false
	}
	_ = conn.Close()
	return true
}

// fileID identifies a file whatever its name now is.
type fileID struct{ dev, ino uint64 }

func idOf(info os.FileInfo) fileID {
	st, ok := info.Sys().(*syscall.Stat_t)
	if !ok {
		return fileID{}
	}
	return fileID{dev: uint64(st.Dev), ino: st.Ino} //nolint:unconvert // Dev's type differs by platform
}

// Socket is the Unix socket a server listens on, which can tell whether its path still leads
// to it. Another process that can write in the directory can remove the socket file and bind
// its own at the path (a second SDS server started later, say): clients that connect from then
// on reach that one, and the server would not know. The path is removed when the server is
// done only while it is still the server's own.
type Socket struct {
	path string
	mode os.FileMode
	log  *slog.Logger

	mu  sync.Mutex
	lis net.Listener // the latest listener
	id  fileID       // of the socket file lis made

	// problem says why the path does not lead to the socket, as its guard last saw; nil while it
	// does.
	problem atomic.Pointer[error]
}

// ListenSocket prepares path's directory (made 0750 when missing), refuses a path another
// server answers on (ErrSocketInUse), removes a stale socket file, and listens with mode, set as
// the file is made. A directory every user may write in is served, with a warning: Kubernetes
// makes an emptyDir, where Envoy's sockets usually live, writable by everyone, and only the
// pod's containers can reach it.
func ListenSocket(path string, mode os.FileMode, log *slog.Logger) (*Socket, error) {
	if err := CheckSocketPath(path); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	dir := filepath.Dir(path)
	if err := EnsureDir(dir, 0o750); err != nil {
		return nil, err
	}
	if err := CheckSocketDir(dir); errors.Is(err, ErrSharedDir) {
		log.Warn("the socket directory is writable by every user: any of them could replace the socket",
			logkey.Dir, dir, logkey.Error, err.Error())
	} else if err != nil {
		return nil, err
	}
	if _, err := os.Lstat(path); err == nil {
		if SocketServing(path) {
			return nil, fmt.Errorf("%w: %s", ErrSocketInUse, path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("remove the stale socket %s: %w", path, err)
		}
		log.Info("removed a stale socket", logkey.Path, path)
	}
	s := &Socket{path: path, mode: mode, log: log}
	if err := s.listen(); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *Socket) listen() error {
	lis, id, err := listenUnix(s.path, s.mode)
	if err != nil {
		return err
	}
	// The path is removed by Remove, and only while it is still ours: net's own unlink on
	// Close would remove whatever took the path meanwhile.
	if ul, ok := lis.(*net.UnixListener); ok {
		ul.SetUnlinkOnClose(false)
	}
	s.mu.Lock()
	s.lis, s.id = lis, id
	s.mu.Unlock()
	return nil
}

// Listener returns the listener ListenSocket made.
func (s *Socket) Listener() net.Listener {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lis
}

// Path returns the socket's path.
func (s *Socket) Path() string { return s.path }

// Check reports whether the path still leads to the socket: nil, or an error wrapping
// ErrSocketTaken that says what is there now.
func (s *Socket) Check() error {
	s.mu.Lock()
	id := s.id
	s.mu.Unlock()
	info, err := os.Lstat(s.path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return fmt.Errorf("%w: %s was removed", ErrSocketTaken, s.path)
	case err != nil:
		return fmt.Errorf("%w: %s cannot be checked: %w", ErrSocketTaken, s.path, err)
	case idOf(info) == id:
		return nil
	}
	return fmt.Errorf("%w: %s is now %s", ErrSocketTaken, s.path, describeFile(s.path, info))
}

// describeFile says what a file found at a socket's path is, and who serves it.
func describeFile(path string, info os.FileInfo) string {
	owner := "an unknown user"
	if st, ok := info.Sys().(*syscall.Stat_t); ok {
		owner = fmt.Sprintf("uid %d", st.Uid)
	}
	if info.Mode().Type() != os.ModeSocket {
		return fmt.Sprintf("a file of %s (mode %v), not a socket", owner, info.Mode())
	}
	conn, err := net.DialTimeout("unix", path, time.Second)
	if err != nil {
		return fmt.Sprintf("a socket of %s (mode %v) that nothing answers on", owner, info.Mode())
	}
	defer func() { _ = conn.Close() }()
	// The peer of a connection to a listening socket is the process that listened.
	server := PeerProcess(conn)
	if server == "" {
		server = "an unknown process"
	}
	return fmt.Sprintf("a socket of %s (mode %v) served by %s", owner, info.Mode(), server)
}

// reclaim listens at the path again once whatever took it is gone: nothing is there, or a socket
// nothing answers on. While another server answers there it returns ErrSocketInUse; the server
// does not take the path from it (a restart hands it over, as the SDS decision flow does).
func (s *Socket) reclaim() (net.Listener, error) {
	if info, err := os.Lstat(s.path); err == nil {
		if info.Mode().Type() == os.ModeSocket && SocketServing(s.path) {
			return nil, fmt.Errorf("%w: %s", ErrSocketInUse, s.path)
		}
		if err := os.Remove(s.path); err != nil {
			return nil, fmt.Errorf("remove %s: %w", s.path, err)
		}
	}
	if err := s.listen(); err != nil {
		return nil, err
	}
	return s.Listener(), nil
}

// SocketGuard looks, each time it is asked, whether the path still leads to its socket. It logs
// and reports a takeover once, with what is there now; once whatever took the path is gone
// (nothing there, or a socket nothing answers on: a server that dies leaves its file without a
// sound), it listens there again, hands the new listener to serve, and reports nil. The listeners
// of before stay open (a server stops serving them only as it stops). A server asks it every few
// seconds from the goroutine that runs it: it needs no goroutine of its own, nor a watch's
// buffers.
type SocketGuard struct {
	socket   *Socket
	serve    func(net.Listener)
	report   func(error)
	reported error
}

// Guard returns the guard of the socket's path.
func (s *Socket) Guard(serve func(net.Listener), report func(error)) *SocketGuard {
	return &SocketGuard{socket: s, serve: serve, report: report}
}

// Look checks the path once, reports a change, and takes the path back when it can. Call it
// from one goroutine.
func (g *SocketGuard) Look() {
	err := g.socket.Check()
	g.tell(err)
	if err == nil {
		return
	}
	if lis, err := g.socket.reclaim(); err == nil {
		g.serve(lis)
		g.tell(nil)
	}
}

func (g *SocketGuard) tell(err error) {
	changed := (err == nil) != (g.reported == nil) || err != nil && err.Error() != g.reported.Error()
	g.reported = err
	if !changed {
		return
	}
	s := g.socket
	if err == nil {
		s.problem.Store(nil)
		s.log.Info("the socket path is this server's again", logkey.Socket, s.path)
	} else {
		s.problem.Store(&err)
		s.log.Warn("the socket path was taken: Envoy's new connections reach whatever is there now",
			logkey.Socket, s.path, logkey.Error, err.Error())
	}
	g.report(err)
}

// Guarding is how Serve looks at the socket's path, and whom it tells what it sees.
type Guarding struct {
	// Every Interval on Clock (nil: the real clock).
	Clock    clock.Clock
	Interval time.Duration
	// Taken, when set, is called each time the path is found taken (a server counts it);
	// Report, when set, is told every change: what took the path, then nil once it is back.
	Taken  func()
	Report func(error)
}

// Serve serves the socket's listener with serve on a goroutine and, until ctx ends or that serve
// returns, looks at the path as g says (a Guard, that serves each listener it takes back the same
// way). It returns serve's error when serve returned first, nil when ctx ended; the server is
// still serving then. Stop the server, then call wait: it returns once every serve has, with the
// first one's error.
func (s *Socket) Serve(ctx context.Context, serve func(net.Listener) error, g Guarding) (wait func() error, err error) {
	clk := clock.OrReal(g.Clock)
	var serving sync.WaitGroup
	var firstErr error
	firstDone := make(chan struct{})
	serving.Go(func() {
		firstErr = serve(s.Listener())
		close(firstDone)
	})
	wait = func() error {
		serving.Wait()
		return firstErr
	}
	guard := s.Guard(func(lis net.Listener) { serving.Go(func() { _ = serve(lis) }) }, func(err error) {
		if err != nil && g.Taken != nil {
			g.Taken()
		}
		if g.Report != nil {
			g.Report(err)
		}
	})
	for {
		timer := clk.NewTimer(g.Interval)
		select {
		case <-firstDone:
			timer.Stop()
			return wait, firstErr
		case <-timer.C():
			guard.Look()
		case <-ctx.Done():
			timer.Stop()
			return wait, nil
		}
	}
}

// Problem says why the path no longer leads to the socket (it was removed, or another server
// took it), as its guard last saw; nil while it does.
func (s *Socket) Problem() error {
	if p := s.problem.Load(); p != nil {
		return *p
	}
	return nil
}

// Remove removes the socket file while the path still leads to it. Call it once the listeners
// are closed.
func (s *Socket) Remove() {
	if s.Check() == nil {
		_ = os.Remove(s.path)
	}
}

// Close closes the listener and removes the socket file, for a server that will not run.
func (s *Socket) Close() {
	_ = s.Listener().Close()
	s.Remove()
}
