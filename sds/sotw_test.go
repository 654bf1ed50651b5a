package sds_test

import (
	"crypto"
	"crypto/x509"
	"strings"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"

	"github.com/meshid/meshid/internal/pki"
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

	s := h.openSotW(t)
	s.subscribe(dflt, rootCA)
	// On a cold cache the two may come in one response or two (each as soon as it exists).
	last, got := s.recvAll(dflt, rootCA)
	checkAll(t, got, d1, r1)
	if last.nonce == "" || last.version == "" {
		t.Fatalf("response without nonce (%q) or version_info (%q)", last.nonce, last.version)
	}

	// A stream on a warm cache gets both in its first response.
	warm := h.openSotW(t)
	warm.subscribe(dflt, rootCA)
	expect(t, warm.recv(), d1, r1)

	// ACK: no response. The next one is the rotation alone.
	s.ack(last, dflt, rootCA)
	d2 := p.workload(t)
	f.Publish(d2)
	p2 := s.recv()
	expect(t, p2, d2)
	if p2.version != d2.Version {
		t.Fatalf("version_info %q, want %q", p2.version, d2.Version)
	}
	if p2.nonce == last.nonce {
		t.Fatalf("nonce %q reused", p2.nonce)
	}

	// NACK of d2 (previous version, latest nonce): d2 is not sent again; the next response is d3.
	const detail = "Failed to load certificate chain from <inline>: test rejection"
	s.nack(p2, last.version, detail, dflt, rootCA)
	d3 := p.workload(t)
	f.Publish(d3)
	expect(t, s.recv(), d3)

	if n := h.nacks(t); n != 1 {
		t.Fatalf("meshid_sds_nacks_total = %v, want 1", n)
	}
	logs := h.logs.String()
	if !strings.Contains(logs, `error_detail="`+detail+`"`) || !strings.Contains(logs, "NACK") {
		t.Fatalf("the NACK was not logged with its error_detail:\n%s", logs)
	}
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

	s := h.openSotW(t)
	s.subscribe(dflt, rootCA)
	last, got := s.recvAll(dflt, rootCA)
	checkAll(t, got, d1, r1)

	// Add a file resource, drop ROOTCA: the added one comes, alone.
	s.ack(last, dflt, fileCert)
	added := s.recv()
	expect(t, added, fc)
	if subs := h.server.Subscriptions(); subs[rootCA] != 0 || subs[dflt] != 1 || subs[fileCert] != 1 {
		t.Fatalf("Subscriptions() = %v, want default and the file resource once, no ROOTCA", subs)
	}

	// ROOTCA changes: not pushed to this stream; the next response is the default rotation.
	s.ack(added, dflt, fileCert)
	f.Publish(p.roots(t, rootCA))
	d2 := p.workload(t)
	f.Publish(d2)
	expect(t, s.recv(), d2)
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
			other := h.openSotW(t)
			other.subscribe(rootCA)
			expect(t, other.recv(), r1)

			s := h.openSotW(t)
			s.subscribe(dflt)
			n1 := s.recv()
			expect(t, n1, d1)
			s.ack(n1, dflt)
			d2 := p.workload(t)
			f.Publish(d2)
			n2 := s.recv()
			expect(t, n2, d2)
			if tc.ackLatest {
				s.ack(n2, dflt)
			}

			// A request carrying N1 that adds ROOTCA is stale: ignored.
			s.send(&discovery.DiscoveryRequest{VersionInfo: n1.version, ResponseNonce: n1.nonce, ResourceNames: []string{dflt, rootCA}})
			// One carrying N2 that adds another name is honoured: the next response is that
			// name, not ROOTCA.
			s.send(&discovery.DiscoveryRequest{VersionInfo: n2.version, ResponseNonce: n2.nonce, ResourceNames: []string{dflt, spare}})
			n3 := s.recv()
			expect(t, n3, sp)
			// ROOTCA comes once a current request asks for it.
			s.send(&discovery.DiscoveryRequest{VersionInfo: n3.version, ResponseNonce: n3.nonce, ResourceNames: []string{dflt, rootCA, spare}})
			expect(t, s.recv(), r1)
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

	s := h.openSotW(t)
	s.send(&discovery.DiscoveryRequest{
		Node: &core.Node{Id: nodeID}, ResourceNames: []string{dflt},
		VersionInfo: "3f2a9c", ResponseNonce: "17",
	})
	expect(t, s.recv(), d1)
}

func TestSotWRotationReachesOnlySubscribers(t *testing.T) {
	t.Parallel()
	p, f := newPKI(t), newFakeSecrets()
	d1, r1 := p.workload(t), p.roots(t, rootCA)
	f.Publish(d1)
	f.Publish(r1)
	h := startServer(t, f)

	a, b := h.openSotW(t), h.openSotW(t)
	a.subscribe(dflt)
	b.subscribe(rootCA)
	pa, pb := a.recv(), b.recv()
	expect(t, pa, d1)
	expect(t, pb, r1)
	a.ack(pa, dflt)
	b.ack(pb, rootCA)

	d2 := p.workload(t)
	f.Publish(d2)
	expect(t, a.recv(), d2)
	// B's next response is its own ROOTCA change, not the default rotation.
	r2 := p.roots(t, rootCA)
	f.Publish(r2)
	expect(t, b.recv(), r2)
}

func TestStreamRefusesNames(t *testing.T) {
	t.Parallel()
	const (
		unknown   = "spiffe://cluster.local/ns/shop/sa/other"
		forbidden = "file-cert:/etc/shadow~/etc/ssh/ssh_host_ecdsa_key"
		oneMore   = "file-root:/etc/certs/root-257.pem"
	)
	for _, tc := range []struct {
		name   string
		delta  bool
		secret string
		code   codes.Code
	}{
		{name: "sotw unknown", secret: unknown, code: codes.InvalidArgument},
		{name: "sotw forbidden file", secret: forbidden, code: codes.PermissionDenied},
		{name: "delta unknown", delta: true, secret: unknown, code: codes.InvalidArgument},
		{name: "delta forbidden file", delta: true, secret: forbidden, code: codes.PermissionDenied},
		{name: "sotw file past the bound", secret: oneMore, code: codes.ResourceExhausted},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFakeSecrets()
			f.Refuse(unknown, secretmanager.ErrUnknownSecret)
			f.Refuse(forbidden, secretmanager.ErrForbiddenPath)
			f.Refuse(oneMore, secretmanager.ErrTooManyFiles)
			f.Publish(newPKI(t).workload(t))
			h := startServer(t, f)
			var st interface {
				Code() codes.Code
				Message() string
			}
			if tc.delta {
				d := h.openDelta(t)
				d.send(&discovery.DeltaDiscoveryRequest{Node: &core.Node{Id: nodeID}, ResourceNamesSubscribe: []string{dflt, tc.secret}})
				st = d.recvErr()
			} else {
				s := h.openSotW(t)
				s.subscribe(dflt, tc.secret)
				st = s.recvErr()
			}
			if st.Code() != tc.code || !strings.Contains(st.Message(), tc.secret) {
				t.Fatalf("stream ended with %v %q, want %v naming %s", st.Code(), st.Message(), tc.code, tc.secret)
			}
		})
	}
}

func TestStreamNeedsNode(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		delta bool
		node  *core.Node
	}{
		{name: "sotw without node"},
		{name: "sotw node without id", node: &core.Node{Cluster: "shop"}},
		{name: "delta without node", delta: true},
		{name: "delta node without id", delta: true, node: &core.Node{Cluster: "shop"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFakeSecrets()
			f.Publish(newPKI(t).workload(t))
			h := startServer(t, f)
			var code codes.Code
			if tc.delta {
				d := h.openDelta(t)
				d.send(&discovery.DeltaDiscoveryRequest{Node: tc.node, ResourceNamesSubscribe: []string{dflt}})
				code = d.recvErr().Code()
			} else {
				s := h.openSotW(t)
				s.send(&discovery.DiscoveryRequest{Node: tc.node, ResourceNames: []string{dflt}})
				code = s.recvErr().Code()
			}
			if code != codes.InvalidArgument {
				t.Fatalf("stream ended with %v, want InvalidArgument", code)
			}
		})
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
		{name: "not yet valid", secret: func(t *testing.T) *secretmanager.Secret {
			leaf, key := issue(t, now.Add(time.Hour), now.Add(2*time.Hour))
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
			s := h.openSotW(t)
			s.subscribe(dflt)
			first := s.recv()
			expect(t, first, d1)
			s.ack(first, dflt)

			bad := tc.secret(t)
			f.Publish(bad)
			d2 := p.workload(t)
			f.Publish(d2)
			expect(t, s.recv(), d2)
			if logs := h.logs.String(); !strings.Contains(logs, "invalid secret") || !strings.Contains(logs, bad.Version) {
				t.Fatalf("the refused secret %s was not logged:\n%s", bad.Version, logs)
			}
		})
		t.Run(tc.name+"/first", func(t *testing.T) {
			t.Parallel()
			f := newFakeSecrets()
			calls := f.Calls()
			h := startServer(t, f)
			s := h.openSotW(t)
			s.subscribe(dflt)
			// The stream is waiting for default (its watch is in place) when the invalid one
			// comes: it goes on waiting, and gets the valid one.
			if name := <-calls; name != dflt {
				t.Fatalf("generating %s, want %s", name, dflt)
			}
			f.Publish(tc.secret(t))
			d1 := p.workload(t)
			f.Publish(d1)
			expect(t, s.recv(), d1)
		})
	}
}
