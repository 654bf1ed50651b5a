package controlplane_test

import (
	"context"
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

const demoID = "spiffe://cluster.local/ns/default/sa/demo"

// reloadHarness is a control plane serving a plugged-in CA from cacerts, on a fake clock.
type reloadHarness struct {
	cp       *controlplane.ControlPlane
	clock    *testutil.FakeClock
	events   chan ca.Event
	stateDir string
	cacerts  string
}

func (h *reloadHarness) rootFile() string { return filepath.Join(h.stateDir, ca.RootCertFile) }

// startPluggedIn starts a control plane whose cacerts dir holds signer under root. Its clock is
// fake but starts at the real time, because TLS handshakes check certificates on the real clock.
func startPluggedIn(t *testing.T, signer, root *testutil.CA) *reloadHarness {
	t.Helper()
	h := &reloadHarness{
		clock:    testutil.NewFakeClock(time.Now().Truncate(time.Second)),
		events:   make(chan ca.Event, 1024),
		stateDir: t.TempDir(),
		cacerts:  filepath.Join(t.TempDir(), "cacerts"),
	}
	testutil.WriteFiles(t, h.cacerts, cacertsFiles(t, signer, root))
	cfg := testConfig(h.stateDir)
	cfg.CACertsDir = h.cacerts
	cfg.Clock = h.clock
	cfg.OnKeyEvent = func(ev ca.Event) { h.events <- ev }
	h.cp = start(t, cfg)
	// The root check timer is armed: from now on it is the one long-lived timer.
	if err := h.clock.WaitForTimers(t.Context(), 1); err != nil {
		t.Fatal(err)
	}
	return h
}

// swap rewrites the cacerts files to signer under root and lets debounce intervals pass until
// the control plane reports the reload. Unchanged and rejected reloads of the tail of the burst
// of file events are skipped.
func (h *reloadHarness) swap(t *testing.T, signer, root *testutil.CA) {
	t.Helper()
	testutil.WriteFiles(t, h.cacerts, cacertsFiles(t, signer, root))
	for {
		ev := testutil.Drive(t, h.clock, filewatch.DefaultDebounce, 1, h.events)
		switch ev.Kind {
		case ca.EventReloaded:
			if got := h.cp.Authority().Bundle().SigningCert(); !got.Equal(signer.Cert) {
				t.Fatalf("reloaded, but signing with %q instead of %q", got.Subject, signer.Cert.Subject)
			}
			return
		case ca.EventUnchanged, ca.EventRejected:
		default:
			t.Fatalf("unexpected key event %s (%v)", ev.Kind, ev.Err)
		}
	}
}

func cacertsFiles(t *testing.T, signer, root *testutil.CA) map[string][]byte {
	t.Helper()
	return map[string][]byte{
		ca.CACertFile:    testutil.CertPEM(signer.Cert),
		ca.CAKeyFile:     testutil.KeyPEM(t, signer.Key),
		ca.CertChainFile: testutil.CertPEM(signer.Cert, root.Cert),
		ca.RootCertFile:  testutil.CertPEM(root.Cert),
	}
}

// dial connects as an Istio agent does, trusting the roots in rootFile, presenting client (a
// certificate, its intermediates and its key) when it is not nil.
func dial(t *testing.T, addr, rootFile string, client *tls.Certificate) *grpc.ClientConn {
	t.Helper()
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM([]byte(readFile(t, rootFile))) {
		t.Fatalf("%s holds no certificate", rootFile)
	}
	tlsCfg := &tls.Config{RootCAs: roots, ServerName: "istiod.istio-system.svc", MinVersion: tls.VersionTLS12}
	if client != nil {
		tlsCfg.Certificates = []tls.Certificate{*client}
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(tlsCfg)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// requestCertificate asks for a certificate for spiffeID over conn, with tok as the bearer token
// unless it is empty, and returns the chain and the key it certifies. It does not fail the test,
// so that other goroutines may call it.
func requestCertificate(ctx context.Context, conn *grpc.ClientConn, tok, spiffeID string) ([]*x509.Certificate, crypto.Signer, error) {
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		return nil, nil, err
	}
	id, err := pki.ParseSPIFFEID(spiffeID)
	if err != nil {
		return nil, nil, err
	}
	csr, err := pki.CreateCSR(key, id)
	if err != nil {
		return nil, nil, err
	}
	if tok != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	}
	resp, err := pb.NewIstioCertificateServiceClient(conn).CreateCertificate(ctx, &pb.IstioCertificateRequest{Csr: string(csr), ValidityDuration: 3600})
	if err != nil {
		return nil, nil, err
	}
	var chain []*x509.Certificate
	for _, p := range resp.CertChain {
		certs, err := pki.ParseCertificates([]byte(p))
		if err != nil {
			return nil, nil, err
		}
		chain = append(chain, certs...)
	}
	if len(chain) < 2 {
		return nil, nil, fmt.Errorf("chain of %d certificates", len(chain))
	}
	return chain, key, nil
}

// verifyChain checks that chain[0] is signed by chain[1] and chains through chain[1:] to one of roots.
func verifyChain(chain, roots []*x509.Certificate, now time.Time) error {
	if err := chain[0].CheckSignatureFrom(chain[1]); err != nil {
		return fmt.Errorf("leaf not signed by %q: %w", chain[1].Subject, err)
	}
	rootPool, inter := x509.NewCertPool(), x509.NewCertPool()
	for _, r := range roots {
		rootPool.AddCert(r)
	}
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	_, err := chain[0].Verify(x509.VerifyOptions{Roots: rootPool, Intermediates: inter, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}})
	return err
}

func readCertFile(t *testing.T, path string) []*x509.Certificate {
	t.Helper()
	certs, err := pki.ParseCertificates([]byte(readFile(t, path)))
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return certs
}

func TestNewRootOverGRPC(t *testing.T) {
	t.Parallel()
	oldRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "old root"})
	oldInt := oldRoot.NewIntermediate(t, testutil.CAOptions{CommonName: "old intermediate"})
	newRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "new root"})
	newInt := newRoot.NewIntermediate(t, testutil.CAOptions{CommonName: "new intermediate"})
	h := startPluggedIn(t, oldInt, oldRoot)
	addr := h.cp.GRPCAddr()
	tok := mint(t, h.stateDir, "default", "demo")

	oldChain, oldKey, err := requestCertificate(t.Context(), dial(t, addr, h.rootFile(), nil), tok, demoID)
	if err != nil {
		t.Fatal(err)
	}
	if !oldChain[len(oldChain)-1].Equal(oldRoot.Cert) {
		t.Fatal("the first leaf does not chain to the old root")
	}

	h.swap(t, newInt, newRoot)

	newChain, err := createCertificate(t, addr, h.rootFile(), tok, demoID)
	if err != nil {
		t.Fatal(err)
	}
	if len(newChain) != 3 || !newChain[1].Equal(newInt.Cert) || !newChain[2].Equal(newRoot.Cert) {
		t.Fatalf("chain after the swap is not leaf, new intermediate, new root")
	}
	trusted := readCertFile(t, h.rootFile())
	if len(trusted) != 2 || !trusted[0].Equal(newRoot.Cert) || !trusted[1].Equal(oldRoot.Cert) {
		t.Fatalf("root-cert.pem holds %d certificates, want the new root then the old one", len(trusted))
	}
	for name, chain := range map[string][]*x509.Certificate{"old": oldChain, "new": newChain} {
		if err := verifyChain(chain, trusted, h.clock.Now()); err != nil {
			t.Errorf("the %s leaf does not verify against root-cert.pem: %v", name, err)
		}
	}

	// A workload renewing with its old-root certificate, and no token, is still served.
	renewing := &tls.Certificate{Certificate: [][]byte{oldChain[0].Raw, oldChain[1].Raw}, PrivateKey: oldKey}
	chain, _, err := requestCertificate(t.Context(), dial(t, addr, h.rootFile(), renewing), "", demoID)
	if err != nil {
		t.Fatalf("mTLS renewal with the old-root certificate: %v", err)
	}
	if !chain[len(chain)-1].Equal(newRoot.Cert) || chain[0].URIs[0].String() != demoID {
		t.Fatalf("mTLS renewal issued %v under %q", chain[0].URIs, chain[len(chain)-1].Subject)
	}
	if err := verifyChain(chain, trusted, h.clock.Now()); err != nil {
		t.Fatalf("mTLS renewal: %v", err)
	}

	// Whereas a certificate under a root the CA never had is not.
	strangerLeaf, strangerKey := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "stranger"}).IssueWorkload(t, demoID, time.Hour)
	stranger := &tls.Certificate{Certificate: [][]byte{strangerLeaf.Raw}, PrivateKey: strangerKey}
	if _, _, err := requestCertificate(t.Context(), dial(t, addr, h.rootFile(), stranger), "", demoID); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("mTLS with a certificate under an unknown root: %v, want Unauthenticated", err)
	}
}

func TestCreateCertificateDuringReloads(t *testing.T) {
	t.Parallel()
	const (
		reloads = 100
		callers = 4
	)
	root := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "root"})
	intermediates := []*testutil.CA{
		root.NewIntermediate(t, testutil.CAOptions{CommonName: "intermediate A"}),
		root.NewIntermediate(t, testutil.CAOptions{CommonName: "intermediate B"}),
	}
	h := startPluggedIn(t, intermediates[0], root)
	tok := mint(t, h.stateDir, "default", "demo")
	conn := dial(t, h.cp.GRPCAddr(), h.rootFile(), nil) // one connection for every caller

	var (
		wg       sync.WaitGroup
		stop     = make(chan struct{})
		progress = make(chan struct{}, 1) // a call succeeded
		failed   = make(chan struct{})    // a caller gave up
		failOnce sync.Once
		mu       sync.Mutex
		bySigner = map[string]int{}
	)
	stopCallers := sync.OnceFunc(func() { close(stop); wg.Wait() })
	defer stopCallers()
	fail := func(format string, args ...any) {
		t.Errorf(format, args...)
		failOnce.Do(func() { close(failed) })
	}
	for range callers {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				chain, _, err := requestCertificate(context.Background(), conn, tok, demoID)
				if err != nil {
					fail("CreateCertificate during reloads: %v", err)
					return
				}
				if err := verifyChain(chain, []*x509.Certificate{root.Cert}, h.clock.Now()); err != nil {
					fail("chain issued during reloads: %v", err)
					return
				}
				mu.Lock()
				bySigner[chain[1].Subject.CommonName]++
				mu.Unlock()
				select {
				case progress <- struct{}{}:
				default:
				}
			}
		})
	}
	// waitForCall returns once a call that completed after it began is reported.
	waitForCall := func() {
		t.Helper()
		select {
		case <-progress:
		default:
		}
		select {
		case <-progress:
		case <-failed:
			t.FailNow()
		}
	}

	for i := range reloads {
		waitForCall() // every bundle serves at least one call
		h.swap(t, intermediates[(i+1)%2], root)
	}
	waitForCall()
	stopCallers()
	if bySigner["intermediate A"] == 0 || bySigner["intermediate B"] == 0 {
		t.Fatalf("certificates by intermediate: %v, want some under each", bySigner)
	}
	t.Logf("%d reloads, certificates by intermediate: %v", reloads, bySigner)
}
