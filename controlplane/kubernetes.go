package controlplane

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/ca/controller/kube"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/configerr"
	"github.com/meshid/meshid/internal/logkey"
)

// KubernetesConfig puts the control plane on Kubernetes: the API server is its store of
// namespaces and service accounts, keeps its key material (the cacerts Secret, and the JWT-SVID
// key's Secret) and the service-account secrets, authenticates tokens (TokenReview) and elects
// the replica that runs the secret controller (a Lease in the CA namespace).
type KubernetesConfig struct {
	// Kubeconfig is the kubeconfig file to use; with InCluster, the pod's own service account.
	Kubeconfig string
	InCluster  bool
	// Identity names this replica in the leader election; empty: the host name and a random suffix.
	Identity string
	// LeaseDuration, RenewDeadline and RetryPeriod tune the election; zero: client-go's defaults.
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	// StartTimeout bounds the start-up's calls to the API server; zero: DefaultKubernetesStartTimeout.
	StartTimeout time.Duration
}

// DefaultKubernetesStartTimeout bounds loading or creating cacerts and the JWT-SVID key's Secret
// at start-up: a CA that cannot reach its API server fails and is restarted, rather than hanging
// unready.
const DefaultKubernetesStartTimeout = time.Minute

// LeaseName is the Lease, in the CA namespace, whose holder runs the secret controller.
const LeaseName = "meshid-ca"

// Enabled reports whether the control plane runs on Kubernetes.
func (k KubernetesConfig) Enabled() bool { return k.Kubeconfig != "" || k.InCluster }

func (k KubernetesConfig) validate(cfg *Config) []error {
	var errs []error
	if k.Kubeconfig != "" && k.InCluster {
		errs = append(errs, configerr.Errorf("Kubernetes.Kubeconfig", "{Kubernetes.Kubeconfig} and {Kubernetes.InCluster} both name the Kubernetes API: give one"))
	}
	if k.Enabled() && cfg.Manifests != "" {
		errs = append(errs, configerr.Errorf("Manifests", "{Manifests} and the Kubernetes API ({Kubernetes.Kubeconfig}, {Kubernetes.InCluster}) are two stores of namespaces: give one"))
	}
	if k.Enabled() && cfg.Secrets.LivenessProbePath != "" {
		errs = append(errs, configerr.Errorf("Secrets.LivenessProbePath", "{Secrets.LivenessProbePath} works with {Manifests} only: on Kubernetes, only the elected replica runs the secret controller; probe /healthz instead"))
	}
	for name, d := range map[string]time.Duration{"lease duration": k.LeaseDuration, "renew deadline": k.RenewDeadline, "retry period": k.RetryPeriod, "start timeout": k.StartTimeout} {
		if d < 0 {
			errs = append(errs, fmt.Errorf("the Kubernetes %s %s must not be negative", name, d))
		}
	}
	// client-go's own rules, checked here so that a bad election fails the start, not a running CA.
	if err := (kube.LeaderConfig{LeaseDuration: k.LeaseDuration, RenewDeadline: k.RenewDeadline, RetryPeriod: k.RetryPeriod}).CheckTimings(); err != nil {
		errs = append(errs, err)
	}
	return errs
}

// onKubernetes is the control plane's stores on Kubernetes: the API server's namespaces and
// service accounts, and the cacerts Secret.
type onKubernetes struct {
	cfg         KubernetesConfig
	caNamespace string
	clients     *kube.Clients
	store       *kube.Store
	cacerts     *kube.CACerts
	jwtKeys     *kube.JWTSVIDKeyFollower // made with the JWT-SVID signer
	nodePods    *kube.NodePods           // nil without trusted node accounts
	clock       clock.Clock
	reg         prometheus.Registerer
	log         *slog.Logger
}

// leaderWork is what the elected replica runs besides the secret controller, built once
// namespace targeting exists: the istio-ca-root-cert ConfigMaps; and the store of Secrets the
// secret controller keeps, which every replica watches.
type leaderWork struct {
	rootCMs     *kube.RootConfigMaps
	secretStore *kube.SecretStore
}

func newOnKubernetes(cfg Config, reg prometheus.Registerer) (*onKubernetes, error) {
	clk, log := cfg.Clock, cfg.Logger
	restCfg, err := kube.LoadConfig(cfg.Kubernetes.Kubeconfig)
	if err != nil {
		return nil, err
	}
	clients, err := kube.NewClients(restCfg)
	if err != nil {
		return nil, err
	}
	k := &onKubernetes{cfg: cfg.Kubernetes, caNamespace: cfg.CANamespace, clients: clients, clock: clk, reg: reg, log: log.With(logkey.Component, "kubernetes")}
	if k.cfg.Identity == "" {
		if k.cfg.Identity, err = kube.ReplicaIdentity(); err != nil {
			return nil, err
		}
	}
	if k.cfg.StartTimeout == 0 {
		k.cfg.StartTimeout = DefaultKubernetesStartTimeout
	}
	k.store = kube.NewStore(kube.StoreConfig{Clients: clients, Namespace: cfg.Secrets.ListenedNamespace,
		Logger: log.With(logkey.Component, "kube-store"), Registerer: reg})
	if len(cfg.TrustedNodeAccounts) > 0 {
		// Every pod of the cluster, watched only when some node agent may ask for them.
		var err error
		if k.nodePods, err = kube.NewNodePods(kube.NodePodsConfig{Clients: clients,
			Logger: log.With(logkey.Component, "node-pods"), Registerer: reg}); err != nil {
			return nil, err
		}
	}
	if cfg.Upstream.Enabled() {
		// The signing certificate comes from the upstream CA, kept in the state dir (a volume):
		// each replica has its own, all chained to the upstream's root. No cacerts Secret.
		return k, nil
	}
	if k.cacerts, err = kube.NewCACerts(kube.CACertsConfig{
		Clients:               clients,
		Namespace:             cfg.CANamespace,
		SelfSigned:            cfg.SelfSigned,
		RootRotationThreshold: cfg.RootRotationThreshold,
		RootCheckInterval:     cfg.RootCheckInterval,
		Clock:                 clk,
		Logger:                log.With(logkey.Component, "cacerts"),
		Registerer:            reg,
	}); err != nil {
		return nil, err
	}
	return k, nil
}

// initialBundle returns the key material from the cacerts Secret, or nil when the mounted
// cacerts files hold a complete bundle (the RFC's first step, which the key manager takes).
func (k *onKubernetes) initialBundle(ctx context.Context, cacertsDir string, now time.Time) (*ca.Bundle, ca.Origin, error) {
	if cacertsDir != "" {
		_, err := ca.LoadPluggedIn(cacertsDir, now)
		if err == nil {
			return nil, "", nil
		}
		if !errors.Is(err, ca.ErrNoPluggedInCA) {
			return nil, "", &configerr.FieldError{Field: "CACertsDir", Err: err}
		}
	}
	ctx, cancel := context.WithTimeout(ctx, k.cfg.StartTimeout)
	defer cancel()
	return k.cacerts.Load(ctx)
}

// jwtSVIDSigner returns the signer of JWT-SVIDs with the key of the CA namespace's Secret,
// which the first replica to start creates and every other loads: one key, so that a JWT-SVID
// minted through one replica verifies with the bundle any replica serves. run keeps the signer on
// the Secret's key.
func (k *onKubernetes) jwtSVIDSigner(ctx context.Context, cfg Config) (*ca.JWTSVIDSigner, error) {
	ctx, cancel := context.WithTimeout(ctx, k.cfg.StartTimeout)
	defer cancel()
	keys, created, err := kube.LoadOrCreateJWTSVIDKey(ctx, k.clients, k.caNamespace)
	if err != nil {
		return nil, fmt.Errorf("load the JWT-SVID signing key: %w", err)
	}
	signer, err := keys.Signer(cfg.TrustDomain, cfg.JWTSVIDTTL, cfg.Clock.Now())
	if err != nil {
		return nil, err
	}
	if keys.Ignored != nil {
		cfg.Logger.Warn("the JWT-SVID key secret holds data that cannot be read; it is ignored",
			logkey.Reason, keys.Ignored.Error())
	}
	logJWTSVIDKey(cfg, signer, created, logkey.Object, "secret "+k.caNamespace+"/"+kube.JWTSVIDKeySecret)
	if k.jwtKeys, err = kube.NewJWTSVIDKeyFollower(kube.JWTSVIDKeyFollowerConfig{
		Clients: k.clients, Namespace: k.caNamespace, Signer: signer, Keys: keys,
		Clock: cfg.Clock, Logger: cfg.Logger.With(logkey.Component, "jwt-svid-key"), Registerer: k.reg,
	}); err != nil {
		return nil, err
	}
	return signer, nil
}

// newLeaderWork builds what the elected replica runs besides the secret controller, and the
// secret controller's store.
func (k *onKubernetes) newLeaderWork(cfg Config, targeting *controller.Targeting, authority *ca.Authority,
	reg prometheus.Registerer) (*leaderWork, error) {
	log := cfg.Logger
	rootCMs, err := kube.NewRootConfigMaps(kube.RootConfigMapsConfig{
		Clients:    k.clients,
		Store:      k.store,
		Targeting:  targeting,
		Bundle:     authority,
		Logger:     log.With(logkey.Component, "root-configmaps"),
		Registerer: reg,
	})
	if err != nil {
		return nil, err
	}
	return &leaderWork{rootCMs: rootCMs, secretStore: kube.NewSecretStore(kube.SecretStoreConfig{
		Clients:    k.clients,
		Namespace:  cfg.Secrets.ListenedNamespace,
		Logger:     log.With(logkey.Component, "kube-secrets"),
		Registerer: reg,
	})}, nil
}

func (k *onKubernetes) tokenReviews(cfg Config, reg prometheus.Registerer) (*kube.TokenReviewAuthenticator, error) {
	return kube.NewTokenReviewAuthenticator(kube.TokenReviewConfig{
		Reviews:     k.clients.Authentication.TokenReviews(),
		Audience:    cfg.JWTAudience,
		TrustDomain: cfg.TrustDomain,
		Clock:       cfg.Clock,
		Logger:      k.log,
		Registerer:  reg,
	})
}

// run runs the informers and the watches of cacerts and the JWT-SVID key on every replica, and
// the secret controller and the root ConfigMaps on the one holding the Lease. A change the secret
// store sees requeues the secret controller, where it runs.
func (k *onKubernetes) run(ctx context.Context, g *errgroup.Group, keys *ca.KeyManager, leader *leaderWork, secrets *controller.Secrets) {
	var requeue func(controller.SecretKey)
	if secrets != nil {
		requeue = secrets.Requeue
	}
	g.Go(func() error { return k.store.Run(ctx) })
	if k.nodePods != nil {
		g.Go(func() error { return k.nodePods.Run(ctx) })
	}
	if k.cacerts != nil {
		g.Go(func() error { return k.cacerts.Run(ctx, keys) })
	}
	if k.jwtKeys != nil {
		g.Go(func() error { return k.jwtKeys.Run(ctx) })
	}
	g.Go(func() error { return leader.secretStore.Run(ctx, requeue) })
	g.Go(func() error {
		// The elected replica's work reads both views: it starts once they are complete.
		for _, synced := range []<-chan struct{}{k.store.Synced(), leader.secretStore.Synced()} {
			select {
			case <-synced:
			case <-ctx.Done():
				return nil
			}
		}
		return kube.RunLeaderElected(ctx, kube.LeaderConfig{
			Clients:       k.clients,
			Namespace:     k.caNamespace,
			Name:          LeaseName,
			Identity:      k.cfg.Identity,
			LeaseDuration: k.cfg.LeaseDuration,
			RenewDeadline: k.cfg.RenewDeadline,
			RetryPeriod:   k.cfg.RetryPeriod,
			Clock:         k.clock,
			Logger:        k.log,
			Registerer:    k.reg,
		}, func(ctx context.Context) error {
			lg, ctx := errgroup.WithContext(ctx)
			lg.Go(func() error { return leader.rootCMs.Run(ctx) })
			if secrets != nil {
				lg.Go(func() error { return secrets.Run(ctx) })
			}
			return lg.Wait()
		})
	})
}
