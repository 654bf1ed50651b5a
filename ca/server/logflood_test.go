package server_test

import (
	"crypto/x509"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/ca/server"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/testutil"
)

// Attack: a client without credentials sent tokens with a 1 MB kid, and each refusal copied the
// kid into a WARN line and into the status sent back: 50 MB of log in 3.5 s. Every string of the
// client that a refusal quotes is now bounded.
func TestRefusalsQuoteClientStringsBounded(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	client := h.dial(t, nil)
	huge := strings.Repeat("k", 1<<20)
	// 64 KB is as good a test of the other strings, and much faster under the race detector.
	long := strings.Repeat("n", 64<<10)
	now := h.clock.Now()

	hugeKid := jwt.NewWithClaims(jwt.SigningMethodES256, jwt.MapClaims(goodClaims(now)))
	hugeKid.Header["kid"] = huge
	hugeKidToken, err := hugeKid.SignedString(h.tokenKey)
	if err != nil {
		t.Fatal(err)
	}
	longSub := func(sub string) string {
		return signClaims(t, h.tokenKey, jwt.MapClaims{"aud": "istio-ca", "exp": now.Add(time.Hour).Unix(), "sub": sub})
	}
	longURI := request(t, p256(t), []string{"spiffe://cluster.local/ns/default/sa/" + long}, nil, 0)
	// x509 quotes the subject of a certificate the client presented: a chain whose intermediate
	// has the leaf's issuer name but not its key, named at length (the TLS handshake takes 64 KB).
	named := testutil.CAOptions{CommonName: strings.Repeat("c", 16<<10)}
	impostor := testutil.NewRootCA(t, named)
	signer := testutil.NewRootCA(t, named)
	leaf, leafKey := signer.IssueWorkload(t, demoID(), time.Hour)
	longChain := h.dial(t, tlsCert([]*x509.Certificate{leaf, impostor.Cert}, leafKey))
	// A certificate the CA's own chain vouches for, but whose URI is no workload's: a plugged-in
	// corporate root may have certified anything.
	odd, oddKey := h.intermediate.IssueWorkload(t, "spiffe://cluster.local/x/"+long[:16<<10], time.Hour)
	longURIClient := h.dial(t, tlsCert([]*x509.Certificate{odd, h.intermediate.Cert}, oddKey))
	for _, tt := range []struct {
		name   string
		client pb.IstioCertificateServiceClient
		token  string // "" sends none
		req    *pb.IstioCertificateRequest
		reason string
		most   int // bytes logged
	}{
		{"a megabyte kid", client, hugeKidToken, request(t, p256(t), nil, nil, 0), "token_unknown_key", 1024},
		{"a long sub", client, longSub(long), request(t, p256(t), nil, nil, 0), "token_subject", 1024},
		{"a long namespace", client, longSub(token.Subject(long, "demo")), request(t, p256(t), nil, nil, 0), "token_subject", 1024},
		{"a long service account", client, longSub(token.Subject("default", long)), request(t, p256(t), nil, nil, 0), "token_subject", 1024},
		{"a long URI SAN in the CSR", client, h.token(t, mintOptions{}), longURI, "csr_identity", 1024},
		{"a client certificate with a long URI SAN", longURIClient, "", request(t, p256(t), nil, nil, 0), "client_certificate", 1024},
		// The whole error text is bounded too, at 1 KB.
		{"a client certificate naming a long subject", longChain, "", request(t, p256(t), nil, nil, 0), "client_certificate", 1536},
	} {
		// One at a time: each reads the log lines its request added.
		t.Run(tt.name, func(t *testing.T) {
			before := len(h.logs.String())
			ctx := t.Context()
			if tt.token != "" {
				ctx = withToken(ctx, tt.token)
			}
			_, err := tt.client.CreateCertificate(ctx, tt.req)
			if status.Code(err) == codes.OK {
				t.Fatal("accepted")
			}
			lines := h.logs.String()[before:]
			if !strings.Contains(lines, "reason="+tt.reason) {
				t.Fatalf("refused with %.500v, want reason %s; logged:\n%.500s", err, tt.reason, lines)
			}
			if len(lines) > tt.most {
				t.Fatalf("the refusal logged %d bytes, want one line of at most %d:\n%.500s…", len(lines), tt.most, lines)
			}
			if msg := status.Convert(err).Message(); len(msg) > tt.most {
				t.Fatalf("the status sent back is %d bytes", len(msg))
			}
		})
	}
}

// Attack: refusals need no credentials, so a client can have one logged per request. Their lines
// are rate-limited per reason; every refusal is still counted, the next line logged says how many
// were left out, and a flood of one reason does not hide the others.
func TestRefusalLogIsRateLimited(t *testing.T) {
	t.Parallel()
	clk := testutil.NewFakeClock(time.Now())
	registry := prometheus.NewRegistry()
	metrics, err := server.NewMetrics(registry)
	if err != nil {
		t.Fatal(err)
	}
	logs := &testutil.SyncBuffer{}
	key := p256(t)
	keys, _ := token.NewKeySet(key.Public())
	verifier, _ := token.NewVerifier(token.VerifierConfig{Keys: keys, Audience: "istio-ca", Now: clk.Now})
	srv := server.New(server.Config{
		Authenticators: []server.Authenticator{server.NewJWTAuthenticator(verifier, trustDomain)},
		Targeting:      controller.NewTargeting(controller.TargetingConfig{EnabledByDefault: true}),
		Metrics:        metrics,
		Logger:         slog.New(slog.NewTextHandler(logs, nil)),
		Clock:          clk,
	})
	req := request(t, p256(t), nil, nil, 0)
	refuse := func(md metadata.MD) {
		t.Helper()
		if _, err := srv.CreateCertificate(metadata.NewIncomingContext(t.Context(), md), req); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("code %v, want Unauthenticated", status.Code(err))
		}
	}
	lines := func() int { return strings.Count(logs.String(), "certificate request refused") }

	const flood = 1000
	for range flood {
		refuse(metadata.MD{})
	}
	logged := lines()
	if logged == 0 || logged > 20 {
		t.Fatalf("%d refusals in an instant logged %d lines, want a few", flood, logged)
	}
	labels := map[string]string{"reason": "no_credentials", "code": codes.Unauthenticated.String()}
	if got := promtest.ToFloat64(counter(t, registry, "meshid_ca_requests_refused_total", labels)); got != flood {
		t.Fatalf("refusals counted %v, want every one of %d", got, flood)
	}
	// Another kind of refusal is logged during the flood.
	refuse(metadata.Pairs("authorization", "Bearer not.a.jwt"))
	if !strings.Contains(logs.String(), "reason=token_malformed") {
		t.Fatal("a flood of one reason held back the line of another")
	}

	clk.Advance(time.Second)
	refuse(metadata.MD{})
	if lines() != logged+2 {
		t.Fatalf("a second later the refusal was not logged")
	}
	m := regexp.MustCompile(`reason=no_credentials .*suppressed=(\d+)`).FindStringSubmatch(logs.String())
	if m == nil {
		t.Fatalf("the line after the flood does not say how many were left out:\n%s", logs)
	}
	if n, _ := strconv.Atoi(m[1]); logged+n != flood {
		t.Fatalf("%d logged and %d said left out, want %d in all", logged, n, flood)
	}
}
