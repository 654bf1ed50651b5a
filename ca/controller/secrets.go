package controller

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/util/workqueue"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/istio"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// Service-account secrets, as Citadel names and types them.
const (
	SecretPrefix = "istio."
	SecretType   = "istio.io/key-and-cert" //nolint:gosec // a Kubernetes secret type, not a credential
	// SecretMarkerFile marks a secret directory this controller made: only those are ever
	// replaced or removed.
	SecretMarkerFile = ".meshid-secret"
	// generationPrefix names the "..data" generations of a secret directory.
	generationPrefix = "..meshid_"
)

// Defaults of the secret controller, as Citadel's.
const (
	DefaultGracePeriodRatio = 0.5
	DefaultMinGracePeriod   = 10 * time.Minute
	DefaultResyncInterval   = time.Minute
)

// SecretSigner is what the secret controller needs of the CA.
type SecretSigner interface {
	SignSecret(ctx context.Context, req ca.SecretRequest) (*ca.Issued, error)
	// Bundle is the key material in service; Changed is closed at its next change.
	Bundle() *ca.Bundle
	Changed() <-chan struct{}
}

// SecretsConfig configures Secrets. Zero values take the defaults.
type SecretsConfig struct {
	Store     Store
	Targeting *Targeting
	Signer    SecretSigner
	// Secrets keeps the secrets: NewFileSecrets for a directory, or the Kubernetes API.
	Secrets     SecretStore
	TrustDomain string
	// Namespace limits the controller to one namespace (Citadel's --listened-namespace); "" is all.
	Namespace string
	// CertTTL is the lifetime asked for; 0 is the CA's default.
	CertTTL time.Duration
	// A secret is refreshed when less than max(GracePeriodRatio × lifetime, MinGracePeriod) remains.
	GracePeriodRatio float64
	MinGracePeriod   time.Duration
	// DNSNames maps "<sa>.<namespace>" to the DNS SANs its certificate carries (see DNSNames).
	DNSNames map[string][]string
	// ResyncInterval is how often every secret is checked again, so that one deleted or tampered
	// with on disk is recreated.
	ResyncInterval time.Duration
	// RetryBase and RetryMax bound the per-secret backoff after a failed reconcile.
	RetryBase, RetryMax time.Duration

	Clock      clock.Clock
	Logger     *slog.Logger
	Registerer prometheus.Registerer // optional
	// OnEvent, when set, is told of every reconcile, after the fact.
	OnEvent func(SecretEvent)
}

// SecretEventKind names what one reconcile did.
type SecretEventKind string

// Secret controller events.
const (
	SecretCreated   SecretEventKind = "created"
	SecretRefreshed SecretEventKind = "refreshed"
	SecretDeleted   SecretEventKind = "deleted"
	SecretUnchanged SecretEventKind = "unchanged"
	// SecretForeign: the directory exists but this controller did not make it; left alone.
	SecretForeign SecretEventKind = "foreign"
	// SecretAbsent: no secret is wanted and none of ours exists.
	SecretAbsent SecretEventKind = "absent"
	SecretFailed SecretEventKind = "failed"
	// SecretRefused: the store will not hold this secret as things stand (a link in the secrets
	// tree, a name too long for it); logged once, counted, not retried before the next resync.
	SecretRefused SecretEventKind = "refused"
)

// SecretEvent reports one reconcile.
type SecretEvent struct {
	Kind           SecretEventKind
	Namespace      string
	ServiceAccount string
	Where          string // the secret's directory, or its name in the API
	Reason         string // why a secret was refreshed or deleted
	Err            error
}

// Secrets keeps a secret istio.<sa> for every service account of every served namespace: a
// key pair for spiffe://<trust domain>/ns/<ns>/sa/<sa> and the CA's roots, in a SecretStore.
//
// Work goes through client-go's delaying workqueue (one reconcile per secret at a time, repeats
// merged): refreshes, retries (after the per-item exponential rate limiter's delay) and the
// periodic resync are items added after a delay, on the injected clock. The queue keeps the
// earliest time an item was added for, so a secret rescheduled later may be reconciled once more
// at its former time; reconcile is repeatable, and finds it unchanged then.
type Secrets struct {
	cfg     SecretsConfig
	clock   clock.Clock
	log     *slog.Logger
	limiter workqueue.TypedRateLimiter[SecretKey]
	metrics secretMetrics
	// watches hands the change channels a resync took, before reading, to Run, which waits on them.
	watches chan watch

	mu       sync.Mutex
	queue    workqueue.TypedDelayingInterface[work] // set while Run runs
	foreign  map[SecretKey]bool                     // warned about, until it goes
	refused  map[SecretKey]string                   // why the store refused it, logged once, until it is not
	listErr  string                                 // the last failure to list, logged once
	healthy  bool                                   // the last resync listed the store
	lastSync time.Time
}

// work is an item of the queue: one secret to reconcile, or the resync of them all.
type work struct {
	key    SecretKey
	resync bool
}

// watch is the pair of change channels a resync took before it read the stores.
type watch struct{ store, bundle <-chan struct{} }

type secretMetrics struct {
	created, refreshed, deleted, errors prometheus.Counter
}

// NewSecrets returns the controller; it starts no goroutine: call Run.
func NewSecrets(cfg SecretsConfig) (*Secrets, error) {
	switch {
	case cfg.Store == nil:
		return nil, errors.New("secret controller needs a store")
	case cfg.Targeting == nil:
		return nil, errors.New("secret controller needs namespace targeting")
	case cfg.Signer == nil:
		return nil, errors.New("secret controller needs a signer")
	case cfg.Secrets == nil:
		return nil, errors.New("secret controller needs a secret store")
	}
	if err := pki.ValidateTrustDomain(cfg.TrustDomain); err != nil {
		return nil, err
	}
	if cfg.Namespace != "" {
		if err := pki.ValidateNamespace(cfg.Namespace); err != nil {
			return nil, fmt.Errorf("listened namespace: %w", err)
		}
	}
	if cfg.GracePeriodRatio < 0 || cfg.GracePeriodRatio >= 1 {
		return nil, fmt.Errorf("grace period ratio %g: want at least 0 and below 1", cfg.GracePeriodRatio)
	}
	if cfg.GracePeriodRatio == 0 {
		cfg.GracePeriodRatio = DefaultGracePeriodRatio
	}
	if cfg.MinGracePeriod < 0 {
		return nil, fmt.Errorf("minimum grace period %s must not be negative", cfg.MinGracePeriod)
	}
	if cfg.ResyncInterval <= 0 {
		cfg.ResyncInterval = DefaultResyncInterval
	}
	if cfg.RetryBase <= 0 {
		cfg.RetryBase = time.Second
	}
	if cfg.RetryMax < cfg.RetryBase {
		cfg.RetryMax = max(5*time.Minute, cfg.RetryBase)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Secrets{
		cfg: cfg, clock: clock.OrReal(cfg.Clock), log: log,
		limiter: workqueue.NewTypedItemExponentialFailureRateLimiter[SecretKey](cfg.RetryBase, cfg.RetryMax),
		watches: make(chan watch), foreign: map[SecretKey]bool{}, refused: map[SecretKey]string{},
	}
	counter := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
	}
	s.metrics = secretMetrics{
		created:   counter("meshid_ca_secrets_created_total", "Service-account secrets created."),
		refreshed: counter("meshid_ca_secrets_refreshed_total", "Service-account secrets re-issued: due, root changed, or found invalid."),
		deleted:   counter("meshid_ca_secrets_deleted_total", "Service-account secrets removed: service account gone or namespace no longer served."),
		errors:    counter("meshid_ca_secret_reconcile_errors_total", "Failed reconciles of service-account secrets, and secrets their store refuses (a link in the secrets tree, a name too long), each refusal once."),
	}
	if cfg.Registerer != nil {
		depth := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "meshid_ca_secret_queue_depth", Help: "Service-account secrets waiting to be reconciled.",
		}, func() float64 {
			s.mu.Lock()
			defer s.mu.Unlock()
			if s.queue == nil {
				return 0
			}
			return float64(s.queue.Len())
		})
		for _, c := range []prometheus.Collector{s.metrics.created, s.metrics.refreshed, s.metrics.deleted, s.metrics.errors, depth} {
			if err := cfg.Registerer.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return s, nil
}

// Healthy reports whether the last resync read the store and the controller has resynced within
// two intervals: what the liveness probe file tells.
func (s *Secrets) Healthy() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.healthy && s.clock.Now().Sub(s.lastSync) < 2*s.cfg.ResyncInterval
}

// secretWorkers reconcile at once; beyond the cores, they overlap the writes' waits on the disk.
const secretWorkers = 8

// Run reconciles until ctx ends; the workers it starts have returned when Run does.
func (s *Secrets) Run(ctx context.Context) error {
	queue := workqueue.NewTypedDelayingQueueWithConfig(workqueue.TypedDelayingQueueConfig[work]{Clock: queueClock(s.cfg.Clock)})
	s.mu.Lock()
	s.queue = queue
	s.mu.Unlock()

	// Several workers: a secret's write waits on the disk (each file and directory is synced),
	// and the queue never hands one item to two workers at once (so resyncs never overlap).
	var wg sync.WaitGroup
	for range secretWorkers {
		wg.Go(func() {
			for s.processNext(ctx, queue) {
			}
		})
	}
	defer func() {
		queue.ShutDown()
		wg.Wait()
		s.mu.Lock()
		s.queue = nil
		s.mu.Unlock()
	}()

	// A change of either store, or of the CA's bundle, resyncs at once. Each resync hands over
	// the channels it took before reading; until then a change is already being looked at.
	queue.Add(work{resync: true})
	var w watch
	for {
		select {
		case <-ctx.Done():
			return nil
		case w = <-s.watches:
		case <-w.store:
			w = watch{}
			queue.Add(work{resync: true})
		case <-w.bundle:
			w = watch{}
			queue.Add(work{resync: true})
		}
	}
}

// resync queues every secret that should exist and every one on disk, and itself again after
// ResyncInterval.
func (s *Secrets) resync(ctx context.Context, queue workqueue.TypedDelayingInterface[work]) {
	defer queue.AddAfter(work{resync: true}, s.cfg.ResyncInterval)
	// Take both change channels before reading, so that no change after this read is missed.
	w := watch{store: s.cfg.Store.Changed(), bundle: s.cfg.Signer.Changed()}
	select {
	case s.watches <- w:
	case <-ctx.Done():
		return
	}
	accounts, err := s.cfg.Store.ServiceAccounts(ctx, s.cfg.Namespace)
	var present []SecretKey
	if err == nil {
		if present, err = s.cfg.Secrets.Keys(ctx, s.cfg.Namespace); err != nil {
			err = fmt.Errorf("list secrets: %w", err)
		}
	}
	s.mu.Lock()
	s.lastSync, s.healthy = s.clock.Now(), err == nil
	report := ""
	if err != nil && err.Error() != s.listErr {
		report = err.Error()
	}
	recovered := err == nil && s.listErr != ""
	if err != nil {
		s.listErr = err.Error()
	} else {
		s.listErr = ""
	}
	s.mu.Unlock()
	switch {
	case report != "":
		// Secrets stay as they are until the stores answer again.
		s.log.Error("cannot list service accounts or their secrets; secrets are left as they are", logkey.Error, report)
		return
	case err != nil:
		return
	case recovered:
		s.log.Info("service accounts and secrets listed again")
	}
	for _, sa := range accounts {
		queue.Add(work{key: SecretKey{sa.Namespace, sa.Name}})
	}
	for _, k := range present {
		queue.Add(work{key: k})
	}
}

// Requeue reconciles one secret soon, without a resync: for a store that sees a secret change
// (a user deleting or editing it). It does nothing while Run is not running.
func (s *Secrets) Requeue(k SecretKey) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.queue != nil {
		s.queue.Add(work{key: k})
	}
}

func (s *Secrets) processNext(ctx context.Context, queue workqueue.TypedDelayingInterface[work]) bool {
	item, shutdown := queue.Get()
	if shutdown {
		return false
	}
	defer queue.Done(item)
	if item.resync {
		s.resync(ctx, queue)
		return true
	}
	k := item.key
	ev, next, err := s.reconcile(ctx, k)
	switch {
	case err == nil:
		s.limiter.Forget(k)
		s.refuse(k, nil)
	case ctx.Err() != nil:
		return true // stopping: not a failure
	case errors.Is(err, ErrSecretRefused):
		// Retrying would meet the same refusal: the next resync looks again.
		s.limiter.Forget(k)
		s.refuse(k, err)
		ev, next = SecretEvent{Kind: SecretRefused, Err: err}, time.Time{}
	default:
		delay := s.limiter.When(k)
		retryAt := s.clock.Now().Add(delay)
		s.metrics.errors.Inc()
		s.log.Error("cannot reconcile a service-account secret", logkey.Namespace, k.Namespace, logkey.ServiceAccount, k.ServiceAccount,
			logkey.Error, err.Error(), logkey.RetryAt, retryAt)
		ev = SecretEvent{Kind: SecretFailed, Err: err}
		next = retryAt
	}
	if !next.IsZero() {
		// A time already past adds it at once.
		queue.AddAfter(item, next.Sub(s.clock.Now()))
	}
	ev.Namespace, ev.ServiceAccount, ev.Where = k.Namespace, k.ServiceAccount, s.cfg.Secrets.Where(k)
	if s.cfg.OnEvent != nil {
		s.cfg.OnEvent(ev)
	}
	return true
}

// reconcile makes one secret what it should be, and returns when to look at it again (zero:
// only at the next resync). It is repeatable: a secret already right is left alone.
func (s *Secrets) reconcile(ctx context.Context, k SecretKey) (SecretEvent, time.Time, error) {
	// Names may become paths: one that is not a valid name (a stray directory, say) is never touched.
	if pki.ValidateNamespace(k.Namespace) != nil || pki.ValidateServiceAccount(k.ServiceAccount) != nil {
		s.warnForeign(k, true)
		return SecretEvent{Kind: SecretForeign}, time.Time{}, nil
	}
	wanted, why, err := s.wanted(ctx, k)
	if err != nil {
		return SecretEvent{}, time.Time{}, err
	}
	stored, err := s.cfg.Secrets.Read(ctx, k)
	if err != nil {
		return SecretEvent{}, time.Time{}, err
	}
	if stored.Exists && !stored.Ours {
		s.warnForeign(k, true)
		return SecretEvent{Kind: SecretForeign}, time.Time{}, nil
	}
	if !wanted {
		if !stored.Exists {
			return SecretEvent{Kind: SecretAbsent}, time.Time{}, nil
		}
		if err := s.cfg.Secrets.Delete(ctx, k); err != nil {
			return SecretEvent{}, time.Time{}, err
		}
		s.metrics.deleted.Inc()
		s.log.Info("service-account secret removed", logkey.Namespace, k.Namespace, logkey.ServiceAccount, k.ServiceAccount, logkey.Reason, why)
		return SecretEvent{Kind: SecretDeleted, Reason: why}, time.Time{}, nil
	}

	id, err := pki.NewSPIFFEID(s.cfg.TrustDomain, k.Namespace, k.ServiceAccount)
	if err != nil {
		return SecretEvent{}, time.Time{}, err
	}
	dns := s.cfg.DNSNames[k.ServiceAccount+"."+k.Namespace]
	b := s.cfg.Signer.Bundle()
	if b == nil {
		return SecretEvent{}, time.Time{}, ca.ErrNotReady
	}
	now := s.clock.Now()
	problem := "new"
	if stored.Exists {
		refreshAt, p := s.check(stored, id, dns, b, now)
		if p == "" {
			s.warnForeign(k, false)
			return SecretEvent{Kind: SecretUnchanged}, refreshAt, nil
		}
		problem = p
	}
	refreshAt, err := s.issue(ctx, k, id, dns)
	if errors.Is(err, ErrForeignSecret) {
		// Made by someone else since it was read (or invisible to this store's view).
		s.warnForeign(k, true)
		return SecretEvent{Kind: SecretForeign}, time.Time{}, nil
	}
	if err != nil {
		return SecretEvent{}, time.Time{}, err
	}
	// Ours now: a foreign secret of that name that comes back is warned about again.
	s.warnForeign(k, false)
	if !stored.Exists {
		s.metrics.created.Inc()
		s.log.Info("service-account secret created", logkey.Namespace, k.Namespace, logkey.ServiceAccount, k.ServiceAccount,
			logkey.Secret, s.cfg.Secrets.Where(k), logkey.RenewAt, refreshAt)
		return SecretEvent{Kind: SecretCreated}, refreshAt, nil
	}
	s.metrics.refreshed.Inc()
	s.log.Info("service-account secret re-issued", logkey.Namespace, k.Namespace, logkey.ServiceAccount, k.ServiceAccount,
		logkey.Reason, problem, logkey.RenewAt, refreshAt)
	return SecretEvent{Kind: SecretRefreshed, Reason: problem}, refreshAt, nil
}

// wanted reports whether the secret should exist, and when not, why.
func (s *Secrets) wanted(ctx context.Context, k SecretKey) (bool, string, error) {
	if s.cfg.Namespace != "" && k.Namespace != s.cfg.Namespace {
		return false, "namespace not listened to", nil
	}
	accounts, err := s.cfg.Store.ServiceAccounts(ctx, k.Namespace)
	if err != nil {
		return false, "", fmt.Errorf("list service accounts of %s: %w", k.Namespace, err)
	}
	if !slices.Contains(accounts, ServiceAccount{Namespace: k.Namespace, Name: k.ServiceAccount}) {
		return false, "service account deleted", nil
	}
	served, why, err := s.cfg.Targeting.Targets(ctx, k.Namespace)
	if err != nil {
		return false, "", err
	}
	if !served {
		return false, "not served: " + why, nil
	}
	return true, "", nil
}

// refuse logs and counts a secret its store refuses to hold (err), once until the refusal
// changes; a nil err ends it.
func (s *Secrets) refuse(k SecretKey, err error) {
	s.mu.Lock()
	report := err != nil && s.refused[k] != err.Error()
	if err != nil {
		s.refused[k] = err.Error()
	} else {
		delete(s.refused, k)
	}
	s.mu.Unlock()
	if report {
		s.metrics.errors.Inc()
		s.log.Error("a service-account secret is refused by its store; it is not retried", logkey.Namespace, k.Namespace,
			logkey.ServiceAccount, k.ServiceAccount, logkey.Secret, s.cfg.Secrets.Where(k), logkey.Error, err.Error())
	}
}

func (s *Secrets) warnForeign(k SecretKey, foreign bool) {
	s.mu.Lock()
	warn := foreign && !s.foreign[k]
	if foreign {
		s.foreign[k] = true
	} else {
		delete(s.foreign, k)
	}
	s.mu.Unlock()
	if warn {
		s.log.Warn("a secret this controller did not make is left alone", logkey.Secret, s.cfg.Secrets.Where(k),
			logkey.Detail, "it lacks the controller's mark ("+SecretMarkerFile+" on disk, type "+SecretType+" in the API)")
	}
}

// gracePeriod is how long before expiry a certificate of this lifetime is refreshed.
func (s *Secrets) gracePeriod(lifetime time.Duration) time.Duration {
	return max(time.Duration(s.cfg.GracePeriodRatio*float64(lifetime)), s.cfg.MinGracePeriod)
}

func (s *Secrets) refreshAt(leaf *x509.Certificate) time.Time {
	return leaf.NotAfter.Add(-s.gracePeriod(leaf.NotAfter.Sub(leaf.NotBefore)))
}

// check returns when the stored secret is due, or what is wrong with it: missing data, a problem
// the store found (a private key readable by others), a key that does not match, another identity
// or DNS names, a chain or roots not the CA's in service, or a certificate due for refresh.
func (s *Secrets) check(stored StoredSecret, id pki.SPIFFEID, dns []string, b *ca.Bundle, now time.Time) (time.Time, string) {
	if stored.Problem != "" {
		return time.Time{}, stored.Problem
	}
	for _, name := range []string{istio.KeyFile, istio.CertChainFile, istio.RootCertFile} {
		if len(stored.Data[name]) == 0 {
			return time.Time{}, "no " + name
		}
	}
	keyPEM, chainPEM, rootsPEM := stored.Data[istio.KeyFile], stored.Data[istio.CertChainFile], stored.Data[istio.RootCertFile]
	key, err := pki.ParsePrivateKey(keyPEM)
	if err != nil {
		return time.Time{}, "unreadable key"
	}
	chain, err := pki.ParseCertificates(chainPEM)
	if err != nil || len(chain) == 0 {
		return time.Time{}, "unreadable certificate chain"
	}
	if err := pki.CheckKeyPair(chain, key, id.String(), now); err != nil {
		return time.Time{}, err.Error()
	}
	leaf := chain[0]
	if !slices.Equal(leaf.DNSNames, dns) {
		return time.Time{}, "other DNS names"
	}
	want := b.Chain()
	if len(chain)-1 != len(want) || !slices.EqualFunc(chain[1:], want, func(a, b *x509.Certificate) bool { return a.Equal(b) }) {
		return time.Time{}, "not the CA's chain in service"
	}
	if !bytes.Equal(rootsPEM, b.RootsPEM()) {
		return time.Time{}, "not the CA's roots in service"
	}
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: b.RootPool(), Intermediates: inter, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return time.Time{}, "not under the CA's roots"
	}
	at := s.refreshAt(leaf)
	if !now.Before(at) {
		return time.Time{}, "due for refresh"
	}
	return at, ""
}

// issue writes a new key pair and the roots, and returns when it is due for refresh.
func (s *Secrets) issue(ctx context.Context, k SecretKey, id pki.SPIFFEID, dns []string) (time.Time, error) {
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		return time.Time{}, err
	}
	issued, err := s.cfg.Signer.SignSecret(ctx, ca.SecretRequest{Identity: id, DNSNames: dns, PublicKey: key.Public(), TTL: s.cfg.CertTTL})
	if err != nil {
		return time.Time{}, fmt.Errorf("sign for %s: %w", id, err)
	}
	keyPEM, err := pki.EncodePrivateKey(key)
	if err != nil {
		return time.Time{}, err
	}
	data := map[string][]byte{
		istio.KeyFile:       keyPEM,
		istio.CertChainFile: pki.EncodeCertificates(issued.Chain()...),
		istio.RootCertFile:  issued.Bundle().RootsPEM(),
	}
	if err := s.cfg.Secrets.Write(ctx, k, data, id.String()); err != nil {
		return time.Time{}, err
	}
	return s.refreshAt(issued.Leaf), nil
}
