package server_test

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/ca/server"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/jwtsvidpb"
	"github.com/meshid/meshid/internal/meshcapb"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

const trustDomain = "cluster.local"

// harness runs the real CA server over TLS gRPC on 127.0.0.1:0, with a root and an
// intermediate as its key material and the local token key as its issuer.
type harness struct {
	root         *testutil.CA
	intermediate *testutil.CA
	authority    *ca.Authority
	tokenKey     crypto.Signer
	clock        *testutil.FakeClock
	registry     *prometheus.Registry
	addr         string
	logs         *testutil.SyncBuffer
	jwtSigner    *ca.JWTSVIDSigner
	stateDir     string // holds jwt-svid-key.pem
}

type harnessOptions struct {
	enabledByDefault *bool
	maxTTL           time.Duration
	signer           server.Signer      // nil: the harness's authority
	moreTokenKeys    []crypto.PublicKey // trusted besides the harness's token key
	store            controller.NamespaceStore
	caCertIDs        []pki.SPIFFEID // identities allowed CA certificates (--ca-cert-identities)
	// layout is what signs: "" an intermediate plugged in under the root, "root" the root itself
	// (a single self-signed CA), "downstream" a CA certificate the root's CA signed with SignCA.
	layout string
	// trustedNodes may impersonate (--trusted-node-accounts); nodes, when set, decides on nodes.
	trustedNodes []server.NodeAccount
	nodes        server.NodeAuthorizer
	// jwtSVIDTTL is the JWT-SVID signer's lifetime; 0: the default.
	jwtSVIDTTL time.Duration
	// authenticators are tried before the harness's own (JWT, mTLS).
	authenticators []server.Authenticator
}

func newHarness(t testing.TB, opts harnessOptions) *harness {
	t.Helper()
	clk := testutil.NewFakeClock(time.Now().Truncate(time.Second)) // certificates carry whole seconds
	root := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "harness root"})
	var inter *testutil.CA
	switch opts.layout {
	case "":
		inter = root.NewIntermediate(t, testutil.CAOptions{CommonName: "harness intermediate"})
	case "root":
		inter = root
	case "downstream":
		inter = downstreamOf(t, root, clk)
	default:
		t.Fatalf("harness layout %q", opts.layout)
	}
	bundle, err := ca.NewBundle(ca.BundleParams{
		SigningCert:   inter.Cert,
		SigningKey:    inter.Key,
		Intermediates: []*x509.Certificate{inter.Cert, root.Cert},
		Roots:         []*x509.Certificate{root.Cert},
		Source:        ca.SourcePluggedIn,
		Now:           clk.Now(),
	})
	if err != nil {
		t.Fatal(err)
	}
	authority := ca.New(ca.Config{Clock: clk, DefaultTTL: time.Hour, MaxTTL: opts.maxTTL, CACertIdentities: opts.caCertIDs}, bundle)

	tokenKey, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	keys, err := token.NewKeySet(append([]crypto.PublicKey{tokenKey.Public()}, opts.moreTokenKeys...)...)
	if err != nil {
		t.Fatal(err)
	}
	verifier, err := token.NewVerifier(token.VerifierConfig{Keys: keys, Audience: "istio-ca", Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	registry := prometheus.NewRegistry()
	metrics, err := server.NewMetrics(registry)
	if err != nil {
		t.Fatal(err)
	}
	enabled := true
	if opts.enabledByDefault != nil {
		enabled = *opts.enabledByDefault
	}
	logs := &testutil.SyncBuffer{}
	var signer server.Signer = authority
	if opts.signer != nil {
		signer = opts.signer
	}
	srv := server.New(server.Config{
		Signer: signer,
		Authenticators: append(slices.Clone(opts.authenticators),
			server.NewJWTAuthenticator(verifier, trustDomain),
			server.NewMTLSAuthenticator(authority, trustDomain, clk),
		),
		Targeting:           controller.NewTargeting(controller.TargetingConfig{Store: opts.store, CANamespace: "istio-system", EnabledByDefault: enabled}),
		Metrics:             metrics,
		Logger:              slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		TrustedNodeAccounts: opts.trustedNodes,
		Nodes:               opts.nodes,
	})
	stateDir := t.TempDir()
	jwtSigner, _, err := ca.LoadOrCreateJWTSVIDSigner(stateDir, trustDomain, opts.jwtSVIDTTL)
	if err != nil {
		t.Fatal(err)
	}
	return &harness{root: root, intermediate: inter, authority: authority, tokenKey: tokenKey, clock: clk,
		registry: registry, addr: serveTLS(t, srv, authority, clk, jwtSigner), logs: logs, jwtSigner: jwtSigner, stateDir: stateDir}
}

// serveTLS serves srv over TLS gRPC on 127.0.0.1:0 until the test ends, as the control plane
// does: a serving certificate from authority, client certificates requested but checked per call.
func serveTLS(t testing.TB, srv *server.Server, authority *ca.Authority, clk *testutil.FakeClock, jwtSigners ...server.JWTSVIDSigner) string {
	t.Helper()
	serving := server.NewServingCertificate(authority, nil, clk)
	gs := grpc.NewServer(append(server.GRPCServerOptions(), grpc.Creds(credentials.NewTLS(&tls.Config{
		MinVersion:     tls.VersionTLS12,
		GetCertificate: serving.GetCertificate,
		ClientAuth:     tls.RequestClientCert,
	})))...)
	pb.RegisterIstioCertificateServiceServer(gs, srv)
	meshcapb.RegisterMeshCertificateServiceServer(gs, srv.MeshCA())
	for _, j := range jwtSigners {
		jwtsvidpb.RegisterJWTSVIDServiceServer(gs, srv.JWTSVID(j))
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	return lis.Addr().String()
}

// dial connects as an Istio agent does: TLS verified against the root, server name
// istiod.istio-system.svc, optionally presenting a client certificate.
func (h *harness) dial(t testing.TB, clientCert *tls.Certificate) pb.IstioCertificateServiceClient {
	t.Helper()
	return pb.NewIstioCertificateServiceClient(h.conn(t, clientCert))
}

// dialMeshCA connects to the same server's Mesh CA service, as dial does.
func (h *harness) dialMeshCA(t testing.TB, clientCert *tls.Certificate) meshcapb.MeshCertificateServiceClient {
	t.Helper()
	return meshcapb.NewMeshCertificateServiceClient(h.conn(t, clientCert))
}

func (h *harness) conn(t testing.TB, clientCert *tls.Certificate) *grpc.ClientConn {
	t.Helper()
	pool := x509.NewCertPool()
	pool.AddCert(h.root.Cert)
	cfg := &tls.Config{RootCAs: pool, ServerName: "istiod.istio-system.svc", MinVersion: tls.VersionTLS12}
	if clientCert != nil {
		cfg.Certificates = []tls.Certificate{*clientCert}
	}
	conn, err := grpc.NewClient(h.addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

type mintOptions struct {
	ns, sa string
	aud    string
	now    time.Time
	ttl    time.Duration
	key    crypto.Signer
}

func (h *harness) token(t testing.TB, o mintOptions) string {
	t.Helper()
	if o.ns == "" {
		o.ns = "default"
	}
	if o.sa == "" {
		o.sa = "demo"
	}
	if o.aud == "" {
		o.aud = "istio-ca"
	}
	if o.now.IsZero() {
		o.now = h.clock.Now()
	}
	if o.ttl == 0 {
		o.ttl = time.Hour
	}
	if o.key == nil {
		o.key = h.tokenKey
	}
	tok, err := token.Mint(o.key, token.MintParams{Issuer: "test", Audiences: []string{o.aud}, Namespace: o.ns, ServiceAccount: o.sa, TTL: o.ttl, Now: o.now})
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// request builds the request Istio's agent sends: a PEM CSR for its SPIFFE ID, a validity in
// seconds, and the ClusterID metadata.
func request(t testing.TB, key crypto.Signer, uris []string, dnsNames []string, ttl time.Duration) *pb.IstioCertificateRequest {
	t.Helper()
	tmpl := &x509.CertificateRequest{DNSNames: dnsNames}
	for _, u := range uris {
		parsed, err := url.Parse(u)
		if err != nil {
			t.Fatal(err)
		}
		tmpl.URIs = append(tmpl.URIs, parsed)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
	if err != nil {
		t.Fatal(err)
	}
	meta, err := structpb.NewStruct(map[string]any{"ClusterID": "Kubernetes"})
	if err != nil {
		t.Fatal(err)
	}
	return &pb.IstioCertificateRequest{
		Csr:              string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})),
		ValidityDuration: int64(ttl / time.Second),
		Metadata:         meta,
	}
}

// sha1Request is a request whose CSR is signed with ECDSA and SHA-1.
func sha1Request(t testing.TB) *pb.IstioCertificateRequest {
	t.Helper()
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{SignatureAlgorithm: x509.ECDSAWithSHA1}, p256(t))
	if err != nil {
		t.Fatal(err)
	}
	return &pb.IstioCertificateRequest{Csr: string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}))}
}

func withToken(ctx context.Context, tok string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok, "ClusterID", "Kubernetes")
}

func p256(t testing.TB) crypto.Signer {
	t.Helper()
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

func demoID() string { return "spiffe://cluster.local/ns/default/sa/demo" }

// parseChain decodes a response chain, one PEM per element.
func parseChain(t testing.TB, chain []string) []*x509.Certificate {
	t.Helper()
	var certs []*x509.Certificate
	for i, p := range chain {
		c, err := pki.ParseCertificates([]byte(p))
		if err != nil {
			t.Fatalf("element %d: %v", i, err)
		}
		if len(c) != 1 {
			t.Fatalf("element %d holds %d certificates, want one PEM per element", i, len(c))
		}
		certs = append(certs, c[0])
	}
	return certs
}

func TestCreateCertificateIssuesCallerIdentityWithIstioChainOrder(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	client := h.dial(t, nil)
	key := p256(t)
	resp, err := client.CreateCertificate(withToken(t.Context(), h.token(t, mintOptions{})), request(t, key, []string{demoID()}, nil, 0))
	if err != nil {
		t.Fatal(err)
	}
	chain := parseChain(t, resp.CertChain)
	if len(chain) != 3 {
		t.Fatalf("chain has %d elements, want leaf, intermediate, root", len(chain))
	}
	leaf := chain[0]
	if !chain[1].Equal(h.intermediate.Cert) || !chain[2].Equal(h.root.Cert) {
		t.Fatal("chain is not leaf, intermediate, root")
	}
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != demoID() {
		t.Fatalf("leaf URIs = %v, want [%s]", leaf.URIs, demoID())
	}
	if !pki.PublicKeysEqual(leaf.PublicKey, key.Public()) {
		t.Fatal("leaf does not carry the CSR's key")
	}
	roots := x509.NewCertPool()
	roots.AddCert(h.root.Cert)
	inter := x509.NewCertPool()
	inter.AddCert(chain[1])
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, CurrentTime: h.clock.Now(),
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth}}); err != nil {
		t.Fatalf("leaf does not verify against the root: %v", err)
	}
	if got, want := leaf.NotAfter.Sub(h.clock.Now()), time.Hour; got != want {
		t.Fatalf("lifetime %s, want the default %s", got, want)
	}
	if got := promtest.ToFloat64(counter(t, h.registry, "meshid_ca_certificates_issued_total", map[string]string{"auth_method": "jwt"})); got != 1 {
		t.Fatalf("issued counter = %v, want 1", got)
	}
}

func TestCreateCertificateRSAKeyAndTTLClamp(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{maxTTL: 2 * time.Hour})
	client := h.dial(t, nil)
	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		key  crypto.Signer
		ttl  time.Duration
		want time.Duration
	}{
		{"rsa default ttl", rsaKey, 0, time.Hour},
		{"requested ttl", p256(t), 30 * time.Minute, 30 * time.Minute},
		{"clamped to max", p256(t), 100 * time.Hour, 2 * time.Hour},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			resp, err := client.CreateCertificate(withToken(t.Context(), h.token(t, mintOptions{})), request(t, tt.key, nil, nil, tt.ttl))
			if err != nil {
				t.Fatal(err)
			}
			leaf := parseChain(t, resp.CertChain)[0]
			if got := leaf.NotAfter.Sub(h.clock.Now()); got != tt.want {
				t.Fatalf("lifetime %s, want %s", got, tt.want)
			}
		})
	}
}

// refusalCase is a request CreateCertificate refuses, with the code and the counted reason; the
// Mesh CA's service is checked on the same cases (meshca_test.go).
type refusalCase struct {
	name   string
	h      *harness
	auth   string // the authorization header value; "" sends none
	req    *pb.IstioCertificateRequest
	code   codes.Code
	reason string
}

// refusalCases are the refusals of authentication (h), of the CSR, and of targeting (hDisabled,
// which serves no namespace by default).
func refusalCases(t *testing.T, h, hDisabled *harness) []refusalCase {
	t.Helper()
	now := h.clock.Now()
	otherKey := p256(t)
	weakKey, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		t.Fatal(err)
	}
	p521, err := ecdsa.GenerateKey(elliptic.P521(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	good := func() *pb.IstioCertificateRequest { return request(t, p256(t), []string{demoID()}, nil, 0) }

	return []refusalCase{
		{"no credentials", h, "", good(), codes.Unauthenticated, "no_credentials"},
		{"not a bearer token", h, "Basic dXNlcjpwYXNz", good(), codes.Unauthenticated, "token_malformed"},
		{"garbage token", h, "Bearer not.a.jwt", good(), codes.Unauthenticated, "token_malformed"},
		{"expired token", h, "Bearer " + h.token(t, mintOptions{now: now.Add(-2 * time.Hour), ttl: time.Hour}), good(), codes.Unauthenticated, "token_expired"},
		{"token not yet valid", h, "Bearer " + h.token(t, mintOptions{now: now.Add(time.Hour)}), good(), codes.Unauthenticated, "token_not_yet_valid"},
		{"wrong audience", h, "Bearer " + h.token(t, mintOptions{aud: "kubernetes"}), good(), codes.Unauthenticated, "token_audience"},
		{"unknown key", h, "Bearer " + h.token(t, mintOptions{key: otherKey}), good(), codes.Unauthenticated, "token_unknown_key"},
		{"alg none", h, "Bearer " + unsignedToken(t, now), good(), codes.Unauthenticated, "token_signature"},
		{"HS256 with the public key as secret", h, "Bearer " + hmacWithPublicKey(t, h.tokenKey, now), good(), codes.Unauthenticated, "token_signature"},
		{"missing sub", h, "Bearer " + signClaims(t, h.tokenKey, jwt.MapClaims{"aud": "istio-ca", "exp": now.Add(time.Hour).Unix()}), good(), codes.Unauthenticated, "token_subject"},
		{"malformed sub", h, "Bearer " + signClaims(t, h.tokenKey, jwt.MapClaims{"aud": "istio-ca", "exp": now.Add(time.Hour).Unix(), "sub": "system:serviceaccount:Default"}), good(), codes.Unauthenticated, "token_subject"},
		{"garbage CSR", h, "Bearer " + h.token(t, mintOptions{}), &pb.IstioCertificateRequest{Csr: "hello"}, codes.InvalidArgument, "csr_malformed"},
		{"CSR for another identity", h, "Bearer " + h.token(t, mintOptions{}), request(t, p256(t), []string{"spiffe://cluster.local/ns/kube-system/sa/admin"}, nil, 0), codes.PermissionDenied, "csr_identity"},
		{"CSR with a DNS name", h, "Bearer " + h.token(t, mintOptions{}), request(t, p256(t), nil, []string{"evil.example.com"}, 0), codes.PermissionDenied, "csr_names"},
		{"CSR signed with SHA-1", h, "Bearer " + h.token(t, mintOptions{}), sha1Request(t), codes.InvalidArgument, "csr_signature_algorithm"},
		{"CSR with a weak RSA key", h, "Bearer " + h.token(t, mintOptions{}), request(t, weakKey, nil, nil, 0), codes.InvalidArgument, "csr_key"},
		{"CSR with a P-521 key", h, "Bearer " + h.token(t, mintOptions{}), request(t, p521, nil, nil, 0), codes.InvalidArgument, "csr_key"},
		{"negative validity", h, "Bearer " + h.token(t, mintOptions{}), &pb.IstioCertificateRequest{Csr: good().Csr, ValidityDuration: -5}, codes.InvalidArgument, "validity_duration"},
		{"namespace not targeted", hDisabled, "Bearer " + hDisabled.token(t, mintOptions{}), good(), codes.PermissionDenied, "namespace_not_targeted"},
	}
}

func TestCreateCertificateRefusals(t *testing.T) {
	t.Parallel()
	disabled := false
	h := newHarness(t, harnessOptions{})
	hDisabled := newHarness(t, harnessOptions{enabledByDefault: &disabled})
	tests := refusalCases(t, h, hDisabled)
	clients := map[*harness]pb.IstioCertificateServiceClient{h: h.dial(t, nil), hDisabled: hDisabled.dial(t, nil)}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := t.Context()
			if tt.auth != "" {
				ctx = metadata.AppendToOutgoingContext(ctx, "authorization", tt.auth)
			}
			_, err := clients[tt.h].CreateCertificate(ctx, tt.req)
			if got := status.Code(err); got != tt.code {
				t.Fatalf("code = %v (%v), want %v", got, err, tt.code)
			}
			labels := map[string]string{"reason": tt.reason, "code": tt.code.String()}
			if got := promtest.ToFloat64(counter(t, tt.h.registry, "meshid_ca_requests_refused_total", labels)); got < 1 {
				t.Fatalf("refusal not counted under %v", labels)
			}
			if tt.auth != "" && strings.Contains(tt.h.logs.String(), strings.TrimPrefix(tt.auth, "Bearer ")) {
				t.Fatal("the token appears in the logs")
			}
		})
	}
	// Each refusal is logged once.
	if got, want := strings.Count(h.logs.String(), `msg="certificate request refused"`), len(tests)-1; got != want {
		t.Fatalf("%d refusals logged, want %d", got, want)
	}
}

func TestCreateCertificateMTLS(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	// A workload first gets a certificate with its token...
	key := p256(t)
	resp, err := h.dial(t, nil).CreateCertificate(withToken(t.Context(), h.token(t, mintOptions{})), request(t, key, []string{demoID()}, nil, 0))
	if err != nil {
		t.Fatal(err)
	}
	issued := tlsCert(parseChain(t, resp.CertChain), key)
	foreign := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "foreign root"})

	leafFor := func(uris ...string) *tls.Certificate {
		k := p256(t)
		tmpl := &x509.Certificate{
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			KeyUsage:    x509.KeyUsageDigitalSignature,
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		}
		for _, u := range uris {
			parsed, _ := url.Parse(u)
			tmpl.URIs = append(tmpl.URIs, parsed)
		}
		return tlsCert([]*x509.Certificate{h.intermediate.Issue(t, tmpl, k.Public()), h.intermediate.Cert}, k)
	}
	foreignLeaf, foreignKey := foreign.IssueWorkload(t, demoID(), time.Hour)
	expiredTmpl := &x509.Certificate{NotBefore: time.Now().Add(-2 * time.Hour), NotAfter: time.Now().Add(-time.Hour),
		URIs: []*url.URL{mustURL(t, demoID())}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	expiredKey := p256(t)
	expired := tlsCert([]*x509.Certificate{h.intermediate.Issue(t, expiredTmpl, expiredKey.Public()), h.intermediate.Cert}, expiredKey)

	tests := []struct {
		name string
		cert *tls.Certificate
		uris []string
		code codes.Code
		want string
	}{
		{"own certificate renews the same identity", issued, []string{demoID()}, codes.OK, demoID()},
		{"own certificate without URI in the CSR", issued, nil, codes.OK, demoID()},
		{"own certificate asking for another identity", issued, []string{"spiffe://cluster.local/ns/default/sa/other"}, codes.PermissionDenied, ""},
		{"certificate of another trust domain", leafFor("spiffe://example.org/ns/default/sa/demo"), nil, codes.Unauthenticated, ""},
		{"certificate with two URIs", leafFor(demoID(), "spiffe://cluster.local/ns/default/sa/other"), nil, codes.Unauthenticated, ""},
		{"certificate without SPIFFE ID", leafFor(), nil, codes.Unauthenticated, ""},
		{"certificate of a foreign CA", tlsCert([]*x509.Certificate{foreignLeaf}, foreignKey), nil, codes.Unauthenticated, ""},
		{"expired certificate", expired, nil, codes.Unauthenticated, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			resp, err := h.dial(t, tt.cert).CreateCertificate(t.Context(), request(t, p256(t), tt.uris, nil, 0))
			if got := status.Code(err); got != tt.code {
				t.Fatalf("code = %v (%v), want %v", got, err, tt.code)
			}
			if tt.code != codes.OK {
				return
			}
			if leaf := parseChain(t, resp.CertChain)[0]; leaf.URIs[0].String() != tt.want {
				t.Fatalf("leaf names %s, want %s", leaf.URIs[0], tt.want)
			}
		})
	}
}

// A valid client certificate with a bad token still authenticates: the first success wins.
func TestCreateCertificateFirstSuccessWins(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	leaf, key := h.intermediate.IssueWorkload(t, demoID(), time.Hour)
	client := h.dial(t, tlsCert([]*x509.Certificate{leaf, h.intermediate.Cert}, key))
	expired := h.token(t, mintOptions{now: h.clock.Now().Add(-3 * time.Hour)})
	if _, err := client.CreateCertificate(withToken(t.Context(), expired), request(t, p256(t), nil, nil, 0)); err != nil {
		t.Fatalf("mTLS caller with an expired token refused: %v", err)
	}
}

// The CA core refuses with Unavailable when it has no key material.
func TestCreateCertificateNotReady(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	registry := prometheus.NewRegistry()
	metrics, err := server.NewMetrics(registry)
	if err != nil {
		t.Fatal(err)
	}
	keys, _ := token.NewKeySet(h.tokenKey.Public())
	verifier, _ := token.NewVerifier(token.VerifierConfig{Keys: keys, Audience: "istio-ca"})
	srv := server.New(server.Config{
		Signer:         ca.New(ca.Config{}, nil),
		Authenticators: []server.Authenticator{server.NewJWTAuthenticator(verifier, trustDomain)},
		Targeting:      controller.NewTargeting(controller.TargetingConfig{EnabledByDefault: true}),
		Metrics:        metrics,
	})
	ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs("authorization", "Bearer "+h.token(t, mintOptions{})))
	_, err = srv.CreateCertificate(ctx, request(t, p256(t), nil, nil, 0))
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("code = %v (%v), want Unavailable", status.Code(err), err)
	}
}

func TestServingCertificateNamesAndReissueOnBundleChange(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	serving := server.NewServingCertificate(h.authority, []string{"ca.example.com", "10.0.0.7", "istio-ca"}, h.clock)
	first, err := serving.GetCertificate(nil)
	if err != nil {
		t.Fatal(err)
	}
	leaf := first.Leaf
	for _, name := range []string{"istiod.istio-system.svc", "istio-ca", "localhost", "ca.example.com"} {
		if err := leaf.VerifyHostname(name); err != nil {
			t.Errorf("serving certificate does not cover %s: %v", name, err)
		}
	}
	for _, ip := range []string{"127.0.0.1", "::1", "10.0.0.7"} {
		if err := leaf.VerifyHostname(ip); err != nil {
			t.Errorf("serving certificate does not cover %s: %v", ip, err)
		}
	}
	if again, _ := serving.GetCertificate(nil); again != first {
		t.Fatal("serving certificate reissued with nothing changed")
	}
	// A new bundle in service gets a serving certificate issued by it.
	newRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "next root"})
	b, err := ca.NewBundle(ca.BundleParams{SigningCert: newRoot.Cert, SigningKey: newRoot.Key, Source: ca.SourcePluggedIn, Now: h.clock.Now()})
	if err != nil {
		t.Fatal(err)
	}
	h.authority.SetBundle(b)
	next, err := serving.GetCertificate(nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := next.Leaf.CheckSignatureFrom(newRoot.Cert); err != nil {
		t.Fatalf("serving certificate not reissued under the new bundle: %v", err)
	}
	// Past half its lifetime, it is renewed.
	h.clock.Advance(server.DefaultServingTTL/2 + time.Minute)
	renewed, err := serving.GetCertificate(nil)
	if err != nil {
		t.Fatal(err)
	}
	if renewed == next {
		t.Fatal("serving certificate not renewed past half its lifetime")
	}
}

func counter(t testing.TB, reg *prometheus.Registry, name string, labels map[string]string) prometheus.Collector {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	metrics:
		for _, m := range f.GetMetric() {
			for _, lp := range m.GetLabel() {
				if labels[lp.GetName()] != lp.GetValue() {
					continue metrics
				}
			}
			return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "x", Help: "x"}, func() float64 { return m.GetCounter().GetValue() })
		}
	}
	return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "x", Help: "x"}, func() float64 { return 0 })
}

func tlsCert(chain []*x509.Certificate, key crypto.Signer) *tls.Certificate {
	c := &tls.Certificate{PrivateKey: key, Leaf: chain[0]}
	for _, x := range chain {
		c.Certificate = append(c.Certificate, x.Raw)
	}
	return c
}

func mustURL(t testing.TB, s string) *url.URL {
	t.Helper()
	u, err := url.Parse(s)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

func b64(v any) string {
	data, _ := json.Marshal(v)
	return base64.RawURLEncoding.EncodeToString(data)
}

func goodClaims(now time.Time) map[string]any {
	return map[string]any{"aud": []string{"istio-ca"}, "sub": "system:serviceaccount:default:demo", "exp": now.Add(time.Hour).Unix()}
}

func unsignedToken(t testing.TB, now time.Time) string {
	t.Helper()
	return b64(map[string]string{"alg": "none", "typ": "JWT"}) + "." + b64(goodClaims(now)) + "."
}

func hmacWithPublicKey(t testing.TB, key crypto.Signer, now time.Time) string {
	t.Helper()
	der, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		t.Fatal(err)
	}
	secret := pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der})
	s, err := jwt.NewWithClaims(jwt.SigningMethodHS256, jwt.MapClaims(goodClaims(now))).SignedString(secret)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func signClaims(t testing.TB, key crypto.Signer, claims jwt.MapClaims) string {
	t.Helper()
	s, err := jwt.NewWithClaims(jwt.SigningMethodES256, claims).SignedString(key)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

type failingTargeting struct{}

func (failingTargeting) Targets(context.Context, string) (bool, string, error) {
	return false, "", errors.New("namespace store unreachable")
}

// When the namespace store cannot answer, the caller is told to retry, not refused for good.
func TestCreateCertificateTargetingUnavailable(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	keys, _ := token.NewKeySet(h.tokenKey.Public())
	verifier, _ := token.NewVerifier(token.VerifierConfig{Keys: keys, Audience: "istio-ca"})
	srv := server.New(server.Config{
		Signer:         h.authority,
		Authenticators: []server.Authenticator{server.NewJWTAuthenticator(verifier, trustDomain)},
		Targeting:      failingTargeting{},
	})
	ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs("authorization", "Bearer "+h.token(t, mintOptions{})))
	_, err := srv.CreateCertificate(ctx, request(t, p256(t), nil, nil, 0))
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "namespace store unreachable") {
		t.Fatalf("error %v, want Unavailable naming the cause", err)
	}
}

// failingSigner fails as a broken key backend might, with details meant for the operator only.
type failingSigner struct{ err error }

func (f failingSigner) SignWorkload(context.Context, ca.WorkloadRequest) (*ca.Issued, error) {
	return nil, f.err
}

func (f failingSigner) SignCA(context.Context, ca.CARequest) (*ca.Issued, error) {
	return nil, f.err
}

// An unexpected failure reaches the caller as Internal with a fixed message; its text, which may
// name files or backends, stays in the CA's log.
func TestCreateCertificateInternalErrorText(t *testing.T) {
	t.Parallel()
	const detail = "pkcs11 slot 3: pin rejected by /var/lib/meshid/hsm.conf"
	h := newHarness(t, harnessOptions{signer: failingSigner{err: fmt.Errorf("sign: %w", errors.New(detail))}})
	_, err := h.dial(t, nil).CreateCertificate(withToken(t.Context(), h.token(t, mintOptions{})), request(t, p256(t), []string{demoID()}, nil, 0))
	st, _ := status.FromError(err)
	if st.Code() != codes.Internal {
		t.Fatalf("code = %v (%v), want Internal", st.Code(), err)
	}
	if st.Message() == "" || strings.Contains(st.Message(), "pin rejected") || strings.Contains(st.Message(), "hsm.conf") {
		t.Fatalf("the caller was told %q, want a fixed message without the inner error", st.Message())
	}
	if got := strings.Count(h.logs.String(), detail); got != 1 {
		t.Fatalf("the inner error is logged %d times, want once:\n%s", got, h.logs.String())
	}
	labels := map[string]string{"reason": "internal", "code": codes.Internal.String()}
	if got := promtest.ToFloat64(counter(t, h.registry, "meshid_ca_requests_refused_total", labels)); got != 1 {
		t.Fatalf("refusal counted %v times under %v, want 1", got, labels)
	}
}

// A token without kid names its key only when the CA trusts a single one; with several it is
// refused as the other token errors are, not tried against each key.
func TestCreateCertificateTokenWithoutKid(t *testing.T) {
	t.Parallel()
	single := newHarness(t, harnessOptions{})
	several := newHarness(t, harnessOptions{moreTokenKeys: []crypto.PublicKey{p256(t).Public()}})
	for _, tt := range []struct {
		name string
		h    *harness
		code codes.Code
	}{
		{"single key", single, codes.OK},
		{"several keys", several, codes.Unauthenticated},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			noKid := signClaims(t, tt.h.tokenKey, jwt.MapClaims(goodClaims(tt.h.clock.Now())))
			_, err := tt.h.dial(t, nil).CreateCertificate(withToken(t.Context(), noKid), request(t, p256(t), []string{demoID()}, nil, 0))
			if got := status.Code(err); got != tt.code {
				t.Fatalf("code = %v (%v), want %v", got, err, tt.code)
			}
			if tt.code == codes.OK {
				return
			}
			if !strings.Contains(err.Error(), "kid") {
				t.Fatalf("refused with %q, want a message about the missing kid", err)
			}
			labels := map[string]string{"reason": "token_no_kid", "code": tt.code.String()}
			if got := promtest.ToFloat64(counter(t, tt.h.registry, "meshid_ca_requests_refused_total", labels)); got != 1 {
				t.Fatalf("refusal counted %v times under %v, want 1", got, labels)
			}
		})
	}
}
