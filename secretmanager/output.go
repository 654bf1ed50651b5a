package secretmanager

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/istio"
	"github.com/meshid/meshid/internal/logkey"
)

// Names of the files in OUTPUT_CERTS, as Istio's agent writes them.
const (
	CertChainFile = istio.CertChainFile
	KeyFile       = istio.KeyFile
	RootCertFile  = istio.RootCertFile
)

const (
	dataLink      = fsutil.DataLink
	versionPrefix = "..meshid_" // one directory per written generation
)

// Output configures OUTPUT_CERTS: the directory that receives the workload key pair and trust
// bundle in service, for a VM's applications.
type Output struct {
	Dir string
	// GroupRead makes the directories 0750 and cert-chain.pem and root-cert.pem 0640, so that a
	// group of readers (Prometheus, the application) can read them; KeyGroupRead makes key.pem
	// 0640 too. Without them, only the agent's user can read anything.
	GroupRead, KeyGroupRead bool
	// RetryInitial and RetryMax bound the backoff between failed writes.
	RetryInitial, RetryMax time.Duration
	// Sync flushes each file and directory of a generation; nil: fsync. Tests block it to see
	// that only readiness waits for the disk.
	Sync fsutil.Syncer
	// Claim, when set, is the agent's hold on Dir (ClaimOutput): the key pair left there is read
	// only once it is held, and a write takes it first when the directory could not be made at
	// start.
	Claim *OutputClaim
}

// OutputLockFile is the lock an agent holds in OUTPUT_CERTS for its life, holding its pid. It is
// a dot-file, which readers of the ..data layout never look at, and no generation or temporary
// file name: nothing that sweeps the directory removes it.
const OutputLockFile = ".meshid-agent.lock"

// OutputClaim is an agent's hold on OUTPUT_CERTS: the directory found ours alone, and a lock in it
// that keeps a second agent out while the first runs. Two agents on one directory would overwrite
// each other's key pair.
type OutputClaim struct {
	dir  string
	mode os.FileMode

	mu       sync.Mutex
	unlock   func() // set once held
	released bool
}

// ClaimOutput makes OUTPUT_CERTS private when it is missing, checks it and locks it. It is
// refused (fsutil.ErrNotOwned) when another user owns the directory or can write in it, or when
// the key a restart would serve from it is a link out, another user's or open to others: they
// could have put their own key pair there. It is refused (fsutil.ErrLocked) while another agent
// holds the directory, naming that agent's pid. A directory that cannot be made yet (a read-only
// disk, a missing mount) is claimed by the first write that can make it; until then writes fail,
// and the agent is not ready. Call Release when the agent stops.
func ClaimOutput(o Output) (*OutputClaim, error) {
	c := &OutputClaim{dir: o.Dir, mode: o.modes().dir}
	if err := c.take(); errors.Is(err, fsutil.ErrNotOwned) || errors.Is(err, fsutil.ErrLocked) {
		return nil, err
	}
	return c, nil
}

// take checks the directory and locks it, once.
func (c *OutputClaim) take() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.released:
		return errors.New("OUTPUT_CERTS " + c.dir + " was released: the agent is stopping")
	case c.unlock != nil:
		return nil
	}
	if err := fsutil.EnsureOwnedDir(c.dir, c.mode); err != nil {
		return fmt.Errorf("OUTPUT_CERTS: %w", err)
	}
	if err := fsutil.CheckDataKeyFile(c.dir, KeyFile); err != nil {
		return fmt.Errorf("OUTPUT_CERTS: %w", err)
	}
	path := filepath.Join(c.dir, OutputLockFile)
	unlock, err := fsutil.TryLockPID(path)
	if errors.Is(err, fsutil.ErrLocked) {
		holder := "another agent"
		if pid, ok := fsutil.LockHolder(path); ok {
			holder = "the agent with pid " + strconv.Itoa(pid)
		}
		return fmt.Errorf("OUTPUT_CERTS %s is %w, %s: give each agent its own --output-certs (OUTPUT_CERTS)", c.dir, fsutil.ErrLocked, holder)
	}
	if err != nil {
		return fmt.Errorf("OUTPUT_CERTS: %w", err)
	}
	c.unlock = unlock
	return nil
}

// held reports whether the directory is checked and locked.
func (c *OutputClaim) held() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.unlock != nil
}

// Release lets another agent have the directory; nothing is written to it after.
func (c *OutputClaim) Release() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.unlock != nil {
		c.unlock()
		c.unlock = nil
	}
	c.released = true
}

// outputModes are the modes of what writeOutput creates.
type outputModes struct {
	dir, key, cert os.FileMode
}

func (o Output) modes() outputModes {
	m := outputModes{dir: fsutil.PrivateDirMode, key: fsutil.PrivateFileMode, cert: fsutil.PublicFileMode}
	if o.GroupRead {
		m.dir, m.cert = 0o750, 0o640
	}
	if o.KeyGroupRead {
		m.key = 0o640
	}
	return m
}

// outputWriter writes the latest key pair and trust bundle to OUTPUT_CERTS, retrying a failed
// write with backoff until it succeeds. Until then the agent is not ready: the files are the
// VM's product.
type outputWriter struct {
	cfg     Output
	modes   outputModes
	clock   clock.Clock
	log     *slog.Logger
	metrics *metrics
	event   func(Event)
	wake    chan struct{}

	mu      sync.Mutex
	pair    *Secret // latest key pair offered
	roots   *Secret // latest trust bundle offered
	written string  // the pair and bundle last on disk
	lastErr error   // why the last write failed; nil once one succeeds
}

func newOutputWriter(cfg Output, clk clock.Clock, log *slog.Logger, m *metrics, event func(Event)) (*outputWriter, error) {
	if cfg.KeyGroupRead && !cfg.GroupRead {
		return nil, errors.New("OUTPUT_CERTS: a group-readable key needs group-readable directories")
	}
	if cfg.RetryInitial <= 0 {
		cfg.RetryInitial = DefaultRetryInitial
	}
	if cfg.RetryMax < cfg.RetryInitial {
		cfg.RetryMax = max(DefaultRetryMax, cfg.RetryInitial)
	}
	return &outputWriter{cfg: cfg, modes: cfg.modes(), clock: clk, log: log, metrics: m, event: event, wake: make(chan struct{}, 1)}, nil
}

// offer takes a new secret to write; it never blocks.
func (w *outputWriter) offer(s *Secret) {
	if s == nil {
		return
	}
	w.mu.Lock()
	if s.KeyPair != nil {
		w.pair = s
	} else {
		w.roots = s
	}
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// ready reports whether OUTPUT_CERTS holds what is in service, or at least what was before and
// no write has failed since.
func (w *outputWriter) ready() (bool, string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case w.lastErr != nil:
		return false, fmt.Sprintf("cannot write OUTPUT_CERTS (%s): %s", w.cfg.Dir, w.lastErr.Error())
	case w.written == "":
		return false, "OUTPUT_CERTS (" + w.cfg.Dir + ") not written yet"
	}
	return true, ""
}

func (w *outputWriter) pending() (pair, roots *Secret, key string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.pair == nil {
		return nil, nil, ""
	}
	key = w.pair.Version + "/"
	if w.roots != nil {
		key += w.roots.Version
	}
	if key == w.written {
		return nil, nil, ""
	}
	return w.pair, w.roots, key
}

func (w *outputWriter) run(ctx context.Context) error {
	w.removeStaleGenerations()
	retry := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(w.cfg.RetryInitial),
		backoff.WithMaxInterval(w.cfg.RetryMax),
		backoff.WithMaxElapsedTime(0),
		backoff.WithClockProvider(w.clock),
	)
	var (
		timer  clock.Timer
		retryC <-chan time.Time
		failed string // the content whose write failed last, until a write succeeds
	)
	stopTimer := func() {
		if timer != nil {
			timer.Stop()
			timer, retryC = nil, nil
		}
	}
	for {
		var retrying bool
		select {
		case <-ctx.Done():
			stopTimer()
			return nil
		case <-w.wake:
		case <-retryC:
			timer, retryC = nil, nil
			retrying = true
		}
		pair, roots, key := w.pending()
		// A wake-up brings new content to write at once. One can also come for content that
		// just failed (offered while the write was under way): that waits for its retry.
		if pair == nil || (key == failed && !retrying) {
			continue
		}
		var rootsPEM []byte
		if roots != nil {
			rootsPEM = roots.Bundle.PEM
		}
		files := outputFiles(w.modes, pair.KeyPair.KeyPEM, pair.KeyPair.ChainPEM, rootsPEM)
		var err error
		if w.cfg.Claim != nil {
			err = w.cfg.Claim.take() // at once when it was taken at start
		}
		if err == nil && !onDisk(w.cfg.Dir, files) {
			err = writeOutput(w.cfg.Sync, w.cfg.Dir, w.modes.dir, files)
		}
		if err != nil {
			failed = key
			wait := retry.NextBackOff()
			retryAt := w.clock.Now().Add(wait)
			w.mu.Lock()
			w.lastErr = err
			w.mu.Unlock()
			w.metrics.outputFailures.Inc()
			w.log.Error("cannot write OUTPUT_CERTS; the agent is not ready until it can", logkey.Dir, w.cfg.Dir, logkey.Error, err.Error(), logkey.RetryAt, retryAt)
			w.event(Event{Kind: EventOutputFailed, Version: pair.Version, RetryAt: retryAt, Err: err})
			stopTimer()
			timer = w.clock.NewTimer(wait)
			retryC = timer.C()
			continue
		}
		stopTimer()
		retry.Reset()
		failed = ""
		w.mu.Lock()
		recovered := w.lastErr != nil
		w.written, w.lastErr = key, nil
		w.mu.Unlock()
		if recovered {
			w.log.Info("OUTPUT_CERTS written again", logkey.Dir, w.cfg.Dir, logkey.Serial, pair.Version)
		}
		w.event(Event{Kind: EventOutputWritten, Version: pair.Version})
	}
}

// outputFile is one file of a generation.
type outputFile = fsutil.DataFile

// outputFiles lists the files of one generation, the key first.
func outputFiles(m outputModes, keyPEM, chainPEM, rootsPEM []byte) []outputFile {
	return []outputFile{
		{Name: KeyFile, Data: keyPEM, Mode: m.key},
		{Name: CertChainFile, Data: chainPEM, Mode: m.cert},
		{Name: RootCertFile, Data: rootsPEM, Mode: m.cert},
	}
}

// onDisk reports whether dir already shows exactly these files (after a restart that loaded
// them, say), so that they are not written again.
func onDisk(dir string, files []outputFile) bool { return fsutil.DataOnDisk(dir, files) }

// writeOutput publishes a key pair and trust bundle in dir through a "..data" symlink swap (see
// fsutil.WriteData), so that a reader always sees a matching pair, each file and directory flushed
// with sync.
func writeOutput(sync fsutil.Syncer, dir string, dirMode os.FileMode, files []outputFile) error {
	return sync.WriteData(dir, versionPrefix, dirMode, files)
}

// removeStaleGenerations removes what a writer killed mid-way left in OUTPUT_CERTS: generations
// that "..data" does not point at, with any partly written file inside. A restart that finds the
// pair in service already on disk writes nothing, so this is not left to the next write.
func (w *outputWriter) removeStaleGenerations() {
	for _, path := range fsutil.StaleGenerations(w.cfg.Dir, versionPrefix) {
		if err := os.RemoveAll(path); err != nil {
			w.log.Warn("cannot remove an unfinished OUTPUT_CERTS generation", logkey.Path, path, logkey.Error, err.Error())
			continue
		}
		w.log.Info("removed an unfinished OUTPUT_CERTS generation", logkey.Path, path)
	}
}
