package secretmanager

import (
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// A CA whose clock is ahead of ours (by minutes or hours: a clock kept in a local time zone)
// returns a certificate whose NotBefore lies in our future: it is served, with a warning, and
// renewed when half the lifetime the CA gave is over, counted from receipt. A CA behind us leaves
// less of it on our clock, and the renewal comes within that. Further ahead than
// pki.MaxClockSkew is a wrong clock, and one already expired on our clock is no use: both are
// refused and retried.
func TestRotationWithTheCAClockSkewed(t *testing.T) {
	t.Parallel()
	const ttl = time.Hour // newEnv's; its grace ratio is 0.5 here
	for _, tc := range []struct {
		name string
		skew time.Duration // of the CA's clock, ahead of ours
		// renewAfter is the delay from receipt to the renewal; zero when refused with want.
		renewAfter time.Duration
		warned     bool
		want       string
	}{
		{name: "in step", renewAfter: ttl / 2},
		{name: "ahead less than the backdating", skew: time.Minute, renewAfter: (ttl + time.Minute) / 2},
		{name: "ahead 5m", skew: 5 * time.Minute, renewAfter: (ttl + 2*time.Minute) / 2, warned: true},
		{name: "ahead 30m", skew: 30 * time.Minute, renewAfter: (ttl + 2*time.Minute) / 2, warned: true},
		{name: "ahead a day", skew: pki.MaxClockSkew + 2*time.Minute, renewAfter: (ttl + 2*time.Minute) / 2, warned: true},
		{name: "ahead more than a day", skew: pki.MaxClockSkew + 2*time.Minute + time.Second, want: pki.ErrClockBehind.Error()},
		{name: "behind 30m", skew: -30 * time.Minute, renewAfter: (ttl - 30*time.Minute) / 2},
		{name: "behind more than the TTL", skew: -ttl, want: "valid from"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.rot.GraceRatioJitter = 0
			e.signer.clock = testutil.NewFakeClock(t0.Add(tc.skew))
			r := e.start()
			if tc.want != "" {
				ev := e.failure(0)
				if !strings.Contains(ev.Err.Error(), tc.want) || !strings.Contains(ev.Err.Error(), "unusable certificate") {
					t.Fatalf("the attempt reported %v, want a refusal naming %q", ev.Err, tc.want)
				}
				if tc.skew > 0 && !errors.Is(ev.Err, pki.ErrClockBehind) {
					t.Errorf("%v does not wrap pki.ErrClockBehind", ev.Err)
				}
				ready(t, r.m, false, tc.want)
				return
			}
			s := r.next(t)
			ready(t, r.m, true)
			if got := s.RenewAt.Sub(s.Received); got != tc.renewAfter {
				t.Errorf("renewal %s after receipt, want %s", got, tc.renewAfter)
			}
			if !s.RenewAt.Before(s.NotAfter()) {
				t.Errorf("renewal at %s, not before NotAfter %s on our clock", s.RenewAt, s.NotAfter())
			}
			warnings := e.logs.matching(func(rec logRecord) bool {
				return rec.level == slog.LevelWarn && strings.Contains(rec.msg, "clock is ahead")
			})
			if got := len(warnings) == 1; got != tc.warned {
				t.Errorf("%d warnings of the CA's clock ahead, want warned=%v", len(warnings), tc.warned)
			}
			e.signer.clock.Set(t0.Add(tc.skew).Add(tc.renewAfter))
			if ev := e.attempt(s.RenewAt); ev.Kind != EventIssued {
				t.Fatalf("no renewal at RenewAt: %+v", ev)
			}
			if renewed := r.next(t); renewed.Version == s.Version {
				t.Fatal("renewal kept the serial")
			}
		})
	}
}
