package sds

import (
	"context"
	"errors"
	"log/slog"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/secretmanager"
)

// A push may be inside Send when the client goes away; the handler must not return (grpc then
// finishes the stream, racing the Send) until that Send is over, and no Send may start after.
func TestCloseWatcherWaitsForTheSendInFlight(t *testing.T) {
	t.Parallel()
	gate, err := admission.NewGate(admission.Limits{Streams: 1})
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{cfg: Config{MaxStreams: 1}, cache: newSecretCache(nil, clock.Real(), slog.New(slog.DiscardHandler)), metrics: newMetrics(), gate: gate}
	entered, release := make(chan struct{}), make(chan struct{})
	closed := make(chan struct{})
	var sends int
	var closedDuringSend bool
	w, err := s.openWatcher(context.Background(), protocolSotW, func(string, []pushed) error {
		sends++
		entered <- struct{}{}
		<-release
		select {
		case <-closed:
			closedDuringSend = true
		default:
		}
		// Failed: the stream awaits no acknowledgement, so only its end can stop a next send.
		return errors.New("the client went away")
	})
	if err != nil {
		t.Fatal(err)
	}
	w.names = []string{"default"}
	w.entries = []*entry{{}}
	w.entries[0].served.Store(&servedSecret{version: "1"})
	w.notify()
	<-entered

	go func() {
		s.closeWatcher(w)
		close(closed)
	}()
	// Not a wait for time to pass: without the fix closeWatcher returns at once, well within it;
	// with it, it cannot return before release.
	select {
	case <-closed:
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	<-closed
	w.entries[0].served.Store(&servedSecret{version: "2"})
	w.notify()
	w.mu.Lock() // a push started by notify is done with w by the time it lets go of mu
	defer w.mu.Unlock()
	if closedDuringSend {
		t.Error("closeWatcher returned while a Send was in flight")
	}
	if sends != 1 {
		t.Errorf("%d sends, want 1: a response was sent after the handler ended", sends)
	}
}

// fakeSubscriptions tells nothing of the names it is asked for; cancelling the subscriptions
// (what Run does once its streams have ended) closes cancelled.
type fakeSubscriptions struct {
	once      sync.Once
	cancelled chan struct{}
}

func (f *fakeSubscriptions) Subscribe(string, func(*secretmanager.Secret, error)) (func(), error) {
	return func() { f.once.Do(func() { close(f.cancelled) }) }, nil
}

// A push goroutine is the server's: Run must not return while one is still sending. Here the push
// is stuck in Send until Run cancels the subscriptions, on its way out (a real Send ends when
// the stop closes the connection); Run returning before the push has ended is a leak.
func TestRunWaitsForThePushInFlight(t *testing.T) {
	t.Parallel()
	secrets := &fakeSubscriptions{cancelled: make(chan struct{})}
	s, err := New(Config{SocketPath: filepath.Join(testutil.ShortTempDir(t), SocketName), Secrets: secrets})
	if err != nil {
		t.Fatal(err)
	}
	entered := make(chan struct{})
	var sendEnded atomic.Bool
	w, err := s.openWatcher(context.Background(), protocolSotW, func(string, []pushed) error {
		close(entered)
		<-secrets.cancelled
		sendEnded.Store(true)
		return errors.New("the connection is closed")
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.follow(w, request{subscribe: []string{"default"}, replace: true}); err != nil {
		t.Fatal(err)
	}
	w.entries[0].served.Store(&servedSecret{version: "1"})
	w.notify()
	<-entered

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(time.Minute): // only bounds a broken test
		t.Fatal("Run did not return")
	}
	if !sendEnded.Load() || w.pushing.Load() {
		t.Fatal("Run returned while a push was still sending")
	}
}
