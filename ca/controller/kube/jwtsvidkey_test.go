//go:build external

package kube_test

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/golang-jwt/jwt/v5"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller/kube"
	"github.com/meshid/meshid/ca/controller/kube/kubetest"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// caNamespace is a new CA namespace with the CA's service account, bound to the deploy Role.
func caNamespace(t *testing.T) (ns, sa string) {
	t.Helper()
	ns, sa = env.Namespace(t, nil), "meshid-ca"
	env.ServiceAccount(t, ns, sa)
	bind(t, ns, sa, caRole(), nil)
	return ns, sa
}

// jwtSigner is what a replica builds from the key it loaded.
func jwtSigner(t *testing.T, cfg *rest.Config, ns string) (*ca.JWTSVIDSigner, bool) {
	t.Helper()
	keys, created, err := kube.LoadOrCreateJWTSVIDKey(t.Context(), clientsFor(t, cfg), ns)
	if err != nil {
		t.Fatal(err)
	}
	s, err := keys.Signer("cluster.local", 0, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	return s, created
}

// verifiesWith checks that a JWT-SVID signed by signer verifies with the JWKS of bundle, as a
// validator holding only that bundle does.
func verifiesWith(t *testing.T, signer *ca.JWTSVIDSigner, bundle ca.JWTBundle) {
	t.Helper()
	id, err := pki.NewSPIFFEID("cluster.local", "default", "demo")
	if err != nil {
		t.Fatal(err)
	}
	tok, _, err := signer.SignJWTSVID(ca.JWTSVIDRequest{Identity: id, Audience: []string{"db"}, Now: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	var jwks jose.JSONWebKeySet
	if err := json.Unmarshal(bundle.JWKS, &jwks); err != nil {
		t.Fatal(err)
	}
	keyOf := func(tok *jwt.Token) (any, error) {
		kid, _ := tok.Header["kid"].(string)
		keys := jwks.Key(kid)
		if len(keys) != 1 {
			return nil, errors.New("no key of kid " + kid + " in the bundle")
		}
		return keys[0].Key, nil
	}
	if _, err := jwt.Parse(tok, keyOf, jwt.WithValidMethods([]string{"ES256"}), jwt.WithAudience("db")); err != nil {
		t.Fatalf("a JWT-SVID of one replica does not verify with the other's bundle: %v", err)
	}
}

// Two replicas starting together, each with its own client of the CA's service account and only
// the deploy Role's rights, end up with one key: one creates the Secret, the other loads it, and
// a JWT-SVID of either verifies with the other's bundle. A restart loads the same key.
func TestJWTSVIDKeySharedByReplicas(t *testing.T) {
	t.Parallel()
	ns, sa := caNamespace(t)

	type loaded struct {
		signer  *ca.JWTSVIDSigner
		created bool
	}
	var (
		wg   sync.WaitGroup
		both [2]loaded
	)
	for i := range both {
		cfg := env.As(t, ns, sa)
		wg.Go(func() {
			keys, created, err := kube.LoadOrCreateJWTSVIDKey(context.Background(), clientsFor(t, cfg), ns)
			if err != nil {
				t.Errorf("replica %d: %v", i, err)
				return
			}
			s, err := keys.Signer("cluster.local", 0, time.Now())
			if err != nil {
				t.Errorf("replica %d: %v", i, err)
				return
			}
			both[i] = loaded{s, created}
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	a, b := both[0], both[1]
	if a.created == b.created {
		t.Fatalf("created by a: %v, by b: %v; want exactly one", a.created, b.created)
	}
	if a.signer.KeyID(time.Now()) != b.signer.KeyID(time.Now()) {
		t.Fatalf("the replicas sign with kids %s and %s", a.signer.KeyID(time.Now()), b.signer.KeyID(time.Now()))
	}
	verifiesWith(t, a.signer, b.signer.Bundle(time.Now()))
	verifiesWith(t, b.signer, a.signer.Bundle(time.Now()))

	s := getSecret(t, ns, kube.JWTSVIDKeySecret)
	if s.Type != kube.JWTSVIDKeySecretType || len(s.Data) != 1 || len(s.Data[kube.JWTSVIDKeyData]) == 0 {
		t.Fatalf("secret: type %q, data keys %d; want %q with %s only", s.Type, len(s.Data), kube.JWTSVIDKeySecretType, kube.JWTSVIDKeyData)
	}

	restarted, created := jwtSigner(t, env.As(t, ns, sa), ns)
	if created || restarted.KeyID(time.Now()) != a.signer.KeyID(time.Now()) {
		t.Fatalf("a restarted replica: created %v, kid %s; want the kept kid %s", created, restarted.KeyID(time.Now()), a.signer.KeyID(time.Now()))
	}
}

// raceTransport lets another writer create the Secret just before this client's create reaches
// the API server: the loss of the race, made certain.
type raceTransport struct {
	next  http.RoundTripper
	first func()
	once  sync.Once
}

func (r *raceTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Method == http.MethodPost && strings.HasSuffix(req.URL.Path, "/secrets") {
		r.once.Do(r.first)
	}
	return r.next.RoundTrip(req)
}

// A replica whose create loses to another writer's uses the winner's key, not its own.
func TestJWTSVIDKeyRaceLoserTakesTheWinners(t *testing.T) {
	t.Parallel()
	ns, sa := caNamespace(t)

	var winner *ca.JWTSVIDSigner
	cfg := env.As(t, ns, sa)
	cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		return &raceTransport{next: rt, first: func() {
			var created bool
			winner, created = jwtSigner(t, env.Admin, ns)
			if !created {
				t.Error("the winner did not create the secret")
			}
		}}
	}
	loser, created := jwtSigner(t, cfg, ns)
	if winner == nil {
		t.Fatal("the loser never tried to create the secret")
	}
	if created || loser.KeyID(time.Now()) != winner.KeyID(time.Now()) {
		t.Fatalf("the loser: created %v, kid %s; want the winner's %s", created, loser.KeyID(time.Now()), winner.KeyID(time.Now()))
	}
}

// A Secret that holds no ECDSA P-256 key is refused with an error that names it and says why,
// never shows the data, and is left as it is: the CA does not start on it.
func TestJWTSVIDKeyInvalidSecretIsRefused(t *testing.T) {
	t.Parallel()
	p384, err := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	rsaKey, err := pki.GenerateKey(pki.RSA, 2048)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		data map[string][]byte
		want string
		is   error
	}{
		{"garbage", map[string][]byte{kube.JWTSVIDKeyData: []byte("not a key at all")}, "key.pem: private key: no PEM", pki.ErrNoPEM},
		{"RSA", map[string][]byte{kube.JWTSVIDKeyData: testutil.KeyPEM(t, rsaKey)}, "must be ECDSA P-256 (ES256), not RSA 2048", ca.ErrJWTSVIDKey},
		{"P-384", map[string][]byte{kube.JWTSVIDKeyData: testutil.KeyPEM(t, p384)}, "must be ECDSA P-256 (ES256), not ECDSA P-384", ca.ErrJWTSVIDKey},
		{"no key.pem", map[string][]byte{"tls.key": testutil.KeyPEM(t, p384)}, "has no key.pem", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ns := env.Namespace(t, nil)
			createSecret(t, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: kube.JWTSVIDKeySecret, Namespace: ns}, Data: tc.data})
			before := getSecret(t, ns, kube.JWTSVIDKeySecret)
			_, _, err := kube.LoadOrCreateJWTSVIDKey(t.Context(), clientsFor(t, env.Admin), ns)
			if err == nil {
				t.Fatal("loaded")
			}
			msg := err.Error()
			if !strings.Contains(msg, "secret "+ns+"/"+kube.JWTSVIDKeySecret) || !strings.Contains(msg, tc.want) {
				t.Fatalf("error %q: want the secret named and %q", msg, tc.want)
			}
			if tc.is != nil && !errors.Is(err, tc.is) {
				t.Fatalf("error %v: want %v", err, tc.is)
			}
			for _, v := range tc.data {
				if strings.Contains(msg, string(v)) || strings.Contains(msg, "PRIVATE KEY") {
					t.Fatalf("the error shows the secret's data: %q", msg)
				}
			}
			if after := getSecret(t, ns, kube.JWTSVIDKeySecret); after.ResourceVersion != before.ResourceVersion {
				t.Fatal("the refused secret was written")
			}
		})
	}
}

// Without the Role the API server's refusal is the error, at once: no key is made up locally.
func TestJWTSVIDKeyWithoutRightsFails(t *testing.T) {
	t.Parallel()
	ns := env.Namespace(t, nil)
	env.ServiceAccount(t, ns, "nobody")
	_, _, err := kube.LoadOrCreateJWTSVIDKey(t.Context(), clientsFor(t, env.As(t, ns, "nobody")), ns)
	if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "get secret "+ns+"/"+kube.JWTSVIDKeySecret) {
		t.Fatalf("load without rights: %v, want a forbidden get of the secret", err)
	}
}

// Every replica follows the key's Secret, with only the deploy Role's rights. A key an operator
// puts in its place is adopted, published at once and signing once ca.JWTSVIDKeyLead is over,
// and the rotation is written in the Secret, so that a replica starting meanwhile signs and
// publishes as the others do; once the replaced key's last JWT-SVID has expired it is removed. A
// key that is not ECDSA P-256 is ignored, logged once and counted; a deleted Secret is put back
// with the newest key and its rotation.
func TestJWTSVIDKeysFollowTheSecret(t *testing.T) {
	t.Parallel()
	ns, sa := caNamespace(t)
	clients := clientsFor(t, env.As(t, ns, sa))
	t0 := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	f := startFollower(t, ns, clients, t0)
	signer, clk, logs, events := f.signer, f.clock, f.logs, f.events
	oldKid := signer.KeyID(t0)
	kubetest.Until(t, "the key loaded at start followed", func() bool { return events("unchanged") == 1 })

	// An operator puts the key to rotate to in next-key.pem.
	next := testutil.ECDSAKey(t)
	newKid := kidOf(t, next)
	putData(t, ns, kube.JWTSVIDNextKeyData, testutil.KeyPEM(t, next))
	signsFrom := t0.Add(ca.JWTSVIDKeyLead)
	kubetest.Until(t, "the new key adopted", func() bool { return len(signer.Bundle(t0).Keys) == 2 })
	if got := kidsOf(signer.Bundle(t0)); got[0] != oldKid || got[1] != newKid {
		t.Fatalf("bundle %v, want the old key %s then the new %s", got, oldKid, newKid)
	}
	if got := signer.KeyID(signsFrom.Add(-time.Second)); got != oldKid {
		t.Fatalf("signing with %s before the lead is over, want the old key", got)
	}
	if got := signer.KeyID(signsFrom); got != newKid {
		t.Fatalf("signing with %s once the lead is over, want %s", got, newKid)
	}
	kubetest.Eventually(t, "next-key.pem moved into key.pem, with the rotation", func() error {
		s := getSecret(t, ns, kube.JWTSVIDKeySecret)
		if _, ok := s.Data[kube.JWTSVIDNextKeyData]; ok {
			return errors.New("next-key.pem is still there")
		}
		return rotationIn(s, oldKid, newKid, signsFrom)
	})

	// Another writer's version without the rotation (a tool that rewrites the Secret from its own
	// copy): the rotation is written again.
	stripped := getSecret(t, ns, kube.JWTSVIDKeySecret)
	delete(stripped.Data, kube.JWTSVIDPreviousKeyData)
	stripped.Annotations = nil
	if _, err := env.Core().Secrets(ns).Update(t.Context(), stripped, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.Until(t, "the rotation written again", func() bool { return events("rotation_written") == 1 })
	if err := rotationIn(getSecret(t, ns, kube.JWTSVIDKeySecret), oldKid, newKid, signsFrom); err != nil {
		t.Fatal(err)
	}

	// A replica starting now signs with the old key until the same time, and publishes both.
	startingKeys, created, err := kube.LoadOrCreateJWTSVIDKey(t.Context(), clients, ns)
	if err != nil {
		t.Fatal(err)
	}
	starting, err := startingKeys.Signer("cluster.local", 0, t0)
	if err != nil {
		t.Fatal(err)
	}
	if created || starting.KeyID(t0) != oldKid || starting.KeyID(signsFrom) != newKid {
		t.Fatalf("a replica starting during the rotation: created %v, signs with %s, then %s; want %s, then %s",
			created, starting.KeyID(t0), starting.KeyID(signsFrom), oldKid, newKid)
	}
	if got := kidsOf(starting.Bundle(t0)); len(got) != 2 || got[0] != oldKid || got[1] != newKid {
		t.Fatalf("a replica starting during the rotation publishes %v, want %s and %s", got, oldKid, newKid)
	}

	// Then one that is not ECDSA P-256: kept out, said once.
	rsaKey, err := pki.GenerateKey(pki.RSA, 2048)
	if err != nil {
		t.Fatal(err)
	}
	putData(t, ns, kube.JWTSVIDKeyData, testutil.KeyPEM(t, rsaKey))
	kubetest.Until(t, "the RSA key refused", func() bool { return events("invalid") == 1 })
	if got := len(signer.Bundle(t0).Keys); got != 2 {
		t.Fatalf("%d keys published after an invalid one, want 2", got)
	}

	// Then deletes the Secret: it comes back with the newest key and its rotation.
	if err := env.Core().Secrets(ns).Delete(t.Context(), kube.JWTSVIDKeySecret, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.Eventually(t, "the deleted secret put back with the rotation", func() error {
		s, err := env.Core().Secrets(ns).Get(t.Context(), kube.JWTSVIDKeySecret, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if s.Type != kube.JWTSVIDKeySecretType {
			return fmt.Errorf("type %q, want %q", s.Type, kube.JWTSVIDKeySecretType)
		}
		return rotationIn(s, oldKid, newKid, signsFrom)
	})

	// Once the old key's last JWT-SVID has expired, it leaves the Secret.
	due := signsFrom.Add(ca.DefaultJWTSVIDTTL + ca.JWTSVIDClockSkew)
	if err := clk.WaitForDeadline(t.Context(), due); err != nil {
		t.Fatal(err)
	}
	clk.Advance(due.Sub(t0))
	kubetest.Until(t, "the replaced key removed from the secret", func() bool {
		_, ok := getSecret(t, ns, kube.JWTSVIDKeySecret).Data[kube.JWTSVIDPreviousKeyData]
		return !ok
	})
	restarted, _ := jwtSigner(t, env.As(t, ns, sa), ns)
	if got := kidsOf(restarted.Bundle(clk.Now())); len(got) != 1 || got[0] != newKid {
		t.Fatalf("a replica starting after the rotation publishes %v, want only %s", got, newKid)
	}

	// The follower counts and logs a write after the API server has it, which the test may see
	// first: waited for, not read once.
	kubetest.Eventually(t, "each event counted and logged once", func() error {
		for event, want := range map[string]float64{"adopted": 1, "invalid": 1, "deleted": 1, "restored": 1, "next_moved": 1, "rotation_written": 1, "previous_removed": 1, "write_failed": 0} {
			if got := events(event); got != want {
				return fmt.Errorf("%v %s events counted, want %v", got, event, want)
			}
		}
		for _, msg := range []string{
			"adopted the JWT-SVID key of the secret: published now, signing once every agent has it",
			"the JWT-SVID key secret holds no valid key; the CA keeps signing with the key it has",
			"the JWT-SVID key secret was deleted; putting it back with the newest key and its rotation (to change the key, put one in next-key.pem instead)",
			"put the JWT-SVID key secret back",
			"removed the replaced JWT-SVID key from the secret: the last JWT-SVID it signed has expired",
		} {
			if n := logs.count(msg); n != 1 {
				return fmt.Errorf("logged %d times, want once: %s", n, msg)
			}
		}
		return nil
	})
	if logs.contains("PRIVATE KEY") {
		t.Fatal("key material was logged")
	}
}

// A rotation in the Secret that cannot be read (an annotation edited by hand, say) does not stop
// the start: the key signs from the start, and why the rotation was ignored is told.
func TestJWTSVIDKeyMalformedRotationIsIgnored(t *testing.T) {
	t.Parallel()
	ns, sa := caNamespace(t)
	key := testutil.ECDSAKey(t)
	kid := kidOf(t, key)
	for _, tc := range []struct {
		name        string
		annotations map[string]string
		previous    []byte
		want        string
	}{
		{"time", map[string]string{kube.AnnotationJWTSVIDKeyID: kid, kube.AnnotationJWTSVIDSignsFrom: "tomorrow"}, testutil.KeyPEM(t, testutil.ECDSAKey(t)), "annotation meshid.io/jwt-svid-signs-from"},
		{"previous key", map[string]string{kube.AnnotationJWTSVIDKeyID: kid, kube.AnnotationJWTSVIDSignsFrom: "2026-11-27T12:00:00Z"}, []byte("not a key"), "previous-key.pem"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			createKeySecret(t, ns, tc.annotations, map[string][]byte{kube.JWTSVIDKeyData: testutil.KeyPEM(t, key), kube.JWTSVIDPreviousKeyData: tc.previous})
			t.Cleanup(func() {
				_ = env.Core().Secrets(ns).Delete(context.Background(), kube.JWTSVIDKeySecret, metav1.DeleteOptions{})
			})
			keys, _, err := kube.LoadOrCreateJWTSVIDKey(t.Context(), clientsFor(t, env.As(t, ns, sa)), ns)
			if err != nil {
				t.Fatalf("the start was stopped: %v", err)
			}
			if keys.Previous != nil || keys.Ignored == nil || !strings.Contains(keys.Ignored.Error(), tc.want) || strings.Contains(keys.Ignored.Error(), "PRIVATE") {
				t.Fatalf("previous %v, ignored %v; want no previous key and a reason naming %s", keys.Previous, keys.Ignored, tc.want)
			}
		})
	}
}

// A replica that starts while next-key.pem waits to be moved publishes it and signs on with
// key.pem, as the replica that moves it will, and keeps that rotation if the Secret goes.
func TestJWTSVIDKeyNextBeforeItIsMoved(t *testing.T) {
	t.Parallel()
	ns, sa := caNamespace(t)
	current, next := testutil.ECDSAKey(t), testutil.ECDSAKey(t)
	kids := []string{kidOf(t, current), kidOf(t, next)}
	createKeySecret(t, ns, nil, map[string][]byte{kube.JWTSVIDKeyData: testutil.KeyPEM(t, current), kube.JWTSVIDNextKeyData: testutil.KeyPEM(t, next)})
	clients := clientsFor(t, env.As(t, ns, sa))
	keys, _, err := kube.LoadOrCreateJWTSVIDKey(t.Context(), clients, ns)
	if err != nil {
		t.Fatal(err)
	}
	// The Secret goes before the replica's watch lists it: it is put back with the rotation to the
	// next key, which the replica publishes, not with key.pem alone.
	if err := env.Core().Secrets(ns).Delete(t.Context(), kube.JWTSVIDKeySecret, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	t0 := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	s := follow(t, ns, clients, keys, t0).signer
	if got := kidsOf(s.Bundle(t0)); !slices.Equal(got, kids) {
		t.Fatalf("bundle %v, want %v", got, kids)
	}
	if s.KeyID(t0) != kids[0] || s.KeyID(t0.Add(ca.JWTSVIDKeyLead)) != kids[1] {
		t.Fatalf("signs with %s, then %s; want %s until the lead is over, then %s", s.KeyID(t0), s.KeyID(t0.Add(ca.JWTSVIDKeyLead)), kids[0], kids[1])
	}
	kubetest.Eventually(t, "the secret put back with the rotation to the next key", func() error {
		s, err := env.Core().Secrets(ns).Get(t.Context(), kube.JWTSVIDKeySecret, metav1.GetOptions{})
		if err != nil {
			return err
		}
		return rotationIn(s, kids[0], kids[1], t0.Add(ca.JWTSVIDKeyLead))
	})
}

// follower is a replica's JWT-SVID key follower, run until the test ends, and what it is seen by.
type follower struct {
	signer *ca.JWTSVIDSigner
	clock  *testutil.FakeClock
	logs   *logRecorder
	events func(event string) float64
}

// startFollower loads (or creates) the key as a replica starting at t0 does, and follows it.
func startFollower(t *testing.T, ns string, clients *kube.Clients, t0 time.Time) follower {
	t.Helper()
	keys, _, err := kube.LoadOrCreateJWTSVIDKey(t.Context(), clients, ns)
	if err != nil {
		t.Fatal(err)
	}
	return follow(t, ns, clients, keys, t0)
}

// follow follows the key from keys, loaded at t0.
func follow(t *testing.T, ns string, clients *kube.Clients, keys kube.JWTSVIDKey, t0 time.Time) follower {
	t.Helper()
	signer, err := keys.Signer("cluster.local", 0, t0)
	if err != nil {
		t.Fatal(err)
	}
	f := follower{signer: signer, clock: testutil.NewFakeClock(t0), logs: newLogRecorder()}
	reg := prometheus.NewRegistry()
	keysFollower, err := kube.NewJWTSVIDKeyFollower(kube.JWTSVIDKeyFollowerConfig{Clients: clients, Namespace: ns, Signer: signer, Keys: keys,
		Clock: f.clock, Logger: f.logs.logger(), Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- keysFollower.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	f.events = func(event string) float64 {
		return metric(t, reg, "meshid_ca_jwt_svid_key_secret_events_total", "event", event)
	}
	return f
}

// A next-key.pem put while a rotation is under way waits for it to end, so that the Secret never
// needs two replaced keys; one equal to key.pem is no rotation, and is removed.
func TestJWTSVIDKeyNextWaitsForTheRotationUnderWay(t *testing.T) {
	t.Parallel()
	ns, sa := caNamespace(t)
	k1, k2, k3 := testutil.ECDSAKey(t), testutil.ECDSAKey(t), testutil.ECDSAKey(t)
	t0 := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	signsFrom := t0.Add(ca.JWTSVIDKeyLead)
	// A rotation from k1 to k2 under way.
	createKeySecret(t, ns, map[string]string{kube.AnnotationJWTSVIDKeyID: kidOf(t, k2), kube.AnnotationJWTSVIDSignsFrom: signsFrom.Format(time.RFC3339)},
		map[string][]byte{kube.JWTSVIDKeyData: testutil.KeyPEM(t, k2), kube.JWTSVIDPreviousKeyData: testutil.KeyPEM(t, k1)})
	f := startFollower(t, ns, clientsFor(t, env.As(t, ns, sa)), t0)
	kubetest.Until(t, "the rotation followed", func() bool { return f.events("unchanged") == 1 })

	// The same key again: removed, the rotation kept.
	putData(t, ns, kube.JWTSVIDNextKeyData, testutil.KeyPEM(t, k2))
	kubetest.Eventually(t, "next-key.pem equal to key.pem removed", func() error {
		s := getSecret(t, ns, kube.JWTSVIDKeySecret)
		if _, ok := s.Data[kube.JWTSVIDNextKeyData]; ok {
			return errors.New("next-key.pem is still there")
		}
		return rotationIn(s, kidOf(t, k1), kidOf(t, k2), signsFrom)
	})

	// Another key: it waits, published nowhere, until k1 is needed no more.
	putData(t, ns, kube.JWTSVIDNextKeyData, testutil.KeyPEM(t, k3))
	kubetest.Until(t, "next-key.pem waiting", func() bool { return f.events("next_waiting") == 1 })
	if got := kidsOf(f.signer.Bundle(t0)); !slices.Equal(got, []string{kidOf(t, k1), kidOf(t, k2)}) {
		t.Fatalf("bundle %v while k3 waits, want k1 and k2", got)
	}
	due := signsFrom.Add(ca.DefaultJWTSVIDTTL + ca.JWTSVIDClockSkew)
	if err := f.clock.WaitForDeadline(t.Context(), due); err != nil {
		t.Fatal(err)
	}
	f.clock.Advance(due.Sub(t0))
	kubetest.Eventually(t, "the rotation to k3 once the one under way is over", func() error {
		s := getSecret(t, ns, kube.JWTSVIDKeySecret)
		if _, ok := s.Data[kube.JWTSVIDNextKeyData]; ok {
			return errors.New("next-key.pem is still there")
		}
		return rotationIn(s, kidOf(t, k2), kidOf(t, k3), due.Add(ca.JWTSVIDKeyLead))
	})
	if got := kidsOf(f.signer.Bundle(due)); !slices.Equal(got, []string{kidOf(t, k2), kidOf(t, k3)}) {
		t.Fatalf("bundle %v once rotating to k3, want k2 and k3", got)
	}
}

// A next-key.pem withdrawn before any replica moved it is no rotation: a replica that loaded it
// drops the next key, which never signed.
func TestJWTSVIDKeyNextWithdrawnBeforeItIsMoved(t *testing.T) {
	t.Parallel()
	ns, sa := caNamespace(t)
	current, next := testutil.ECDSAKey(t), testutil.ECDSAKey(t)
	currentKid := kidOf(t, current)
	createKeySecret(t, ns, nil, map[string][]byte{kube.JWTSVIDKeyData: testutil.KeyPEM(t, current), kube.JWTSVIDNextKeyData: testutil.KeyPEM(t, next)})
	clients := clientsFor(t, env.As(t, ns, sa))
	keys, _, err := kube.LoadOrCreateJWTSVIDKey(t.Context(), clients, ns)
	if err != nil {
		t.Fatal(err)
	}
	withdrawn := getSecret(t, ns, kube.JWTSVIDKeySecret)
	delete(withdrawn.Data, kube.JWTSVIDNextKeyData)
	if _, err := env.Core().Secrets(ns).Update(t.Context(), withdrawn, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	t0 := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	f := follow(t, ns, clients, keys, t0)
	kubetest.Until(t, "the next key dropped", func() bool { return len(f.signer.Bundle(t0).Keys) == 1 })
	if got := f.signer.KeyID(t0.Add(ca.JWTSVIDKeyLead)); got != currentKid {
		t.Fatalf("signing with %s after the lead, want %s: the withdrawn key", got, currentKid)
	}
	kubetest.Until(t, "the cancelled rotation logged once", func() bool {
		return f.logs.count("the JWT-SVID key signing was put back in the secret: the rotation under way is cancelled") == 1
	})
}

// A previous-key.pem of no rotation of key.pem's (key.pem replaced by hand since) is a private key
// nothing needs: it is removed at once.
func TestJWTSVIDKeyStalePreviousIsRemoved(t *testing.T) {
	t.Parallel()
	ns, sa := caNamespace(t)
	createKeySecret(t, ns, map[string]string{kube.AnnotationJWTSVIDKeyID: "the-kid-of-a-key-replaced-since", kube.AnnotationJWTSVIDSignsFrom: "2026-11-27T12:00:00Z"},
		map[string][]byte{kube.JWTSVIDKeyData: testutil.KeyPEM(t, testutil.ECDSAKey(t)), kube.JWTSVIDPreviousKeyData: testutil.KeyPEM(t, testutil.ECDSAKey(t))})
	f := startFollower(t, ns, clientsFor(t, env.As(t, ns, sa)), time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC))
	kubetest.Until(t, "the stale previous-key.pem removed", func() bool {
		_, ok := getSecret(t, ns, kube.JWTSVIDKeySecret).Data[kube.JWTSVIDPreviousKeyData]
		return !ok
	})
	kubetest.Until(t, "the removal counted", func() bool { return f.events("previous_removed") == 1 })
}

// createKeySecret creates the JWT-SVID key's Secret in ns, as an operator or an earlier replica
// left it.
func createKeySecret(t *testing.T, ns string, annotations map[string]string, data map[string][]byte) {
	t.Helper()
	if _, err := env.Core().Secrets(ns).Create(t.Context(), &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: kube.JWTSVIDKeySecret, Namespace: ns, Annotations: annotations},
		Type:       kube.JWTSVIDKeySecretType,
		Data:       data,
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func kidOf(t *testing.T, key crypto.Signer) string {
	t.Helper()
	kid, err := ca.JWTSVIDKeyID(key)
	if err != nil {
		t.Fatal(err)
	}
	return kid
}

// rotationIn checks that s holds the rotation from the key of oldKid to the key of newKid at
// signsFrom.
func rotationIn(s *corev1.Secret, oldKid, newKid string, signsFrom time.Time) error {
	current, err := ca.ParseJWTSVIDKey(s.Data[kube.JWTSVIDKeyData])
	if err != nil {
		return err
	}
	previous, err := ca.ParseJWTSVIDKey(s.Data[kube.JWTSVIDPreviousKeyData])
	if err != nil {
		return fmt.Errorf("%s: %w", kube.JWTSVIDPreviousKeyData, err)
	}
	kids := make([]string, 2)
	for i, key := range []crypto.Signer{previous, current} {
		if kids[i], err = ca.JWTSVIDKeyID(key); err != nil {
			return err
		}
	}
	if kids[0] != oldKid || kids[1] != newKid {
		return fmt.Errorf("previous %s and current %s, want %s and %s", kids[0], kids[1], oldKid, newKid)
	}
	if got, want := s.Annotations, (map[string]string{kube.AnnotationJWTSVIDKeyID: newKid,
		kube.AnnotationJWTSVIDSignsFrom: signsFrom.UTC().Format(time.RFC3339)}); !maps.Equal(got, want) {
		return fmt.Errorf("annotations %v, want %v", got, want)
	}
	return nil
}

func kidsOf(b ca.JWTBundle) []string {
	var kids []string
	for _, k := range b.Keys {
		kids = append(kids, k.ID)
	}
	return kids
}

// putData writes one entry of the JWT-SVID Secret, as an operator does.
func putData(t *testing.T, ns, name string, data []byte) {
	t.Helper()
	s := getSecret(t, ns, kube.JWTSVIDKeySecret)
	s.Data[name] = data
	if _, err := env.Core().Secrets(ns).Update(t.Context(), s, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}
