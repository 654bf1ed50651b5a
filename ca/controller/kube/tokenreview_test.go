//go:build external

package kube_test

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"
	authenticationv1 "k8s.io/api/authentication/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	authenticationv1client "k8s.io/client-go/kubernetes/typed/authentication/v1"
	rbacv1client "k8s.io/client-go/kubernetes/typed/rbac/v1"
	"k8s.io/client-go/rest"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/ca/controller/kube"
	"github.com/meshid/meshid/ca/controller/kube/kubetest"
	caserver "github.com/meshid/meshid/ca/server"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

const reviewTrustDomain = "td.example"

// countingReviews counts the TokenReviews sent through the real client it wraps.
type countingReviews struct {
	authenticationv1client.TokenReviewInterface
	n atomic.Int64
}

func (c *countingReviews) Create(ctx context.Context, tr *authenticationv1.TokenReview, opts metav1.CreateOptions) (*authenticationv1.TokenReview, error) {
	c.n.Add(1)
	return c.TokenReviewInterface.Create(ctx, tr, opts)
}

type reviewer struct {
	auth     *kube.TokenReviewAuthenticator
	reviews  *countingReviews
	registry *prometheus.Registry
	clock    *testutil.FakeClock
}

// newReviewer returns a TokenReviewAuthenticator calling the API server as cfg (admin when nil),
// on a fake clock.
func newReviewer(t testing.TB, cfg *rest.Config, audience string) *reviewer {
	t.Helper()
	if cfg == nil {
		cfg = env.Admin
	}
	clients := clientsFor(t, cfg)
	r := &reviewer{
		reviews:  &countingReviews{TokenReviewInterface: clients.Authentication.TokenReviews()},
		registry: prometheus.NewRegistry(),
		clock:    testutil.NewFakeClock(time.Now()),
	}
	var err error
	r.auth, err = kube.NewTokenReviewAuthenticator(kube.TokenReviewConfig{
		Reviews: r.reviews, Audience: audience, TrustDomain: reviewTrustDomain,
		Clock: r.clock, Registerer: r.registry,
	})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func reviewBearer(ctx context.Context, tok string) context.Context {
	return metadata.NewIncomingContext(ctx, metadata.Pairs("authorization", "Bearer "+tok))
}

func TestTokenReviewAuthenticatesServiceAccount(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	env.ServiceAccount(t, ns, "workload")
	r := newReviewer(t, nil, "")
	tok := env.Token(t, ns, "workload", time.Hour, "istio-ca")
	caller, err := r.auth.Authenticate(reviewBearer(t.Context(), tok))
	if err != nil {
		t.Fatal(err)
	}
	if want := "spiffe://" + reviewTrustDomain + "/ns/" + ns + "/sa/workload"; caller.Identity.String() != want || caller.Method != "tokenreview" {
		t.Fatalf("caller %s by %q, want %s by tokenreview", caller.Identity, caller.Method, want)
	}
	// The streams of one token are capped together, whichever authenticator accepted it.
	if want := caserver.TokenCredential(tok); caller.Credential != want {
		t.Fatalf("credential %q, want %q", caller.Credential, want)
	}
	if got := metric(t, r.registry, "meshid_ca_token_reviews_total", "outcome", "authenticated"); got != 1 {
		t.Fatalf("%v authenticated reviews counted, want 1", got)
	}
}

func TestTokenReviewRefusals(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	env.ServiceAccount(t, ns, "workload")
	env.ServiceAccount(t, ns, "gone")
	goneToken := env.Token(t, ns, "gone", time.Hour, "istio-ca")
	if err := env.Core().ServiceAccounts(ns).Delete(t.Context(), "gone", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	admin := clientsFor(t, env.Admin)
	// The API server learns of the deletion through its own watch: wait until it refuses the
	// token, so that the authenticator below sees the settled state.
	kubetest.Until(t, "the API server to refuse the deleted service account's token", func() bool {
		tr, err := admin.Authentication.TokenReviews().Create(t.Context(), &authenticationv1.TokenReview{
			Spec: authenticationv1.TokenReviewSpec{Token: goneToken, Audiences: []string{"istio-ca"}},
		}, metav1.CreateOptions{})
		return err == nil && !tr.Status.Authenticated
	})

	for _, tt := range []struct {
		name     string
		audience string // of the authenticator; "" is istio-ca
		token    string
		target   error
		mention  string
	}{
		{"wrong audience", "", env.Token(t, ns, "workload", time.Hour, "other"), caserver.ErrTokenRejected, "audience"},
		{"deleted service account", "", goneToken, caserver.ErrTokenRejected, ""},
		{"garbage", "", "not-a-token", caserver.ErrTokenRejected, ""},
		// The token-auth-file user is audience-unaware: the API server authenticates it only
		// for its own audience.
		{"a user for the audience istio-ca", "", env.Admin.BearerToken, caserver.ErrTokenRejected, ""},
		{"a user that is no service account", kubetest.Issuer, env.Admin.BearerToken, token.ErrSubject, `user "admin", not a service account`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			r := newReviewer(t, nil, tt.audience)
			caller, err := r.auth.Authenticate(reviewBearer(t.Context(), tt.token))
			if !errors.Is(err, tt.target) {
				t.Fatalf("Authenticate = %v, %v; want an error wrapping %v", caller, err, tt.target)
			}
			t.Logf("refused: %v", err)
			if !strings.Contains(err.Error(), tt.mention) {
				t.Fatalf("error %q does not mention %q", err, tt.mention)
			}
			if strings.Contains(err.Error(), tt.token) {
				t.Fatal("the error quotes the token")
			}
			if got := metric(t, r.registry, "meshid_ca_token_reviews_total", "outcome", "refused"); got != 1 {
				t.Fatalf("%v refused reviews counted, want 1", got)
			}
		})
	}

	t.Run("no bearer token", func(t *testing.T) {
		t.Parallel()
		r := newReviewer(t, nil, "")
		if _, err := r.auth.Authenticate(t.Context()); !errors.Is(err, caserver.ErrNoCredentials) {
			t.Fatalf("error %v, want one wrapping ErrNoCredentials", err)
		}
		if n := r.reviews.n.Load(); n != 0 {
			t.Fatalf("%d TokenReviews sent for a request without a token", n)
		}
	})
}

// Many concurrent and repeated renewals with one token cost one TokenReview, until the cache
// entry expires: after the TTL, or at the token's exp when that comes first.
func TestTokenReviewCache(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	env.ServiceAccount(t, ns, "workload")
	tok := env.Token(t, ns, "workload", time.Hour, "istio-ca")

	t.Run("shared and cached for the TTL", func(t *testing.T) {
		t.Parallel()
		r := newReviewer(t, nil, "")
		const callers, rounds = 50, 3
		var wg sync.WaitGroup
		errs := make(chan error, callers*rounds)
		for range callers {
			wg.Go(func() {
				for range rounds {
					if _, err := r.auth.Authenticate(reviewBearer(t.Context(), tok)); err != nil {
						errs <- err
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		if n := r.reviews.n.Load(); n != 1 {
			t.Fatalf("%d TokenReviews for %d authentications of one token, want 1", n, callers*rounds)
		}
		// Those that joined the one review in flight are neither reviews nor hits.
		if hits := metric(t, r.registry, "meshid_ca_token_review_cache_hits_total", "outcome", "authenticated"); hits < callers*(rounds-1) {
			t.Fatalf("%v cache hits, want at least %d", hits, callers*(rounds-1))
		}
		r.clock.Advance(time.Minute - time.Second)
		mustReview(t, r, tok)
		if n := r.reviews.n.Load(); n != 1 {
			t.Fatalf("%d TokenReviews before the TTL ran out, want 1", n)
		}
		r.clock.Advance(2 * time.Second)
		mustReview(t, r, tok)
		if n := r.reviews.n.Load(); n != 2 {
			t.Fatalf("%d TokenReviews once the TTL ran out, want 2", n)
		}
	})

	t.Run("never past the token's exp", func(t *testing.T) {
		t.Parallel()
		r := newReviewer(t, nil, "")
		// TokenRequest issues tokens for at least 10 minutes: the fake clock is moved to 30 s
		// before this one's exp instead, sooner than the TTL of a minute.
		exp := reviewExpiry(t, tok)
		r.clock.Set(exp.Add(-30 * time.Second))
		mustReview(t, r, tok)
		mustReview(t, r, tok)
		if n := r.reviews.n.Load(); n != 1 {
			t.Fatalf("%d TokenReviews before exp, want 1", n)
		}
		r.clock.Set(exp)
		mustReview(t, r, tok) // the API server, on the real clock, still accepts it
		if n := r.reviews.n.Load(); n != 2 {
			t.Fatalf("%d TokenReviews at exp, want 2: the cache served a token past its exp", n)
		}
	})

	t.Run("refusals cached briefly", func(t *testing.T) {
		t.Parallel()
		r := newReviewer(t, nil, "")
		for range 20 {
			if _, err := r.auth.Authenticate(reviewBearer(t.Context(), "not-a-token")); !errors.Is(err, caserver.ErrTokenRejected) {
				t.Fatalf("error %v, want a refusal", err)
			}
		}
		if n := r.reviews.n.Load(); n != 1 {
			t.Fatalf("%d TokenReviews for one bad token sent 20 times, want 1", n)
		}
		r.clock.Advance(11 * time.Second)
		if _, err := r.auth.Authenticate(reviewBearer(t.Context(), "not-a-token")); !errors.Is(err, caserver.ErrTokenRejected) {
			t.Fatalf("error %v, want a refusal", err)
		}
		if n := r.reviews.n.Load(); n != 2 {
			t.Fatalf("%d TokenReviews after the refusal expired, want 2", n)
		}
	})

	t.Run("bounded", func(t *testing.T) {
		t.Parallel()
		clients := clientsFor(t, env.Admin)
		reviews := &countingReviews{TokenReviewInterface: clients.Authentication.TokenReviews()}
		auth, err := kube.NewTokenReviewAuthenticator(kube.TokenReviewConfig{
			Reviews: reviews, TrustDomain: reviewTrustDomain, MaxEntries: 2, Clock: testutil.NewFakeClock(time.Now()),
		})
		if err != nil {
			t.Fatal(err)
		}
		env.ServiceAccount(t, ns, "second")
		env.ServiceAccount(t, ns, "third")
		tokens := []string{tok, env.Token(t, ns, "second", time.Hour, "istio-ca"), env.Token(t, ns, "third", time.Hour, "istio-ca")}
		for _, tk := range append(tokens, tokens[1], tokens[2], tokens[0]) {
			if _, err := auth.Authenticate(reviewBearer(t.Context(), tk)); err != nil {
				t.Fatal(err)
			}
		}
		// The third token evicted the first, the oldest: asked again, it costs a review.
		if n := reviews.n.Load(); n != 4 {
			t.Fatalf("%d TokenReviews, want 4", n)
		}
	})
}

func mustReview(t testing.TB, r *reviewer, tok string) {
	t.Helper()
	if _, err := r.auth.Authenticate(reviewBearer(t.Context(), tok)); err != nil {
		t.Fatal(err)
	}
}

// reviewExpiry reads a JWT's exp.
func reviewExpiry(t testing.TB, tok string) time.Time {
	t.Helper()
	parts := strings.Split(tok, ".")
	if len(parts) != 3 {
		t.Fatalf("token of %d parts", len(parts))
	}
	payload, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		t.Fatal(err)
	}
	var claims struct{ Exp int64 }
	if err := json.Unmarshal(payload, &claims); err != nil || claims.Exp == 0 {
		t.Fatalf("exp of the token: %v", err)
	}
	return time.Unix(claims.Exp, 0)
}

// The CA authenticates with a service account's token, under RBAC: with create on tokenreviews
// it works; without, it says that it may not, which is the CA's fault and not the caller's.
func TestTokenReviewRBAC(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	env.ServiceAccount(t, ns, "workload")
	env.ServiceAccount(t, ns, "ca")
	env.ServiceAccount(t, ns, "ca-without-rbac")
	rbac, err := rbacv1client.NewForConfig(env.Admin)
	if err != nil {
		t.Fatal(err)
	}
	role := "tokenreviewer-" + ns
	if _, err := rbac.ClusterRoles().Create(t.Context(), &rbacv1.ClusterRole{
		ObjectMeta: metav1.ObjectMeta{Name: role},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{"authentication.k8s.io"}, Resources: []string{"tokenreviews"}, Verbs: []string{"create"}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := rbac.ClusterRoleBindings().Create(t.Context(), &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: role},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: role},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Namespace: ns, Name: "ca"}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	tok := env.Token(t, ns, "workload", time.Hour, "istio-ca")

	granted := newReviewer(t, env.As(t, ns, "ca"), "")
	// The API server's authorizer learns of the binding through its watch; a refused call is not
	// cached, so each try asks again.
	var caller caserver.Caller
	kubetest.Until(t, "the CA's role binding to take effect", func() bool {
		caller, err = granted.auth.Authenticate(reviewBearer(t.Context(), tok))
		return err == nil
	})
	if want := "spiffe://" + reviewTrustDomain + "/ns/" + ns + "/sa/workload"; caller.Identity.String() != want {
		t.Fatalf("identity %s, want %s", caller.Identity, want)
	}

	denied := newReviewer(t, env.As(t, ns, "ca-without-rbac"), "")
	for range 2 {
		_, err = denied.auth.Authenticate(reviewBearer(t.Context(), tok))
		if !errors.Is(err, caserver.ErrAuthenticatorMisconfigured) || errors.Is(err, caserver.ErrTokenRejected) {
			t.Fatalf("error %v, want one saying the CA is misconfigured, not that the token is refused", err)
		}
		t.Logf("failed: %v", err)
		if !strings.Contains(err.Error(), "may not create TokenReviews") {
			t.Fatalf("error %q does not say that the CA may not create TokenReviews", err)
		}
	}
	// A failed call is not cached as a refusal: each authentication asks again.
	if n := denied.reviews.n.Load(); n != 2 {
		t.Fatalf("%d TokenReviews tried, want 2", n)
	}
	if got := metric(t, denied.registry, "meshid_ca_token_reviews_total", "outcome", "error"); got != 2 {
		t.Fatalf("%v failed reviews counted, want 2", got)
	}
}

// End to end: a token from TokenRequest gets a certificate from the CA's gRPC server through
// TokenReview; a token for another audience is Unauthenticated.
func TestTokenReviewThroughCAServer(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	env.ServiceAccount(t, ns, "workload")
	r := newReviewer(t, nil, "")
	root := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "tokenreview root"})
	bundle, err := ca.NewBundle(ca.BundleParams{SigningCert: root.Cert, SigningKey: root.Key, Source: ca.SourceSelfSigned, Now: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	authority := ca.New(ca.Config{DefaultTTL: time.Hour}, bundle)
	registry := prometheus.NewRegistry()
	metrics, err := caserver.NewMetrics(registry)
	if err != nil {
		t.Fatal(err)
	}
	logs := &testutil.SyncBuffer{}
	srv := caserver.New(caserver.Config{
		Signer:         authority,
		Authenticators: []caserver.Authenticator{r.auth},
		Targeting:      controller.NewTargeting(controller.TargetingConfig{CANamespace: "istio-system", EnabledByDefault: true}),
		Metrics:        metrics,
		Logger:         slog.New(slog.NewTextHandler(logs, nil)),
	})
	serving := caserver.NewServingCertificate(authority, nil, nil)
	gs := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: serving.GetCertificate})))
	pb.RegisterIstioCertificateServiceServer(gs, srv)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	pool := x509.NewCertPool()
	pool.AddCert(root.Cert)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
		RootCAs: pool, ServerName: "istiod.istio-system.svc", MinVersion: tls.VersionTLS12,
	})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	client := pb.NewIstioCertificateServiceClient(conn)

	id := pki.SPIFFEID{TrustDomain: reviewTrustDomain, Namespace: ns, ServiceAccount: "workload"}
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{URIs: []*url.URL{id.URL()}}, key)
	if err != nil {
		t.Fatal(err)
	}
	req := &pb.IstioCertificateRequest{
		Csr:              string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: csr})),
		ValidityDuration: int64(time.Hour / time.Second),
	}
	good := env.Token(t, ns, "workload", time.Hour, "istio-ca")
	resp, err := client.CreateCertificate(metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+good), req)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := pki.ParseCertificates([]byte(resp.GetCertChain()[0]))
	if err != nil {
		t.Fatal(err)
	}
	if len(leaf[0].URIs) != 1 || leaf[0].URIs[0].String() != id.String() {
		t.Fatalf("certificate for %v, want %s", leaf[0].URIs, id)
	}
	if got := metric(t, registry, "meshid_ca_certificates_issued_total", "auth_method", "tokenreview"); got != 1 {
		t.Fatalf("%v certificates counted as issued by tokenreview, want 1", got)
	}

	wrong := env.Token(t, ns, "workload", time.Hour, "other")
	_, err = client.CreateCertificate(metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+wrong), req)
	if status.Code(err) != codes.Unauthenticated || !strings.Contains(status.Convert(err).Message(), "audience") {
		t.Fatalf("error %v, want Unauthenticated naming the audience", err)
	}
	if got := metric(t, registry, "meshid_ca_requests_refused_total", "reason", "token_rejected", "code", "Unauthenticated"); got != 1 {
		t.Fatalf("refusal counted %v times, want 1", got)
	}
	if got := strings.Count(logs.String(), "certificate request refused"); got != 1 {
		t.Fatalf("refusal logged %d times, want once:\n%s", got, logs.String())
	}
	if text := logs.String(); strings.Contains(text, good) || strings.Contains(text, wrong) {
		t.Fatal("a token appears in the CA's log")
	}
}

// blockingReviews holds each TokenReview until release is closed, then sends it on.
type blockingReviews struct {
	authenticationv1client.TokenReviewInterface
	started chan struct{} // receives one value per review that began
	release chan struct{}
	n       atomic.Int64
}

func (b *blockingReviews) Create(ctx context.Context, tr *authenticationv1.TokenReview, opts metav1.CreateOptions) (*authenticationv1.TokenReview, error) {
	b.n.Add(1)
	b.started <- struct{}{}
	<-b.release
	return b.TokenReviewInterface.Create(ctx, tr, opts)
}

// A caller that gives up does not cancel the review it shares with others.
func TestTokenReviewSharedReviewOutlivesACaller(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	env.ServiceAccount(t, ns, "workload")
	tok := env.Token(t, ns, "workload", time.Hour, "istio-ca")
	clients := clientsFor(t, env.Admin)
	reviews := &blockingReviews{TokenReviewInterface: clients.Authentication.TokenReviews(), started: make(chan struct{}, 1), release: make(chan struct{})}
	auth, err := kube.NewTokenReviewAuthenticator(kube.TokenReviewConfig{Reviews: reviews, TrustDomain: reviewTrustDomain})
	if err != nil {
		t.Fatal(err)
	}
	impatient, cancel := context.WithCancel(t.Context())
	first := make(chan error, 1)
	go func() {
		_, err := auth.Authenticate(reviewBearer(impatient, tok))
		first <- err
	}()
	<-reviews.started
	second := make(chan error, 1)
	go func() {
		_, err := auth.Authenticate(reviewBearer(t.Context(), tok))
		second <- err
	}()
	cancel()
	if err := <-first; !errors.Is(err, context.Canceled) {
		t.Fatalf("the caller that gave up got %v, want context.Canceled", err)
	}
	close(reviews.release)
	if err := <-second; err != nil {
		t.Fatalf("the caller that waited got %v", err)
	}
	if n := reviews.n.Load(); n != 1 {
		t.Fatalf("%d TokenReviews, want 1", n)
	}
}

// An API server that cannot be reached makes the CA unavailable, not the token refused, and
// nothing is cached: the next try asks again.
func TestTokenReviewAPIServerUnreachable(t *testing.T) {
	t.Parallel()
	// A port that hangs up on every connection: held for the test, so nothing else takes it.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lis.Close() })
	go func() {
		for {
			conn, err := lis.Accept()
			if err != nil {
				return
			}
			_ = conn.Close()
		}
	}()
	addr := lis.Addr().String()
	cfg := rest.CopyConfig(env.Admin)
	cfg.Host = "https://" + addr
	r := newReviewer(t, cfg, "")
	for range 2 {
		_, err := r.auth.Authenticate(reviewBearer(t.Context(), "some-token"))
		if !errors.Is(err, caserver.ErrAuthenticatorUnavailable) || errors.Is(err, caserver.ErrTokenRejected) {
			t.Fatalf("error %v, want one wrapping ErrAuthenticatorUnavailable", err)
		}
	}
	if n := r.reviews.n.Load(); n != 2 {
		t.Fatalf("%d TokenReviews tried, want 2", n)
	}
}

func TestTokenReviewConfig(t *testing.T) {
	t.Parallel()
	clients := clientsFor(t, env.Admin)
	reviews := clients.Authentication.TokenReviews()
	for _, tt := range []struct {
		name string
		cfg  kube.TokenReviewConfig
		ok   bool
	}{
		{"defaults", kube.TokenReviewConfig{Reviews: reviews, TrustDomain: "cluster.local"}, true},
		{"a minute", kube.TokenReviewConfig{Reviews: reviews, TrustDomain: "cluster.local", CacheTTL: time.Minute}, true},
		{"no client", kube.TokenReviewConfig{TrustDomain: "cluster.local"}, false},
		{"no trust domain", kube.TokenReviewConfig{Reviews: reviews}, false},
		{"cache TTL over a minute", kube.TokenReviewConfig{Reviews: reviews, TrustDomain: "cluster.local", CacheTTL: 2 * time.Minute}, false},
		{"negative cache TTL", kube.TokenReviewConfig{Reviews: reviews, TrustDomain: "cluster.local", CacheTTL: -time.Second}, false},
		{"negative max entries", kube.TokenReviewConfig{Reviews: reviews, TrustDomain: "cluster.local", MaxEntries: -1}, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if _, err := kube.NewTokenReviewAuthenticator(tt.cfg); (err == nil) != tt.ok {
				t.Fatalf("NewTokenReviewAuthenticator: %v, want success %v", err, tt.ok)
			}
		})
	}
}
