//go:build external

package kube_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller/kube"
	"github.com/meshid/meshid/ca/controller/kube/kubetest"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

const (
	year          = 365 * 24 * time.Hour
	checkInterval = time.Hour
	threshold     = 0.2
)

// pastRenewal is how far a test moves a replica's clock to make a root generated at the start due.
const pastRenewal = time.Duration(float64(year) * (1 - threshold/2))

func digest(certPEM []byte) string {
	sum := sha256.Sum256(certPEM)
	return hex.EncodeToString(sum[:])
}

func caCertsConfig(t *testing.T, cfg *rest.Config, ns string, clk *testutil.FakeClock, reg prometheus.Registerer) kube.CACertsConfig {
	t.Helper()
	clients := clientsFor(t, cfg)
	return kube.CACertsConfig{
		Clients:               clients,
		Namespace:             ns,
		SelfSigned:            ca.SelfSignedConfig{KeyAlgorithm: pki.ECDSA, Org: "meshid test", TTL: year},
		RootRotationThreshold: threshold,
		RootCheckInterval:     checkInterval,
		Clock:                 clk,
		Jitter:                func() float64 { return 0.5 },
		Registerer:            reg,
	}
}

func newCACerts(t *testing.T, cfg kube.CACertsConfig) *kube.CACerts {
	t.Helper()
	c, err := kube.NewCACerts(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func getSecret(t *testing.T, ns, name string) *corev1.Secret {
	t.Helper()
	s, err := env.Core().Secrets(ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get secret %s/%s: %v", ns, name, err)
	}
	return s
}

func createSecret(t *testing.T, s *corev1.Secret) {
	t.Helper()
	if _, err := env.Core().Secrets(s.Namespace).Create(context.Background(), s, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create secret %s/%s: %v", s.Namespace, s.Name, err)
	}
}

// pluggedIn is an operator's CA: an intermediate under a corporate root, in Istio's layout.
func pluggedIn(t *testing.T) (map[string][]byte, *testutil.CA, *testutil.CA) {
	t.Helper()
	root := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "corp root", NotAfter: time.Now().Add(3 * year)})
	inter := root.NewIntermediate(t, testutil.CAOptions{CommonName: "mesh intermediate", NotAfter: time.Now().Add(2 * year)})
	return map[string][]byte{
		ca.CACertFile:    testutil.CertPEM(inter.Cert),
		ca.CAKeyFile:     testutil.KeyPEM(t, inter.Key),
		ca.CertChainFile: testutil.CertPEM(inter.Cert, root.Cert),
		ca.RootCertFile:  testutil.CertPEM(root.Cert),
	}, root, inter
}

func TestCACertsLoadStartupPaths(t *testing.T) {
	t.Parallel()
	istiodRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "istiod root"})
	operatorData, operatorRoot, operatorInter := pluggedIn(t)
	tests := []struct {
		name       string
		existing   []*corev1.Secret // created before Load (their namespace is set by the test)
		wantOrigin ca.Origin
		// check looks at the loaded bundle and the cacerts Secret after Load.
		check func(t *testing.T, b *ca.Bundle, cacerts *corev1.Secret)
	}{
		{
			name: "an operator's cacerts is used as it is",
			existing: []*corev1.Secret{
				{ObjectMeta: metav1.ObjectMeta{Name: kube.CACertsSecret}, Data: operatorData},
				// cacerts wins over istio-ca-secret.
				{ObjectMeta: metav1.ObjectMeta{Name: kube.IstioCASecret}, Type: kube.CARootSecretType, Data: map[string][]byte{
					ca.CACertFile: testutil.CertPEM(istiodRoot.Cert), ca.CAKeyFile: testutil.KeyPEM(t, istiodRoot.Key),
				}},
			},
			wantOrigin: ca.OriginCACertsSecret,
			check: func(t *testing.T, b *ca.Bundle, s *corev1.Secret) {
				if !b.SigningCert().Equal(operatorInter.Cert) || !b.Root().Equal(operatorRoot.Cert) {
					t.Fatalf("serving %q under %q, want the operator's intermediate", b.SigningCert().Subject, b.Root().Subject)
				}
				if _, ok := s.Annotations[kube.AnnotationGenerated]; ok {
					t.Fatal("an operator's cacerts was annotated as generated")
				}
			},
		},
		{
			name: "cacerts is created from istio-ca-secret",
			existing: []*corev1.Secret{{
				ObjectMeta: metav1.ObjectMeta{Name: kube.IstioCASecret}, Type: kube.CARootSecretType,
				// As istiod writes it.
				Data: map[string][]byte{
					ca.CACertFile: testutil.CertPEM(istiodRoot.Cert), ca.CAKeyFile: testutil.KeyPEM(t, istiodRoot.Key),
					ca.CertChainFile: {}, "key.pem": {}, ca.RootCertFile: {},
				},
			}},
			wantOrigin: ca.OriginIstioCASecret,
			check: func(t *testing.T, b *ca.Bundle, s *corev1.Secret) {
				if !b.SigningCert().Equal(istiodRoot.Cert) {
					t.Fatalf("serving %q, want istiod's root", b.SigningCert().Subject)
				}
				if s.Type != kube.CARootSecretType {
					t.Fatalf("cacerts of type %q, want %q", s.Type, kube.CARootSecretType)
				}
				if !bytes.Equal(s.Data[ca.CAKeyFile], testutil.KeyPEM(t, istiodRoot.Key)) || len(s.Data["key.pem"]) != 0 {
					t.Fatal("cacerts does not hold istio-ca-secret's data")
				}
				if got := s.Annotations[kube.AnnotationGenerated]; got != digest(testutil.CertPEM(istiodRoot.Cert)) {
					t.Fatalf("annotation %s=%q, want the digest of ca-cert.pem", kube.AnnotationGenerated, got)
				}
			},
		},
		{
			name:       "cacerts is generated when there is neither",
			wantOrigin: ca.OriginGeneratedSecret,
			check: func(t *testing.T, b *ca.Bundle, s *corev1.Secret) {
				if s.Type != kube.CARootSecretType {
					t.Fatalf("cacerts of type %q, want %q", s.Type, kube.CARootSecretType)
				}
				if got := s.Annotations[kube.AnnotationGenerated]; got != digest(s.Data[ca.CACertFile]) {
					t.Fatalf("annotation %s=%q, want the digest of ca-cert.pem", kube.AnnotationGenerated, got)
				}
				stored, err := ca.BundleFromData(s.Data, "cacerts", time.Now())
				if err != nil {
					t.Fatal(err)
				}
				if !stored.SigningCert().Equal(b.SigningCert()) || !stored.Root().Equal(b.SigningCert()) {
					t.Fatal("the loaded bundle is not the stored self-signed root")
				}
				if b.SigningCert().Subject.Organization[0] != "meshid test" || !b.SigningCert().NotAfter.After(time.Now().Add(year-time.Hour)) {
					t.Fatalf("generated root %q until %s, want the configured org and TTL", b.SigningCert().Subject, b.SigningCert().NotAfter)
				}
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ns := env.Namespace(t, nil)
			for _, s := range tt.existing {
				s = s.DeepCopy()
				s.Namespace = ns
				createSecret(t, s)
			}
			c := newCACerts(t, caCertsConfig(t, env.Admin, ns, testutil.NewFakeClock(time.Now()), nil))
			b, origin, err := c.Load(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if origin != tt.wantOrigin {
				t.Fatalf("origin %q, want %q", origin, tt.wantOrigin)
			}
			if b.Source() != ca.SourceSecret {
				t.Fatalf("source %q, want %q", b.Source(), ca.SourceSecret)
			}
			tt.check(t, b, getSecret(t, ns, kube.CACertsSecret))
		})
	}
}

func TestCACertsLoadRefusesInvalidSecrets(t *testing.T) {
	t.Parallel()
	for _, name := range []string{kube.CACertsSecret, kube.IstioCASecret} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ns := env.Namespace(t, nil)
			createSecret(t, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Data: map[string][]byte{ca.CACertFile: []byte("junk")}})
			c := newCACerts(t, caCertsConfig(t, env.Admin, ns, testutil.NewFakeClock(time.Now()), nil))
			if _, _, err := c.Load(t.Context()); err == nil || !strings.Contains(err.Error(), ns+"/cacerts") {
				t.Fatalf("Load: %v, want an error naming the cacerts secret", err)
			}
			if name == kube.IstioCASecret {
				if _, err := env.Core().Secrets(ns).Get(t.Context(), kube.CACertsSecret, metav1.GetOptions{}); err == nil {
					t.Fatal("a cacerts was created from an invalid istio-ca-secret")
				}
			}
		})
	}
}

func TestCACertsLoadRace(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	const replicas = 5
	roots := make([]*x509.Certificate, replicas)
	origins := make([]ca.Origin, replicas)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range replicas {
		c := newCACerts(t, caCertsConfig(t, env.Admin, ns, testutil.NewFakeClock(time.Now()), nil))
		wg.Go(func() {
			<-start
			b, origin, err := c.Load(context.Background())
			if err != nil {
				t.Errorf("replica %d: %v", i, err)
				return
			}
			roots[i], origins[i] = b.Root(), origin
		})
	}
	close(start)
	wg.Wait()
	if t.Failed() {
		return
	}
	stored, err := ca.BundleFromData(getSecret(t, ns, kube.CACertsSecret).Data, "cacerts", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	generatedHere := 0
	for i, r := range roots {
		if !r.Equal(stored.Root()) {
			t.Errorf("replica %d serves root %x, not the stored one", i, r.SerialNumber)
		}
		if origins[i] == ca.OriginGeneratedSecret {
			generatedHere++
		}
	}
	if generatedHere != 1 {
		t.Errorf("%d replicas report that they generated cacerts (origins %v), want 1", generatedHere, origins)
	}
	list, err := env.Core().Secrets(ns).List(t.Context(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Items) != 1 {
		t.Fatalf("%d secrets in the CA namespace, want only cacerts", len(list.Items))
	}
}

// replica is one CA instance of a test: its cacerts follower, key manager and authority, on a
// fake clock of its own.
type replica struct {
	cacerts   *kube.CACerts
	keys      *ca.KeyManager
	authority *ca.Authority
	clock     *testutil.FakeClock
	reg       *prometheus.Registry
	origin    ca.Origin
}

// startReplica loads the key material as cfg's user and runs the follower until the test ends.
// It returns once the follower has synced and waits for its next root check.
func startReplica(t *testing.T, cfg *rest.Config, ns string) *replica {
	t.Helper()
	return startReplicaWith(t, cfg, ns, nil)
}

func startReplicaWith(t *testing.T, cfg *rest.Config, ns string, log *slog.Logger) *replica {
	t.Helper()
	r := &replica{clock: testutil.NewFakeClock(time.Now()), reg: prometheus.NewRegistry()}
	ccfg := caCertsConfig(t, cfg, ns, r.clock, r.reg)
	ccfg.Logger = log
	if log == nil {
		ccfg.Logger = testLogger(t)
	}
	r.cacerts = newCACerts(t, ccfg)
	b, origin, err := r.cacerts.Load(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	r.origin = origin
	r.authority = ca.New(ca.Config{Clock: r.clock}, nil)
	r.keys, err = ca.NewKeyManager(ca.KeyManagerConfig{
		Authority: r.authority, StateDir: t.TempDir(), Initial: b, InitialOrigin: origin, Clock: r.clock,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.cacerts.Run(ctx, r.keys) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	r.idle(t)
	return r
}

// idle waits until the follower waits for its next root check, its last sync done.
func (r *replica) idle(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if err := r.clock.WaitForTimers(ctx, 1); err != nil {
		t.Fatalf("the cacerts follower never waited for its root check: %v", err)
	}
}

// check moves the replica's clock by d, which fires its pending root check, and waits until the
// check is done.
func (r *replica) check(t *testing.T, d time.Duration) {
	t.Helper()
	r.idle(t)
	r.clock.Advance(d)
	r.idle(t)
}

// waitSigner waits until the replica signs with a certificate for which ok holds.
func (r *replica) waitSigner(t *testing.T, what string, ok func(*x509.Certificate) bool) *ca.Bundle {
	t.Helper()
	deadline := time.NewTimer(kubetest.WaitLimit)
	defer deadline.Stop()
	for {
		changed := r.authority.Changed()
		if b := r.authority.Bundle(); ok(b.SigningCert()) {
			return b
		}
		select {
		case <-changed:
		case <-deadline.C:
			t.Fatalf("the replica never signed with %s; it signs with %q", what, r.authority.Bundle().SigningCert().Subject)
		}
	}
}

// gate holds the first update of the cacerts Secret a replica sends until it is opened.
type gate struct {
	once    sync.Once
	arrived chan struct{}
	open    chan struct{}
}

// wrap is a rest.Config's WrapTransport.
func (g *gate) wrap(next http.RoundTripper) http.RoundTripper {
	return roundTripper(func(req *http.Request) (*http.Response, error) {
		if req.Method == http.MethodPut && strings.HasSuffix(req.URL.Path, "/secrets/"+kube.CACertsSecret) {
			first := false
			g.once.Do(func() { first = true })
			if first {
				close(g.arrived)
				<-g.open
			}
		}
		return next.RoundTrip(req)
	})
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }

func TestCACertsReplicasShareOneRootAndRotateItOnce(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	a := startReplica(t, env.Admin, ns)
	// b's first update of cacerts waits until a has rotated: it then carries a stale version.
	g := &gate{arrived: make(chan struct{}), open: make(chan struct{})}
	t.Cleanup(func() {
		select {
		case <-g.open:
		default:
			close(g.open)
		}
	})
	gated := rest.CopyConfig(env.Admin)
	gated.WrapTransport = g.wrap
	b := startReplica(t, gated, ns)

	if a.origin != ca.OriginGeneratedSecret || b.origin != ca.OriginCACertsSecret {
		t.Fatalf("origins %q and %q, want one generated, one loaded", a.origin, b.origin)
	}
	old := a.authority.Bundle().SigningCert()
	if !b.authority.Bundle().SigningCert().Equal(old) {
		t.Fatal("the replicas serve different roots")
	}

	// Both are past the renewal time; b tries first, but its update is held.
	b.idle(t)
	b.clock.Advance(pastRenewal)
	select {
	case <-g.arrived:
	case <-time.After(kubetest.WaitLimit):
		t.Fatal("replica b never tried to rotate the root")
	}
	a.check(t, pastRenewal)
	isNew := func(c *x509.Certificate) bool { return !c.Equal(old) }
	renewed := a.waitSigner(t, "the renewed root", isNew).SigningCert()
	close(g.open)
	b.waitSigner(t, "the renewed root", isNew)

	if !bytes.Equal(renewed.RawSubject, old.RawSubject) || !pki.PublicKeysEqual(renewed.PublicKey, old.PublicKey) {
		t.Fatal("the renewed root has another subject or key")
	}
	for name, r := range map[string]*replica{"a": a, "b": b} {
		if got := r.authority.Bundle().Roots(); !slices.EqualFunc(got, []*x509.Certificate{renewed, old}, (*x509.Certificate).Equal) {
			t.Errorf("replica %s trusts %d roots, want the renewed root then the old one", name, len(got))
		}
	}
	const rotations = "meshid_ca_cacerts_secret_rotations_total"
	if got := metric(t, a.reg, rotations, "outcome", "rotated"); got != 1 {
		t.Errorf("replica a rotated %v times, want 1", got)
	}
	b.idle(t)
	if got, conflicts := metric(t, b.reg, rotations, "outcome", "rotated"), metric(t, b.reg, rotations, "outcome", "conflict"); got != 0 || conflicts != 1 {
		t.Errorf("replica b rotated %v times with %v conflicts, want 0 and 1", got, conflicts)
	}
	s := getSecret(t, ns, kube.CACertsSecret)
	if !bytes.Equal(s.Data[ca.CACertFile], pki.EncodeCertificate(renewed)) || !bytes.Equal(s.Data[ca.RootCertFile], pki.EncodeCertificate(renewed)) {
		t.Fatal("cacerts does not hold the renewed root")
	}
	if s.Annotations[kube.AnnotationGenerated] != digest(s.Data[ca.CACertFile]) {
		t.Fatal("the renewed cacerts is not marked as generated")
	}
	for name, r := range map[string]*replica{"a": a, "b": b} {
		if got := metric(t, r.reg, "meshid_ca_cacerts_secret_versions_total", "outcome", string(ca.EventReloaded)); got != 1 {
			t.Errorf("replica %s reloaded %v versions, want 1", name, got)
		}
	}
}

func TestCACertsOperatorPlugInReachesReplicas(t *testing.T) {
	t.Parallel()
	for _, keepAnnotation := range []bool{false, true} {
		name := "data replaced"
		if keepAnnotation {
			name = "data edited in place, annotation kept"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ns := env.Namespace(t, nil)
			a := startReplica(t, env.Admin, ns)
			b := startReplica(t, env.Admin, ns)
			generatedRoot := a.authority.Bundle().SigningCert()

			data, root, inter := pluggedIn(t)
			s := getSecret(t, ns, kube.CACertsSecret)
			s.Data = data
			if !keepAnnotation {
				s.Annotations = nil
			}
			if _, err := env.Core().Secrets(ns).Update(t.Context(), s, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
			isPlugged := func(c *x509.Certificate) bool { return c.Equal(inter.Cert) }
			for name, r := range map[string]*replica{"a": a, "b": b} {
				r.waitSigner(t, "the plugged-in intermediate", isPlugged)
				if got := r.authority.Bundle().Roots(); !slices.EqualFunc(got, []*x509.Certificate{root.Cert, generatedRoot}, (*x509.Certificate).Equal) {
					t.Errorf("replica %s trusts %d roots, want the plugged-in root then the generated one", name, len(got))
				}
			}

			// Past the generated root's renewal time, nobody touches the operator's Secret.
			version := getSecret(t, ns, kube.CACertsSecret).ResourceVersion
			for _, r := range []*replica{a, b} {
				r.check(t, pastRenewal)
			}
			if got := getSecret(t, ns, kube.CACertsSecret).ResourceVersion; got != version {
				t.Fatalf("the operator's cacerts was rewritten (version %s, then %s)", version, got)
			}
			for name, r := range map[string]*replica{"a": a, "b": b} {
				if got := metric(t, r.reg, "meshid_ca_cacerts_secret_rotations_total"); got != 0 {
					t.Errorf("replica %s tried %v rotations, want none", name, got)
				}
				if !isPlugged(r.authority.Bundle().SigningCert()) {
					t.Errorf("replica %s no longer signs with the plugged-in intermediate", name)
				}
			}
		})
	}
}

func TestCACertsInvalidOrDeletedKeepsServing(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	logs := newLogRecorder()
	r := startReplicaWith(t, env.Admin, ns, logs.logger())
	serving := r.authority.Bundle()
	const (
		invalid = "the cacerts secret holds no valid key material; the CA keeps serving the key material it has"
		deleted = "the cacerts secret was deleted; the CA keeps serving its key material and does not recreate it"
	)

	s := getSecret(t, ns, kube.CACertsSecret)
	s.Data[ca.CAKeyFile] = []byte("not a key")
	if _, err := env.Core().Secrets(ns).Update(t.Context(), s, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	logs.wait(t, invalid)
	if err := env.Core().Secrets(ns).Delete(t.Context(), kube.CACertsSecret, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	logs.wait(t, deleted)
	r.check(t, checkInterval)
	r.check(t, checkInterval)

	if r.authority.Bundle() != serving {
		t.Fatal("the bundle in service changed")
	}
	if _, err := env.Core().Secrets(ns).Get(t.Context(), kube.CACertsSecret, metav1.GetOptions{}); err == nil {
		t.Fatal("the deleted cacerts was recreated")
	}
	for _, msg := range []string{invalid, deleted} {
		if n := logs.count(msg); n != 1 {
			t.Errorf("logged %d times, want once: %s", n, msg)
		}
	}
	if got := metric(t, r.reg, "meshid_ca_cacerts_secret_versions_total", "outcome", "invalid"); got != 1 {
		t.Errorf("%v invalid versions counted, want 1", got)
	}
	if got := metric(t, r.reg, "meshid_ca_cacerts_secret_deletions_total"); got != 1 {
		t.Errorf("%v deletions counted, want 1", got)
	}
	if logs.contains("PRIVATE KEY") || logs.contains("not a key") {
		t.Fatal("key material was logged")
	}
}

// logRecorder is a slog handler that keeps every record's message and attributes, and tells
// waiters of each new one.
type logRecorder struct {
	mu      sync.Mutex
	records []string // message, then attributes
	changed chan struct{}
}

func newLogRecorder() *logRecorder { return &logRecorder{changed: make(chan struct{})} }

func (l *logRecorder) logger() *slog.Logger { return slog.New(l) }

func (l *logRecorder) Enabled(context.Context, slog.Level) bool { return true }

func (l *logRecorder) Handle(_ context.Context, r slog.Record) error {
	line := r.Message
	r.Attrs(func(a slog.Attr) bool { line += " " + a.String(); return true })
	l.mu.Lock()
	l.records = append(l.records, line)
	close(l.changed)
	l.changed = make(chan struct{})
	l.mu.Unlock()
	return nil
}

func (l *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logRecorder) WithGroup(string) slog.Handler      { return l }

func (l *logRecorder) count(msg string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, r := range l.records {
		if r == msg || strings.HasPrefix(r, msg+" ") {
			n++
		}
	}
	return n
}

func (l *logRecorder) contains(s string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range l.records {
		if strings.Contains(r, s) {
			return true
		}
	}
	return false
}

// wait blocks until msg was logged.
func (l *logRecorder) wait(t *testing.T, msg string) {
	t.Helper()
	deadline := time.NewTimer(kubetest.WaitLimit)
	defer deadline.Stop()
	for {
		l.mu.Lock()
		changed := l.changed
		l.mu.Unlock()
		if l.count(msg) > 0 {
			return
		}
		select {
		case <-changed:
		case <-deadline.C:
			t.Fatalf("never logged: %s", msg)
		}
	}
}

// A version not valid yet here (written by a replica or operator whose clock runs ahead) is
// reported once and taken once it is valid, with no new version needed.
func TestCACertsVersionNotValidYetIsTakenLater(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	logs := newLogRecorder()
	r := startReplicaWith(t, env.Admin, ns, logs.logger())
	const invalid = "the cacerts secret holds no valid key material; the CA keeps serving the key material it has"

	ahead := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "ahead", NotBefore: r.clock.Now().Add(time.Hour)})
	s := getSecret(t, ns, kube.CACertsSecret)
	s.Data = map[string][]byte{
		ca.CACertFile: testutil.CertPEM(ahead.Cert), ca.CAKeyFile: testutil.KeyPEM(t, ahead.Key),
		ca.CertChainFile: {}, ca.RootCertFile: {},
	}
	s.Annotations = nil
	if _, err := env.Core().Secrets(ns).Update(t.Context(), s, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	logs.wait(t, invalid)
	r.check(t, checkInterval) // the next root check is an hour on
	r.waitSigner(t, "the root valid from an hour on", func(c *x509.Certificate) bool { return c.Equal(ahead.Cert) })
	if n := logs.count(invalid); n != 1 {
		t.Errorf("the version not valid yet was reported %d times, want once", n)
	}
}
