package controller

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/util/workqueue"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/fsutil"
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
	// Dir receives <namespace>/istio.<sa>/{cert-chain.pem,key.pem,root-cert.pem}.
	Dir         string
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
)

// SecretEvent reports one reconcile.
type SecretEvent struct {
	Kind           SecretEventKind
	Namespace      string
	ServiceAccount string
	Dir            string
	Reason         string // why a secret was refreshed or deleted
	Err            error
}

// secretKey names one secret: its namespace and service account.
type secretKey struct{ namespace, serviceAccount string }

func (k secretKey) String() string { return k.namespace + "/" + k.serviceAccount }

// Secrets keeps a secret istio.<sa> for every service account of every served namespace: a
// key pair for spiffe://<trust domain>/ns/<ns>/sa/<sa> and the CA's roots, in a directory laid out
// as the kubelet mounts a secret ("..data"), so that an agent can use it as --credentials-dir.
//
// Work goes through client-go's workqueue (one reconcile per secret at a time, repeats merged)
// with its per-item exponential rate limiter. Delays run on the injected clock: the queue's own
// delaying variant takes Kubernetes' clock interface, so the schedule of refreshes and retries
// is kept here and due keys are added without delay.
type Secrets struct {
	cfg     SecretsConfig
	clock   clock.Clock
	log     *slog.Logger
	limiter workqueue.TypedRateLimiter[secretKey]
	metrics secretMetrics

	mu       sync.Mutex
	queue    *workqueue.Typed[secretKey] // set while Run runs
	due      map[secretKey]time.Time     // next refresh or retry
	foreign  map[secretKey]bool          // warned about, until it goes
	wake     chan struct{}               // the schedule changed
	listErr  string                      // the last failure to list, logged once
	healthy  bool                        // the last resync listed the store
	lastSync time.Time
}

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
	case cfg.Dir == "":
		return nil, errors.New("secret controller needs a directory")
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
		limiter: workqueue.NewTypedItemExponentialFailureRateLimiter[secretKey](cfg.RetryBase, cfg.RetryMax),
		due:     map[secretKey]time.Time{}, foreign: map[secretKey]bool{}, wake: make(chan struct{}, 1),
	}
	counter := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
	}
	s.metrics = secretMetrics{
		created:   counter("meshid_ca_secrets_created_total", "Service-account secrets created."),
		refreshed: counter("meshid_ca_secrets_refreshed_total", "Service-account secrets re-issued: due, root changed, or found invalid."),
		deleted:   counter("meshid_ca_secrets_deleted_total", "Service-account secrets removed: service account gone or namespace no longer served."),
		errors:    counter("meshid_ca_secret_reconcile_errors_total", "Failed reconciles of service-account secrets."),
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
	queue := workqueue.NewTyped[secretKey]()
	s.mu.Lock()
	s.queue = queue
	s.mu.Unlock()

	// Several workers: a secret's write waits on the disk (each file and directory is synced),
	// and the queue never hands one key to two workers at once.
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

	var (
		nextResync                  time.Time // zero: resync at once
		storeChanged, bundleChanged <-chan struct{}
		timer                       clock.Timer
	)
	for {
		now := s.clock.Now()
		if !now.Before(nextResync) {
			// Take both change channels before reading, and keep them until they close, so that
			// no change after this read is missed.
			storeChanged, bundleChanged = s.cfg.Store.Changed(), s.cfg.Signer.Changed()
			s.resync(ctx, queue)
			nextResync = now.Add(s.cfg.ResyncInterval)
		}
		next := s.addDue(queue, now, nextResync)
		if timer != nil {
			timer.Stop()
		}
		timer = s.clock.NewTimer(next.Sub(s.clock.Now()))
		// The timer is relative: had the clock passed next while it was armed, it would fire
		// late by as much. Looking again after arming it closes that window.
		if !s.clock.Now().Before(next) {
			continue
		}
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil
		case <-storeChanged:
			nextResync = time.Time{}
		case <-bundleChanged:
			nextResync = time.Time{}
		case <-s.wake:
		case <-timer.C():
		}
	}
}

// addDue adds the keys whose time has come, and returns the next time something is due.
func (s *Secrets) addDue(queue *workqueue.Typed[secretKey], now, next time.Time) time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	for k, at := range s.due {
		if !now.Before(at) {
			delete(s.due, k)
			queue.Add(k)
		} else if at.Before(next) {
			next = at
		}
	}
	return next
}

func (s *Secrets) schedule(k secretKey, at time.Time) {
	s.mu.Lock()
	if at.IsZero() {
		delete(s.due, k)
	} else {
		s.due[k] = at
	}
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// resync queues every secret that should exist and every one on disk.
func (s *Secrets) resync(ctx context.Context, queue *workqueue.Typed[secretKey]) {
	accounts, err := s.cfg.Store.ServiceAccounts(ctx, s.cfg.Namespace)
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
		// Secrets on disk stay as they are until the store answers again.
		s.log.Error("cannot list service accounts; secrets are left as they are", logkey.Error, report)
		return
	case err != nil:
		return
	case recovered:
		s.log.Info("service accounts listed again")
	}
	for _, sa := range accounts {
		queue.Add(secretKey{sa.Namespace, sa.Name})
	}
	for _, k := range s.onDisk() {
		queue.Add(k)
	}
}

// onDisk lists the secret directories under Dir (in the listened namespace only, if any).
func (s *Secrets) onDisk() []secretKey {
	namespaces := []string{s.cfg.Namespace}
	if s.cfg.Namespace == "" {
		entries, err := os.ReadDir(s.cfg.Dir)
		if err != nil {
			return nil // nothing written yet
		}
		namespaces = namespaces[:0]
		for _, e := range entries {
			if e.IsDir() {
				namespaces = append(namespaces, e.Name())
			}
		}
	}
	var keys []secretKey
	for _, ns := range namespaces {
		entries, err := os.ReadDir(filepath.Join(s.cfg.Dir, ns))
		if err != nil {
			continue
		}
		for _, e := range entries {
			if sa, ok := strings.CutPrefix(e.Name(), SecretPrefix); ok && sa != "" {
				keys = append(keys, secretKey{ns, sa})
			}
		}
	}
	return keys
}

func (s *Secrets) processNext(ctx context.Context, queue *workqueue.Typed[secretKey]) bool {
	k, shutdown := queue.Get()
	if shutdown {
		return false
	}
	defer queue.Done(k)
	ev, next, err := s.reconcile(ctx, k)
	if err != nil {
		if ctx.Err() != nil {
			return true // stopping: not a failure
		}
		delay := s.limiter.When(k)
		retryAt := s.clock.Now().Add(delay)
		s.metrics.errors.Inc()
		s.log.Error("cannot reconcile a service-account secret", logkey.Namespace, k.namespace, logkey.ServiceAccount, k.serviceAccount,
			logkey.Error, err.Error(), logkey.RetryAt, retryAt)
		ev = SecretEvent{Kind: SecretFailed, Err: err}
		next = retryAt
	} else {
		s.limiter.Forget(k)
	}
	s.schedule(k, next)
	ev.Namespace, ev.ServiceAccount, ev.Dir = k.namespace, k.serviceAccount, s.secretDir(k)
	if s.cfg.OnEvent != nil {
		s.cfg.OnEvent(ev)
	}
	return true
}

func (s *Secrets) secretDir(k secretKey) string {
	return filepath.Join(s.cfg.Dir, k.namespace, SecretPrefix+k.serviceAccount)
}

// reconcile makes one secret what it should be, and returns when to look at it again (zero:
// only at the next resync). It is repeatable: a secret already right is left alone.
func (s *Secrets) reconcile(ctx context.Context, k secretKey) (SecretEvent, time.Time, error) {
	dir := s.secretDir(k)
	// Names become paths: one that is not a valid name (a stray directory, say) is never touched.
	if pki.ValidateNamespace(k.namespace) != nil || pki.ValidateServiceAccount(k.serviceAccount) != nil {
		s.warnForeign(k, dir, true)
		return SecretEvent{Kind: SecretForeign}, time.Time{}, nil
	}
	wanted, why, err := s.wanted(ctx, k)
	if err != nil {
		return SecretEvent{}, time.Time{}, err
	}
	ours, exists, err := owned(dir)
	if err != nil {
		return SecretEvent{}, time.Time{}, err
	}
	if exists && !ours {
		s.warnForeign(k, dir, true)
		return SecretEvent{Kind: SecretForeign}, time.Time{}, nil
	}
	s.warnForeign(k, dir, false)
	if exists {
		// Generations a write interrupted by a crash left behind; the next write would remove
		// them, but a secret that stays valid is not written again.
		for _, stale := range fsutil.StaleGenerations(dir, generationPrefix) {
			_ = os.RemoveAll(stale)
		}
	}
	if !wanted {
		if !exists {
			return SecretEvent{Kind: SecretAbsent}, time.Time{}, nil
		}
		if err := os.RemoveAll(dir); err != nil {
			return SecretEvent{}, time.Time{}, fmt.Errorf("remove %s: %w", dir, err)
		}
		// The namespace's directory goes with its last secret; one holding anything else stays.
		_ = os.Remove(filepath.Dir(dir))
		s.metrics.deleted.Inc()
		s.log.Info("service-account secret removed", logkey.Namespace, k.namespace, logkey.ServiceAccount, k.serviceAccount, logkey.Reason, why)
		return SecretEvent{Kind: SecretDeleted, Reason: why}, time.Time{}, nil
	}

	id, err := pki.NewSPIFFEID(s.cfg.TrustDomain, k.namespace, k.serviceAccount)
	if err != nil {
		return SecretEvent{}, time.Time{}, err
	}
	dns := s.cfg.DNSNames[k.serviceAccount+"."+k.namespace]
	b := s.cfg.Signer.Bundle()
	if b == nil {
		return SecretEvent{}, time.Time{}, ca.ErrNotReady
	}
	now := s.clock.Now()
	problem := "new"
	if exists {
		refreshAt, p := s.check(dir, id, dns, b, now)
		if p == "" {
			return SecretEvent{Kind: SecretUnchanged}, refreshAt, nil
		}
		problem = p
	}
	refreshAt, err := s.issue(ctx, dir, id, dns)
	if err != nil {
		return SecretEvent{}, time.Time{}, err
	}
	if !exists {
		s.metrics.created.Inc()
		s.log.Info("service-account secret created", logkey.Namespace, k.namespace, logkey.ServiceAccount, k.serviceAccount, logkey.Dir, dir, logkey.RenewAt, refreshAt)
		return SecretEvent{Kind: SecretCreated}, refreshAt, nil
	}
	s.metrics.refreshed.Inc()
	s.log.Info("service-account secret re-issued", logkey.Namespace, k.namespace, logkey.ServiceAccount, k.serviceAccount,
		logkey.Reason, problem, logkey.RenewAt, refreshAt)
	return SecretEvent{Kind: SecretRefreshed, Reason: problem}, refreshAt, nil
}

// wanted reports whether the secret should exist, and when not, why.
func (s *Secrets) wanted(ctx context.Context, k secretKey) (bool, string, error) {
	if s.cfg.Namespace != "" && k.namespace != s.cfg.Namespace {
		return false, "namespace not listened to", nil
	}
	accounts, err := s.cfg.Store.ServiceAccounts(ctx, k.namespace)
	if err != nil {
		return false, "", fmt.Errorf("list service accounts of %s: %w", k.namespace, err)
	}
	if !slices.Contains(accounts, ServiceAccount{Namespace: k.namespace, Name: k.serviceAccount}) {
		return false, "service account deleted", nil
	}
	served, why, err := s.cfg.Targeting.Targets(ctx, k.namespace)
	if err != nil {
		return false, "", err
	}
	if !served {
		return false, "not served: " + why, nil
	}
	return true, "", nil
}

func (s *Secrets) warnForeign(k secretKey, dir string, foreign bool) {
	s.mu.Lock()
	warn := foreign && !s.foreign[k]
	if foreign {
		s.foreign[k] = true
	} else {
		delete(s.foreign, k)
	}
	s.mu.Unlock()
	if warn {
		s.log.Warn("a secret directory this controller did not make is left alone", logkey.Dir, dir,
			logkey.Detail, "no "+SecretMarkerFile+" in it")
	}
}

// owned reports whether dir exists and whether it is ours (it holds our marker).
func owned(dir string) (ours, exists bool, err error) {
	info, err := os.Lstat(dir)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return false, false, nil
	case err != nil:
		return false, false, err
	case !info.IsDir():
		return false, true, nil
	}
	marker, err := os.Lstat(filepath.Join(dir, SecretMarkerFile))
	switch {
	case errors.Is(err, os.ErrNotExist):
		return false, true, nil
	case err != nil:
		return false, true, err
	}
	return marker.Mode().IsRegular(), true, nil
}

// gracePeriod is how long before expiry a certificate of this lifetime is refreshed.
func (s *Secrets) gracePeriod(lifetime time.Duration) time.Duration {
	return max(time.Duration(s.cfg.GracePeriodRatio*float64(lifetime)), s.cfg.MinGracePeriod)
}

func (s *Secrets) refreshAt(leaf *x509.Certificate) time.Time {
	return leaf.NotAfter.Add(-s.gracePeriod(leaf.NotAfter.Sub(leaf.NotBefore)))
}

// check returns when the secret in dir is due, or what is wrong with it: unreadable files, a
// private key readable by others, a key that does not match, another identity or DNS names, a
// chain or roots not the CA's in service, or a certificate due for refresh.
func (s *Secrets) check(dir string, id pki.SPIFFEID, dns []string, b *ca.Bundle, now time.Time) (time.Time, string) {
	read := func(name string) ([]byte, string) {
		data, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return nil, "cannot read " + name
		}
		return data, ""
	}
	keyPEM, p := read(istio.KeyFile)
	if p != "" {
		return time.Time{}, p
	}
	if info, err := os.Stat(filepath.Join(dir, istio.KeyFile)); err != nil || info.Mode().Perm() != fsutil.PrivateFileMode {
		return time.Time{}, istio.KeyFile + " is not private"
	}
	chainPEM, p := read(istio.CertChainFile)
	if p != "" {
		return time.Time{}, p
	}
	rootsPEM, p := read(istio.RootCertFile)
	if p != "" {
		return time.Time{}, p
	}
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

// issue writes a new key pair and the roots to dir, marking it ours first, and returns when it
// is due for refresh.
func (s *Secrets) issue(ctx context.Context, dir string, id pki.SPIFFEID, dns []string) (time.Time, error) {
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
	for _, d := range []string{s.cfg.Dir, filepath.Dir(dir), dir} {
		if err := fsutil.EnsureDir(d, fsutil.PrivateDirMode); err != nil {
			return time.Time{}, err
		}
	}
	// The marker first: a write interrupted after it leaves a directory we still own.
	marker := filepath.Join(dir, SecretMarkerFile)
	if _, err := os.Lstat(marker); err != nil {
		if err := fsutil.WriteFileAtomic(marker, []byte("type: "+SecretType+"\nidentity: "+id.String()+"\n"), fsutil.PublicFileMode); err != nil {
			return time.Time{}, err
		}
	}
	files := []fsutil.DataFile{
		{Name: istio.KeyFile, Data: keyPEM, Mode: fsutil.PrivateFileMode},
		{Name: istio.CertChainFile, Data: pki.EncodeCertificates(issued.Chain()...), Mode: fsutil.PublicFileMode},
		{Name: istio.RootCertFile, Data: issued.Bundle().RootsPEM(), Mode: fsutil.PublicFileMode},
	}
	if err := fsutil.WriteData(dir, generationPrefix, fsutil.PrivateDirMode, files); err != nil {
		return time.Time{}, err
	}
	return s.refreshAt(issued.Leaf), nil
}
