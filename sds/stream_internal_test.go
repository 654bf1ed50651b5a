package sds

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/clock"
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
