//go:build linux

package main

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"

	"github.com/meshid/meshid/internal/testutil"
)

// contention keeps the file system of the temporary directory (where every agent's root dir is)
// busy, as other work on the same disk does: writers each write 32 MiB to a file of their own
// there and fsync it, over and over. The writes bypass the page cache (O_DIRECT) where the file
// system allows it: on two vCPUs, copying into the cache took a third of a CPU per writer, which
// would measure contention for the CPU rather than for the disk.
type contention struct {
	// gate is held shared by each writer for one file, and exclusively while paused: pause waits
	// for the files being written to be synced, and no new one starts until resume.
	gate   sync.RWMutex
	paused bool // by the benchmark's goroutine alone
	cancel context.CancelFunc
	wg     sync.WaitGroup
	errs   chan error
	chunk  []byte
	b      *testing.B
}

// diskContention starts writers goroutines of contention, paused; call resume.
func diskContention(b *testing.B, writers int) *contention {
	b.Helper()
	dir := testutil.ShortTempDir(b)
	// O_DIRECT needs an aligned buffer: an anonymous mapping is page-aligned.
	chunk, err := syscall.Mmap(-1, 0, 1<<20, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		b.Fatal(err)
	}
	for i := range chunk {
		chunk[i] = byte(i * 7) // not zeros: nothing below may skip them
	}
	ctx, cancel := context.WithCancel(b.Context())
	c := &contention{cancel: cancel, errs: make(chan error, writers), chunk: chunk, b: b}
	c.pause()
	for i := range writers {
		c.wg.Go(func() {
			path := filepath.Join(dir, "contention-"+strconv.Itoa(i))
			for {
				c.gate.RLock()
				if ctx.Err() != nil {
					c.gate.RUnlock()
					return
				}
				err := writeSyncedFile(ctx, path, chunk, 32)
				c.gate.RUnlock()
				if err != nil {
					c.errs <- err
					return
				}
			}
		})
	}
	return c
}

func (c *contention) resume() {
	if c.paused {
		c.paused = false
		c.gate.Unlock()
	}
}

func (c *contention) pause() {
	if !c.paused {
		c.gate.Lock()
		c.paused = true
	}
}

// stop ends the writers, paused or not (a measurement that failed leaves them running), and
// removes their files.
func (c *contention) stop() {
	c.cancel()
	c.resume()
	c.wg.Wait()
	_ = syscall.Munmap(c.chunk)
	select {
	case err := <-c.errs:
		c.b.Fatalf("disk contention: %v", err)
	default:
	}
}

// writeSyncedFile writes n copies of chunk to path (truncating it), directly when the file system
// allows it, syncs it and removes it.
func writeSyncedFile(ctx context.Context, path string, chunk []byte, n int) error {
	const flags = os.O_CREATE | os.O_WRONLY | os.O_TRUNC
	f, err := os.OpenFile(path, flags|syscall.O_DIRECT, 0o600)
	if errors.Is(err, syscall.EINVAL) { // tmpfs, for one
		f, err = os.OpenFile(path, flags, 0o600)
	}
	if err != nil {
		return err
	}
	defer func() { _ = os.Remove(path) }()
	for range n {
		if ctx.Err() != nil {
			break
		}
		if _, err := f.Write(chunk); err != nil {
			_ = f.Close()
			return err
		}
	}
	if err := f.Sync(); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}
