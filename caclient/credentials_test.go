package caclient_test

import (
	"crypto"
	"crypto/x509"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// writePair writes chain and key as a workload key pair into dir (created if missing).
func writePair(t *testing.T, dir string, chain []*x509.Certificate, key crypto.Signer) {
	t.Helper()
	testutil.WriteFiles(t, dir, map[string][]byte{
		caclient.CertChainFile: testutil.CertPEM(chain...),
		caclient.KeyFile:       testutil.KeyPEM(t, key),
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
			files:    map[string][]byte{caclient.CertChainFile: testutil.CertPEM(mine.chain...), caclient.KeyFile: testutil.KeyPEM(t, mine.key)},
			spiffeID: me.String(),
		},
		{
			name:  "any identity when none is asked for",
			files: map[string][]byte{caclient.CertChainFile: testutil.CertPEM(theirs.chain...), caclient.KeyFile: testutil.KeyPEM(t, theirs.key)},
		},
		{
			name:     "another identity",
			files:    map[string][]byte{caclient.CertChainFile: testutil.CertPEM(theirs.chain...), caclient.KeyFile: testutil.KeyPEM(t, theirs.key)},
			spiffeID: me.String(),
			wantErr:  []string{"does not name " + me.String()},
		},
		{
			name:     "expired",
			files:    map[string][]byte{caclient.CertChainFile: testutil.CertPEM(mine.chain...), caclient.KeyFile: testutil.KeyPEM(t, mine.key)},
			spiffeID: me.String(),
			now:      leaf.NotAfter.Add(time.Minute),
			wantErr:  []string{"valid from", "not at"},
		},
		{
			name:     "not yet valid",
			files:    map[string][]byte{caclient.CertChainFile: testutil.CertPEM(mine.chain...), caclient.KeyFile: testutil.KeyPEM(t, mine.key)},
			spiffeID: me.String(),
			now:      leaf.NotBefore.Add(-time.Minute),
			wantErr:  []string{"valid from", "not at"},
		},
		{
			name:     "mismatched key",
			files:    map[string][]byte{caclient.CertChainFile: testutil.CertPEM(mine.chain...), caclient.KeyFile: testutil.KeyPEM(t, theirs.key)},
			spiffeID: me.String(),
			wantErr:  []string{"key does not match"},
		},
		{
			name:    "missing directory",
			wantErr: []string{caclient.CertChainFile, "no such file"},
		},
		{
			name:    "missing key",
			files:   map[string][]byte{caclient.CertChainFile: testutil.CertPEM(mine.chain...)},
			wantErr: []string{caclient.KeyFile, "no such file"},
		},
		{
			name:    "garbage certificate",
			files:   map[string][]byte{caclient.CertChainFile: []byte("garbage"), caclient.KeyFile: testutil.KeyPEM(t, mine.key)},
			wantErr: []string{caclient.CertChainFile, "no PEM"},
		},
		{
			name:    "garbage key",
			files:   map[string][]byte{caclient.CertChainFile: testutil.CertPEM(mine.chain...), caclient.KeyFile: []byte("garbage")},
			wantErr: []string{caclient.KeyFile},
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

func TestKeyPairFromDirs(t *testing.T) {
	t.Parallel()
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	me, other := spiffeID("ns1", "me"), spiffeID("ns1", "other")
	base := t.TempDir()
	missing := filepath.Join(base, "missing")
	mismatched := filepath.Join(base, "mismatched")
	writePair(t, mismatched, newTestPair(t, root, me).chain, newTestPair(t, root, me).key)
	goodTheirs := filepath.Join(base, "good-theirs")
	p := newTestPair(t, root, other)
	writePair(t, goodTheirs, p.chain, p.key)
	mineDir := filepath.Join(base, "mine")
	mine := newTestPair(t, root, me)
	writePair(t, mineDir, mine.chain, mine.key)

	tests := []struct {
		name     string
		dirs     []caclient.KeyPairDir
		now      time.Time         // zero: now
		wantLeaf *x509.Certificate // nil: none
		wantErr  []string
	}{
		{
			name: "skips unusable, takes the first usable",
			dirs: []caclient.KeyPairDir{
				{Dir: ""}, {Dir: missing}, {Dir: mismatched}, {Dir: goodTheirs, SPIFFEID: me.String()},
				{Dir: mineDir, SPIFFEID: me.String()}, {Dir: goodTheirs},
			},
			wantLeaf: mine.chain[0],
		},
		{
			name:     "a pair for another identity when no SPIFFE ID is set",
			dirs:     []caclient.KeyPairDir{{Dir: goodTheirs, SPIFFEID: me.String()}, {Dir: goodTheirs}, {Dir: mineDir}},
			wantLeaf: p.chain[0],
		},
		{
			name:    "none usable: every reason",
			dirs:    []caclient.KeyPairDir{{Dir: missing}, {Dir: mismatched}, {Dir: goodTheirs, SPIFFEID: me.String()}},
			wantErr: []string{missing, "no such file", mismatched, "key does not match", goodTheirs, "does not name " + me.String()},
		},
		{
			name:    "expired",
			dirs:    []caclient.KeyPairDir{{Dir: mineDir, SPIFFEID: me.String()}},
			now:     mine.chain[0].NotAfter,
			wantErr: []string{mineDir, "valid from"},
		},
		{
			name: "no directories",
			dirs: []caclient.KeyPairDir{{Dir: ""}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			now := tt.now
			if now.IsZero() {
				now = time.Now()
			}
			cert, err := caclient.KeyPairFromDirs(testutil.NewFakeClock(now), tt.dirs...)()
			switch {
			case tt.wantLeaf != nil:
				if err != nil {
					t.Fatal(err)
				}
				if cert == nil || !cert.Leaf.Equal(tt.wantLeaf) {
					t.Fatal("the callback did not return the expected pair")
				}
			case tt.wantErr != nil:
				if cert != nil || err == nil {
					t.Fatalf("certificate %v, error %v; want no certificate and an error", cert, err)
				}
				for _, want := range tt.wantErr {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("error %q does not mention %q", err, want)
					}
				}
			default:
				if cert != nil || err != nil {
					t.Fatalf("certificate %v, error %v; want neither", cert, err)
				}
			}
		})
	}
}

// issuedPair has the real CA issue a key pair for ns/sa (with a token) and writes it into a new
// directory, as OUTPUT_CERTS or PROV_CERT would hold it.
func (c *realCA) issuedPair(t *testing.T, ns, sa string) (chain []*x509.Certificate, key crypto.Signer) {
	t.Helper()
	cfg := c.config()
	cfg.TokenPath = c.tokenFile(t, ns, sa)
	cl := newClient(t, cfg)
	csr, key := newCSR(t, pki.ECDSA, spiffeID(ns, sa))
	res := cl.sign(t, csr, time.Hour)
	if res.err != nil {
		t.Fatal(res.err)
	}
	return res.chain, key
}

func TestSignOverMTLS(t *testing.T) {
	t.Parallel()
	ca := startCA(t)
	me, other := spiffeID("ns1", "vm"), spiffeID("ns1", "other")
	mineChain, mineKey := ca.issuedPair(t, "ns1", "vm")
	otherChain, otherKey := ca.issuedPair(t, "ns1", "other")
	base := t.TempDir()
	mine, theirs := filepath.Join(base, "mine"), filepath.Join(base, "theirs")
	writePair(t, mine, mineChain, mineKey)
	writePair(t, theirs, otherChain, otherKey)
	expiredToken := filepath.Join(base, "expired-token")
	writeFile(t, expiredToken, ca.token(t, "ns1", "vm", time.Now().Add(-2*time.Hour), time.Hour))
	afterExpiry := testutil.NewFakeClock(mineChain[0].NotAfter.Add(time.Minute))

	tests := []struct {
		name      string
		tokenPath string              // "" means a path where no file exists
		pairClock *testutil.FakeClock // judges the pair's validity; nil: now
		dirs      []caclient.KeyPairDir
		csrFor    pki.SPIFFEID
		wantLeaf  pki.SPIFFEID // zero: refused as unauthenticated
	}{
		{
			name:     "valid pair, no token file",
			dirs:     []caclient.KeyPairDir{{Dir: mine, SPIFFEID: me.String()}},
			csrFor:   me,
			wantLeaf: me,
		},
		{
			name:      "valid pair, expired token",
			tokenPath: expiredToken,
			dirs:      []caclient.KeyPairDir{{Dir: mine, SPIFFEID: me.String()}},
			csrFor:    me,
			wantLeaf:  me,
		},
		{
			name:   "pair for another identity skipped when the SPIFFE ID is set",
			dirs:   []caclient.KeyPairDir{{Dir: theirs, SPIFFEID: me.String()}},
			csrFor: me,
		},
		{
			name:     "pair for another identity used when the SPIFFE ID is empty",
			dirs:     []caclient.KeyPairDir{{Dir: theirs}},
			csrFor:   other,
			wantLeaf: other,
		},
		{
			name:      "expired pair skipped",
			pairClock: afterExpiry,
			dirs:      []caclient.KeyPairDir{{Dir: mine, SPIFFEID: me.String()}},
			csrFor:    me,
		},
		{
			name:   "missing directory skipped",
			dirs:   []caclient.KeyPairDir{{Dir: filepath.Join(base, "absent"), SPIFFEID: me.String()}},
			csrFor: me,
		},
		{
			name:     "first usable of several",
			dirs:     []caclient.KeyPairDir{{Dir: filepath.Join(base, "absent")}, {Dir: theirs, SPIFFEID: me.String()}, {Dir: mine, SPIFFEID: me.String()}, {Dir: theirs}},
			csrFor:   me,
			wantLeaf: me,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := ca.config()
			cfg.TokenPath = tt.tokenPath
			if cfg.TokenPath == "" {
				cfg.TokenPath = filepath.Join(t.TempDir(), "no-token")
			}
			pairClock := tt.pairClock
			if pairClock == nil {
				pairClock = testutil.NewFakeClock(time.Now())
			}
			cfg.ClientCertificate = caclient.KeyPairFromDirs(pairClock, tt.dirs...)
			c := newClient(t, cfg)
			csr, _ := newCSR(t, pki.ECDSA, tt.csrFor)

			res := c.sign(t, csr, time.Hour)
			if tt.wantLeaf == (pki.SPIFFEID{}) {
				if !errors.Is(res.err, caclient.ErrRejected) || status.Code(res.err) != codes.Unauthenticated {
					t.Fatalf("error %v, want ErrRejected with Unauthenticated: no certificate should be presented", res.err)
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

func TestClientCertificateIsReadAtEachHandshake(t *testing.T) {
	t.Parallel()
	ca := startCA(t)
	first, second := spiffeID("ns1", "first"), spiffeID("ns1", "second")
	firstChain, firstKey := ca.issuedPair(t, "ns1", "first")
	secondChain, secondKey := ca.issuedPair(t, "ns1", "second")
	dir := filepath.Join(t.TempDir(), "certs")
	writePair(t, dir, firstChain, firstKey)

	cfg := ca.config()
	cfg.TokenPath = filepath.Join(t.TempDir(), "no-token")
	cfg.ClientCertificate = caclient.KeyPairFromDirs(nil, caclient.KeyPairDir{Dir: dir})
	c := newClient(t, cfg)

	csr, _ := newCSR(t, pki.ECDSA, first)
	if got := leafID(t, c.mustSign(t, csr, time.Hour)); got != first.String() {
		t.Fatalf("first leaf names %s", got)
	}
	// With the first pair still presented, the CA would refuse a CSR for the second identity.
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	writePair(t, dir, secondChain, secondKey)
	csr, _ = newCSR(t, pki.ECDSA, second)
	if got := leafID(t, c.mustSign(t, csr, time.Hour)); got != second.String() {
		t.Fatalf("second leaf names %s, want the identity of the replaced pair", got)
	}
}

// A directory published through "..data" (OUTPUT_CERTS, a mounted secret) is read from a single
// generation, even when a visible name still points into an older one mid-swap.
func TestLoadKeyPairReadsOneGeneration(t *testing.T) {
	t.Parallel()
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	id := spiffeID("ns1", "sa1")
	dir := t.TempDir()
	old, current := newTestPair(t, root, id), newTestPair(t, root, id)
	writePair(t, filepath.Join(dir, "..gen1"), old.chain, old.key)
	writePair(t, filepath.Join(dir, "..gen2"), current.chain, current.key)
	for _, link := range []struct{ name, target string }{
		{"..data", "..gen2"},
		{caclient.CertChainFile, filepath.Join("..gen1", caclient.CertChainFile)}, // not yet relinked
		{caclient.KeyFile, filepath.Join("..data", caclient.KeyFile)},
	} {
		if err := os.Symlink(link.target, filepath.Join(dir, link.name)); err != nil {
			t.Fatal(err)
		}
	}
	cert, err := caclient.LoadKeyPair(dir, id.String(), nil)
	if err != nil {
		t.Fatalf("a pair split across generations was read: %v", err)
	}
	if !cert.Leaf.Equal(current.chain[0]) {
		t.Fatal("LoadKeyPair did not read the generation ..data points at")
	}
}
