package agent_test

import (
	"context"
	"errors"
	"os"
	"runtime"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds/sdsclient"
)

// processCounts is what a leak shows in: this process's goroutines and open file descriptors.
type processCounts struct{ goroutines, fds int }

func countProcess(t *testing.T) processCounts {
	t.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd to count file descriptors in: %v", err)
	}
	return processCounts{goroutines: runtime.NumGoroutine(), fds: len(fds)}
}

// sdsConnectOnce is what an Envoy that starts and stops does to the agent: a new connection, a
// StreamSecrets for "default", the first response, and the connection closed.
func sdsConnectOnce(ctx context.Context, socket string) error {
	c, err := sdsclient.Dial(socket, sdsclient.WithNode(&core.Node{Id: "churn"}))
	if err != nil {
		return err
	}
	defer func() { _ = c.Close() }()
	s, err := c.StreamSecrets(ctx)
	if err != nil {
		return err
	}
	if err := s.Subscribe("default"); err != nil {
		return err
	}
	resp, err := s.Recv()
	if err == nil && len(resp.Secrets) != 1 {
		err = errors.New("the first response does not hold the default secret")
	}
	return err
}

// 500 SDS connects and disconnects (20 at a time) leave nothing behind in the agent: the
// goroutines and file descriptors of this process (the agent and its clients) come back to what
// they were after the first. BenchmarkStreamChurn in cmd/meshid-agent does 10,000 against the
// agent's binary. Not parallel: the counts are the whole process's.
func TestSDSConnectChurnLeaksNothing(t *testing.T) {
	const cycles, concurrency = 500, 20
	// A goroutine or descriptor of a closed connection may still be on its way out when the
	// counts are read before; none may remain once they settle.
	const tolerance = 0
	ca := testutil.NewRootCA(t, testutil.CAOptions{})
	cfg := testConfig(t, newFakeClock(), nil, nil)
	cfg.SDS.CredentialsDir = credentialsDir(t, newCredentials(t, ca, "spiffe://cluster.local/ns/shop/sa/cart"))
	a := newAgent(t, cfg)
	runAgent(t, a)
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	// The first connect creates what lasts (the subscription's machinery, grpc's): the baseline
	// is after it, once the counts stop moving.
	if err := sdsConnectOnce(ctx, a.SocketPath()); err != nil {
		t.Fatal(err)
	}
	before := settleCounts(t, nil, 0)

	var (
		next, failed atomic.Int64
		first        error
		once         sync.Once
		wg           sync.WaitGroup
	)
	for range concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= cycles {
				if err := sdsConnectOnce(ctx, a.SocketPath()); err != nil {
					failed.Add(1)
					once.Do(func() { first = err })
				}
			}
		}()
	}
	wg.Wait()
	if n := failed.Load(); n > 0 {
		t.Fatalf("%d of %d connects failed; the first: %v", n, cycles, first)
	}
	settleCounts(t, &before, tolerance)
}

// settleCounts waits until the counts are within tolerance of base (nil: until two readings in a
// row agree) and returns them. Goroutines told to end take a moment to do so; the real-time limit
// only fails a test in which some never do, and the goroutines then are in its message.
func settleCounts(t *testing.T, base *processCounts, tolerance int) processCounts {
	t.Helper()
	limit := time.Now().Add(wait)
	last := countProcess(t)
	for {
		runtime.Gosched()
		c := countProcess(t)
		if (base == nil && c == last) || (base != nil && c.goroutines <= base.goroutines+tolerance && c.fds <= base.fds+tolerance) {
			return c
		}
		if time.Now().After(limit) {
			var dump strings.Builder
			_ = pprof.Lookup("goroutine").WriteTo(&dump, 1)
			if base == nil {
				t.Fatalf("the counts did not settle in %s: %+v, then %+v", wait, last, c)
			}
			t.Fatalf("leak: %d goroutines and %d file descriptors %s after the churn, %d and %d before (tolerance %d):\n%s",
				c.goroutines, c.fds, wait, base.goroutines, base.fds, tolerance, dump.String())
		}
		last = c
	}
}
