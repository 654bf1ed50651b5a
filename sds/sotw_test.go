package sds_test

import (
	"context"
	"crypto"
	"crypto/x509"
	"fmt"
	"strings"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds"
	"github.com/meshid/meshid/secretmanager"
)

// Silence after an ACK or a NACK is proven without waiting: the test publishes a new secret, and
// the stream's next response must be that one alone, not a re-send of what it had.

func TestSotWInitialACKAndNACK(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1, r1 := p.workload(t), p.roots(t, rootCA)
	f.Publish(d1)
	f.Publish(r1)
	h := startServer(t, f)

	s := h.sotw()
	s.Subscribe(dflt, rootCA)
	// Both are known: they come in one response.
	last := s.Recv()
	expect(t, last, d1, r1)

	// A second stream, on a cache that follows both names already, gets both at once too.
	warm := h.sotw()
	warm.Subscribe(dflt, rootCA)
	expect(t, warm.Recv(), d1, r1)

	// ACK: no response. The next one is the rotation alone.
	s.Ack(last, dflt, rootCA)
	d2 := p.workload(t)
	f.Publish(d2)
	p2 := s.Recv()
	expect(t, p2, d2)
	if p2.Version != d2.Version {
		t.Fatalf("version_info %q, want %q", p2.Version, d2.Version)
	}
	if p2.Nonce == last.Nonce {
		t.Fatalf("nonce %q reused", p2.Nonce)
	}

	// NACK of d2 (previous version, latest nonce): d2 is not sent again; the next response is d3.
	const detail = "Failed to load certificate chain from <inline>: test rejection"
	s.Nack(p2, last.Version, detail, dflt, rootCA)
	d3 := p.workload(t)
	f.Publish(d3)
	expect(t, s.Recv(), d3)

	if n := h.nacks(t); n != 1 {
		t.Fatalf("meshid_sds_nacks_total = %v, want 1", n)
	}
	// The NACK was logged before the request that carried it was answered with d3.
	logs := h.logs.String()
	if !strings.Contains(logs, `error_detail="`+detail+`"`) || !strings.Contains(logs, "NACK") {
		t.Fatalf("the NACK was not logged with its error_detail:\n%s", logs)
	}
	checkRefusals(t, h, map[string]float64{})
}

func TestSotWResubscribe(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1, r1 := p.workload(t), p.roots(t, rootCA)
	fc := p.workload(t)
	fc.Name = fileCert
	for _, s := range []*secretmanager.Secret{d1, r1, fc} {
		f.Publish(s)
	}
	h := startServer(t, f)

	s := h.sotw()
	s.Subscribe(dflt, rootCA)
	last, got := s.RecvAll(dflt, rootCA)
	checkAll(t, got, d1, r1)

	// Add a file resource, drop ROOTCA: the added one comes, alone.
	s.Ack(last, dflt, fileCert)
	added := s.Recv()
	expect(t, added, fc)
	if subs := h.server.Subscriptions(); subs[rootCA] != 0 || subs[dflt] != 1 || subs[fileCert] != 1 {
		t.Fatalf("Subscriptions() = %v, want default and the file resource once, no ROOTCA", subs)
	}

	// ROOTCA changes: not pushed to this stream; the next response is the default rotation.
	s.Ack(added, dflt, fileCert)
	f.Publish(p.roots(t, rootCA))
	d2 := p.workload(t)
	f.Publish(d2)
	expect(t, s.Recv(), d2)
}

func TestSotWStaleNonce(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		ackLatest bool // the stream acknowledged N2 before the stale request
	}{
		{name: "before the latest response is acknowledged"},
		{name: "after the latest response is acknowledged", ackLatest: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, f := newPKI(t), newFakeSecrets()
			d1, r1, sp := p.workload(t), p.roots(t, rootCA), p.roots(t, spare)
			for _, s := range []*secretmanager.Secret{d1, r1, sp} {
				f.Publish(s)
			}
			h := startServer(t, f)
			// Another stream brings ROOTCA into the cache, so that a request for it that
			// were honoured would be answered at once.
			other := h.sotw()
			other.Subscribe(rootCA)
			expect(t, other.Recv(), r1)

			s := h.sotw()
			s.Subscribe(dflt)
			n1 := s.Recv()
			expect(t, n1, d1)
			s.Ack(n1, dflt)
			d2 := p.workload(t)
			f.Publish(d2)
			n2 := s.Recv()
			expect(t, n2, d2)
			if tc.ackLatest {
				s.Ack(n2, dflt)
			}

			// A request carrying N1 that adds ROOTCA is stale: ignored.
			s.Send(&discovery.DiscoveryRequest{VersionInfo: n1.Version, ResponseNonce: n1.Nonce, ResourceNames: []string{dflt, rootCA}})
			// One carrying N2 that adds another name is honoured: the next response is that
			// name, not ROOTCA.
			s.Send(&discovery.DiscoveryRequest{VersionInfo: n2.Version, ResponseNonce: n2.Nonce, ResourceNames: []string{dflt, spare}})
			n3 := s.Recv()
			expect(t, n3, sp)
			// The stale request was counted as dropped (it was read before the one answered),
			// and the stream went on.
			checkRefusals(t, h, map[string]float64{"stale_nonce/dropped": 1})
			// ROOTCA comes once a current request asks for it.
			s.Send(&discovery.DiscoveryRequest{VersionInfo: n3.Version, ResponseNonce: n3.Nonce, ResourceNames: []string{dflt, rootCA, spare}})
			expect(t, s.Recv(), r1)
			checkRefusals(t, h, map[string]float64{"stale_nonce/dropped": 1})
		})
	}
}

// An agent restart leaves Envoy holding a nonce the new server never sent (spire#813): the first
// request on a stream is answered whatever nonce it carries.
func TestSotWFirstRequestWithUnknownNonce(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1 := p.workload(t)
	f.Publish(d1)
	h := startServer(t, f)

	s := h.sotw()
	s.Send(&discovery.DiscoveryRequest{
		Node: &core.Node{Id: nodeID}, ResourceNames: []string{dflt},
		VersionInfo: "3f2a9c", ResponseNonce: "17",
	})
	expect(t, s.Recv(), d1)
	checkRefusals(t, h, map[string]float64{})
}

func TestSotWRotationReachesOnlySubscribers(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1, r1 := p.workload(t), p.roots(t, rootCA)
	f.Publish(d1)
	f.Publish(r1)
	h := startServer(t, f)

	a, b := h.sotw(), h.sotw()
	a.Subscribe(dflt)
	b.Subscribe(rootCA)
	pa, pb := a.Recv(), b.Recv()
	expect(t, pa, d1)
	expect(t, pb, r1)
	a.Ack(pa, dflt)
	b.Ack(pb, rootCA)

	d2 := p.workload(t)
	f.Publish(d2)
	expect(t, a.Recv(), d2)
	// B's next response is its own ROOTCA change, not the default rotation.
	r2 := p.roots(t, rootCA)
	f.Publish(r2)
	expect(t, b.Recv(), r2)
}

// Every refusal ends the stream (or the fetch) with its code, names the secret refused, and is
// counted once in meshid_sds_refusals_total by reason and code. The stale nonce, which is dropped
// while the stream goes on, is in TestSotWStaleNonce.
func TestRefusals(t *testing.T) {
	t.Parallel()
	const (
		unknown   = "spiffe://cluster.local/ns/shop/sa/other"
		forbidden = "file-cert:/etc/shadow~/etc/ssh/ssh_host_ecdsa_key"
		oneMore   = "file-root:/etc/certs/root-257.pem"
	)
	for _, r := range []struct {
		name   string
		secret string     // the name refused; "" for a missing node
		node   *core.Node // sent instead of the Envoy's when secret is ""
		code   codes.Code
		reason string
	}{
		{name: "missing node", code: codes.InvalidArgument, reason: "missing_node"},
		{name: "node without id", node: &core.Node{Cluster: "shop"}, code: codes.InvalidArgument, reason: "missing_node"},
		{name: "unknown name", secret: unknown, code: codes.InvalidArgument, reason: "unknown_name"},
		{name: "forbidden file", secret: forbidden, code: codes.PermissionDenied, reason: "forbidden_path"},
		{name: "file past the bound", secret: oneMore, code: codes.ResourceExhausted, reason: "too_many_secrets"},
	} {
		for _, protocol := range []string{"sotw", "delta", "fetch"} {
			t.Run(protocol+"/"+r.name, func(t *testing.T) {
				t.Parallel()
				f := newFakeSecrets()
				f.Refuse(unknown, secretmanager.ErrUnknownSecret)
				f.Refuse(forbidden, secretmanager.ErrForbiddenPath)
				f.Refuse(oneMore, secretmanager.ErrTooManyFiles)
				d1 := newPKI(t).workload(t)
				f.Publish(d1)
				h := startServer(t, f)
				names := []string{dflt}
				if r.secret != "" {
					names = append(names, r.secret)
				} else {
					h.envoy.Node = r.node
				}
				var st *status.Status
				switch protocol {
				case "sotw":
					s := h.sotw()
					s.Subscribe(names...)
					st = s.RecvErr()
				case "delta":
					d := h.delta()
					d.Subscribe(names...)
					st = d.RecvErr()
				case "fetch":
					ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
					defer cancel()
					_, err := h.envoy.Fetch(ctx, names...)
					if err == nil {
						t.Fatal("FetchSecrets answered")
					}
					st = status.Convert(err)
				}
				if st.Code() != r.code || !strings.Contains(st.Message(), r.secret) {
					t.Fatalf("ended with %v %q, want %v naming %q", st.Code(), st.Message(), r.code, r.secret)
				}
				checkRefusals(t, h, map[string]float64{r.reason + "/" + r.code.String(): 1})
			})
		}
	}
}

// Nothing invalid is ever pushed (istio#49575): neither after a valid secret nor as the first one.
func TestInvalidSecretsAreNotPushed(t *testing.T) {
	t.Parallel()
	p := newPKI(t)
	issue := func(t *testing.T, notBefore, notAfter time.Time) (*x509.Certificate, crypto.Signer) {
		key, err := pki.GenerateKey(pki.ECDSA, 0)
		if err != nil {
			t.Fatal(err)
		}
		return p.root.Issue(t, &x509.Certificate{NotBefore: notBefore, NotAfter: notAfter, KeyUsage: x509.KeyUsageDigitalSignature}, key.Public()), key
	}
	now := time.Now()
	for _, tc := range []struct {
		name   string
		secret func(t *testing.T) *secretmanager.Secret
	}{
		{name: "key does not match the leaf", secret: func(t *testing.T) *secretmanager.Secret {
			leaf, _ := issue(t, now.Add(-time.Hour), now.Add(time.Hour))
			_, other := issue(t, now.Add(-time.Hour), now.Add(time.Hour))
			return keyPair(t, dflt, []*x509.Certificate{leaf, p.root.Cert}, other)
		}},
		{name: "expired", secret: func(t *testing.T) *secretmanager.Secret {
			leaf, key := issue(t, now.Add(-2*time.Hour), now.Add(-time.Hour))
			return keyPair(t, dflt, []*x509.Certificate{leaf, p.root.Cert}, key)
		}},
		// A NotBefore minutes or hours ahead is our clock behind the CA's, and is sent; days ahead
		// is a wrong clock.
		{name: "not valid for days", secret: func(t *testing.T) *secretmanager.Secret {
			leaf, key := issue(t, now.Add(pki.MaxClockSkew+time.Hour), now.Add(pki.MaxClockSkew+2*time.Hour))
			return keyPair(t, dflt, []*x509.Certificate{leaf, p.root.Cert}, key)
		}},
		{name: "key without chain", secret: func(t *testing.T) *secretmanager.Secret {
			_, key := issue(t, now.Add(-time.Hour), now.Add(time.Hour))
			s := keyPair(t, dflt, nil, key)
			s.Version = "key-only"
			return s
		}},
		{name: "chain without key", secret: func(t *testing.T) *secretmanager.Secret {
			leaf, _ := issue(t, now.Add(-time.Hour), now.Add(time.Hour))
			return keyPair(t, dflt, []*x509.Certificate{leaf}, nil)
		}},
		{name: "trust bundle without roots", secret: func(*testing.T) *secretmanager.Secret {
			return &secretmanager.Secret{Name: dflt, Bundle: &secretmanager.TrustBundle{}, Version: "no-roots"}
		}},
		{name: "empty", secret: func(*testing.T) *secretmanager.Secret {
			return &secretmanager.Secret{Name: dflt, Version: "empty"}
		}},
	} {
		t.Run(tc.name+"/after a valid one", func(t *testing.T) {
			t.Parallel()
			f := newFakeSecrets()
			d1 := p.workload(t)
			f.Publish(d1)
			h := startServer(t, f)
			s := h.sotw()
			s.Subscribe(dflt)
			first := s.Recv()
			expect(t, first, d1)
			s.Ack(first, dflt)

			bad := tc.secret(t)
			f.Publish(bad)
			// Publish returns once the server has taken the state: the refusal is logged.
			if logs := h.logs.String(); !strings.Contains(logs, "invalid secret") || !strings.Contains(logs, bad.Version) {
				t.Fatalf("the refused secret %s was not logged:\n%s", bad.Version, logs)
			}
			d2 := p.workload(t)
			f.Publish(d2)
			expect(t, s.Recv(), d2)
		})
		t.Run(tc.name+"/first", func(t *testing.T) {
			t.Parallel()
			f := newFakeSecrets()
			r1 := p.roots(t, rootCA)
			f.Publish(r1)
			h := startServer(t, f)
			s := h.sotw()
			s.Subscribe(dflt, rootCA)
			// ROOTCA alone: the stream waits for default, which the server follows.
			first := s.Recv()
			expect(t, first, r1)
			s.Ack(first, dflt, rootCA)
			f.Publish(tc.secret(t))
			// Fetch is not given it either: it is told there is nothing to serve.
			ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
			defer cancel()
			if _, err := h.envoy.Fetch(ctx, dflt); status.Code(err) != codes.Unavailable {
				t.Fatalf("FetchSecrets after an invalid secret: %v, want Unavailable", err)
			}
			d1 := p.workload(t)
			f.Publish(d1)
			expect(t, s.Recv(), d1)
		})
	}
}

// Attack: every name a client asks for once used to keep its subscription to the secret manager
// for the agent's life (for file secrets: a file read and watched, one of 256 places). A name no
// stream has watched for a while is released when a new name comes; streams still open are
// served as before.
func TestNamesNoStreamWatchesAreReleased(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	f.Publish(p.workload(t))
	f.Publish(p.roots(t, rootCA))
	f.Publish(p.roots(t, spare))
	clk := testutil.NewFakeClock(time.Now())
	h := startServer(t, f, func(c *sds.Config) { c.Clock = clk })

	kept := h.sotw()
	kept.Subscribe(rootCA)
	kept.Ack(kept.Recv(), rootCA) // its next watch stays open

	gone := h.sotw()
	gone.Subscribe(spare)
	gone.Recv()
	gone.CloseSend()
	gone.RecvErr() // the server has ended it

	// Each new name makes the cache look for idle ones; the closed stream's watch ends on the
	// server's side in its own time, so look again with another name until it has.
	for i := 0; f.Active(spare) > 0; i++ {
		if i == 50 {
			t.Fatalf("%s still subscribed after %d new names, each a minute apart", spare, i)
		}
		clk.Advance(2 * time.Minute)
		fresh := fmt.Sprintf("file-root:/etc/certs/fresh-%d.pem", i)
		h.sotw().Subscribe(fresh)
		f.awaitActive(t, fresh, 1)
	}
	// The stream that stayed is still served its rotations.
	r2 := p.roots(t, rootCA)
	f.Publish(r2)
	expect(t, kept.Recv(), r2)

	// A stream that comes back for the released name is served again.
	again := h.sotw()
	again.Subscribe(spare)
	if p := again.Recv(); p.Secrets[spare] == nil {
		t.Fatalf("after the release, %s was answered with %v", spare, p.Names())
	}
}

// An ACK that names the stream's secrets in another order, twice, or with the wildcard leaves
// the subscription as it is (and is answered without the cache); one that names fewer takes
// the others off the stream.
func TestSotWACKKeepsOrChangesSubscription(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1, r1 := p.workload(t), p.roots(t, rootCA)
	f.Publish(d1)
	f.Publish(r1)
	h := startServer(t, f)

	s := h.sotw()
	s.Subscribe(dflt, rootCA)
	last := s.Recv()
	expect(t, last, d1, r1)
	s.Ack(last, rootCA, "*", dflt, rootCA)
	// Nothing was answered: the next response is the rotation alone.
	d2 := p.workload(t)
	f.Publish(d2)
	last = s.Recv()
	expect(t, last, d2)
	if got := h.server.Subscriptions(); got[dflt] != 1 || got[rootCA] != 1 {
		t.Fatalf("subscriptions %v, want one stream on each of %s and %s", got, dflt, rootCA)
	}

	// Without ROOTCA: a new trust bundle does not reach the stream, the next key pair does.
	s.Ack(last, dflt)
	f.Publish(p.roots(t, rootCA))
	d3 := p.workload(t)
	f.Publish(d3)
	expect(t, s.Recv(), d3)
	if got := h.server.Subscriptions(); got[dflt] != 1 || got[rootCA] != 0 {
		t.Fatalf("subscriptions %v, want one stream on %s and none on %s", got, dflt, rootCA)
	}
	checkRefusals(t, h, map[string]float64{})
}
