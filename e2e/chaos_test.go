package e2e_test

// The fault suite (issue 14): each scenario runs the real binaries as processes, injects one kind
// of fault, and checks throughout that the Envoy-side client never receives an expired or
// mismatched certificate (sdsWatch) and that OUTPUT_CERTS is never partial or torn
// (outputWatch). `make test` runs the short form; `make chaos` the long one (-chaos.long).

import (
	"context"
	"crypto/x509"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds/sdsclient"
)

const chaosID = "spiffe://cluster.local/ns/default/sa/chaos"

func chaosWorkload(name string, ttl time.Duration) workload {
	return workload{name: name, namespace: "default", serviceAccount: "chaos", secretTTL: ttl}
}

// bundleOf reads the CA's trust bundle for the SDS checker, which runs off the test's goroutine.
func bundleOf(ca *chaosCA) func() []*x509.Certificate {
	return func() []*x509.Certificate {
		data, err := os.ReadFile(ca.rootFile())
		if err != nil {
			return nil
		}
		roots, _ := pki.ParseCertificates(data)
		return roots
	}
}

func isInService(rec map[string]any) bool { return rec["serial"] != nil }

const (
	inService       = "workload certificate in service"
	renewalFailed   = "workload certificate renewal failed; the current one keeps serving"
	noValidCert     = "no valid workload certificate: Envoy gets none until one is obtained"
	outputFailed    = "cannot write OUTPUT_CERTS; the agent is not ready until it can"
	outputRecovered = "OUTPUT_CERTS written again"
)

// 1. The CA is SIGKILLed during renewals and restarted on the same state dir and port: the agent
// keeps serving, retries and resumes, Envoy never holds an expired certificate, and the CA
// comes back with the same root.
func TestChaosCAKilledDuringRenewals(t *testing.T) {
	t.Parallel()
	ca := startChaosCA(t)
	roots := ca.roots(t)
	// Renewed every 4 s; each certificate has 4 s more, which a restart fits in.
	a := startAgent(t, ca.caProcess, chaosWorkload("ca-killed", 8*time.Second))
	sds := watchSDS(t, a.sdsSocket(), chaosID, 1, bundleOf(ca), false)

	kills := form(3, 12)
	for i := range kills {
		held, _ := sds.held()
		from := a.mark()
		var moment string
		switch i % 3 {
		case 0: // the CA has signed; the answer is on its way
			ca.awaitLog(t, "certificate issued", nil)
			moment = "with a certificate on its way"
		case 1: // the agent has just put a renewal in service
			a.awaitLogFrom(t, from, inService, isInService)
			moment = "right after a renewal"
		default:
			// A random moment of the renewal period: a deliberate choice of when, not a wait
			// for something to happen.
			time.Sleep(time.Duration(rand.Int64N(int64(4 * time.Second))))
			moment = "at a random moment"
		}
		ca.kill(t)
		if code, body := a.ready(t); code != http.StatusOK {
			t.Fatalf("kill %d (%s): the CA down, the agent holding a valid certificate answers %d %s", i, moment, code, body)
		}
		ca.launch(t)
		if got := ca.roots(t); len(got) != len(roots) || !got[0].Equal(roots[0]) {
			t.Fatalf("kill %d: the restarted CA has %d roots, not the one it had", i, len(got))
		}
		// The agent resumes with the restarted CA.
		next := sds.awaitNewDefault(t, held)
		t.Logf("kill %d %s: the agent went from %s to %s", i, moment, held, next)
	}
	if gaps := sds.expiredGaps(); len(gaps) > 0 {
		t.Errorf("Envoy held an expired certificate while the CA restarted:\n%s", strings.Join(gaps, "\n"))
	}
	if code, body := a.ready(t); code != http.StatusOK {
		t.Errorf("after the restarts: %d %s", code, body)
	}
	t.Logf("%d kills; %d certificates received; %v failed renewals", kills, sds.defaults(),
		metric(t, a.statusAddr, "meshid_agent_cert_renewal_failures_total"))
}

// 2. The CA is unreachable for longer than a certificate's life. What the agent promises
// (secretmanager, sds): it keeps the certificate in service until it expires; at expiry it says
// so (log, /healthz/ready 503, /debug/secrets, meshid_agent_cert_valid 0) and pushes nothing,
// so Envoy keeps what it has; a stream opened meanwhile waits, FetchSecrets is told why at once;
// with the CA back, the new certificate is pushed and the agent is ready again.
//
// Killed, the CA refuses connections; stopped (SIGSTOP), it accepts them and never answers, so
// that the agent's request is still waiting for its deadline when the certificate expires.
func TestChaosCAUnreachablePastExpiry(t *testing.T) {
	t.Parallel()
	t.Run("killed", func(t *testing.T) {
		t.Parallel()
		unreachablePastExpiry(t, false)
	})
	t.Run("stopped", func(t *testing.T) {
		t.Parallel()
		unreachablePastExpiry(t, true)
	})
}

func unreachablePastExpiry(t *testing.T, stopped bool) {
	ca := startChaosCA(t)
	a := startAgent(t, ca.caProcess, chaosWorkload("ca-unreachable", 4*time.Second))
	sds := watchSDS(t, a.sdsSocket(), chaosID, 1, bundleOf(ca), false)

	from := a.mark()
	if stopped {
		ca.signal(t, syscall.SIGSTOP)
	} else {
		ca.kill(t)
	}
	held, leaf := sds.held()
	receivedBefore := sds.defaults()
	expired := a.awaitLogFrom(t, from, noValidCert, nil)
	t.Logf("the CA down, the agent's certificate %s expired at %s: %s", held, leaf.NotAfter, expired["reason"])
	if stopped {
		if late := time.Since(leaf.NotAfter); late > 5*time.Second { // the CA client would have held it ~30 s
			t.Errorf("the agent said its certificate had expired %s after it did", late)
		}
	} else {
		// Longer past expiry in the long form: more failed attempts.
		for range form(1, 5) {
			from = a.awaitLogIndex(t, from, "cannot obtain a workload certificate")
		}
	}

	code, body := a.ready(t)
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "no valid workload certificate") || !strings.Contains(body, "expired") {
		t.Errorf("/healthz/ready with an expired certificate: %d %q; want 503 saying it expired", code, body)
	}
	st := a.debugSecret(t, "default")
	if st.Valid || !strings.Contains(st.Error, "expired") || (!stopped && !strings.Contains(st.Error, "CA unreachable")) {
		t.Errorf("/debug/secrets default: %+v; want not valid, expired, the CA unreachable", st)
	}
	if v := metric(t, a.statusAddr, "meshid_agent_cert_valid"); v != 0 {
		t.Errorf("meshid_agent_cert_valid = %v with an expired certificate", v)
	}
	// Envoy keeps what it has: nothing was pushed.
	if v, _ := sds.held(); v != held || sds.defaults() != receivedBefore {
		t.Errorf("the SDS client got %d pushes of default after the CA went (holds %s, had %s)", sds.defaults()-receivedBefore, v, held)
	}
	// FetchSecrets is answered at once with the reason.
	fetchErr := fetchDefault(t, a.sdsSocket())
	if status.Code(fetchErr) != codes.Unavailable || !strings.Contains(fetchErr.Error(), "expired") {
		t.Errorf("FetchSecrets default with an expired certificate: %v; want Unavailable saying it expired", fetchErr)
	}
	// A stream opened now gets ROOTCA, and default only once a valid one is had.
	late := openSDSWatch(t, a.sdsSocket(), chaosID, 1, bundleOf(ca), false)

	from = a.mark()
	if stopped {
		ca.signal(t, syscall.SIGCONT)
	} else {
		ca.launch(t)
	}
	next := sds.awaitNewDefault(t, held)
	back := a.awaitLogFrom(t, from, inService, isInService)
	if back["reason"] != "a valid certificate is held again" {
		t.Errorf("the agent's word for the new certificate: %v", back["reason"])
	}
	late.await(t, "the late stream's default", func() bool { return late.streams[0].leaf != nil })
	if first := late.firstDefault(); first == held {
		t.Errorf("a stream opened during the outage was sent the expired certificate %s", held)
	}
	if code, body := a.ready(t); code != http.StatusOK {
		t.Errorf("/healthz/ready with the CA back and %s held: %d %s", next, code, body)
	}
	if st := a.debugSecret(t, "default"); !st.Valid || st.Serial != next {
		t.Errorf("/debug/secrets default with the CA back: %+v; want %s, valid", st, next)
	}
	if v := metric(t, a.statusAddr, "meshid_agent_cert_valid"); v != 1 {
		t.Errorf("meshid_agent_cert_valid = %v with the CA back", v)
	}
}

// fetchDefault asks for default by FetchSecrets and returns the error.
func fetchDefault(t *testing.T, socket string) error {
	t.Helper()
	client, err := sdsclient.Dial(socket, sdsclient.WithNode(sdsNode(0)))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = client.Close() }()
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	_, err = client.Fetch(ctx, "default")
	return err
}

// 3. A CA behind a proxy that refuses connections (Unavailable), then holds them (the agent's
// deadline fires), then passes again: the agent keeps the certificate it holds, counts each
// failure, retries with backoff, and renews once the proxy passes.
func TestChaosSlowOrUnavailableCA(t *testing.T) {
	t.Parallel()
	ca := startChaosCA(t)
	proxy := startFaultProxy(t, ca.addr)
	// Valid 30 s and renewed 3 s in (ratio 0.9): the faults come at renewals, and a 10 s
	// deadline fits in the certificate's life.
	a := startAgentWith(t, ca.caProcess, chaosWorkload("ca-faulty", 30*time.Second), agentOptions{caAddr: proxy.addr, graceRatio: "0.9"})
	sds := watchSDS(t, a.sdsSocket(), chaosID, 1, bundleOf(ca), false)

	for cycle := range form(1, 3) {
		held, _ := sds.held()
		failures := metric(t, a.statusAddr, "meshid_agent_cert_renewal_failures_total")

		// Refused: Unavailable, at every retry.
		from := a.mark()
		proxy.set(refuse)
		for range 2 {
			var rec map[string]any
			from, rec = a.awaitLogRecord(t, from, renewalFailed, nil)
			if e := fmt.Sprint(rec["error"]); !strings.Contains(e, "Unavailable") {
				t.Errorf("cycle %d: a refused connection: %s", cycle, e)
			}
			checkBackoff(t, rec)
		}
		if n := metric(t, a.statusAddr, "meshid_agent_cert_renewal_failures_total"); n < failures+2 {
			t.Errorf("cycle %d: meshid_agent_cert_renewal_failures_total went from %v to %v over two refusals", cycle, failures, n)
		}

		// Held: the deadline fires.
		from = a.mark()
		proxy.set(hold)
		a.awaitLogFrom(t, from, "CA request failed; retrying", func(rec map[string]any) bool {
			return strings.Contains(fmt.Sprint(rec["error"]), "DeadlineExceeded")
		})
		if proxy.count(hold) == 0 {
			t.Errorf("cycle %d: no connection was held", cycle)
		}
		// Throughout, the certificate in service is the one held before.
		if v, leaf := sds.held(); v != held || time.Now().After(leaf.NotAfter) {
			t.Fatalf("cycle %d: Envoy holds %s (until %s); want %s, still valid", cycle, v, leaf.NotAfter, held)
		}
		if code, body := a.ready(t); code != http.StatusOK {
			t.Errorf("cycle %d: the CA failing, a valid certificate held: %d %s", cycle, code, body)
		}

		// Passing again: the agent renews.
		proxy.set(pass)
		next := sds.awaitNewDefault(t, held)
		t.Logf("cycle %d: %s renewed as %s after %v failures", cycle, held, next,
			metric(t, a.statusAddr, "meshid_agent_cert_renewal_failures_total")-failures)
	}
	if gaps := sds.expiredGaps(); len(gaps) > 0 {
		t.Errorf("Envoy held an expired certificate:\n%s", strings.Join(gaps, "\n"))
	}
}

// checkBackoff checks that a failed renewal is retried no sooner than the backoff's floor (the
// first interval, 1 s, less its 50% randomization).
func checkBackoff(t *testing.T, rec map[string]any) {
	t.Helper()
	at, err1 := time.Parse(time.RFC3339Nano, fmt.Sprint(rec["time"]))
	retry, err2 := time.Parse(time.RFC3339Nano, fmt.Sprint(rec["retry_at"]))
	if err1 != nil || err2 != nil {
		t.Fatalf("a failed renewal's record: %v", rec)
	}
	if d := retry.Sub(at); d < 400*time.Millisecond {
		t.Errorf("a failed renewal is retried %s later: no backoff", d)
	}
}

// 4. The agent is SIGKILLed at many moments, writing OUTPUT_CERTS or not, and restarted on the
// same root dir: the files are always one whole, matching generation; the restarted agent serves
// the pair on disk at once when it is still valid; generations left by a kill are removed at
// the next start, so there are never more than the current one and one unfinished.
func TestChaosAgentKilledMidWrite(t *testing.T) {
	t.Parallel()
	ca := startChaosCA(t)
	out := filepath.Join(t.TempDir(), "certs")
	// Renewed every 1.5 s, each renewal a write.
	a := startAgentWith(t, ca.caProcess, chaosWorkload("agent-killed", 3*time.Second), agentOptions{extraArgs: []string{"--output-certs", out}})
	files := watchOutput(t, func() string { return out }, chaosID)
	sds := watchSDS(t, a.sdsSocket(), chaosID, 1, bundleOf(ca), false)

	kills := form(4, 20)
	fromDisk := 0
	for i := range kills {
		from := a.mark()
		if i%2 == 0 {
			// The writer starts on the renewal as it is put in service.
			a.awaitLogFrom(t, from, inService, isInService)
		} else {
			// A random moment of the renewal period: a deliberate choice of when.
			time.Sleep(time.Duration(rand.Int64N(int64(1500 * time.Millisecond))))
		}
		a.kill(t)
		onDisk := files.check(t, out, chaosID)
		gens := generations(t, out)
		if len(gens) > 2 {
			t.Errorf("kill %d: %d generations in OUTPUT_CERTS: %v", i, len(gens), gens)
		}
		opened := sds.opened()
		restarted := time.Now()
		a.launch(t)
		first := a.awaitLog(t, inService, isInService)
		// Served at once from disk when still valid, by a margin that leaves no doubt.
		if onDisk.leaf != nil && onDisk.leaf.NotAfter.After(restarted.Add(time.Second)) {
			if first["source"] != "output-certs" || serialOf(first) != onDisk.leaf.SerialNumber.Text(16) {
				t.Errorf("kill %d: the restarted agent first served %v from %v; want %x from OUTPUT_CERTS, valid until %s",
					i, serialOf(first), first["source"], onDisk.leaf.SerialNumber, onDisk.leaf.NotAfter)
			} else {
				fromDisk++
			}
		}
		if len(gens) == 2 {
			a.awaitLog(t, "removed an unfinished OUTPUT_CERTS generation", nil)
		}
		sds.awaitReopened(t, opened)
	}
	t.Logf("%d kills; the restarted agent served OUTPUT_CERTS at once %d times; %d reads of OUTPUT_CERTS", kills, fromDisk, files.count())
}

// 5. OUTPUT_CERTS on a full, then a read-only, file system: the failure is logged and counted,
// /healthz/ready is 503 naming OUTPUT_CERTS, the files in place stay whole, SDS goes on
// renewing; with room (or writes) back, the files catch up and the agent is ready.
func TestChaosOutputCertsFullOrReadOnly(t *testing.T) {
	t.Parallel()
	ca := startChaosCA(t)
	a := startTmpfsAgent(t, ca.caProcess, chaosWorkload("output-tmpfs", 3*time.Second), agentOptions{})
	files := watchOutput(t, a.outputDir, chaosID)
	sds := watchSDS(t, a.sdsSocket(), chaosID, 1, bundleOf(ca), false)
	awaitReady(t, a.agentProcess)

	faults := []struct {
		name, errText string
		inject, lift  func() string
	}{
		{
			name: "full", errText: "no space left on device",
			inject: func() string { a.fill(t); return "filled" },
			lift: func() string {
				if err := os.Remove(filepath.Join(a.outputDir(), "filler")); err != nil {
					t.Fatal(err)
				}
				return "emptied"
			},
		},
		{
			name: "read-only", errText: "read-only file system",
			inject: func() string { return a.remount(t, true) },
			lift:   func() string { return a.remount(t, false) },
		},
	}
	for cycle := range form(1, 3) {
		for _, f := range faults {
			from := a.mark()
			writeFailures := metric(t, a.statusAddr, "meshid_agent_output_certs_write_failures_total")
			f.inject()
			before := files.check(t, a.outputDir(), chaosID)
			failed := a.awaitLogFrom(t, from, outputFailed, nil)
			if e := fmt.Sprint(failed["error"]); !strings.Contains(e, f.errText) {
				t.Errorf("%s %d: the write failed with %q; want %q", f.name, cycle, e, f.errText)
			}
			if n := metric(t, a.statusAddr, "meshid_agent_output_certs_write_failures_total"); n <= writeFailures {
				t.Errorf("%s %d: meshid_agent_output_certs_write_failures_total stayed at %v", f.name, cycle, n)
			}
			if code, body := a.ready(t); code != http.StatusServiceUnavailable || !strings.Contains(body, "OUTPUT_CERTS") || !strings.Contains(body, f.errText) {
				t.Errorf("%s %d: /healthz/ready %d %q; want 503 naming OUTPUT_CERTS and %q", f.name, cycle, code, body, f.errText)
			}
			// SDS goes on renewing, twice, while the files stay as they were.
			for range 2 {
				held, _ := sds.held()
				sds.awaitNewDefault(t, held)
			}
			if after := files.check(t, a.outputDir(), chaosID); after.generation != before.generation {
				t.Errorf("%s %d: OUTPUT_CERTS moved from %s to %s while it could not be written", f.name, cycle, before.generation, after.generation)
			}
			f.lift()
			a.awaitLogFrom(t, from, outputRecovered, nil)
			if code, body := a.ready(t); code != http.StatusOK {
				t.Errorf("%s %d lifted: /healthz/ready %d %s", f.name, cycle, code, body)
			}
			if now := files.check(t, a.outputDir(), chaosID); now.leaf == nil || now.leaf.SerialNumber.Cmp(before.leaf.SerialNumber) == 0 {
				t.Errorf("%s %d lifted: OUTPUT_CERTS still holds %s", f.name, cycle, before.generation)
			}
		}
	}
	t.Logf("%d reads of OUTPUT_CERTS", files.count())
}

// remount makes the tmpfs read-only or writable again, through the wrapper.
func (a *tmpfsAgent) remount(t *testing.T, readOnly bool) string {
	t.Helper()
	from := a.mark()
	sig := syscall.SIGUSR2
	if readOnly {
		sig = syscall.SIGUSR1
	}
	a.signal(t, sig)
	a.awaitLogFrom(t, from, "tmpfs remounted", func(rec map[string]any) bool { return rec["read_only"] == readOnly })
	return "remounted"
}

// awaitReady waits for /healthz/ready to answer 200.
func awaitReady(t *testing.T, a *agentProcess) {
	t.Helper()
	deadline := time.Now().Add(wait)
	for {
		code, body := a.ready(t)
		if code == http.StatusOK {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not ready within %s: %d %s", wait, code, body)
		}
		// Polling: nothing announces a successful write of OUTPUT_CERTS.
		time.Sleep(50 * time.Millisecond)
	}
}

// 6. The CA moves to a new root by the two-step plug-in while 100 SDS streams are open on one
// agent: every stream gets the new ROOTCA, then a default under the new root, and no stream ever
// holds a default its own ROOTCA does not verify.
func TestChaosRootRotationUnder100Streams(t *testing.T) {
	t.Parallel()
	ca := startChaosCA(t)
	a := startAgent(t, ca.caProcess, chaosWorkload("rotation", 4*time.Second))
	const streams = 100
	sds := watchSDS(t, a.sdsSocket(), chaosID, streams, nil, true)

	// The CA's own key material, to plug in first with the new root added.
	caCert := readFile(t, filepath.Join(ca.stateDir, "ca-cert.pem"))
	caKey := readFile(t, filepath.Join(ca.stateDir, "ca-key.pem"))
	chain := []byte(nil)
	current := ca.roots(t)[0]
	for r := range form(1, 3) {
		newRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: fmt.Sprintf("root %d", r+1)})
		newCA := newRoot.NewIntermediate(t, testutil.CAOptions{CommonName: fmt.Sprintf("intermediate %d", r+1)})

		// Step 1: the same signer, both roots trusted.
		ca.cacerts.Update(map[string][]byte{
			"ca-cert.pem":    caCert,
			"ca-key.pem":     caKey,
			"cert-chain.pem": chain,
			"root-cert.pem":  testutil.CertPEM(current, newRoot.Cert),
		})
		sds.await(t, fmt.Sprintf("rotation %d: every stream trusts both roots", r), func() bool {
			return sds.countLocked(func(s *watchedStream) bool {
				return slices.ContainsFunc(s.roots, current.Equal) && slices.ContainsFunc(s.roots, newRoot.Cert.Equal)
			}) == streams
		})

		// Step 2: the new CA signs.
		caCert, caKey = testutil.CertPEM(newCA.Cert), testutil.KeyPEM(t, newCA.Key)
		chain = testutil.CertPEM(newCA.Cert, newRoot.Cert)
		ca.cacerts.Update(map[string][]byte{
			"ca-cert.pem":    caCert,
			"ca-key.pem":     caKey,
			"cert-chain.pem": chain,
			"root-cert.pem":  testutil.CertPEM(newRoot.Cert),
		})
		sds.await(t, fmt.Sprintf("rotation %d: every stream holds a default under the new root", r), func() bool {
			return sds.countLocked(func(s *watchedStream) bool { return verifyTo(s.chain, []*x509.Certificate{newRoot.Cert}) == nil }) == streams
		})
		steps := sds.stepCounts(current, newRoot.Cert)
		t.Logf("rotation %d: streams that received both roots %d, a default under the new root %d, of %d", r, steps[0], steps[1], streams)
		if steps[0] != streams || steps[1] != streams {
			t.Errorf("rotation %d: %v of %d streams saw each step", r, steps, streams)
		}
		current = newRoot.Cert
	}
}
