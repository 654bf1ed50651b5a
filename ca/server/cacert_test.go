package server_test

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"strings"
	"testing"
	"time"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/server"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// caRequest is what a downstream CA sends: a CSR whose extension request asks for CA:true.
func caRequest(t testing.TB, ttl time.Duration) *pb.IstioCertificateRequest {
	t.Helper()
	der, err := ca.NewCACSR(p256(t))
	if err != nil {
		t.Fatal(err)
	}
	return &pb.IstioCertificateRequest{
		Csr:              string(pem.EncodeToMemory(&pem.Block{Type: pki.BlockCertificateRequest, Bytes: der})),
		ValidityDuration: int64(ttl / time.Second),
	}
}

func downstreamID() pki.SPIFFEID {
	return pki.SPIFFEID{TrustDomain: trustDomain, Namespace: "site-a", ServiceAccount: "meshid-ca"}
}

// A listed identity gets a CA certificate for its own identity: CA, path length 0, certSign and
// cRLSign, URIs constrained to its trust domain, chained to the upstream's root.
func TestCreateCertificateSignsCACertForListedIdentity(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{caCertIDs: []pki.SPIFFEID{downstreamID()}})
	tok := h.token(t, mintOptions{ns: "site-a", sa: "meshid-ca"})
	resp, err := h.dial(t, nil).CreateCertificate(withToken(t.Context(), tok), caRequest(t, 24*time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	chain := parseChain(t, resp.GetCertChain())
	if len(chain) != 3 {
		t.Fatalf("chain has %d certificates, want CA certificate, intermediate, root", len(chain))
	}
	c := chain[0]
	switch {
	case !c.BasicConstraintsValid || !c.IsCA:
		t.Errorf("not a CA certificate")
	case c.MaxPathLen != 0 || !c.MaxPathLenZero:
		t.Errorf("MaxPathLen = %d (zero %v), want 0", c.MaxPathLen, c.MaxPathLenZero)
	case c.KeyUsage != x509.KeyUsageCertSign|x509.KeyUsageCRLSign:
		t.Errorf("KeyUsage = %v, want certSign|cRLSign", c.KeyUsage)
	case len(c.PermittedURIDomains) != 1 || c.PermittedURIDomains[0] != trustDomain || !c.PermittedDNSDomainsCritical:
		t.Errorf("PermittedURIDomains = %v (critical %v), want [%s], critical", c.PermittedURIDomains, c.PermittedDNSDomainsCritical, trustDomain)
	case len(c.URIs) != 1 || c.URIs[0].String() != downstreamID().String():
		t.Errorf("URIs = %v, want the caller's %s", c.URIs, downstreamID())
	}
	pool := x509.NewCertPool()
	pool.AddCert(h.root.Cert)
	inter := x509.NewCertPool()
	inter.AddCert(chain[1])
	if _, err := c.Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, CurrentTime: h.clock.Now(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Fatalf("CA certificate does not chain to the root: %v", err)
	}
	if !strings.Contains(h.logs.String(), "CA certificate issued") {
		t.Errorf("no log of the CA certificate issued:\n%s", h.logs.String())
	}
}

// A CA certificate is refused, with PermissionDenied, logged with who asked and counted, to an
// identity not listed and by a CA that signs none; a workload request of a listed identity still
// gets a workload certificate.
func TestCreateCertificateCACertPolicy(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		ids        []pki.SPIFFEID
		ns, sa     string
		workload   bool
		wantReason string // empty: signed
	}{
		{name: "unlisted identity", ids: []pki.SPIFFEID{downstreamID()}, ns: "default", sa: "demo", wantReason: "ca_cert_identity"},
		{name: "another trust domain's listing", ids: []pki.SPIFFEID{{TrustDomain: "other.example", Namespace: "site-a", ServiceAccount: "meshid-ca"}},
			ns: "site-a", sa: "meshid-ca", wantReason: "ca_cert_identity"},
		{name: "no --sign-ca-certs", ns: "site-a", sa: "meshid-ca", wantReason: "ca_cert_not_signed"},
		{name: "workload request of a listed identity", ids: []pki.SPIFFEID{downstreamID()}, ns: "site-a", sa: "meshid-ca", workload: true},
		{name: "workload request without --sign-ca-certs", ns: "default", sa: "demo", workload: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, harnessOptions{caCertIDs: tt.ids})
			tok := h.token(t, mintOptions{ns: tt.ns, sa: tt.sa})
			req := caRequest(t, time.Hour)
			if tt.workload {
				req = request(t, p256(t), nil, nil, time.Hour)
			}
			resp, err := h.dial(t, nil).CreateCertificate(withToken(t.Context(), tok), req)
			if tt.wantReason == "" {
				if err != nil {
					t.Fatal(err)
				}
				if leaf := parseChain(t, resp.GetCertChain())[0]; leaf.IsCA {
					t.Fatal("a workload request got a CA certificate")
				}
				return
			}
			if status.Code(err) != codes.PermissionDenied {
				t.Fatalf("err = %v, want PermissionDenied", err)
			}
			labels := map[string]string{"reason": tt.wantReason, "code": codes.PermissionDenied.String()}
			if got := promtest.ToFloat64(counter(t, h.registry, "meshid_ca_requests_refused_total", labels)); got != 1 {
				t.Errorf("refusals %v = %v, want 1", labels, got)
			}
			logs := h.logs.String()
			who := "spiffe://" + trustDomain + "/ns/" + tt.ns + "/sa/" + tt.sa
			if strings.Count(logs, "certificate request refused") != 1 || !strings.Contains(logs, who) || !strings.Contains(logs, tt.wantReason) {
				t.Errorf("want one refusal logged with %s and %s:\n%s", who, tt.wantReason, logs)
			}
		})
	}
}

// A listed identity that shows a client certificate instead of a token is refused a CA
// certificate: a CA under the same root could have minted that certificate.
func TestCreateCertificateCACertNotForClientCertificates(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{caCertIDs: []pki.SPIFFEID{downstreamID()}})
	leaf, key := h.intermediate.IssueWorkload(t, downstreamID().String(), time.Hour)
	client := h.dial(t, tlsCert([]*x509.Certificate{leaf, h.intermediate.Cert}, key))
	if _, err := client.CreateCertificate(t.Context(), request(t, p256(t), []string{downstreamID().String()}, nil, time.Hour)); err != nil {
		t.Fatalf("the client certificate does not authenticate: %v", err)
	}
	_, err := client.CreateCertificate(t.Context(), caRequest(t, time.Hour))
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("err = %v, want PermissionDenied", err)
	}
	labels := map[string]string{"reason": "ca_cert_credential", "code": codes.PermissionDenied.String()}
	if got := promtest.ToFloat64(counter(t, h.registry, "meshid_ca_requests_refused_total", labels)); got != 1 {
		t.Errorf("refusals %v = %v, want 1", labels, got)
	}
}

// A CA certificate's lifetime is clamped like a workload's to the maximum, and never outlives
// the upstream's own signing certificate.
func TestCreateCertificateCACertTTLClamp(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		maxTTL time.Duration
		want   func(h *harness) time.Time
	}{
		{name: "maximum", maxTTL: 48 * time.Hour, want: func(h *harness) time.Time { return h.clock.Now().Add(48 * time.Hour) }},
		{name: "signing certificate's expiry", maxTTL: 5 * 365 * 24 * time.Hour, want: func(h *harness) time.Time { return h.intermediate.Cert.NotAfter }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, harnessOptions{maxTTL: tt.maxTTL, caCertIDs: []pki.SPIFFEID{downstreamID()}})
			tok := h.token(t, mintOptions{ns: "site-a", sa: "meshid-ca"})
			resp, err := h.dial(t, nil).CreateCertificate(withToken(t.Context(), tok), caRequest(t, 10*365*24*time.Hour))
			if err != nil {
				t.Fatal(err)
			}
			if got, want := parseChain(t, resp.GetCertChain())[0].NotAfter, tt.want(h); !got.Equal(want) {
				t.Fatalf("NotAfter = %s, want %s", got, want)
			}
		})
	}
}

// downstreamOf is a downstream CA's signing certificate and key, as root's CA signs it for
// downstreamID with SignCA.
func downstreamOf(t testing.TB, root *testutil.CA, clk *testutil.FakeClock) *testutil.CA {
	t.Helper()
	b, err := ca.NewBundle(ca.BundleParams{SigningCert: root.Cert, SigningKey: root.Key, Source: ca.SourceSelfSigned, Now: clk.Now()})
	if err != nil {
		t.Fatal(err)
	}
	upstream := ca.New(ca.Config{Clock: clk, CACertIdentities: []pki.SPIFFEID{downstreamID()}}, b)
	key := p256(t)
	der, err := ca.NewCACSR(key)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil {
		t.Fatal(err)
	}
	issued, err := upstream.SignCA(t.Context(), ca.CARequest{CSR: csr, Identity: downstreamID(), TTL: 30 * 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	return &testutil.CA{Cert: issued.Leaf, Key: key}
}

// headerAuthenticator stands for an authenticator the CA may gain, of neither a token nor a
// client certificate: it takes the caller's identity from a metadata header.
type headerAuthenticator struct{}

func (headerAuthenticator) Authenticate(ctx context.Context) (server.Caller, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	ids := md.Get("x-test-identity")
	if len(ids) != 1 {
		return server.Caller{}, server.ErrNoCredentials
	}
	id, err := pki.ParseSPIFFEID(ids[0])
	if err != nil {
		return server.Caller{}, err
	}
	return server.Caller{Identity: id, Method: "header"}, nil
}

// What only a token proves is refused to any other authenticator's caller, not only to a client
// certificate's: a CA certificate, and another workload's identity.
func TestTokenOnlyRequestsRefusedToOtherAuthenticators(t *testing.T) {
	t.Parallel()
	node := server.NodeAccount{Namespace: "kube-system", ServiceAccount: "node-agent"}
	h := newHarness(t, harnessOptions{caCertIDs: []pki.SPIFFEID{downstreamID()}, trustedNodes: []server.NodeAccount{node},
		authenticators: []server.Authenticator{headerAuthenticator{}}})
	client := h.dial(t, nil)
	as := func(id string) context.Context {
		return metadata.AppendToOutgoingContext(t.Context(), "x-test-identity", id)
	}
	if _, err := client.CreateCertificate(as(downstreamID().String()), caRequest(t, time.Hour)); status.Code(err) != codes.PermissionDenied {
		t.Errorf("a CA certificate for a listed identity by a header: %v, want PermissionDenied", err)
	}
	req := impersonating(t, request(t, p256(t), nil, nil, 0), "spiffe://"+trustDomain+"/ns/shop/sa/web")
	if _, err := client.CreateCertificate(as("spiffe://"+trustDomain+"/ns/kube-system/sa/node-agent"), req); status.Code(err) != codes.PermissionDenied {
		t.Errorf("impersonation by a trusted node account by a header: %v, want PermissionDenied", err)
	}
}
