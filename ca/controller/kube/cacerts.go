package kube

import (
	"bytes"
	"context"
	"crypto"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// The Secrets of seed 001.
const (
	// CACertsSecret holds the CA's key material: plugged in by an operator, or generated.
	CACertsSecret = "cacerts"
	// IstioCASecret is where istiod keeps the self-signed CA it generated.
	IstioCASecret = "istio-ca-secret"
	// CARootSecretType is the type of istio-ca-secret, and of a cacerts Secret we generate.
	CARootSecretType corev1.SecretType = "istio.io/ca-root" //nolint:gosec // a type name, not a credential
)

// AnnotationGenerated marks a cacerts Secret whose key material meshid generated, or copied from
// istio-ca-secret (which istiod generated): the RFC's open problem of telling it from a plugged-in
// one. Its value is the hex SHA-256 of the ca-cert.pem it was written with, not "true": an
// operator who replaces the data keeps the annotation when editing in place (kubectl edit), and
// must still take over. Only a Secret whose annotation matches its ca-cert.pem is ever rotated.
const AnnotationGenerated = "meshid.io/generated"

// Offerer puts key material from the cacerts Secret in service: ca.KeyManager.
type Offerer interface {
	Offer(b *ca.Bundle, from string) ca.Event
}

// CACertsConfig configures CACerts. Zero rotation settings take the key manager's defaults;
// SelfSigned is used as given (the composition root fills it, as for the state dir's root).
type CACertsConfig struct {
	Clients   *Clients
	Namespace string // --ca-namespace, where the Secrets live
	// SelfSigned describes the root generated when neither Secret exists, and its renewals.
	SelfSigned            ca.SelfSignedConfig
	RootRotationThreshold float64
	RootCheckInterval     time.Duration
	Clock                 clock.Clock
	// Jitter returns a number in [0, 1) that spreads the root checks of replicas; nil is random.
	Jitter     func() float64
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

// CACerts keeps the CA's key material in the cacerts Secret, as seed 001's accepted approach does:
// Load finds or creates it at start-up; Run follows it and rotates a generated root.
type CACerts struct {
	cfg     CACertsConfig
	clock   clock.Clock
	log     *slog.Logger
	where   string // "secret NS/cacerts", in errors and logs
	offers  *prometheus.CounterVec
	rotates *prometheus.CounterVec
	apiErrs *prometheus.CounterVec
	// watchErrs counts failed lists and watches, shared with the other informers.
	watchErrs *prometheus.CounterVec
	deletes   prometheus.Counter
}

// NewCACerts returns a CACerts. It starts no goroutine.
func NewCACerts(cfg CACertsConfig) (*CACerts, error) {
	switch {
	case cfg.Clients == nil:
		return nil, errors.New("cacerts: no Kubernetes clients")
	case cfg.Namespace == "":
		return nil, errors.New("cacerts: no CA namespace")
	}
	if cfg.RootCheckInterval <= 0 {
		cfg.RootCheckInterval = ca.DefaultRootCheckInterval
	}
	if cfg.RootRotationThreshold == 0 {
		cfg.RootRotationThreshold = ca.DefaultRootRotationThreshold
	}
	if err := ca.ValidateRootRotationThreshold(cfg.RootRotationThreshold); err != nil {
		return nil, fmt.Errorf("cacerts: %w", err)
	}
	if cfg.Jitter == nil {
		cfg.Jitter = rand.Float64
	}
	c := &CACerts{
		watchErrs: watchErrors(cfg.Registerer),
		cfg:       cfg,
		clock:     clock.OrReal(cfg.Clock),
		log:       cfg.Logger,
		where:     "secret " + cfg.Namespace + "/" + CACertsSecret,
		offers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "cacerts_secret_versions_total",
			Help: "Versions of the cacerts Secret seen, by outcome (reloaded, unchanged, rejected by the key manager; invalid data).",
		}, []string{"outcome"}),
		rotates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "cacerts_secret_rotations_total",
			Help: "Renewals of the generated root in the cacerts Secret, by outcome (rotated; conflict: another replica rotated first; failed).",
		}, []string{"outcome"}),
		apiErrs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "cacerts_secret_api_errors_total",
			Help: "Failed API calls about the cacerts and istio-ca-secret Secrets, by operation.",
		}, []string{"operation"}),
		deletes: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "cacerts_secret_deletions_total",
			Help: "Deletions of the cacerts Secret seen; the CA keeps serving the key material it has.",
		}),
	}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	if cfg.Registerer != nil {
		for _, col := range []prometheus.Collector{c.offers, c.rotates, c.apiErrs, c.deletes} {
			if err := cfg.Registerer.Register(col); err != nil {
				return nil, fmt.Errorf("cacerts metrics: %w", err)
			}
		}
	}
	return c, nil
}

// Load runs seed 001's start-up steps 2 and 3 (the caller did step 1, the mounted files): the
// Secret cacerts when it exists; else a cacerts created from istio-ca-secret's data; else a
// cacerts of type istio.io/ca-root holding a new self-signed root. A replica that loses the race
// to create cacerts loads the winner's. It returns the key material and the step that found it.
func (c *CACerts) Load(ctx context.Context) (*ca.Bundle, ca.Origin, error) {
	secrets := c.cfg.Clients.Core.Secrets(c.cfg.Namespace)
	b, found, err := c.loadExisting(ctx)
	if err != nil || found {
		return b, ca.OriginCACertsSecret, err
	}

	now := c.clock.Now()
	var (
		data   map[string][]byte
		typ    = CARootSecretType
		origin = ca.OriginIstioCASecret
	)
	src, err := secrets.Get(ctx, IstioCASecret, metav1.GetOptions{})
	switch {
	case err == nil:
		data = fromIstioCASecret(src.Data)
		if src.Type != "" {
			typ = src.Type
		}
	case apierrors.IsNotFound(err):
		origin = ca.OriginGeneratedSecret
		if data, err = c.generate(now); err != nil {
			return nil, "", err
		}
	default:
		c.apiErrs.WithLabelValues("get").Inc()
		return nil, "", fmt.Errorf("get secret %s/%s: %w", c.cfg.Namespace, IstioCASecret, err)
	}
	// Checked before it is written: an invalid cacerts would stop every replica.
	b, err = ca.BundleFromData(data, c.where, now)
	if err != nil {
		return nil, "", fmt.Errorf("key material for %s from %s: %w", c.where, origin, err)
	}
	_, err = secrets.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name:        CACertsSecret,
			Namespace:   c.cfg.Namespace,
			Annotations: map[string]string{AnnotationGenerated: certDigest(data[ca.CACertFile])},
		},
		Type: typ,
		Data: data,
	}, metav1.CreateOptions{})
	switch {
	case apierrors.IsAlreadyExists(err):
		// Another replica (or an operator) was first: theirs is the CA's.
		b, found, err = c.loadExisting(ctx)
		if err == nil && !found {
			err = fmt.Errorf("%s was created by another writer and is gone again", c.where)
		}
		return b, ca.OriginCACertsSecret, err
	case err != nil:
		c.apiErrs.WithLabelValues("create").Inc()
		return nil, "", fmt.Errorf("create %s: %w", c.where, err)
	}
	c.log.Info("created the cacerts secret", logkey.Object, c.where, logkey.Source, string(origin),
		logkey.Root, b.Root().Subject.String(), logkey.NotAfter, b.Root().NotAfter)
	return b, origin, nil
}

// loadExisting reads the cacerts Secret; found is false when there is none.
func (c *CACerts) loadExisting(ctx context.Context) (*ca.Bundle, bool, error) {
	s, err := c.cfg.Clients.Core.Secrets(c.cfg.Namespace).Get(ctx, CACertsSecret, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return nil, false, nil
	case err != nil:
		c.apiErrs.WithLabelValues("get").Inc()
		return nil, false, fmt.Errorf("get %s: %w", c.where, err)
	}
	b, err := ca.BundleFromData(s.Data, c.where, c.clock.Now())
	if err != nil {
		return nil, true, err
	}
	return b, true, nil
}

// generate returns the data of a cacerts Secret holding a new self-signed root, in Istio's
// plugged-in layout, so that Istio's tools read it too.
func (c *CACerts) generate(now time.Time) (map[string][]byte, error) {
	root, key, err := ca.GenerateSelfSignedRoot(c.cfg.SelfSigned, now)
	if err != nil {
		return nil, fmt.Errorf("generate a self-signed root for %s: %w", c.where, err)
	}
	keyPEM, err := pki.EncodePrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("encode the key of the root for %s: %w", c.where, err)
	}
	rootPEM := pki.EncodeCertificate(root)
	return map[string][]byte{
		ca.CACertFile:    rootPEM,
		ca.CAKeyFile:     keyPEM,
		ca.CertChainFile: rootPEM,
		ca.RootCertFile:  rootPEM,
	}, nil
}

// fromIstioCASecret copies istio-ca-secret's data. istiod writes cert-chain.pem and root-cert.pem
// empty (its ca-cert.pem is a self-signed root); they are added when missing so that the data is
// Istio's complete plugged-in layout.
func fromIstioCASecret(src map[string][]byte) map[string][]byte {
	data := make(map[string][]byte, len(src)+2)
	for k, v := range src {
		data[k] = bytes.Clone(v)
	}
	for _, name := range []string{ca.CertChainFile, ca.RootCertFile} {
		if _, ok := data[name]; !ok {
			data[name] = []byte{}
		}
	}
	return data
}

func certDigest(certPEM []byte) string {
	sum := sha256.Sum256(certPEM)
	return hex.EncodeToString(sum[:])
}

// generated reports whether s holds key material we generated and nobody replaced since.
func generated(s *corev1.Secret) bool {
	v, ok := s.Annotations[AnnotationGenerated]
	return ok && v == certDigest(s.Data[ca.CACertFile])
}

// Run follows the cacerts Secret until ctx ends: every new version is offered to keys, so that a
// rotation or plug-in by any replica or operator reaches every replica with no restart. On each
// version and every RootCheckInterval (±5%) it renews a generated root that nears its end.
func (c *CACerts) Run(ctx context.Context, keys Offerer) error {
	var v versions
	return followSecret(ctx, secretWatch{
		clients: c.cfg.Clients, namespace: c.cfg.Namespace, name: CACertsSecret,
		clock: c.clock, log: c.log, errs: c.watchErrs,
		deleted: func() {
			c.deletes.Inc()
			c.log.Warn("the cacerts secret was deleted; the CA keeps serving its key material and does not recreate it", logkey.Object, c.where)
		},
	}, func(s *corev1.Secret) time.Duration {
		if s != nil {
			c.sync(ctx, s, &v, keys)
		}
		return time.Duration(float64(c.cfg.RootCheckInterval) * (0.95 + 0.1*c.cfg.Jitter()))
	})
}

// versions is what the follower knows of the Secret's versions.
type versions struct {
	offered string // the last one offered
	refused string // the last one found invalid, logged and counted once
}

// sync offers a version of the Secret not offered yet, and renews its root when it is due. A
// version found invalid is tried again at each sync, since validity depends on the time (a root
// renewed by a replica whose clock runs ahead is not valid here yet), but reported once.
func (c *CACerts) sync(ctx context.Context, s *corev1.Secret, v *versions, keys Offerer) {
	now := c.clock.Now()
	if s.ResourceVersion != v.offered {
		b, err := ca.BundleFromData(s.Data, c.where, now)
		switch {
		case err != nil && s.ResourceVersion != v.refused:
			v.refused = s.ResourceVersion
			c.offers.WithLabelValues("invalid").Inc()
			c.log.Warn("the cacerts secret holds no valid key material; the CA keeps serving the key material it has",
				logkey.Object, c.where, logkey.ResourceVersion, s.ResourceVersion, logkey.Reason, err.Error())
		case err == nil:
			v.offered = s.ResourceVersion
			ev := keys.Offer(b, c.where)
			c.offers.WithLabelValues(string(ev.Kind)).Inc()
		}
	}
	c.rotateIfDue(ctx, s, now)
}

// rotateIfDue renews a generated root from the same key once less than the threshold of its
// lifetime is left, and writes it to the Secret version it was read from. Replicas race for it:
// the API server takes one update, the others get a Conflict and the watch brings them the new root.
func (c *CACerts) rotateIfDue(ctx context.Context, s *corev1.Secret, now time.Time) {
	if !generated(s) {
		return
	}
	root, key, ok := selfSignedRoot(s.Data)
	if !ok || now.Before(ca.RootRenewalTime(root, c.cfg.RootRotationThreshold)) {
		return
	}
	renewed, err := ca.RenewRoot(root, key, c.cfg.SelfSigned.TTL, now)
	if err != nil {
		c.rotates.WithLabelValues("failed").Inc()
		c.log.Error("cannot renew the generated root of the cacerts secret", logkey.Object, c.where, logkey.Error, err.Error())
		return
	}
	next := s.DeepCopy()
	renewedPEM := pki.EncodeCertificate(renewed)
	next.Data[ca.CACertFile] = renewedPEM
	for _, name := range []string{ca.CertChainFile, ca.RootCertFile} {
		if len(next.Data[name]) > 0 { // left empty as istiod writes them
			next.Data[name] = renewedPEM
		}
	}
	next.Annotations[AnnotationGenerated] = certDigest(renewedPEM)
	_, err = c.cfg.Clients.Core.Secrets(c.cfg.Namespace).Update(ctx, next, metav1.UpdateOptions{})
	switch {
	case apierrors.IsConflict(err):
		c.rotates.WithLabelValues("conflict").Inc()
		c.log.Debug("another writer changed the cacerts secret first; its version comes with the watch",
			logkey.Object, c.where, logkey.ResourceVersion, s.ResourceVersion)
	case err != nil:
		c.rotates.WithLabelValues("failed").Inc()
		c.apiErrs.WithLabelValues("update").Inc()
		c.log.Error("cannot write the renewed root to the cacerts secret; retrying at the next check",
			logkey.Object, c.where, logkey.Error, err.Error())
	default:
		c.rotates.WithLabelValues("rotated").Inc()
		c.log.Info("renewed the generated root in the cacerts secret; the old root stays trusted",
			logkey.Object, c.where, logkey.OldNotAfter, root.NotAfter, logkey.NotAfter, renewed.NotAfter)
	}
}

// selfSignedRoot returns the signing certificate and key of a Secret's Istio layout when the
// certificate is a self-signed root, the only kind the rotator renews.
func selfSignedRoot(data map[string][]byte) (*x509.Certificate, crypto.Signer, bool) {
	certs, err := pki.ParseCertificates(data[ca.CACertFile])
	if err != nil {
		return nil, nil, false
	}
	key, err := pki.ParsePrivateKey(data[ca.CAKeyFile])
	if err != nil {
		return nil, nil, false
	}
	root := certs[0]
	if !root.IsCA || !pki.IsSelfSigned(root) {
		return nil, nil, false
	}
	return root, key, true
}
