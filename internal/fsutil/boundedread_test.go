package fsutil_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/testutil"
)

// A read on a file system that stopped answering is given up after the bound, on the injected
// clock; while it is stuck, asking again starts no other read of the file; once it returns, the
// next read works.
func TestBoundedReadsGivesUpOnAStuckRead(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // only bounds a broken test
	defer cancel()
	clk := testutil.NewFakeClock(time.Unix(1_700_000_000, 0))
	reads := fsutil.NewBoundedReads(clk, 5*time.Second, 0)
	const path, what = "/mnt/nfs/root-cert.pem", "the CA root /mnt/nfs/root-cert.pem"
	entered, unstuck := make(chan struct{}, 1), make(chan struct{})
	stuck := func() ([]byte, error) {
		entered <- struct{}{}
		<-unstuck
		return []byte("late"), nil
	}
	var extra atomic.Int32 // reads started while the first was stuck: none
	another := func() ([]byte, error) {
		extra.Add(1)
		return []byte("another"), nil
	}

	type result struct {
		data []byte
		err  error
	}
	ask := func(read func() ([]byte, error)) <-chan result {
		ch := make(chan result, 1)
		go func() {
			data, err := reads.Read(ctx, path, what, read)
			ch <- result{data, err}
		}()
		return ch
	}
	first := ask(stuck)
	<-entered
	if err := clk.WaitForTimers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	clk.Advance(5 * time.Second)
	got := <-first
	if !errors.Is(got.err, fsutil.ErrNoAnswer) || got.data != nil {
		t.Fatalf("stuck read: %q, %v; want ErrNoAnswer", got.data, got.err)
	}
	if want := "reading " + what + ": no answer after 5s, is the file system alive?"; got.err.Error() != want {
		t.Fatalf("error %q, want %q", got.err, want)
	}

	// Asked again while the first read is stuck: it waits for that one, and starts none.
	second := ask(another)
	if err := clk.WaitForTimers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	clk.Advance(5 * time.Second)
	if got := <-second; !errors.Is(got.err, fsutil.ErrNoAnswer) {
		t.Fatalf("second read while stuck: %q, %v; want ErrNoAnswer", got.data, got.err)
	}

	// A caller whose context ends stops waiting too.
	gone, stop := context.WithCancel(ctx)
	stop()
	if _, err := reads.Read(gone, path, what, another); !errors.Is(err, context.Canceled) {
		t.Fatalf("read with an ended context: %v, want context.Canceled", err)
	}

	// The stuck read returns and its goroutine ends; the next read is a new one, and works. (One
	// asked just as the stuck read returns may still join it, and gets its answer.)
	close(unstuck)
	fresh := func() ([]byte, error) { return []byte("fresh"), nil }
	data, err := reads.Read(ctx, path, what, fresh)
	for err == nil && string(data) == "late" {
		runtime.Gosched()
		data, err = reads.Read(ctx, path, what, fresh)
	}
	if err != nil || string(data) != "fresh" {
		t.Fatalf("read after the file system answered again: %q, %v; want fresh", data, err)
	}
	if n := extra.Load(); n != 0 {
		t.Fatalf("%d reads started while one was stuck, want none: a stuck file system must not pile up goroutines", n)
	}
}

func TestBoundedReadsReadFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "root-cert.pem")
	if err := os.WriteFile(path, []byte("roots"), 0o600); err != nil {
		t.Fatal(err)
	}
	clk := testutil.NewFakeClock(time.Unix(1_700_000_000, 0))
	reads := fsutil.NewBoundedReads(clk, 0, 0)
	data, err := reads.ReadFile(context.Background(), path)
	if err != nil || string(data) != "roots" {
		t.Fatalf("ReadFile = %q, %v", data, err)
	}
	if data, err := reads.ReadFile(context.Background(), filepath.Join(dir, "missing")); !errors.Is(err, os.ErrNotExist) || data != nil {
		t.Fatalf("ReadFile(missing) = %q, %v; want ErrNotExist", data, err)
	}
	if n := clk.PendingTimers(); n != 0 {
		t.Fatalf("%d timers pending after reads that answered", n)
	}
}

// Reads of files a client names are bounded in number: on a hung file system each could leave a
// goroutine behind until it answers.
func TestBoundedReadsLimit(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // only bounds a broken test
	defer cancel()
	clk := testutil.NewFakeClock(time.Unix(1_700_000_000, 0))
	reads := fsutil.NewBoundedReads(clk, time.Second, 2)
	unstuck := make(chan struct{})
	stuck := func() ([]byte, error) { <-unstuck; return nil, nil }
	for i, path := range []string{"/mnt/a", "/mnt/b"} {
		done := make(chan error, 1)
		go func() { _, err := reads.Read(ctx, path, path, stuck); done <- err }()
		if err := clk.WaitForTimers(ctx, 1); err != nil {
			t.Fatal(err)
		}
		clk.Advance(time.Second)
		if err := <-done; !errors.Is(err, fsutil.ErrNoAnswer) {
			t.Fatalf("read %d: %v, want ErrNoAnswer", i, err)
		}
	}
	_, err := reads.Read(ctx, "/mnt/c", "/mnt/c", func() ([]byte, error) { t.Error("a third read started"); return nil, nil })
	if !errors.Is(err, fsutil.ErrTooManyReads) {
		t.Fatalf("third read: %v, want ErrTooManyReads", err)
	}
	close(unstuck)
	for {
		data, err := reads.Read(ctx, "/mnt/c", "/mnt/c", func() ([]byte, error) { return []byte("c"), nil })
		if err == nil && string(data) == "c" {
			break
		}
		if !errors.Is(err, fsutil.ErrTooManyReads) {
			t.Fatalf("read once the others answered: %q, %v", data, err)
		}
		runtime.Gosched() // the stuck reads are ending
	}
}
