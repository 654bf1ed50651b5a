package kube

import (
	"context"
	"crypto"
	"errors"
	"fmt"
	"log/slog"
	"maps"
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
	// JWTSVIDNextKeyData is where an operator puts the key to rotate to. The first replica to see
	// it moves it to key.pem, and key.pem to previous-key.pem, in one write: so the Secret never
	// holds a new key.pem without the rotation to it, which a replica starting then would sign with
	// at once.
	JWTSVIDNextKeyData = "next-key.pem"
	// JWTSVIDPreviousKeyData holds, while a rotation is under way, the key that key.pem replaced:
	// written by the CA, so that a replica starting then signs and publishes as the others do.
	JWTSVIDPreviousKeyData = "previous-key.pem"
	// AnnotationJWTSVIDKeyID names the key (its kid) that AnnotationJWTSVIDSignsFrom and
	// previous-key.pem belong to: a key.pem replaced since is a new rotation.
	AnnotationJWTSVIDKeyID = "meshid.io/jwt-svid-kid"
	// AnnotationJWTSVIDSignsFrom is when key.pem signs (RFC 3339); before, previous-key.pem does.
	AnnotationJWTSVIDSignsFrom = "meshid.io/jwt-svid-signs-from"
)

// JWTSVIDKey is what the Secret holds: the key, and while a rotation is under way the key it
// replaced and when it takes over.
type JWTSVIDKey struct {
	Key      crypto.Signer
	Previous crypto.Signer // nil: none
	// SignsFrom is when Key signs; before, Previous. Without Previous, the rotation is over (or
	// never was) and Key signs.
	SignsFrom time.Time
	// Ignored says why data in the Secret was not taken: a rotation or a next-key.pem that
	// cannot be read. Key is followed as if it were not there.
	Ignored error
	// Next is a key put in next-key.pem that no replica has moved into key.pem yet.
	Next    crypto.Signer
	version string // the Secret's resource version read
}

// Signer returns a signer of k at now: Previous signing until SignsFrom, then Key, each
// published while a JWT-SVID it signed may be valid; and Next, if any, published at once as the
// replica that moves it starts the rotation to it (withNext).
func (k JWTSVIDKey) Signer(trustDomain string, ttl time.Duration, now time.Time) (*ca.JWTSVIDSigner, error) {
	k, _ = k.withNext(ttl, now)
	if k.Previous == nil {
		return ca.NewJWTSVIDSigner(k.Key, trustDomain, ttl)
	}
	s, err := ca.NewJWTSVIDSigner(k.Previous, trustDomain, ttl)
	if err != nil {
		return nil, err
	}
	if _, _, err := s.AdoptKey(k.Key, k.Previous, k.SignsFrom, now); err != nil {
		return nil, err
	}
	return s, nil
}

// withNext is k with the rotation to Next started at now, from the key signing, as the replica
// that moves Next into key.pem writes it. A Next equal to Key is no rotation. While k's own
// rotation is under way Next waits: k is returned as it is, with the time it waits until, so that
// the Secret never needs two replaced keys.
func (k JWTSVIDKey) withNext(ttl time.Duration, now time.Time) (JWTSVIDKey, time.Time) {
	if k.Next == nil {
		return k, time.Time{}
	}
	if kids, err := kidsOf(k.Next, k.Key); err != nil || kids[0] == kids[1] {
		k.Next = nil
		return k, time.Time{}
	}
	if until := previousUntil(k, ttl); k.Previous != nil && now.Before(until) {
		return k, until
	}
	r := rotationStarted(k.Next, k.signing(now), now)
	r.Ignored, r.version = k.Ignored, k.version
	return r, time.Time{}
}

// rotationStarted is a rotation from the key signing to key, started at now by this replica: key
// signs once the lead is over.
func rotationStarted(key, signing crypto.Signer, now time.Time) JWTSVIDKey {
	return JWTSVIDKey{Key: key, Previous: signing, SignsFrom: leadFrom(now)}
}

// previousUntil is when the replaced key of keys is needed no more: the last JWT-SVID it signed,
// on any replica's clock, has expired.
func previousUntil(keys JWTSVIDKey, ttl time.Duration) time.Time {
	return keys.SignsFrom.Add(ttl + ca.JWTSVIDClockSkew)
}

// signing is the key that signs at now.
func (k JWTSVIDKey) signing(now time.Time) crypto.Signer {
	if k.Previous != nil && now.Before(k.SignsFrom) {
		return k.Previous
	}
	return k.Key
}

// LoadOrCreateJWTSVIDKey returns the JWT-SVID signing key held by the Secret JWTSVIDKeySecret in
// namespace (with the rotation under way, if any), after creating the Secret with a new ECDSA
// P-256 key when there is none, and reports whether this call created it. A replica that loses
// the race to create it uses the winner's. A Secret whose key is not ECDSA P-256 is refused: the
// CA does not start on it.
func LoadOrCreateJWTSVIDKey(ctx context.Context, clients *Clients, namespace string) (JWTSVIDKey, bool, error) {
	switch {
	case clients == nil:
		return JWTSVIDKey{}, false, errors.New("JWT-SVID key: no Kubernetes clients")
	case namespace == "":
		return JWTSVIDKey{}, false, errors.New("JWT-SVID key: no CA namespace")
	}
	where := "secret " + namespace + "/" + JWTSVIDKeySecret
	secrets := clients.Core.Secrets(namespace)
	s, err := secrets.Get(ctx, JWTSVIDKeySecret, metav1.GetOptions{})
	switch {
	case err == nil:
		key, err := readJWTSVIDKey(s, where)
		return key, false, err
	case !apierrors.IsNotFound(err):
		return JWTSVIDKey{}, false, fmt.Errorf("get %s: %w", where, err)
	}

	keyPEM, err := ca.GenerateJWTSVIDKey()
	if err != nil {
		return JWTSVIDKey{}, false, fmt.Errorf("generate the JWT-SVID key for %s: %w", where, err)
	}
	created, err := secrets.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: JWTSVIDKeySecret, Namespace: namespace},
		Type:       JWTSVIDKeySecretType,
		Data:       map[string][]byte{JWTSVIDKeyData: keyPEM},
	}, metav1.CreateOptions{})
	switch {
	case err == nil:
		key, err := readJWTSVIDKey(created, where)
		return key, err == nil, err
	case apierrors.IsAlreadyExists(err):
		// Another replica (or an operator) was first: theirs is the key.
		s, err := secrets.Get(ctx, JWTSVIDKeySecret, metav1.GetOptions{})
		if err != nil {
			return JWTSVIDKey{}, false, fmt.Errorf("get %s, created by another writer: %w", where, err)
		}
		key, err := readJWTSVIDKey(s, where)
		return key, false, err
	default:
		return JWTSVIDKey{}, false, fmt.Errorf("create %s: %w", where, err)
	}
}

// readJWTSVIDKey reads the Secret: its key, which must be valid, and the rotation the CA wrote
// there when it is that key's (an operator who replaced key.pem since started another). A
// rotation that is malformed is ignored, and said why in Ignored.
func readJWTSVIDKey(s *corev1.Secret, where string) (JWTSVIDKey, error) {
	key, err := currentKeyOf(s, where)
	if err != nil {
		return JWTSVIDKey{}, err
	}
	keys := JWTSVIDKey{Key: key, version: s.ResourceVersion}
	if data, ok := s.Data[JWTSVIDNextKeyData]; ok {
		if keys.Next, err = ca.ParseJWTSVIDKey(data); err != nil {
			keys.Ignored = fmt.Errorf("%s, %s: %w", where, JWTSVIDNextKeyData, err)
		}
	}
	kid, err := ca.JWTSVIDKeyID(key)
	if err != nil || s.Annotations[AnnotationJWTSVIDKeyID] != kid {
		return keys, err
	}
	signsFrom, err := time.Parse(time.RFC3339, s.Annotations[AnnotationJWTSVIDSignsFrom])
	if err != nil {
		keys.Ignored = fmt.Errorf("%s, annotation %s: %w", where, AnnotationJWTSVIDSignsFrom, err)
		return keys, nil
	}
	keys.SignsFrom = signsFrom
	data, ok := s.Data[JWTSVIDPreviousKeyData]
	if !ok {
		return keys, nil // a rotation over: its previous key removed
	}
	if keys.Previous, err = ca.ParseJWTSVIDKey(data); err != nil {
		keys.Ignored = fmt.Errorf("%s, %s: %w", where, JWTSVIDPreviousKeyData, err)
		keys.SignsFrom = time.Time{}
	}
	return keys, nil
}

// currentKeyOf parses and checks the key a Secret holds in key.pem. The error names the Secret
// and what is wrong, never the data.
func currentKeyOf(s *corev1.Secret, where string) (crypto.Signer, error) {
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

// JWTSVIDKeyAdopter is what JWTSVIDKeyFollower keeps on the Secret's key: ca.JWTSVIDSigner.
type JWTSVIDKeyAdopter interface {
	AdoptKey(key, previous crypto.Signer, signsFrom, now time.Time) (kid string, changed bool, err error)
	TTL() time.Duration
}

// JWTSVIDKeyFollowerConfig configures JWTSVIDKeyFollower.
type JWTSVIDKeyFollowerConfig struct {
	Clients   *Clients
	Namespace string // --ca-namespace, where the Secret lives
	// Signer adopts each new key; Keys is what it was made from (LoadOrCreateJWTSVIDKey's).
	Signer     JWTSVIDKeyAdopter
	Keys       JWTSVIDKey
	Clock      clock.Clock
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
}

// JWTSVIDKeyFollower keeps every replica on the key of the JWTSVIDKeySecret Secret while it
// runs. A key an operator puts in next-key.pem (or, with a window, straight into key.pem) is
// adopted: published at once, signing ca.JWTSVIDKeyLead later. The first replica to see it writes
// the rotation in the Secret (the key it replaced, in previous-key.pem, and when it signs), so
// that every replica, and one starting meanwhile, signs with the same key at the same time; once
// the replaced key's last JWT-SVID has expired, it is removed. A deleted Secret is put back with
// the newest key and its rotation, so that a replica starting later does not create a key of its
// own that no other replica publishes.
type JWTSVIDKeyFollower struct {
	cfg       JWTSVIDKeyFollowerConfig
	clock     clock.Clock
	log       *slog.Logger
	where     string
	events    *prometheus.CounterVec
	watchErrs *prometheus.CounterVec
}

// JWTSVIDKeyFollower events, counted by meshid_ca_jwt_svid_key_secret_events_total.
const (
	jwtKeyAdopted         = "adopted"
	jwtKeyUnchanged       = "unchanged"
	jwtKeyInvalid         = "invalid"
	jwtKeyDeleted         = "deleted"
	jwtKeyRestored        = "restored"
	jwtKeyPreviousRemoved = "previous_removed"
	jwtKeyRotationWritten = "rotation_written"
	jwtKeyNextMoved       = "next_moved"
	jwtKeyNextWaiting     = "next_waiting"
	jwtKeyWriteFailed     = "write_failed"
)

// Writes of the Secret: how long one may take, and how long after a failed one the next waits.
const (
	jwtKeyWriteTimeout = 30 * time.Second
	jwtKeyRetry        = 30 * time.Second
)

// NewJWTSVIDKeyFollower returns a JWTSVIDKeyFollower. It starts no goroutine.
func NewJWTSVIDKeyFollower(cfg JWTSVIDKeyFollowerConfig) (*JWTSVIDKeyFollower, error) {
	switch {
	case cfg.Clients == nil:
		return nil, errors.New("JWT-SVID key: no Kubernetes clients")
	case cfg.Namespace == "":
		return nil, errors.New("JWT-SVID key: no CA namespace")
	case cfg.Signer == nil || cfg.Keys.Key == nil:
		return nil, errors.New("JWT-SVID key: no signer to keep on the Secret's key")
	}
	k := &JWTSVIDKeyFollower{
		cfg:       cfg,
		clock:     clock.OrReal(cfg.Clock),
		log:       cfg.Logger,
		where:     "secret " + cfg.Namespace + "/" + JWTSVIDKeySecret,
		watchErrs: watchErrors(cfg.Registerer),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "jwt_svid_key_secret_events_total",
			Help: "What the CA did on changes of the meshid-jwt-svid Secret: a new key adopted, the same key, invalid data ignored; the Secret deleted, restored; a rotation written, next-key.pem moved into key.pem, a replaced key removed once unused; a write that failed.",
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

// jwtKeyFollower is what Run knows of the Secret.
type jwtKeyFollower struct {
	keys    JWTSVIDKey // the newest key adopted and its rotation, as the Secret should show them
	seen    string     // the resource version last handled
	refused string     // the last one found invalid, logged once
	waited  string     // the last one whose next-key.pem waits, logged once
}

// Run follows the Secret until ctx ends.
func (k *JWTSVIDKeyFollower) Run(ctx context.Context) error {
	f := jwtKeyFollower{}
	f.keys, _ = k.cfg.Keys.withNext(k.cfg.Signer.TTL(), k.clock.Now()) // as Signer made the signer
	if f.keys.Ignored != nil {
		f.refused = f.keys.version // said at start
	}
	return followSecret(ctx, secretWatch{
		clients: k.cfg.Clients, namespace: k.cfg.Namespace, name: JWTSVIDKeySecret,
		clock: k.clock, log: k.log, errs: k.watchErrs,
		deleted: func() {
			k.events.WithLabelValues(jwtKeyDeleted).Inc()
			k.log.Warn("the JWT-SVID key secret was deleted; putting it back with the newest key and its rotation (to change the key, put one in next-key.pem instead)",
				logkey.Object, k.where)
		},
	}, func(s *corev1.Secret) time.Duration {
		now := k.clock.Now()
		if s == nil {
			return k.write(ctx, nil, f.keys, now, false, jwtKeyRestored, "put the JWT-SVID key secret back")
		}
		if s.ResourceVersion != f.seen {
			f.seen = s.ResourceVersion
			k.sync(s, &f, now)
		}
		if k.holdsNext(s, f.keys) {
			return k.write(ctx, s, f.keys, now, true, jwtKeyNextMoved, "moved next-key.pem into key.pem: the rotation to it is under way")
		}
		if k.owesRotation(s, f.keys, now) {
			if wait := k.write(ctx, s, f.keys, now, false, jwtKeyRotationWritten, "wrote the JWT-SVID key rotation into the secret, for replicas that start during it"); wait > 0 {
				return wait
			}
		}
		return k.prunePrevious(ctx, s, now)
	})
}

// sync adopts the key of a new version of the Secret, and says once why a version is refused or
// its rotation ignored.
func (k *JWTSVIDKeyFollower) sync(s *corev1.Secret, f *jwtKeyFollower, now time.Time) {
	keys, err := k.syncVersion(s, f, now)
	if err == nil && keys.Ignored == nil {
		return
	}
	k.events.WithLabelValues(jwtKeyInvalid).Inc()
	if s.ResourceVersion == f.refused {
		return
	}
	f.refused = s.ResourceVersion
	if err != nil {
		k.log.Warn("the JWT-SVID key secret holds no valid key; the CA keeps signing with the key it has",
			logkey.Object, k.where, logkey.ResourceVersion, s.ResourceVersion, logkey.Reason, err.Error())
		return
	}
	k.log.Warn("the JWT-SVID key secret holds data that cannot be read; it is ignored",
		logkey.Object, k.where, logkey.ResourceVersion, s.ResourceVersion, logkey.Reason, keys.Ignored.Error())
}

// syncVersion adopts the Secret's key: on the rotation written with it; else, for a key not yet
// adopted here, on a rotation this replica starts from the key signing now (Run writes it), or,
// for the key signing here, by ending the rotation under way.
func (k *JWTSVIDKeyFollower) syncVersion(s *corev1.Secret, f *jwtKeyFollower, now time.Time) (JWTSVIDKey, error) {
	keys, err := readJWTSVIDKey(s, k.where)
	if err != nil {
		return keys, err
	}
	keys, waits := keys.withNext(k.cfg.Signer.TTL(), now)
	if !waits.IsZero() && s.ResourceVersion != f.waited {
		f.waited = s.ResourceVersion
		k.events.WithLabelValues(jwtKeyNextWaiting).Inc()
		k.log.Info("next-key.pem waits for the rotation under way to end",
			logkey.Object, k.where, logkey.NotBefore, waits)
	}
	kids, err := kidsOf(keys.Key, f.keys.Key, f.keys.signing(now))
	if err != nil {
		return keys, err
	}
	kid, newestKid, signingKid := kids[0], kids[1], kids[2]
	previous, signsFrom, cancelled := keys.Previous, keys.SignsFrom, false
	switch {
	case previous != nil:
		// The schedule every replica follows; one that sees it late (its watch was down) has
		// published the key for less than the lead, and its agents may lack it for that long.
	case kid == newestKid:
		k.events.WithLabelValues(jwtKeyUnchanged).Inc() // Run writes a rotation the Secret lacks
		return keys, nil
	case kid == signingKid:
		previous, signsFrom, cancelled = keys.Key, now, true // the key signing here put back
	default:
		r := rotationStarted(keys.Key, f.keys.signing(now), now)
		keys.Previous, keys.SignsFrom = r.Previous, r.SignsFrom
		previous, signsFrom = r.Previous, r.SignsFrom
	}
	_, changed, err := k.cfg.Signer.AdoptKey(keys.Key, previous, signsFrom, now)
	if err != nil {
		return keys, err
	}
	f.keys = keys
	if !changed {
		k.events.WithLabelValues(jwtKeyUnchanged).Inc()
		return keys, nil
	}
	k.events.WithLabelValues(jwtKeyAdopted).Inc()
	if cancelled {
		k.log.Info("the JWT-SVID key signing was put back in the secret: the rotation under way is cancelled",
			logkey.Object, k.where, logkey.KeyID, kid)
		return keys, nil
	}
	k.log.Info("adopted the JWT-SVID key of the secret: published now, signing once every agent has it",
		logkey.Object, k.where, logkey.KeyID, kid, logkey.NotBefore, signsFrom)
	return keys, nil
}

// leadFrom is when a key published at now may sign: after the lead, in whole seconds (as the
// annotation holds it), rounded up.
func leadFrom(now time.Time) time.Time {
	t := now.Add(ca.JWTSVIDKeyLead)
	if r := t.Truncate(time.Second); !r.Equal(t) {
		return r.Add(time.Second)
	}
	return t
}

// kidsOf is the kid of each key.
func kidsOf(keys ...crypto.Signer) ([]string, error) {
	kids := make([]string, len(keys))
	for i, key := range keys {
		var err error
		if kids[i], err = ca.JWTSVIDKeyID(key); err != nil {
			return nil, err
		}
	}
	return kids, nil
}

// holdsNext reports whether the Secret still holds in next-key.pem the key keys rotates to.
func (k *JWTSVIDKeyFollower) holdsNext(s *corev1.Secret, keys JWTSVIDKey) bool {
	data, ok := s.Data[JWTSVIDNextKeyData]
	if !ok {
		return false
	}
	next, err := ca.ParseJWTSVIDKey(data)
	if err != nil {
		return false
	}
	kids, err := kidsOf(next, keys.Key)
	return err == nil && kids[0] == kids[1]
}

// owesRotation reports whether the Secret holds keys' key but not its rotation, while that
// rotation is under way: this replica started it and its write was lost, or another writer's
// version replaced it.
func (k *JWTSVIDKeyFollower) owesRotation(s *corev1.Secret, keys JWTSVIDKey, now time.Time) bool {
	if keys.Previous == nil || !now.Before(previousUntil(keys, k.cfg.Signer.TTL())) {
		return false
	}
	shown, err := readJWTSVIDKey(s, k.where)
	if err != nil {
		return false // an invalid key.pem is refused, not written over
	}
	if kids, err := kidsOf(shown.Key, keys.Key); err != nil || kids[0] != kids[1] {
		return false // another key: the next sync adopts it
	}
	if shown.Previous == nil {
		return !shown.SignsFrom.Equal(keys.SignsFrom) // the same: ended by a replica whose clock is ahead
	}
	kids, err := kidsOf(shown.Previous, keys.Previous)
	return err == nil && (kids[0] != kids[1] || !shown.SignsFrom.Equal(keys.SignsFrom))
}

// write puts keys in the Secret (s; nil: create it) and returns 0, or how long to wait before
// trying again; move writes key.pem in place of next-key.pem, which it removes. An event and a
// message name the write.
func (k *JWTSVIDKeyFollower) write(ctx context.Context, s *corev1.Secret, keys JWTSVIDKey, now time.Time, move bool, event, msg string) time.Duration {
	data, annotations, err := k.secretData(keys, now)
	secrets := k.cfg.Clients.Core.Secrets(k.cfg.Namespace)
	wctx, cancel := context.WithTimeout(ctx, jwtKeyWriteTimeout)
	defer cancel()
	if err == nil && s == nil {
		_, err = secrets.Create(wctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: JWTSVIDKeySecret, Namespace: k.cfg.Namespace, Annotations: annotations},
			Type:       JWTSVIDKeySecretType,
			Data:       data,
		}, metav1.CreateOptions{})
	} else if err == nil {
		next := s.DeepCopy()
		if move {
			delete(next.Data, JWTSVIDNextKeyData)
		} else {
			delete(data, JWTSVIDKeyData) // as its writer put it
		}
		maps.Copy(next.Data, data)
		if next.Annotations == nil {
			next.Annotations = map[string]string{}
		}
		maps.Copy(next.Annotations, annotations)
		_, err = secrets.Update(wctx, next, metav1.UpdateOptions{})
	}
	switch {
	case err == nil:
		if event != "" {
			k.events.WithLabelValues(event).Inc()
			k.log.Info(msg, logkey.Object, k.where)
		}
		return 0
	case apierrors.IsAlreadyExists(err) || apierrors.IsConflict(err) || ctx.Err() != nil:
		return 0 // another writer was first, and the watch brings its version; or stopping
	default:
		k.events.WithLabelValues(jwtKeyWriteFailed).Inc()
		k.log.Error("cannot write the JWT-SVID key secret; retrying", logkey.Object, k.where,
			logkey.Error, err.Error(), logkey.RetryIn, jwtKeyRetry)
		return jwtKeyRetry
	}
}

// secretData is keys as the Secret holds them: the key, and the rotation while the replaced key
// may still be needed.
func (k *JWTSVIDKeyFollower) secretData(keys JWTSVIDKey, now time.Time) (map[string][]byte, map[string]string, error) {
	keyPEM, err := pki.EncodePrivateKey(keys.Key)
	if err != nil {
		return nil, nil, err
	}
	data := map[string][]byte{JWTSVIDKeyData: keyPEM}
	if keys.Next != nil { // waiting for the rotation under way: kept for after it
		if data[JWTSVIDNextKeyData], err = pki.EncodePrivateKey(keys.Next); err != nil {
			return nil, nil, err
		}
	}
	if keys.Previous == nil || !now.Before(previousUntil(keys, k.cfg.Signer.TTL())) {
		return data, nil, nil
	}
	kid, err := ca.JWTSVIDKeyID(keys.Key)
	if err != nil {
		return nil, nil, err
	}
	if data[JWTSVIDPreviousKeyData], err = pki.EncodePrivateKey(keys.Previous); err != nil {
		return nil, nil, err
	}
	return data, map[string]string{
		AnnotationJWTSVIDKeyID:     kid,
		AnnotationJWTSVIDSignsFrom: keys.SignsFrom.UTC().Format(time.RFC3339),
	}, nil
}

// prunePrevious removes the replaced key from the Secret once its last JWT-SVID has expired, or
// at once when it belongs to no rotation of key.pem's, and returns how long until then (0:
// nothing to remove).
func (k *JWTSVIDKeyFollower) prunePrevious(ctx context.Context, s *corev1.Secret, now time.Time) time.Duration {
	if _, ok := s.Data[JWTSVIDPreviousKeyData]; !ok {
		return 0
	}
	keys, err := readJWTSVIDKey(s, k.where)
	if err != nil || keys.Ignored != nil {
		return 0 // sync said why
	}
	// A previous-key.pem of no rotation of key.pem's (replaced since) is removed at once.
	if due := previousUntil(keys, k.cfg.Signer.TTL()); keys.Previous != nil && now.Before(due) {
		return due.Sub(now)
	}
	next := s.DeepCopy()
	delete(next.Data, JWTSVIDPreviousKeyData)
	wctx, cancel := context.WithTimeout(ctx, jwtKeyWriteTimeout)
	defer cancel()
	_, err = k.cfg.Clients.Core.Secrets(k.cfg.Namespace).Update(wctx, next, metav1.UpdateOptions{})
	switch {
	case err == nil:
		k.events.WithLabelValues(jwtKeyPreviousRemoved).Inc()
		k.log.Info("removed the replaced JWT-SVID key from the secret: the last JWT-SVID it signed has expired", logkey.Object, k.where)
		return 0
	case apierrors.IsConflict(err) || ctx.Err() != nil:
		return 0
	default:
		k.events.WithLabelValues(jwtKeyWriteFailed).Inc()
		k.log.Error("cannot remove the replaced JWT-SVID key from the secret; retrying", logkey.Object, k.where,
			logkey.Error, err.Error(), logkey.RetryIn, jwtKeyRetry)
		return jwtKeyRetry
	}
}
