package secretmanager

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/testutil"
)

// storm is one renewal storm: n agents' renewal loops (the Rotation source the agent runs, each
// with its own key and the agent's jitter and retry backoff) on one fake clock, all issued their
// certificate at t0, and a CA that is down from down to up, across their renewal time or part
// of it.
type storm struct {
	n                  int
	ttl                time.Duration
	ratio, jitter      float64
	down, up           time.Duration // after t0
	retryInit, retryMx time.Duration
	rand               func() float64 // nil: random, as in the agent
}

// stormResult is when each agent renewed (its first renewal), as delays after up: negative for
// one that renewed before the outage.
type stormResult struct {
	delays   []time.Duration // sorted
	attempts int             // calls to the CA, failed ones included
}

// run drives the clock from one moment some agent waits for to the next, each time only once
// every agent waits (its timer armed), until every agent has renewed.
func (s storm) run(b *testing.B) stormResult {
	b.Helper()
	clk := testutil.NewFakeClock(t0)
	signer := newFakeSigner(b, clk)
	var (
		mu      sync.Mutex
		renewed = map[int]time.Time{} // the first issue after t0, by agent
	)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	for i := range s.n {
		rot := &Rotation{
			Signer:           signer,
			Identity:         testID,
			TTL:              s.ttl,
			GraceRatio:       s.ratio,
			GraceRatioJitter: s.jitter,
			RetryInitial:     s.retryInit,
			RetryMax:         s.retryMx,
			Rand:             s.rand,
		}
		env := &sourceEnv{
			clock:   clk,
			log:     slog.New(slog.DiscardHandler),
			metrics: newMetrics(),
			event: func(ev Event) {
				if ev.Kind != EventIssued {
					return
				}
				now := clk.Now()
				mu.Lock()
				defer mu.Unlock()
				if _, ok := renewed[i]; !ok && now.After(t0) {
					renewed[i] = now
				}
			},
			set:  func(*Secret) {},
			fail: func(string, error) {},
		}
		run, err := rot.start(env)
		if err != nil {
			b.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := run(ctx); err != nil {
				b.Error(err)
			}
		}()
	}
	giveUp := time.Now().Add(5 * time.Minute) // real time: only a broken benchmark hangs
	for {
		changed := clk.Changed()
		now := clk.Now()
		deadlines := clk.Deadlines()
		live := len(deadlines)
		if live < s.n { // some agent is still at work: wait until it waits again
			select {
			case <-changed:
			case <-time.After(time.Until(giveUp)):
				b.Fatalf("%d of %d agents wait, at %s", live, s.n, now)
			}
			continue
		}
		mu.Lock()
		done := len(renewed) == s.n
		mu.Unlock()
		if done {
			break
		}
		// The CA's state at next, set while every agent waits.
		next := deadlines[0]
		switch at := next.Sub(t0); {
		case at >= s.down && at < s.up:
			signer.setErr(errCADown)
		default:
			signer.setErr(nil)
		}
		clk.Set(next)
	}
	res := stormResult{attempts: signer.Calls() - s.n}
	for _, at := range renewed {
		res.delays = append(res.delays, at.Sub(t0.Add(s.up)))
	}
	slices.Sort(res.delays)
	return res
}

// quantile of sorted durations (nearest rank).
func quantile(sorted []time.Duration, q float64) time.Duration {
	i := min(max(int(q*float64(len(sorted))+0.5)-1, 0), len(sorted)-1)
	return sorted[i]
}

// histogram draws the sorted delays in buckets of width, a # for every 10 agents (begun); the
// renewals before the CA's return, on schedule before its outage, are counted on one line.
func histogram(delays []time.Duration, width time.Duration) string {
	var sb strings.Builder
	row := func(label string, n int) {
		fmt.Fprintf(&sb, "%15s %5d %s\n", label, n, strings.Repeat("#", (n+9)/10))
	}
	before, _ := slices.BinarySearch(delays, 0)
	if before > 0 {
		row("before", before)
	}
	counts := map[int]int{}
	last := 0
	for _, d := range delays[before:] {
		counts[int(d/width)]++
		last = max(last, int(d/width))
	}
	for k := 0; k <= last; k++ {
		row(fmt.Sprintf("%s–%s", time.Duration(k)*width, time.Duration(k+1)*width), counts[k])
	}
	return sb.String()
}

// peak is the most renewals in any window of width.
func peak(sorted []time.Duration, width time.Duration) int {
	best, j := 0, 0
	for i := range sorted {
		for sorted[i]-sorted[j] >= width {
			j++
		}
		best = max(best, i-j+1)
	}
	return best
}

// BenchmarkRenewalStorm: 1,000 agents, each running the agent's renewal loop (Rotation, on a fake
// clock, with the agent's defaults: SECRET_TTL 24 h, SECRET_GRACE_PERIOD_RATIO 0.5 ± 0.01, retries
// from 1 s growing ×1.5 to 5 min, each wait spread ±50%), all issued their certificate at the same
// moment (a fleet deployed at once, the worst case), so that they renew at 12 h ± 14.4 min. The CA
// is down from 11 h to 13 h (across every agent's renewal time), or from 11:55 to 12:05 (in the
// middle of it). It reports when each agent renews, as the delay after the CA's return (negative:
// before the outage): p10/p50/p90/max, the most renewals in one second, and the calls each agent
// made to the CA, and logs the histogram. The baseline, in the same run, is the same storm with no
// jitter at all (renewal and retries), which piles up; "no-renewal-jitter" takes away
// SECRET_GRACE_PERIOD_RATIO_JITTER only.
func BenchmarkRenewalStorm(b *testing.B) {
	for _, outage := range []struct {
		name     string
		down, up time.Duration
		width    time.Duration // of the histogram's buckets
	}{
		{"outage-2h", 11 * time.Hour, 13 * time.Hour, time.Minute},
		{"outage-10m", 11*time.Hour + 55*time.Minute, 12*time.Hour + 5*time.Minute, 90 * time.Second},
	} {
		agent := storm{n: 1000, ttl: DefaultTTL, ratio: DefaultGraceRatio, jitter: DefaultGraceRatioJitter,
			down: outage.down, up: outage.up, retryInit: DefaultRetryInitial, retryMx: DefaultRetryMax}
		noRenewalJitter := agent
		noRenewalJitter.jitter = 0
		noJitter := noRenewalJitter
		noJitter.rand = func() float64 { return 0.5 } // the middle: no spread of the retries either
		for _, tc := range []struct {
			name string
			s    storm
		}{{"baseline-no-jitter", noJitter}, {"no-renewal-jitter", noRenewalJitter}, {"agent", agent}} {
			b.Run(outage.name+"/"+tc.name, func(b *testing.B) {
				for range b.N {
					res := tc.s.run(b)
					b.ReportMetric(quantile(res.delays, 0.1).Seconds(), "p10-s")
					b.ReportMetric(quantile(res.delays, 0.5).Seconds(), "p50-s")
					b.ReportMetric(quantile(res.delays, 0.9).Seconds(), "p90-s")
					b.ReportMetric(quantile(res.delays, 1).Seconds(), "max-s")
					b.ReportMetric(float64(peak(res.delays, time.Second)), "peak-per-s")
					b.ReportMetric(float64(res.attempts)/float64(tc.s.n), "calls/agent")
					b.Logf("renewals by delay after the CA's return (agents):\n%s", histogram(res.delays, outage.width))
				}
			})
		}
	}
}
