//go:build external

package controlplane_test

import (
	"context"
	"crypto"
	"crypto/x509"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	coordinationv1client "k8s.io/client-go/kubernetes/typed/coordination/v1"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller/kube/kubetest"
	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// replica is one `meshid ca` of the Deployment, run in-process so that the test can stop it.
type replica struct {
	cp     *controlplane.ControlPlane
	cfg    controlplane.Config
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
}

// replicaConfig is a control plane on Kubernetes as deploy/kubernetes runs it: in istio-system,
// as the service account meshid-ca, with a token from TokenRequest and exactly the RBAC of
// deploy/kubernetes/rbac.yaml (unless mutate gives other credentials).
func replicaConfig(t *testing.T, identity string, mutate ...func(*controlplane.Config)) controlplane.Config {
	t.Helper()
	cfg := testConfig(t.TempDir())
	cfg.CANamespace = "istio-system"
	cfg.Kubernetes = controlplane.KubernetesConfig{
		Identity: identity,
		// Short, so that a hand-over takes a moment, not the default 15 s.
		LeaseDuration: 2 * time.Second, RenewDeadline: time.Second, RetryPeriod: 100 * time.Millisecond,
	}
	for _, m := range mutate {
		m(&cfg)
	}
	if cfg.Kubernetes.Kubeconfig == "" {
		cfg.Kubernetes.Kubeconfig = kubetest.Kubeconfig(t, t.TempDir(), kubeEnv.As(t, "istio-system", "meshid-ca"))
	}
	return cfg
}

// runReplica runs the control plane until the test ends, and returns once it serves; it may be
// called from any goroutine.
func runReplica(t *testing.T, cfg controlplane.Config) (*replica, error) {
	cp, err := controlplane.New(t.Context(), cfg)
	if err != nil {
		return nil, fmt.Errorf("replica %s: %w", cfg.Kubernetes.Identity, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &replica{cp: cp, cfg: cfg, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- cp.Run(ctx) }()
	t.Cleanup(func() { r.stop(t) })
	select {
	case <-cp.Ready():
		return r, nil
	case err := <-r.done:
		r.done <- err // for the cleanup
		return nil, fmt.Errorf("replica %s ended before serving: %w", cfg.Kubernetes.Identity, err)
	}
}

func startReplica(t *testing.T, identity string, mutate ...func(*controlplane.Config)) *replica {
	t.Helper()
	r, err := runReplica(t, replicaConfig(t, identity, mutate...))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// stop stops the replica and waits for it, once.
func (r *replica) stop(t *testing.T) {
	r.once.Do(func() {
		r.cancel()
		if err := <-r.done; err != nil {
			t.Errorf("replica Run: %v", err)
		}
	})
}

func (r *replica) root() *x509.Certificate { return r.cp.Authority().Bundle().Root() }

func (r *replica) rootFile() string { return filepath.Join(r.cfg.StateDir, ca.RootCertFile) }

// The acceptance, on a real API server: two replicas share one root created from
// nothing, and one JWT-SVID key; a token from TokenRequest gets a certificate through TokenReview; override=false takes
// a namespace's secrets and certificates away and override=true gives them back; an operator's
// cacerts replaces the generated root on both replicas with no restart; the leader's exit hands
// the secret controller over. It alone uses istio-system, which the manifests name.
func TestTwoReplicasOnKubernetes(t *testing.T) {
	t.Parallel()
	deploy := filepath.Join("..", "deploy", "kubernetes")
	kubeEnv.Apply(t, false, filepath.Join(deploy, "00-namespace.yaml"), filepath.Join(deploy, "rbac.yaml"))
	kubeEnv.Apply(t, true, filepath.Join(deploy, "ca.yaml"))
	core := kubeEnv.Core()
	leases, err := coordinationv1client.NewForConfig(kubeEnv.Admin)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()

	// Started together: both race to create cacerts from nothing.
	// What an earlier run of this test left (go test -count): the test starts from nothing.
	t.Cleanup(func() {
		_ = core.Secrets("istio-system").Delete(context.Background(), "cacerts", metav1.DeleteOptions{})
		_ = core.Secrets("istio-system").Delete(context.Background(), "meshid-jwt-svid", metav1.DeleteOptions{})
		_ = leases.Leases("istio-system").Delete(context.Background(), controlplane.LeaseName, metav1.DeleteOptions{})
	})
	type started struct {
		r   *replica
		err error
	}
	replicas := make(chan started, 2)
	for _, id := range []string{"replica-a", "replica-b"} {
		cfg := replicaConfig(t, id)
		go func() {
			r, err := runReplica(t, cfg)
			replicas <- started{r, err}
		}()
	}
	var both []*replica
	for range 2 {
		s := <-replicas
		if s.err != nil {
			t.Fatal(s.err)
		}
		both = append(both, s.r)
	}
	a, b := both[0], both[1]
	if !a.root().Equal(b.root()) {
		t.Fatal("the replicas serve different roots")
	}
	cacerts, err := core.Secrets("istio-system").Get(ctx, "cacerts", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("no cacerts Secret: %v", err)
	}
	if cacerts.Type != "istio.io/ca-root" || cacerts.Annotations["meshid.io/generated"] == "" {
		t.Fatalf("cacerts: type %q, annotations %v; want a generated istio.io/ca-root", cacerts.Type, cacerts.Annotations)
	}

	app := kubeEnv.Namespace(t, nil)
	kubeEnv.ServiceAccount(t, app, "web")
	id := "spiffe://cluster.local/ns/" + app + "/sa/web"
	tok := kubeEnv.Token(t, app, "web", time.Hour, "istio-ca")
	for _, r := range []*replica{a, b} {
		chain, err := createCertificate(t, r.cp.GRPCAddr(), r.rootFile(), tok, id)
		if err != nil {
			t.Fatalf("a TokenRequest token through TokenReview: %v", err)
		}
		if got := chain[0].URIs[0].String(); got != id {
			t.Fatalf("certificate for %s, want %s", got, id)
		}
	}
	sameJWTSVIDKey(t, a, b, tok)
	jwtSVIDKeyReplaced(t, a, b, tok)

	wrongAudience := kubeEnv.Token(t, app, "web", time.Hour, "someone-else")
	if _, err := createCertificate(t, a.cp.GRPCAddr(), a.rootFile(), wrongAudience, id); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("a token for another audience: %v, want Unauthenticated", err)
	}

	secretExists := func() bool {
		_, err := core.Secrets(app).Get(ctx, "istio.web", metav1.GetOptions{})
		return err == nil
	}
	kubetest.Until(t, "the leader creates secret istio.web", secretExists)
	kubetest.Until(t, "istio-ca-root-cert is published in the workload namespace", func() bool {
		cm, err := core.ConfigMaps(app).Get(ctx, "istio-ca-root-cert", metav1.GetOptions{})
		return err == nil && cm.Data["root-cert.pem"] == string(pki.EncodeCertificates(a.root()))
	})

	label := func(value string) {
		t.Helper()
		ns, err := core.Namespaces().Get(ctx, app, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		ns.Labels = map[string]string{"ca.istio.io/override": value}
		if _, err := core.Namespaces().Update(ctx, ns, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	refused := func(r *replica) bool {
		_, err := createCertificate(t, r.cp.GRPCAddr(), r.rootFile(), tok, id)
		return status.Code(err) == codes.PermissionDenied
	}
	label("false")
	kubetest.Until(t, "override=false removes istio.web", func() bool { return !secretExists() })
	for _, r := range []*replica{a, b} {
		kubetest.Until(t, "override=false: the CSR is refused", func() bool { return refused(r) })
	}
	label("true")
	kubetest.Until(t, "override=true recreates istio.web", secretExists)
	for _, r := range []*replica{a, b} {
		kubetest.Until(t, "override=true: the CSR is signed again", func() bool { return !refused(r) })
	}

	// An operator plugs in their own CA, as `kubectl create secret generic cacerts ... | kubectl
	// replace` does: new data, none of our annotations.
	oldRoot := a.root()
	root := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "operator root"})
	inter := root.NewIntermediate(t, testutil.CAOptions{CommonName: "operator intermediate"})
	cacerts.Annotations = nil
	cacerts.Type = corev1.SecretTypeOpaque
	cacerts.Data = map[string][]byte{
		"ca-cert.pem":    testutil.CertPEM(inter.Cert),
		"ca-key.pem":     testutil.KeyPEM(t, inter.Key),
		"cert-chain.pem": testutil.CertPEM(inter.Cert, root.Cert),
		"root-cert.pem":  testutil.CertPEM(root.Cert),
	}
	if err := core.Secrets("istio-system").Delete(ctx, "cacerts", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	cacerts.ResourceVersion = ""
	if _, err := core.Secrets("istio-system").Create(ctx, cacerts, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, r := range []*replica{a, b} {
		kubetest.Until(t, "the operator's CA is in service", func() bool {
			bundle := r.cp.Authority().Bundle()
			return bundle.SigningCert().Equal(inter.Cert) && slices.ContainsFunc(bundle.Roots(), oldRoot.Equal)
		})
	}
	chain, err := createCertificate(t, b.cp.GRPCAddr(), b.rootFile(), tok, id)
	if err != nil {
		t.Fatal(err)
	}
	if !chain[1].Equal(inter.Cert) {
		t.Fatalf("signed by %s, want the operator's intermediate", chain[1].Subject)
	}

	// The leader goes: the other replica takes the Lease and the secret controller with it.
	lease, err := leases.Leases("istio-system").Get(ctx, controlplane.LeaseName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	leader, follower := a, b
	if *lease.Spec.HolderIdentity == b.cfg.Kubernetes.Identity {
		leader, follower = b, a
	}
	leader.stop(t)
	if err := core.Secrets(app).Delete(ctx, "istio.web", metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	kubetest.Until(t, "the remaining replica recreates istio.web", secretExists)
	lease, err = leases.Leases("istio-system").Get(ctx, controlplane.LeaseName, metav1.GetOptions{})
	if err != nil || *lease.Spec.HolderIdentity != follower.cfg.Kubernetes.Identity {
		t.Fatalf("lease after the leader stopped: %v, %v", lease, err)
	}
}

// Mounted cacerts files come first, the RFC's first step: the CA serves them and neither reads
// nor creates the Secret.
func TestMountedCACertsOnKubernetes(t *testing.T) {
	t.Parallel()
	ns := kubeEnv.Namespace(t, nil)
	root := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "mounted root"})
	inter := root.NewIntermediate(t, testutil.CAOptions{CommonName: "mounted intermediate"})
	mounted := t.TempDir()
	testutil.WriteFiles(t, mounted, map[string][]byte{
		ca.CACertFile:    testutil.CertPEM(inter.Cert),
		ca.CAKeyFile:     testutil.KeyPEM(t, inter.Key),
		ca.CertChainFile: testutil.CertPEM(inter.Cert, root.Cert),
		ca.RootCertFile:  testutil.CertPEM(root.Cert),
	})
	events := make(chan ca.Event, 256)
	r := startReplica(t, "mounted", func(cfg *controlplane.Config) {
		cfg.CANamespace, cfg.CACertsDir = ns, mounted
		cfg.Kubernetes.Kubeconfig = kubetest.Kubeconfig(t, t.TempDir(), kubeEnv.Admin)
		cfg.OnKeyEvent = func(ev ca.Event) { events <- ev }
	})
	if got := r.cp.Authority().Bundle().SigningCert(); !got.Equal(inter.Cert) {
		t.Fatalf("signing with %s, want the mounted intermediate", got.Subject)
	}
	if _, err := kubeEnv.Core().Secrets(ns).Get(t.Context(), "cacerts", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("a cacerts Secret beside mounted files: %v", err)
	}

	// A cacerts Secret with other material appears: the files in service still come first.
	other := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "secret root"})
	if _, err := kubeEnv.Core().Secrets(ns).Create(t.Context(), &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "cacerts"},
		Data: map[string][]byte{
			ca.CACertFile: testutil.CertPEM(other.Cert), ca.CAKeyFile: testutil.KeyPEM(t, other.Key),
			ca.CertChainFile: testutil.CertPEM(other.Cert), ca.RootCertFile: testutil.CertPEM(other.Cert),
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for ignored := false; !ignored; {
		select {
		case ev := <-events:
			ignored = ev.Kind == ca.EventIgnored
		case <-time.After(30 * time.Second):
			t.Fatal("the Secret's version was never offered")
		}
	}
	if got := r.cp.Authority().Bundle().SigningCert(); !got.Equal(inter.Cert) {
		t.Fatalf("signing with %s after a cacerts Secret appeared, want the mounted intermediate", got.Subject)
	}
}

// jwtSVIDKeyReplaced puts a new JWT-SVID key in next-key.pem, as an operator rotating it does,
// and checks that both replicas, with the deploy Role's rights, publish the new key after the old
// one with no restart, keep signing with the old one until every agent can have the new, and
// that one of them moved it into key.pem.
func jwtSVIDKeyReplaced(t *testing.T, a, b *replica, tok string) {
	t.Helper()
	secrets := kubeEnv.Core().Secrets("istio-system")
	secret, err := secrets.Get(t.Context(), "meshid-jwt-svid", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	oldKey, err := ca.ParseJWTSVIDKey(secret.Data["key.pem"])
	if err != nil {
		t.Fatal(err)
	}
	next, err := ca.GenerateJWTSVIDKey()
	if err != nil {
		t.Fatal(err)
	}
	nextKey, err := ca.ParseJWTSVIDKey(next)
	if err != nil {
		t.Fatal(err)
	}
	kids := make([]string, 2)
	for i, key := range []crypto.Signer{oldKey, nextKey} {
		s, err := ca.NewJWTSVIDSigner(key, "cluster.local", 0)
		if err != nil {
			t.Fatal(err)
		}
		kids[i] = s.KeyID(time.Now())
	}
	secret.Data["next-key.pem"] = next
	if _, err := secrets.Update(t.Context(), secret, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	kubetest.Eventually(t, "next-key.pem moved into key.pem", func() error {
		s, err := secrets.Get(t.Context(), "meshid-jwt-svid", metav1.GetOptions{})
		if err != nil {
			return err
		}
		if _, ok := s.Data["next-key.pem"]; ok || string(s.Data["key.pem"]) != string(next) || len(s.Data["previous-key.pem"]) == 0 {
			return fmt.Errorf("data keys %v, want key.pem the new key and previous-key.pem", slices.Collect(maps.Keys(s.Data)))
		}
		return nil
	})
	for _, r := range []*replica{a, b} {
		client := jwtClient(t, r.cp.GRPCAddr(), r.cfg.StateDir, tok)
		kubetest.Eventually(t, "replica "+r.cfg.Kubernetes.Identity+" publishes the replaced key", func() error {
			bundle, err := client.FetchJWTBundle(t.Context())
			if err != nil {
				return err
			}
			if _, ok := bundle.Keys[kids[1]]; !ok || len(bundle.Keys) != 2 {
				return fmt.Errorf("kids %v, want the old %s and the new %s", slices.Collect(maps.Keys(bundle.Keys)), kids[0], kids[1])
			}
			return nil
		})
		svid, err := client.MintJWTSVID(t.Context(), []string{"db"}, 0)
		if err != nil {
			t.Fatal(err)
		}
		parsed, _, err := jwt.NewParser().ParseUnverified(svid.Token, jwt.MapClaims{})
		if err != nil {
			t.Fatal(err)
		}
		if kid := parsed.Header["kid"]; kid != kids[0] {
			t.Fatalf("replica %s signs with %v right after the key was replaced, want the old %s until the lead is over", r.cfg.Kubernetes.Identity, kid, kids[0])
		}
	}
}

// sameJWTSVIDKey checks that two replicas sign JWT-SVIDs with one key, the Secret meshid-jwt-svid's
// and not a state dir's: both serve a bundle of the same single kid, and a JWT-SVID minted
// through either verifies with the bundle the other serves.
func sameJWTSVIDKey(t *testing.T, a, b *replica, tok string) {
	t.Helper()
	secret, err := kubeEnv.Core().Secrets("istio-system").Get(t.Context(), "meshid-jwt-svid", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("no meshid-jwt-svid Secret: %v", err)
	}
	if secret.Type != "meshid.io/jwt-svid-key" || len(secret.Data["key.pem"]) == 0 {
		t.Fatalf("meshid-jwt-svid: type %q, want meshid.io/jwt-svid-key with key.pem", secret.Type)
	}
	bundles := make([]caclient.JWTBundle, 2)
	for i, r := range []*replica{a, b} {
		if _, err := os.Stat(ca.JWTSVIDKeyPath(r.cfg.StateDir)); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("a JWT-SVID key file in the state dir on Kubernetes: %v", err)
		}
		if bundles[i], err = jwtClient(t, r.cp.GRPCAddr(), r.cfg.StateDir, tok).FetchJWTBundle(t.Context()); err != nil {
			t.Fatal(err)
		}
		if len(bundles[i].Keys) != 1 {
			t.Fatalf("replica %s serves %d JWT-SVID keys, want 1", r.cfg.Kubernetes.Identity, len(bundles[i].Keys))
		}
	}
	if kids := [2][]string{slices.Collect(maps.Keys(bundles[0].Keys)), slices.Collect(maps.Keys(bundles[1].Keys))}; kids[0][0] != kids[1][0] {
		t.Fatalf("the replicas serve the JWT-SVID kids %v", kids)
	}
	for i, r := range []*replica{a, b} {
		svid, err := jwtClient(t, r.cp.GRPCAddr(), r.cfg.StateDir, tok).MintJWTSVID(t.Context(), []string{"db"}, 0)
		if err != nil {
			t.Fatal(err)
		}
		other := bundles[1-i]
		keyOf := func(tok *jwt.Token) (any, error) {
			kid, _ := tok.Header["kid"].(string)
			if k, ok := other.Keys[kid]; ok {
				return k, nil
			}
			return nil, fmt.Errorf("kid %q is not in the other replica's bundle", kid)
		}
		if _, err := jwt.Parse(svid.Token, keyOf, jwt.WithValidMethods([]string{"ES256"}), jwt.WithAudience("db")); err != nil {
			t.Fatalf("a JWT-SVID minted through %s does not verify with the other's bundle: %v", r.cfg.Kubernetes.Identity, err)
		}
	}
}
