package kube

import (
	"context"
	"crypto"
	"errors"
	"fmt"
	"log/slog"
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

// The Secret, in the CA namespace, that holds the JWT-SVID signing key: one key for every
// replica, so that a JWT-SVID minted through one verifies with the bundle any other serves.
const (
	JWTSVIDKeySecret = "meshid-jwt-svid" //nolint:gosec // a Secret's name, not a credential
	// JWTSVIDKeySecretType is the type of the Secret we create; a Secret made by hand
	// (kubectl create secret generic) is read too.
	JWTSVIDKeySecretType corev1.SecretType = "meshid.io/jwt-svid-key" //nolint:gosec // a type name, not a credential
	// JWTSVIDKeyData is the Secret's key holding the PEM private key.
	JWTSVIDKeyData = "key.pem"
)

// LoadOrCreateJWTSVIDKey returns the JWT-SVID signing key held by the Secret JWTSVIDKeySecret in
// namespace, after creating the Secret with a new ECDSA P-256 key when there is none, and reports
// whether this call created it. A replica that loses the race to create it uses the winner's. A
// Secret whose key is not ECDSA P-256 is refused: the CA does not start on it.
func LoadOrCreateJWTSVIDKey(ctx context.Context, clients *Clients, namespace string) (crypto.Signer, bool, error) {
	switch {
	case clients == nil:
		return nil, false, errors.New("JWT-SVID key: no Kubernetes clients")
	case namespace == "":
		return nil, false, errors.New("JWT-SVID key: no CA namespace")
	}
	where := "secret " + namespace + "/" + JWTSVIDKeySecret
	secrets := clients.Core.Secrets(namespace)
	s, err := secrets.Get(ctx, JWTSVIDKeySecret, metav1.GetOptions{})
	switch {
	case err == nil:
		key, err := jwtSVIDKeyOf(s, where)
		return key, false, err
	case !apierrors.IsNotFound(err):
		return nil, false, fmt.Errorf("get %s: %w", where, err)
	}

	keyPEM, err := ca.GenerateJWTSVIDKey()
	if err != nil {
		return nil, false, fmt.Errorf("generate the JWT-SVID key for %s: %w", where, err)
	}
	created, err := secrets.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: JWTSVIDKeySecret, Namespace: namespace},
		Type:       JWTSVIDKeySecretType,
		Data:       map[string][]byte{JWTSVIDKeyData: keyPEM},
	}, metav1.CreateOptions{})
	switch {
	case err == nil:
		key, err := jwtSVIDKeyOf(created, where)
		return key, err == nil, err
	case apierrors.IsAlreadyExists(err):
		// Another replica (or an operator) was first: theirs is the key.
		s, err := secrets.Get(ctx, JWTSVIDKeySecret, metav1.GetOptions{})
		if err != nil {
			return nil, false, fmt.Errorf("get %s, created by another writer: %w", where, err)
		}
		key, err := jwtSVIDKeyOf(s, where)
		return key, false, err
	default:
		return nil, false, fmt.Errorf("create %s: %w", where, err)
	}
}

// jwtSVIDKeyOf parses and checks the key a Secret holds. The error names the Secret and what is
// wrong, never the data.
func jwtSVIDKeyOf(s *corev1.Secret, where string) (crypto.Signer, error) {
	data, ok := s.Data[JWTSVIDKeyData]
	if !ok {
		return nil, fmt.Errorf("%s has no %s", where, JWTSVIDKeyData)
	}
	key, err := ca.ParseJWTSVIDKey(data)
	if err != nil {
		return nil, fmt.Errorf("%s, %s: %w", where, JWTSVIDKeyData, err)
	}
	return key, nil
}

// JWTSVIDKeyAdopter takes the key the Secret holds now (ca.JWTSVIDSigner.AdoptKey): it returns
// the key's kid, whether it was new, and its refusal.
type JWTSVIDKeyAdopter interface {
	AdoptKey(key crypto.Signer, now time.Time) (kid string, changed bool, err error)
}

// JWTSVIDKeysConfig configures JWTSVIDKeys.
type JWTSVIDKeysConfig struct {
	Clients   *Clients
	Namespace string // --ca-namespace, where the Secret lives
	// Signer adopts each new key, and Key is the one it was made with (LoadOrCreateJWTSVIDKey's).
	Signer     JWTSVIDKeyAdopter
	Key        crypto.Signer
	Clock      clock.Clock
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

// JWTSVIDKeys keeps every replica on the key of the JWTSVIDKeySecret Secret while it runs: a key
// an operator puts there is adopted (published at once, signing after ca.JWTSVIDKeyLead), and a
// deleted Secret is put back with the newest key adopted, so that a replica starting later loads
// that key rather than creating a key of its own that no other replica publishes.
type JWTSVIDKeys struct {
	cfg       JWTSVIDKeysConfig
	clock     clock.Clock
	log       *slog.Logger
	where     string
	events    *prometheus.CounterVec
	watchErrs *prometheus.CounterVec
}

// JWTSVIDKeys events, counted by meshid_ca_jwt_svid_key_secret_events_total.
const (
	jwtKeyAdopted       = "adopted"
	jwtKeyUnchanged     = "unchanged"
	jwtKeyInvalid       = "invalid"
	jwtKeyDeleted       = "deleted"
	jwtKeyRestored      = "restored"
	jwtKeyRestoreFailed = "restore_failed"
)

// jwtKeyRestoreRetry is how long after a failed restore of the deleted Secret the next try waits.
const jwtKeyRestoreRetry = 30 * time.Second

// NewJWTSVIDKeys returns a JWTSVIDKeys. It starts no goroutine.
func NewJWTSVIDKeys(cfg JWTSVIDKeysConfig) (*JWTSVIDKeys, error) {
	switch {
	case cfg.Clients == nil:
		return nil, errors.New("JWT-SVID key: no Kubernetes clients")
	case cfg.Namespace == "":
		return nil, errors.New("JWT-SVID key: no CA namespace")
	case cfg.Signer == nil || cfg.Key == nil:
		return nil, errors.New("JWT-SVID key: no signer to keep on the Secret's key")
	}
	k := &JWTSVIDKeys{
		cfg:       cfg,
		clock:     clock.OrReal(cfg.Clock),
		log:       cfg.Logger,
		where:     "secret " + cfg.Namespace + "/" + JWTSVIDKeySecret,
		watchErrs: watchErrors(cfg.Registerer),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "jwt_svid_key_secret_events_total",
			Help: "What the CA did on changes of the meshid-jwt-svid Secret: a new key adopted, the same key, invalid data ignored; the Secret deleted, restored, or its restore failed.",
		}, []string{"event"}),
	}
	if k.log == nil {
		k.log = slog.New(slog.DiscardHandler)
	}
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(k.events); err != nil {
			return nil, fmt.Errorf("JWT-SVID key metrics: %w", err)
		}
	}
	return k, nil
}

// Run follows the Secret until ctx ends.
func (k *JWTSVIDKeys) Run(ctx context.Context) error {
	f := jwtKeyFollower{newest: k.cfg.Key}
	return followSecret(ctx, secretWatch{
		clients: k.cfg.Clients, namespace: k.cfg.Namespace, name: JWTSVIDKeySecret,
		clock: k.clock, log: k.log, errs: k.watchErrs,
		deleted: func() {
			k.events.WithLabelValues(jwtKeyDeleted).Inc()
			k.log.Warn("the JWT-SVID key secret was deleted; putting it back with the key the CA signs with (to change the key, replace its key.pem instead)",
				logkey.Object, k.where)
		},
	}, func(s *corev1.Secret) time.Duration {
		switch {
		case s != nil:
			k.sync(s, &f)
		case !k.restore(ctx, f.newest):
			return jwtKeyRestoreRetry
		}
		return 0
	})
}

// jwtKeyFollower is what Run knows of the Secret's versions.
type jwtKeyFollower struct {
	newest  crypto.Signer // the newest key adopted, which a restore writes
	seen    string        // the resource version last handled
	refused string        // the last one found invalid, logged once
}

// sync adopts the key of a version of the Secret not handled yet.
func (k *JWTSVIDKeys) sync(s *corev1.Secret, f *jwtKeyFollower) {
	if s.ResourceVersion == f.seen {
		return
	}
	f.seen = s.ResourceVersion
	key, err := jwtSVIDKeyOf(s, k.where)
	if err == nil {
		var kid string
		var changed bool
		if kid, changed, err = k.cfg.Signer.AdoptKey(key, k.clock.Now()); err == nil {
			f.newest = key
			if !changed {
				k.events.WithLabelValues(jwtKeyUnchanged).Inc()
				return
			}
			k.events.WithLabelValues(jwtKeyAdopted).Inc()
			k.log.Info("adopted the JWT-SVID key of the secret: published now, signing once every agent has it",
				logkey.Object, k.where, logkey.KeyID, kid, logkey.NotBefore, k.clock.Now().Add(ca.JWTSVIDKeyLead))
			return
		}
	}
	k.events.WithLabelValues(jwtKeyInvalid).Inc()
	if s.ResourceVersion != f.refused {
		f.refused = s.ResourceVersion
		k.log.Warn("the JWT-SVID key secret holds no valid key; the CA keeps signing with the key it has",
			logkey.Object, k.where, logkey.ResourceVersion, s.ResourceVersion, logkey.Reason, err.Error())
	}
}

// restore creates the deleted Secret with key, and reports whether that is done: created here,
// or by another replica or an operator first (whose version the watch brings).
func (k *JWTSVIDKeys) restore(ctx context.Context, key crypto.Signer) bool {
	keyPEM, err := pki.EncodePrivateKey(key)
	if err == nil {
		_, err = k.cfg.Clients.Core.Secrets(k.cfg.Namespace).Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: JWTSVIDKeySecret, Namespace: k.cfg.Namespace},
			Type:       JWTSVIDKeySecretType,
			Data:       map[string][]byte{JWTSVIDKeyData: keyPEM},
		}, metav1.CreateOptions{})
	}
	switch {
	case err == nil:
		k.events.WithLabelValues(jwtKeyRestored).Inc()
		k.log.Info("put the JWT-SVID key secret back", logkey.Object, k.where)
		return true
	case apierrors.IsAlreadyExists(err):
		return true
	case ctx.Err() != nil:
		return true // stopping
	default:
		k.events.WithLabelValues(jwtKeyRestoreFailed).Inc()
		k.log.Error("cannot put the JWT-SVID key secret back; retrying", logkey.Object, k.where,
			logkey.Error, err.Error(), logkey.RetryIn, jwtKeyRestoreRetry)
		return false
	}
}
