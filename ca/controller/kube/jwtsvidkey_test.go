//go:build external

package kube_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/golang-jwt/jwt/v5"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller/kube"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// jwtSigner is what a replica builds from the key it loaded.
func jwtSigner(t *testing.T, cfg *rest.Config, ns string) (*ca.JWTSVIDSigner, bool) {
	t.Helper()
	key, created, err := kube.LoadOrCreateJWTSVIDKey(t.Context(), clientsFor(t, cfg), ns)
	if err != nil {
		t.Fatal(err)
	}
	s, err := ca.NewJWTSVIDSigner(key, "cluster.local", 0)
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
	ns := env.Namespace(t, nil)
	const sa = "meshid-ca"
	env.ServiceAccount(t, ns, sa)
	bind(t, ns, sa, caRole(), nil)

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
			key, created, err := kube.LoadOrCreateJWTSVIDKey(context.Background(), clientsFor(t, cfg), ns)
			if err != nil {
				t.Errorf("replica %d: %v", i, err)
				return
			}
			s, err := ca.NewJWTSVIDSigner(key, "cluster.local", 0)
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
	if a.signer.KeyID() != b.signer.KeyID() {
		t.Fatalf("the replicas sign with kids %s and %s", a.signer.KeyID(), b.signer.KeyID())
	}
	verifiesWith(t, a.signer, b.signer.Bundle())
	verifiesWith(t, b.signer, a.signer.Bundle())

	s := getSecret(t, ns, kube.JWTSVIDKeySecret)
	if s.Type != kube.JWTSVIDKeySecretType || len(s.Data) != 1 || len(s.Data[kube.JWTSVIDKeyData]) == 0 {
		t.Fatalf("secret: type %q, data keys %d; want %q with %s only", s.Type, len(s.Data), kube.JWTSVIDKeySecretType, kube.JWTSVIDKeyData)
	}

	restarted, created := jwtSigner(t, env.As(t, ns, sa), ns)
	if created || restarted.KeyID() != a.signer.KeyID() {
		t.Fatalf("a restarted replica: created %v, kid %s; want the kept kid %s", created, restarted.KeyID(), a.signer.KeyID())
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
	ns := env.Namespace(t, nil)
	const sa = "meshid-ca"
	env.ServiceAccount(t, ns, sa)
	bind(t, ns, sa, caRole(), nil)

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
	if created || loser.KeyID() != winner.KeyID() {
		t.Fatalf("the loser: created %v, kid %s; want the winner's %s", created, loser.KeyID(), winner.KeyID())
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
