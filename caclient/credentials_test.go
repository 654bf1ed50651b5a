package caclient_test

import (
	"context"
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/internal/istio"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// writePair writes chain and key as a workload key pair into dir (created if missing).
func writePair(t *testing.T, dir string, chain []*x509.Certificate, key crypto.Signer) {
	t.Helper()
	testutil.WriteFiles(t, dir, map[string][]byte{
		istio.CertChainFile: testutil.CertPEM(chain...),
		istio.KeyFile:       testutil.KeyPEM(t, key),
	})
}

// testPair is a workload key pair from a test root (not the mesh CA), valid for an hour.
type testPair struct {
	chain []*x509.Certificate
	key   crypto.Signer
}

func newTestPair(t *testing.T, root *testutil.CA, id pki.SPIFFEID) testPair {
	t.Helper()
	leaf, key := root.IssueWorkload(t, id.String(), time.Hour)
	return testPair{chain: []*x509.Certificate{leaf, root.Cert}, key: key}
}

func TestLoadKeyPair(t *testing.T) {
	t.Parallel()
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	me, other := spiffeID("ns1", "me"), spiffeID("ns1", "other")
	mine, theirs := newTestPair(t, root, me), newTestPair(t, root, other)
	leaf := mine.chain[0]

	tests := []struct {
		name     string
		files    map[string][]byte // nil: the directory does not exist
		spiffeID string
		now      time.Time
		wantErr  []string // substrings; nil for success
	}{
		{
			name:     "valid pair for our identity",
			files:    map[string][]byte{istio.CertChainFile: testutil.CertPEM(mine.chain...), istio.KeyFile: testutil.KeyPEM(t, mine.key)},
			spiffeID: me.String(),
		},
		{
			name:  "any identity when none is asked for",
			files: map[string][]byte{istio.CertChainFile: testutil.CertPEM(theirs.chain...), istio.KeyFile: testutil.KeyPEM(t, theirs.key)},
		},
		{
			name:     "another identity",
			files:    map[string][]byte{istio.CertChainFile: testutil.CertPEM(theirs.chain...), istio.KeyFile: testutil.KeyPEM(t, theirs.key)},
			spiffeID: me.String(),
			wantErr:  []string{"does not name " + me.String()},
		},
		{
			name:     "expired",
			files:    map[string][]byte{istio.CertChainFile: testutil.CertPEM(mine.chain...), istio.KeyFile: testutil.KeyPEM(t, mine.key)},
			spiffeID: me.String(),
			now:      leaf.NotAfter.Add(time.Minute),
			wantErr:  []string{"valid from", "not at"},
		},
		{
			name:     "not yet valid",
			files:    map[string][]byte{istio.CertChainFile: testutil.CertPEM(mine.chain...), istio.KeyFile: testutil.KeyPEM(t, mine.key)},
			spiffeID: me.String(),
			now:      leaf.NotBefore.Add(-time.Minute),
			wantErr:  []string{"valid from", "not at"},
		},
		{
			name:     "mismatched key",
			files:    map[string][]byte{istio.CertChainFile: testutil.CertPEM(mine.chain...), istio.KeyFile: testutil.KeyPEM(t, theirs.key)},
			spiffeID: me.String(),
			wantErr:  []string{"key does not match"},
		},
		{
			name:    "missing directory",
			wantErr: []string{istio.CertChainFile, "no such file"},
		},
		{
			name:    "missing key",
			files:   map[string][]byte{istio.CertChainFile: testutil.CertPEM(mine.chain...)},
			wantErr: []string{istio.KeyFile, "no such file"},
		},
		{
			name:    "garbage certificate",
			files:   map[string][]byte{istio.CertChainFile: []byte("garbage"), istio.KeyFile: testutil.KeyPEM(t, mine.key)},
			wantErr: []string{istio.CertChainFile, "no PEM"},
		},
		{
			name:    "garbage key",
			files:   map[string][]byte{istio.CertChainFile: testutil.CertPEM(mine.chain...), istio.KeyFile: []byte("garbage")},
			wantErr: []string{istio.KeyFile},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := filepath.Join(t.TempDir(), "certs")
			if tt.files != nil {
				testutil.WriteFiles(t, dir, tt.files)
			}
			now := tt.now
			if now.IsZero() {
				now = time.Now()
			}
			cert, err := caclient.LoadKeyPair(dir, tt.spiffeID, testutil.NewFakeClock(now))
			if tt.wantErr == nil {
				if err != nil {
					t.Fatal(err)
				}
				if cert.Leaf == nil || len(cert.Certificate) != 2 || cert.PrivateKey == nil {
					t.Fatalf("certificate with leaf %v, %d DER certificates, key %T; want the leaf, 2, a key", cert.Leaf, len(cert.Certificate), cert.PrivateKey)
				}
				if !pki.PublicKeysEqual(cert.Leaf.PublicKey, cert.PrivateKey.(crypto.Signer).Public()) {
					t.Error("the key does not match the leaf")
				}
				return
			}
			if err == nil {
				t.Fatal("LoadKeyPair accepted the pair")
			}
			if cert != nil {
				t.Error("LoadKeyPair returned a certificate with its error")
			}
			for _, want := range append(tt.wantErr, dir) {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not mention %q", err, want)
				}
			}
		})
	}
}

func (p testPair) tlsCertificate() *tls.Certificate {
	cert := &tls.Certificate{PrivateKey: p.key, Leaf: p.chain[0]}
	for _, c := range p.chain {
		cert.Certificate = append(cert.Certificate, c.Raw)
	}
	return cert
}

func TestProvisionedCertificate(t *testing.T) {
	t.Parallel()
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	me := spiffeID("ns1", "me")
	base := t.TempDir()
	mismatched := filepath.Join(base, "mismatched")
	writePair(t, mismatched, newTestPair(t, root, me).chain, newTestPair(t, root, me).key)
	mineDir := filepath.Join(base, "mine")
	mine := newTestPair(t, root, me)
	writePair(t, mineDir, mine.chain, mine.key)

	tests := []struct {
		name     string
		dir      string
		now      time.Time         // zero: now
		wantLeaf *x509.Certificate // nil: none
	}{
		{name: "usable", dir: mineDir, wantLeaf: mine.chain[0]},
		{name: "missing", dir: filepath.Join(base, "missing")},
		{name: "key does not match", dir: mismatched},
		{name: "expired", dir: mineDir, now: mine.chain[0].NotAfter},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			now := tt.now
			if now.IsZero() {
				now = time.Now()
			}
			cert := caclient.ProvisionedCertificate(tt.dir, testutil.NewFakeClock(now), nil)()
			switch {
			case tt.wantLeaf == nil && cert != nil:
				t.Fatal("an unusable pair was presented")
			case tt.wantLeaf != nil && (cert == nil || !cert.Leaf.Equal(tt.wantLeaf)):
				t.Fatal("the usable pair was not presented")
			}
		})
	}
}

// issuedPair has the real CA issue a key pair for ns/sa (with a token).
func (c *realCA) issuedPair(t *testing.T, ns, sa string) testPair {
	t.Helper()
	cfg := c.config()
	cfg.TokenPath = c.tokenFile(t, ns, sa)
	cl := newClient(t, cfg)
	csr, key := newCSR(t, pki.ECDSA, spiffeID(ns, sa))
	res := cl.sign(t, csr, time.Hour)
	if res.err != nil {
		t.Fatal(res.err)
	}
	return testPair{chain: res.chain, key: key}
}

// The certificate the agent holds authenticates renewals, with or without a token.
func TestSignOverMTLS(t *testing.T) {
	t.Parallel()
	ca := startCA(t)
	me, other := spiffeID("ns1", "vm"), spiffeID("ns1", "other")
	mine, theirs := ca.issuedPair(t, "ns1", "vm"), ca.issuedPair(t, "ns1", "other")
	base := t.TempDir()
	expiredToken := filepath.Join(base, "expired-token")
	writeFile(t, expiredToken, ca.token(t, "ns1", "vm", time.Now().Add(-2*time.Hour), time.Hour))

	tests := []struct {
		name      string
		tokenPath string // "" means a path where no file exists
		pair      *testPair
		csrFor    pki.SPIFFEID
		wantLeaf  pki.SPIFFEID // zero: refused
	}{
		{name: "valid pair, no token file", pair: &mine, csrFor: me, wantLeaf: me},
		{name: "valid pair, expired token", tokenPath: expiredToken, pair: &mine, csrFor: me, wantLeaf: me},
		{name: "another identity's pair signs only for it", pair: &theirs, csrFor: other, wantLeaf: other},
		{name: "a pair does not sign for another identity", pair: &theirs, csrFor: me},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := ca.config()
			cfg.TokenPath = tt.tokenPath
			if cfg.TokenPath == "" {
				cfg.TokenPath = filepath.Join(t.TempDir(), "no-token")
			}
			cfg.ClientCertificate = tt.pair.tlsCertificate
			c := newClient(t, cfg)
			csr, _ := newCSR(t, pki.ECDSA, tt.csrFor)

			res := c.sign(t, csr, time.Hour)
			if tt.wantLeaf == (pki.SPIFFEID{}) {
				if !errors.Is(res.err, caclient.ErrRejected) || status.Code(res.err) != codes.PermissionDenied {
					t.Fatalf("error %v, want ErrRejected with PermissionDenied", res.err)
				}
				return
			}
			if res.err != nil {
				t.Fatal(res.err)
			}
			if got := leafID(t, res.chain[0]); got != tt.wantLeaf.String() {
				t.Errorf("leaf names %s, want %s", got, tt.wantLeaf)
			}
		})
	}
}

// The client keeps one connection and dials again only when the roots that verify the CA or the
// certificate it presents change (it used to dial and handshake for every attempt).
func TestConnectionIsKeptUntilItsMaterialChanges(t *testing.T) {
	t.Parallel()
	chain := newTestChain(t)
	f := startFake(t, answer(chain.pem...), caclient.DefaultServerName)
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	id := spiffeID("ns1", "sa1")
	first, second := newTestPair(t, root, id), newTestPair(t, root, id)
	var presented atomic.Pointer[testPair]
	presented.Store(&first)
	c := newClient(t, caclient.Config{Address: f.addr, RootCertFile: f.rootFile, ClientCertificate: func() *tls.Certificate {
		return presented.Load().tlsCertificate()
	}})
	signTimes := func(n int) {
		t.Helper()
		for range n {
			csr, _ := newCSR(t, pki.ECDSA, id)
			if res := c.sign(t, csr, time.Hour); res.err != nil {
				t.Fatal(res.err)
			}
		}
	}
	signTimes(3)
	if got := f.connections(); got != 1 {
		t.Fatalf("%d connections for 3 calls with nothing changed, want 1", got)
	}
	presented.Store(&second)
	signTimes(2)
	if got := f.connections(); got != 2 {
		t.Fatalf("%d connections after the certificate changed, want 2", got)
	}
	// The root file gains a root (a rotation starting): dial again, with both.
	rootPEM, err := os.ReadFile(f.rootFile)
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, f.rootFile, string(rootPEM)+string(testutil.CertPEM(root.Cert)))
	signTimes(2)
	if got := f.connections(); got != 3 {
		t.Fatalf("%d connections after the root file changed, want 3", got)
	}
}

func TestConnectOpensTheConnectionSignUses(t *testing.T) {
	t.Parallel()
	chain := newTestChain(t)
	f := startFake(t, answer(chain.pem...), caclient.DefaultServerName)
	c := newClient(t, caclient.Config{Address: f.addr, RootCertFile: f.rootFile})
	c.Connect()
	// A guard, not a wait: the connection comes in milliseconds or never.
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	select {
	case <-f.onAccept:
	case <-ctx.Done():
		t.Fatal("Connect opened no connection")
	}
	if calls := len(f.recorded()); calls != 0 {
		t.Fatalf("%d calls after Connect alone, want none", calls)
	}
	csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))
	if res := c.sign(t, csr, time.Hour); res.err != nil {
		t.Fatal(res.err)
	}
	if got := f.connections(); got != 1 {
		t.Fatalf("%d connections for Connect then Sign, want 1: Sign did not use the connection Connect opened", got)
	}
}
