package sds_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"

	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/sds/sdstest"
)

// logLines returns the lines of logs whose message is msg.
func logLines(logs, msg string) []string {
	var out []string
	for _, line := range strings.Split(logs, "\n") {
		if strings.Contains(line, `msg="`+msg+`"`) {
			out = append(out, line)
		}
	}
	return out
}

// Attack: a repeated NACK logged its whole error_detail every time. A NACK is logged once per
// response it rejects (version and nonce) on a stream, however often it is repeated, and what the
// client chose (error_detail, node, names) is logged bounded.
func TestNackFloodLogsOnce(t *testing.T) {
	t.Parallel()
	const repeats = 1000
	detail := "Failed to load certificate chain: " + strings.Repeat("x", 8<<10)
	node := &core.Node{Id: strings.Repeat("n", 10<<10)}
	for _, tc := range []struct {
		name string
		// flood subscribes to default, NACKs the response repeats times, then asks for spare
		// too and returns the response (every NACK was read before it).
		flood func(t *testing.T, h *harness) sdstest.Push
	}{
		{"sotw", func(t *testing.T, h *harness) sdstest.Push {
			s := h.sotw()
			s.Subscribe(dflt)
			first := s.Recv()
			for range repeats {
				s.Nack(first, "", detail, dflt)
			}
			s.Ack(first, dflt, spare)
			return s.Recv()
		}},
		{"delta", func(t *testing.T, h *harness) sdstest.Push {
			d := h.delta()
			d.Subscribe(dflt)
			first := d.Recv()
			for range repeats {
				d.Nack(first, detail)
			}
			d.Update(first, []string{spare}, nil)
			return d.Recv()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, f := newPKI(t), newFakeSecrets()
			sp := p.roots(t, spare)
			f.Publish(p.workload(t))
			f.Publish(sp)
			h := startServer(t, f)
			h.envoy.Node = node
			expect(t, tc.flood(t, h), sp)
			lines := logLines(h.logs.String(), "Envoy rejected secrets (NACK); not sending them again until they change")
			if len(lines) != 1 {
				t.Fatalf("%d identical NACKs logged %d lines, want 1", repeats, len(lines))
			}
			if len(lines[0]) > 2000 || !strings.Contains(lines[0], "bytes)") {
				t.Fatalf("the NACK's line is %d bytes:\n%.1000s", len(lines[0]), lines[0])
			}
			if n := h.nacks(t); n != 1 {
				t.Fatalf("meshid_sds_nacks_total = %v, want 1", n)
			}
		})
	}
}

// Attack: each refusal was logged, so a client refused in a loop filled the disk. Every refusal
// is counted, but each reason is logged a few times at once and then once a second (on the
// server's clock), the next line saying how many were left out.
func TestRefusalFloodLogsBounded(t *testing.T) {
	t.Parallel()
	const flood = 10000
	p, f := newPKI(t), newFakeSecrets()
	d1, r1, sp := p.workload(t), p.roots(t, rootCA), p.roots(t, spare)
	f.Publish(d1)
	f.Publish(r1)
	f.Publish(sp)
	clk := testutil.NewFakeClock(time.Now())
	h := startServer(t, f, func(c *sds.Config) { c.Clock = clk })
	s := h.sotw()
	s.Subscribe(dflt)
	n1 := s.Recv()
	s.Ack(n1, dflt)
	d2 := p.workload(t)
	f.Publish(d2)
	n2 := s.Recv()
	expect(t, n2, d2)

	// Requests answering n1 are stale, each one refused (dropped); one answering n2 is taken,
	// and its answer comes after every request before it was read.
	stale := func() {
		s.Send(&discovery.DiscoveryRequest{VersionInfo: n1.Version, ResponseNonce: n1.Nonce, ResourceNames: []string{dflt, rootCA}})
	}
	for range flood {
		stale()
	}
	s.Ack(n2, dflt, spare)
	n3 := s.Recv()
	expect(t, n3, sp)
	checkRefusals(t, h, map[string]float64{"stale_nonce/dropped": flood})
	lines := logLines(h.logs.String(), "SDS request refused")
	if len(lines) == 0 || len(lines) > 20 {
		t.Fatalf("%d refusals logged %d lines, want a few", flood, len(lines))
	}

	// A second later, the next refusal is logged, with how many were left out.
	clk.Advance(time.Second)
	stale()
	s.Ack(n3, dflt, spare, rootCA)
	expect(t, s.Recv(), r1)
	checkRefusals(t, h, map[string]float64{"stale_nonce/dropped": flood + 1})
	after := logLines(h.logs.String(), "SDS request refused")
	if want := fmt.Sprintf("dropped=%d", flood-len(lines)); len(after) != len(lines)+1 || !strings.Contains(after[len(after)-1], want) {
		t.Fatalf("after a second, %d more lines, the last %q; want one saying %s", len(after)-len(lines), after[len(after)-1], want)
	}
}
