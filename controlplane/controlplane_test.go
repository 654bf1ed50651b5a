package controlplane_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

func testConfig(stateDir string) controlplane.Config {
	cfg := controlplane.DefaultConfig()
	cfg.StateDir = stateDir
	cfg.GRPCAddr = "127.0.0.1:0"
	cfg.MonitoringAddr = "127.0.0.1:0"
	return cfg
}

// start runs a control plane until the test ends and waits until it serves.
func start(t *testing.T, cfg controlplane.Config) *controlplane.ControlPlane {
	t.Helper()
	return controlplanetest.Start(t, cfg)
}

func mint(t *testing.T, stateDir, ns, sa string) string {
	t.Helper()
	return controlplanetest.Token(t, stateDir, ns, sa, time.Now(), time.Hour)
}

// createCertificate speaks Istio's CA protocol as its agent does: TLS verified with the root file
// and the server name istiod.istio-system.svc, a bearer token, a PEM CSR for the SPIFFE ID.
func createCertificate(t *testing.T, addr, rootFile, tok, spiffeID string) ([]*x509.Certificate, error) {
	t.Helper()
	return createCertificateWith(t, addr, rootFile, tok, spiffeID, nil)
}

// createCertificateWith is createCertificate with the request's metadata md (nil: none).
func createCertificateWith(t *testing.T, addr, rootFile, tok, spiffeID string, md *structpb.Struct) ([]*x509.Certificate, error) {
	t.Helper()
	rootPEM, err := os.ReadFile(rootFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(rootPEM) {
		t.Fatalf("%s holds no certificate", rootFile)
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
		RootCAs: pool, ServerName: "istiod.istio-system.svc", MinVersion: tls.VersionTLS12,
	})))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	id, err := pki.ParseSPIFFEID(spiffeID)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := pki.CreateCSR(key, id)
	if err != nil {
		t.Fatal(err)
	}
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+tok)
	resp, err := pb.NewIstioCertificateServiceClient(conn).CreateCertificate(ctx, &pb.IstioCertificateRequest{Csr: string(csr), ValidityDuration: 3600, Metadata: md})
	if err != nil {
		return nil, err
	}
	var chain []*x509.Certificate
	for _, p := range resp.CertChain {
		certs, err := pki.ParseCertificates([]byte(p))
		if err != nil {
			t.Fatal(err)
		}
		chain = append(chain, certs...)
	}
	// The chain verifies against the trust bundle clients are given.
	inter := x509.NewCertPool()
	for _, c := range chain[1 : len(chain)-1] {
		inter.AddCert(c)
	}
	if _, err := chain[0].Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter}); err != nil {
		t.Fatalf("leaf does not verify against %s: %v", rootFile, err)
	}
	return chain, nil
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(body)
}

func TestFreshStateDirEndToEnd(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "state")
	cp := start(t, testConfig(dir))

	chain, err := createCertificate(t, cp.GRPCAddr(), filepath.Join(dir, "root-cert.pem"), mint(t, dir, "default", "demo"), "spiffe://cluster.local/ns/default/sa/demo")
	if err != nil {
		t.Fatal(err)
	}
	if got := chain[0].URIs[0].String(); got != "spiffe://cluster.local/ns/default/sa/demo" {
		t.Fatalf("leaf names %s", got)
	}
	for name, mode := range map[string]os.FileMode{"ca-key.pem": 0o600, "token-key.pem": 0o600, "ca-cert.pem": 0o644, "root-cert.pem": 0o644} {
		info, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if info.Mode().Perm() != mode {
			t.Errorf("%s mode %v, want %v", name, info.Mode().Perm(), mode)
		}
	}

	base := "http://" + cp.MonitoringAddr()
	if code, body := get(t, base+"/healthz/ready"); code != http.StatusOK {
		t.Fatalf("/healthz/ready = %d %q", code, body)
	}
	if code, _ := get(t, base+"/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz = %d", code)
	}
	if code, body := get(t, base+"/version"); code != http.StatusOK || !strings.HasPrefix(body, "meshid ") {
		t.Fatalf("/version = %d %q", code, body)
	}
	_, metrics := get(t, base+"/metrics")
	for _, want := range []string{
		`meshid_ca_certificates_issued_total{auth_method="jwt"} 1`,
		`meshid_ca_signing_duration_seconds_count 1`,
		`meshid_ca_signing_cert_expiry_timestamp_seconds{source="self-signed"}`,
		`meshid_ca_root_cert_expiry_timestamp_seconds{`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}

	// A token for another identity cannot get this one.
	_, err = createCertificate(t, cp.GRPCAddr(), filepath.Join(dir, "root-cert.pem"), mint(t, dir, "other", "demo"), "spiffe://cluster.local/ns/default/sa/demo")
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("CSR for another identity: %v, want PermissionDenied", err)
	}
	_, metrics = get(t, base+"/metrics")
	if want := `meshid_ca_requests_refused_total{code="PermissionDenied",reason="csr_identity"} 1`; !strings.Contains(metrics, want) {
		t.Errorf("/metrics lacks %s", want)
	}
}

func TestRestartKeepsRootAndTokenKey(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	runBriefly(t, testConfig(dir))
	rootBefore := readFile(t, filepath.Join(dir, "root-cert.pem"))
	tok := mint(t, dir, "default", "demo")

	cp2 := start(t, testConfig(dir))
	if rootAfter := readFile(t, filepath.Join(dir, "root-cert.pem")); rootAfter != rootBefore {
		t.Fatal("root-cert.pem changed across a restart")
	}
	// A token minted before the restart is still accepted: the token key persisted too.
	if _, err := createCertificate(t, cp2.GRPCAddr(), filepath.Join(dir, "root-cert.pem"), tok, "spiffe://cluster.local/ns/default/sa/demo"); err != nil {
		t.Fatal(err)
	}
}

func TestPluggedInCATakesOverOnRestart(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	runBriefly(t, testConfig(dir))

	root := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "corp root"})
	inter := root.NewIntermediate(t, testutil.CAOptions{CommonName: "mesh intermediate"})
	cacerts := filepath.Join(t.TempDir(), "cacerts")
	testutil.WriteFiles(t, cacerts, map[string][]byte{
		"ca-cert.pem":    testutil.CertPEM(inter.Cert),
		"ca-key.pem":     testutil.KeyPEM(t, inter.Key),
		"cert-chain.pem": testutil.CertPEM(inter.Cert, root.Cert),
		"root-cert.pem":  testutil.CertPEM(root.Cert),
	})
	cfg := testConfig(dir)
	cfg.CACertsDir = cacerts
	cp2 := start(t, cfg)

	rootFile := filepath.Join(dir, "root-cert.pem")
	selfSigned := readFile(t, filepath.Join(dir, "ca-cert.pem"))
	// The plugged-in root first; the self-signed root stays trusted for workloads still holding
	// its certificates (until it expires, or --trust-bundle-overlap).
	if got := readFile(t, rootFile); got != string(testutil.CertPEM(root.Cert))+selfSigned {
		t.Fatal("root-cert.pem does not hold the plugged-in root followed by the self-signed one")
	}
	chain, err := createCertificate(t, cp2.GRPCAddr(), rootFile, mint(t, dir, "default", "demo"), "spiffe://cluster.local/ns/default/sa/demo")
	if err != nil {
		t.Fatal(err)
	}
	if len(chain) != 3 || !chain[1].Equal(inter.Cert) || !chain[2].Equal(root.Cert) {
		t.Fatalf("chain of %d is not leaf, plugged-in intermediate, plugged-in root", len(chain))
	}
}

func TestJWTKeysFromJWKSFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	issuerKey, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalPKIXPublicKey(issuerKey.Public())
	if err != nil {
		t.Fatal(err)
	}
	keysFile := filepath.Join(t.TempDir(), "sa.pub")
	if err := os.WriteFile(keysFile, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(dir)
	cfg.JWTKeysFile = keysFile
	cfg.JWTIssuer = "https://issuer.example"
	cp := start(t, cfg)
	if _, err := os.Stat(filepath.Join(dir, "token-key.pem")); !errors.Is(err, os.ErrNotExist) {
		t.Fatal("token-key.pem created although --jwt-keys replaces it")
	}
	mintWith := func(iss string) string {
		tok, err := token.Mint(issuerKey, token.MintParams{Issuer: iss, Audiences: []string{"istio-ca"}, Namespace: "ns1", ServiceAccount: "sa1", TTL: time.Hour, Now: time.Now()})
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	rootFile := filepath.Join(dir, "root-cert.pem")
	if _, err := createCertificate(t, cp.GRPCAddr(), rootFile, mintWith("https://issuer.example"), "spiffe://cluster.local/ns/ns1/sa/sa1"); err != nil {
		t.Fatal(err)
	}
	if _, err := createCertificate(t, cp.GRPCAddr(), rootFile, mintWith("https://elsewhere.example"), "spiffe://cluster.local/ns/ns1/sa/sa1"); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("token from another issuer: %v, want Unauthenticated", err)
	}
}

func TestNewFailsClearly(t *testing.T) {
	t.Parallel()
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = busy.Close() })
	partial := t.TempDir()
	testutil.WriteFiles(t, partial, map[string][]byte{"ca-cert.pem": []byte("x")})

	tests := []struct {
		name   string
		modify func(*controlplane.Config)
		want   string
	}{
		{"port in use", func(c *controlplane.Config) { c.GRPCAddr = busy.Addr().String() }, "listen for gRPC"},
		{"partial cacerts", func(c *controlplane.Config) { c.CACertsDir = partial }, "missing ca-key.pem"},
		{"bad address", func(c *controlplane.Config) { c.GRPCAddr = "15012" }, "GRPCAddr"},
		{"port out of range", func(c *controlplane.Config) { c.GRPCAddr = "127.0.0.1:99999" }, `GRPCAddr "127.0.0.1:99999": port "99999": want a number from 0 to 65535`},
		{"monitoring address with a scheme", func(c *controlplane.Config) { c.MonitoringAddr = "http://127.0.0.1:9093" },
			`MonitoringAddr "http://127.0.0.1:9093": http:// is not part of an address`},
		{"bad trust domain", func(c *controlplane.Config) { c.TrustDomain = "Not Valid" }, "TrustDomain"},
		{"missing xds config", func(c *controlplane.Config) { c.XDSConfig = filepath.Join(partial, "xds.yaml") }, "--xds-config"},
		{"lease shorter than its renewal", func(c *controlplane.Config) {
			c.Kubernetes = controlplane.KubernetesConfig{Kubeconfig: "/k", LeaseDuration: 5 * time.Second}
		}, "lease duration (5s) > renew deadline (10s)"},
		{"max below default ttl", func(c *controlplane.Config) { c.MaxWorkloadCertTTL = time.Minute }, "MaxWorkloadCertTTL 1m0s is below WorkloadCertTTL"},
		{"no JWT-SVID lifetime", func(c *controlplane.Config) { c.JWTSVIDTTL = 0 }, "JWTSVIDTTL 0s is not in (0, 24h0m0s]"},
		{"JWT-SVID lifetime too long", func(c *controlplane.Config) { c.JWTSVIDTTL = 25 * time.Hour }, "JWTSVIDTTL 25h0m0s is not in (0, 24h0m0s]"},
		{"missing jwt keys file", func(c *controlplane.Config) { c.JWTKeysFile = filepath.Join(partial, "nope") }, "token keys"},
		{"no discovery streams", func(c *controlplane.Config) { c.XDSMaxStreams = 0 }, "XDSMaxStreams 0 must be positive"},
		{"no discovery streams per credential", func(c *controlplane.Config) { c.XDSMaxStreamsPerCredential = -1 }, "XDSMaxStreamsPerCredential"},
		{"no connection age", func(c *controlplane.Config) { c.MaxConnectionAge = 0 }, "MaxConnectionAge"},
		{"no connection age grace", func(c *controlplane.Config) { c.MaxConnectionAgeGrace = -time.Second }, "grace"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := testConfig(t.TempDir())
			tt.modify(&cfg)
			_, err := controlplane.New(t.Context(), cfg)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one mentioning %q", err, tt.want)
			}
		})
	}
}

// runBriefly starts a control plane on cfg and stops it once it serves, as a first start would.
func runBriefly(t *testing.T, cfg controlplane.Config) {
	t.Helper()
	cp, err := controlplane.New(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- cp.Run(ctx) }()
	<-cp.Ready()
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

// A control plane stopped as soon as it starts (a signal during start-up) stops cleanly, however
// its goroutines are scheduled: Serve may run after the stop.
func TestRunStoppedAtOnce(t *testing.T) {
	t.Parallel()
	for i := range 20 {
		cp, err := controlplane.New(t.Context(), testConfig(t.TempDir()))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		if err := cp.Run(ctx); err != nil {
			t.Fatalf("run %d: Run with its context done = %v, want nil", i, err)
		}
	}
}

// Defect: a control plane stopped right after it was ready returned "grpc: the server has been
// stopped" now and then: Ready does not wait for gRPC's Serve, the stop could run first, and
// Serve then refuses to start. A stop at any moment is a clean stop. Many runs, each stopped the
// moment it is ready, with and without a cacerts dir to watch.
func TestRunStoppedAsSoonAsReady(t *testing.T) {
	t.Parallel()
	for i := range 60 {
		cfg := testConfig(t.TempDir())
		if i%2 == 1 {
			cfg.CACertsDir = t.TempDir()
		}
		_, stop := runUntilStopped(t, cfg) // fails the test unless Run ends cleanly
		stop()
	}
}

// A typo in --cacerts-dir is refused before anything is written, not taken for "no plugged-in CA".
func TestNewRefusesMissingCACertsDir(t *testing.T) {
	t.Parallel()
	base := t.TempDir()
	cfg := testConfig(filepath.Join(base, "state"))
	cfg.CACertsDir = filepath.Join(base, "cacerts-typo")
	_, err := controlplane.New(t.Context(), cfg)
	if err == nil || !strings.Contains(err.Error(), "CACertsDir") || !strings.Contains(err.Error(), cfg.CACertsDir) {
		t.Fatalf("error %v, want one naming CACertsDir and %s", err, cfg.CACertsDir)
	}
	if _, err := os.Stat(cfg.StateDir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the refused start left a state dir behind (stat: %v)", err)
	}

	// An existing empty directory is an optional secret volume whose secret does not exist yet:
	// the self-signed CA serves meanwhile.
	if err := os.Mkdir(cfg.CACertsDir, 0o700); err != nil {
		t.Fatal(err)
	}
	cp := start(t, cfg)
	if src := cp.Authority().Bundle().Source(); src != ca.SourceSelfSigned {
		t.Fatalf("serving a %s CA with an empty --cacerts-dir, want self-signed", src)
	}
}

// A --cacerts-dir or --manifests that is not a directory is the caller's mistake, refused as
// ErrConfigRefused (cmd: exit 2) before anything is bound or written, each problem named.
func TestNewRefusesMissingDirsAsConfig(t *testing.T) {
	t.Parallel()
	base := t.TempDir()
	cfg := testConfig(filepath.Join(base, "state"))
	cfg.CACertsDir, cfg.Manifests = filepath.Join(base, "cacerts"), filepath.Join(base, "manifests")
	_, err := controlplane.New(t.Context(), cfg)
	if !errors.Is(err, controlplane.ErrConfigRefused) {
		t.Fatalf("error %v, want ErrConfigRefused", err)
	}
	for _, want := range []string{"CACertsDir: plugged-in CA directory " + cfg.CACertsDir, "Manifests " + cfg.Manifests + " does not exist"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if _, err := os.Stat(cfg.StateDir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the refused start left a state dir behind (stat: %v)", err)
	}
	_, err = controlplane.Targets(t.Context(), controlplane.TargetsConfig{Manifests: cfg.Manifests, CANamespace: "istio-system"})
	if !errors.Is(err, controlplane.ErrConfigRefused) || !strings.Contains(err.Error(), "Manifests "+cfg.Manifests) {
		t.Fatalf("targets: %v, want ErrConfigRefused naming Manifests", err)
	}
}

// A start that fails binding its ports writes nothing to the state dir, and a start that fails
// after binding releases what it bound.
func TestNewBindsBeforeWriting(t *testing.T) {
	t.Parallel()
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = busy.Close() })
	tests := []struct {
		name       string
		modify     func(c *controlplane.Config)
		want       string
		stateAfter bool // the state dir may exist after the failure
	}{
		{"gRPC port in use", func(c *controlplane.Config) { c.GRPCAddr = busy.Addr().String() }, busy.Addr().String(), false},
		{"monitoring port in use", func(c *controlplane.Config) { c.MonitoringAddr = busy.Addr().String() }, busy.Addr().String(), false},
		{"missing jwt keys file, after binding", func(c *controlplane.Config) { c.JWTKeysFile = filepath.Join(c.StateDir+"-none", "keys.pem") }, "token keys", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := testConfig(filepath.Join(t.TempDir(), "state"))
			// A socket file shows whether the gRPC listener was closed: closing removes it.
			socket := filepath.Join(testutil.ShortTempDir(t), "ca.sock")
			cfg.GRPCAddr = "unix://" + socket
			tt.modify(&cfg)
			if _, err := controlplane.New(t.Context(), cfg); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one naming %q", err, tt.want)
			}
			if _, err := os.Stat(cfg.StateDir); !tt.stateAfter && !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("the failed start wrote the state dir (stat: %v)", err)
			}
			if _, err := os.Lstat(socket); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("the failed start left its gRPC socket open (stat: %v)", err)
			}
		})
	}
}

// The CA's Unix socket (an embedded control plane's) is listened on as the agent's sockets are:
// a stale socket file is replaced, a live one is refused and left alone, and the file is removed
// when the CA stops.
func TestUnixSocketListener(t *testing.T) {
	t.Parallel()
	dir := testutil.ShortTempDir(t)
	socket := filepath.Join(dir, "ca.sock")
	live, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(filepath.Join(t.TempDir(), "state"))
	cfg.GRPCAddr = "unix://" + socket
	if _, err := controlplane.New(t.Context(), cfg); !errors.Is(err, fsutil.ErrSocketInUse) {
		t.Fatalf("a CA on a live socket: %v, want ErrSocketInUse", err)
	}
	if conn, err := net.Dial("unix", socket); err != nil {
		t.Fatalf("the live socket was taken away: %v", err)
	} else {
		_ = conn.Close()
	}
	live.(*net.UnixListener).SetUnlinkOnClose(false)
	_ = live.Close() // now stale
	cp, err := controlplane.New(t.Context(), cfg)
	if err != nil {
		t.Fatalf("a stale socket was not replaced: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- cp.Run(ctx) }()
	<-cp.Ready()
	if cp.GRPCAddr() != cfg.GRPCAddr {
		t.Fatalf("serving on %s, want %s", cp.GRPCAddr(), cfg.GRPCAddr)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(socket); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the socket file outlives the CA (stat: %v)", err)
	}
}
