package secretmanager

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// Prefixes of the resource names that read files, as Istio's agent names them:
// file-cert:<cert-chain>~<key> and file-root:<roots>.
const (
	FileCertPrefix = "file-cert:"
	FileRootPrefix = "file-root:"
)

// MaxFileSecrets bounds the file resources one agent serves at once (counting the workload's
// own files in file mode, and the CA root file).
const MaxFileSecrets = 256

// fileResource is a secret read from files: a key pair (certChain and key) or a trust bundle
// (root). Its paths must stay inside allowed (nil allows any: the operator's own files).
type fileResource struct {
	name           string
	certChain, key string
	root           string
	allowed        []string
	// deliver receives every read: the secret, or why the files are not usable.
	deliver func(*Secret, error)
	// reads bounds the wait for each file (the loader's, set when r is added); nil: unbounded.
	reads *fsutil.BoundedReads

	// Guarded by the loader's mutex.
	current *Secret // the last good read
	failed  bool    // the last read failed
	hung    bool    // the last read had no answer (fsutil.ErrNoAnswer)
	reading bool    // a read is under way
	again   bool    // changed during the read: read again after it
}

func (r *fileResource) paths() []string {
	if r.root != "" {
		return []string{r.root}
	}
	return []string{r.certChain, r.key}
}

// parseFileResource splits a file resource name into its paths and checks that they are inside
// dirs.
func parseFileResource(name string, dirs []string) (*fileResource, error) {
	var r *fileResource
	switch {
	case strings.HasPrefix(name, FileCertPrefix):
		cert, key, ok := strings.Cut(strings.TrimPrefix(name, FileCertPrefix), "~")
		if !ok || cert == "" || key == "" {
			return nil, fmt.Errorf("%w %q: want %s<cert-chain>~<key>", ErrUnknownSecret, name, FileCertPrefix)
		}
		r = &fileResource{name: name, certChain: cert, key: key}
	case strings.HasPrefix(name, FileRootPrefix):
		root := strings.TrimPrefix(name, FileRootPrefix)
		if root == "" {
			return nil, fmt.Errorf("%w %q: want %s<roots>", ErrUnknownSecret, name, FileRootPrefix)
		}
		r = &fileResource{name: name, root: root}
	default:
		return nil, fmt.Errorf("%w %q: this agent serves %q, %q, %s… and %s…", ErrUnknownSecret, name, WorkloadCertName, RootCertName, FileCertPrefix, FileRootPrefix)
	}
	r.allowed = dirs
	for _, p := range r.paths() {
		if err := checkAllowed(p, dirs); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// checkAllowed refuses a path that is not absolute or not inside one of dirs, as written and,
// when it exists, once its symlinks are resolved (a link inside may point anywhere).
func checkAllowed(path string, dirs []string) error {
	if !filepath.IsAbs(path) || filepath.Clean(path) != path {
		return fmt.Errorf("%w: %q is not a clean absolute path", ErrForbiddenPath, path)
	}
	if !inside(path, dirs) {
		return fmt.Errorf("%w: %q (allowed: %s)", ErrForbiddenPath, path, strings.Join(dirs, ", "))
	}
	resolved, err := filepath.EvalSymlinks(path)
	if err != nil {
		return nil //nolint:nilerr // not there yet: checked again when it is read
	}
	if !inside(resolved, resolveDirs(dirs)) {
		return fmt.Errorf("%w: %q leads to %q", ErrForbiddenPath, path, resolved)
	}
	return nil
}

func inside(path string, dirs []string) bool {
	return slices.ContainsFunc(dirs, func(d string) bool {
		rel, err := filepath.Rel(filepath.Clean(d), path)
		return err == nil && rel != ".." && !strings.HasPrefix(rel, "../") && rel != "."
	})
}

// maxFileSize bounds each file of a file resource: certificates and keys take a few kilobytes,
// and a client may name any file in an allowed dir.
const maxFileSize = 1 << 20

// Why a file is refused once opened (besides ErrForbiddenPath).
var (
	errNotRegular = errors.New("not a regular file")
	errTooLarge   = fmt.Errorf("larger than %d bytes", maxFileSize)
	errCALeaf     = errors.New("the leaf is a CA certificate, whose key is not served")
)

// refusal names why files were refused, as counted; "" for files that are merely not usable
// (missing, half written, mismatched).
func refusal(err error) string {
	switch {
	case errors.Is(err, ErrForbiddenPath):
		return "forbidden_path"
	case errors.Is(err, errNotRegular):
		return "not_regular_file"
	case errors.Is(err, errTooLarge):
		return "too_large"
	case errors.Is(err, errCALeaf):
		return "ca_certificate"
	default:
		return ""
	}
}

// readFile reads path, opened once and judged by what was opened, not by the path: a name
// checked and then opened again could be swapped in between for a link to a file outside dirs
// (nil allows any). Only a regular file of at most maxFileSize is read.
func readFile(path string, dirs []string) ([]byte, error) {
	return readFileResolved(path, dirs, filepath.EvalSymlinks)
}

// resolveAttempts bounds how often a path is resolved again after what it led to vanished.
const resolveAttempts = 3

// readFileResolved is readFile with the symlink resolution given, for the test of the race below.
func readFileResolved(path string, dirs []string, resolve func(string) (string, error)) ([]byte, error) {
	var resolvedDirs []string
	if dirs != nil {
		resolvedDirs = resolveDirs(dirs)
	}
	var f *os.File
	for attempt := 1; ; attempt++ {
		resolved, err := resolve(path)
		// The same swap seen earlier: the generation ..data led to is removed while the links
		// are being followed.
		if errors.Is(err, fs.ErrNotExist) && attempt < resolveAttempts {
			continue
		}
		if err != nil {
			return nil, err
		}
		// Nothing outside is even opened, unless swapped in since: opening can have effects.
		if dirs != nil && !inside(resolved, resolvedDirs) {
			return nil, fmt.Errorf("%w: %q leads to %q", ErrForbiddenPath, path, resolved)
		}
		// O_NOFOLLOW: a link swapped in since the resolution is refused; O_NONBLOCK: opening a
		// FIFO does not wait for a writer. os adds O_CLOEXEC.
		f, err = os.OpenFile(resolved, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
		// The kubelet swaps ..data and then removes the generation it led to: a path resolved
		// just before leads nowhere by the open, and resolved again it leads to the new one.
		if errors.Is(err, fs.ErrNotExist) && resolved != path && attempt < resolveAttempts {
			continue
		}
		if err != nil {
			return nil, err
		}
		break
	}
	defer func() { _ = f.Close() }()
	info, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !info.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: %w (%s)", path, errNotRegular, info.Mode().Type())
	}
	if info.Size() > maxFileSize {
		return nil, fmt.Errorf("%s: %w", path, errTooLarge)
	}
	if dirs != nil {
		// Where the opened file really is: the kernel's answer, whatever happened to the path.
		opened, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(int(f.Fd())))
		if err != nil {
			return nil, fmt.Errorf("%w: %q: cannot tell where the opened file is: %w", ErrForbiddenPath, path, err)
		}
		if !inside(opened, resolvedDirs) {
			return nil, fmt.Errorf("%w: %q leads to %q", ErrForbiddenPath, path, opened)
		}
	}
	data, err := io.ReadAll(io.LimitReader(f, maxFileSize+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(data) > maxFileSize {
		return nil, fmt.Errorf("%s: %w", path, errTooLarge)
	}
	return data, nil
}

// resolveDirs resolves the symlinks of the dirs that exist.
func resolveDirs(dirs []string) []string {
	var out []string
	for _, d := range dirs {
		if r, err := filepath.EvalSymlinks(d); err == nil {
			out = append(out, r)
		}
	}
	return out
}

// readBounded reads one of r's files (see readFile), giving up after the bound of r.reads: a
// read that hangs holds up neither the loader's goroutine nor Run's return, and no more than one
// goroutine per file stays behind until the file system answers.
func (r *fileResource) readBounded(path string) ([]byte, error) {
	if r.reads == nil {
		return readFile(path, r.allowed)
	}
	// The bound is the only limit: Run waits for the loader's reads, so at most that long.
	return r.reads.Read(context.Background(), path, path, func() ([]byte, error) { return readFile(path, r.allowed) })
}

// read reads r's files into a secret, checking a key pair (the key matches the leaf, which is
// valid at now and not a CA).
func (r *fileResource) read(now time.Time) (*Secret, error) {
	if r.root != "" {
		data, err := r.readBounded(r.root)
		if err != nil {
			return nil, err
		}
		roots, err := pki.ParseCertificates(data)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", r.root, err)
		}
		return &Secret{Name: r.name, Bundle: &TrustBundle{Roots: roots, PEM: pki.EncodeCertificates(roots...)},
			Version: contentVersion(data), Source: SourceFiles}, nil
	}
	chainPEM, err := r.readBounded(r.certChain)
	if err != nil {
		return nil, err
	}
	keyPEM, err := r.readBounded(r.key)
	if err != nil {
		return nil, err
	}
	chain, err := pki.ParseCertificates(chainPEM)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", r.certChain, err)
	}
	key, err := pki.ParsePrivateKey(keyPEM)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", r.key, err)
	}
	if err := pki.CheckKeyPair(chain, key, "", now); err != nil {
		return nil, fmt.Errorf("%s and %s: %w", r.certChain, r.key, err)
	}
	// A CA's certificate and key would let whoever holds them issue certificates.
	if chain[0].IsCA {
		return nil, fmt.Errorf("%s: %w", r.certChain, errCALeaf)
	}
	return &Secret{
		Name:     r.name,
		KeyPair:  &KeyPair{Chain: chain, ChainPEM: chainPEM, Key: key, KeyPEM: keyPEM},
		Version:  contentVersion(chainPEM, keyPEM),
		Source:   SourceFiles,
		Received: now,
	}, nil
}

// fileLoader reads file resources and reads them again whenever their files change (a
// Kubernetes "..data" swap included) or a key pair it serves expires. Files whose directories
// do not exist yet are read once they appear. Reads happen on goroutines that Run waits for,
// never under a lock that a reader of the secrets takes.
type fileLoader struct {
	clock   clock.Clock
	log     *slog.Logger
	metrics *metrics
	watcher *filewatch.Watcher
	wake    chan struct{} // buffered: a registration or a change to look at
	// readFiles reads a resource's files; tests make it hang, as on a filesystem that does.
	readFiles func(r *fileResource, now time.Time) (*Secret, error)
	// ownFiles and clientFiles bound the wait for each file read: of the operator's own files
	// (r.allowed nil), and of those clients name, whose reads left hanging are bounded in number
	// too. Apart, so that clients cannot use up the reads of the workload's own files.
	ownFiles, clientFiles *fsutil.BoundedReads

	mu          sync.Mutex
	resources   map[string]*fileResource
	unwatched   []*fileResource        // registered, not watched yet
	stale       map[*fileResource]bool // to be read again
	unneeded    []string               // paths of forgotten resources: unwatched unless still read
	clientReads int                    // reads of clients' files under way
	reads       sync.WaitGroup         // every read under way
}

func newFileLoader(clk, readClock clock.Clock, hub *filewatch.Hub, log *slog.Logger, m *metrics) (*fileLoader, error) {
	w, err := filewatch.New(filewatch.Config{Clock: clk, Logger: log, Hub: hub})
	if err != nil {
		return nil, err
	}
	return &fileLoader{
		clock:     clk,
		log:       log,
		metrics:   m,
		watcher:   w,
		wake:      make(chan struct{}, 1),
		readFiles: (*fileResource).read,
		ownFiles:  fsutil.NewBoundedReads(readClock, fsutil.DefaultReadBound, 0),
		// Two files a resource: what maxClientReads reads at once.
		clientFiles: fsutil.NewBoundedReads(readClock, fsutil.DefaultReadBound, 2*maxClientReads),
		resources:   map[string]*fileResource{},
		stale:       map[*fileResource]bool{},
	}, nil
}

// add registers r; it is watched and read by Run. It reports false when a resource of that name
// is there already.
func (l *fileLoader) add(r *fileResource) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.addLocked(r)
}

// addBounded registers r like add, unless limit resources are registered already (the check and
// the registration under one lock, so that clients asking at once cannot overshoot the limit).
// It returns how many are registered, and false when r was refused for the limit.
func (l *fileLoader) addBounded(r *fileResource, limit int) (n int, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, known := l.resources[r.name]; !known && len(l.resources) >= limit {
		return len(l.resources), false
	}
	l.addLocked(r)
	return len(l.resources), true
}

func (l *fileLoader) addLocked(r *fileResource) bool {
	if _, ok := l.resources[r.name]; ok {
		return false
	}
	l.resources[r.name] = r
	r.reads = l.ownFiles
	if r.allowed != nil {
		r.reads = l.clientFiles
	}
	l.unwatched = append(l.unwatched, r)
	l.poke()
	return true
}

// remove forgets the resource of that name: it is read no more, and its files are unwatched
// unless another resource reads them.
func (l *fileLoader) remove(name string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.resources[name]
	if r == nil {
		return
	}
	delete(l.resources, name)
	l.unwatched = slices.DeleteFunc(l.unwatched, func(u *fileResource) bool { return u == r })
	delete(l.stale, r)
	l.unneeded = append(l.unneeded, r.paths()...)
	l.poke()
}

func (l *fileLoader) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.resources)
}

func (l *fileLoader) poke() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// run watches and reads until ctx ends.
func (l *fileLoader) run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return l.watcher.Run(ctx, l.filesChanged) })
	g.Go(func() error { return l.loop(ctx) })
	err := g.Wait()
	l.reads.Wait() // no subscriber is told anything once Run has returned
	return err
}

func (l *fileLoader) loop(ctx context.Context) error {
	// Read only once the files are watched: a change made between a read and its watch would
	// otherwise go unseen until the next one.
	select {
	case <-l.watcher.Ready():
	case <-ctx.Done():
		return nil
	}
	var expiry clock.Timer
	for {
		if err := l.watchNew(ctx); err != nil {
			return nil //nolint:nilerr // only ctx ends the watch of a running watcher
		}
		l.readStale()
		var expired <-chan time.Time
		if expiry != nil {
			expiry.Stop()
			expiry = nil
		}
		if next := l.nextExpiry(); !next.IsZero() {
			expiry = l.clock.NewTimer(next.Sub(l.clock.Now()))
			expired = expiry.C()
		}
		select {
		case <-ctx.Done():
			if expiry != nil {
				expiry.Stop()
			}
			return nil
		case <-l.wake:
		case <-expired:
			l.markExpired()
		}
	}
}

// watchNew unwatches the files no resource reads any more, then watches the files of every
// resource registered since the last look and marks it to be read. Both on the loop's goroutine,
// in this order, so that a file forgotten and asked for again stays watched.
func (l *fileLoader) watchNew(ctx context.Context) error {
	l.mu.Lock()
	fresh := l.unwatched
	l.unwatched = nil
	var drop []string
	for _, p := range l.unneeded {
		if !slices.Contains(drop, p) && !l.readsLocked(p) {
			drop = append(drop, p)
		}
	}
	l.unneeded = nil
	l.mu.Unlock()
	for _, p := range drop {
		if err := l.watcher.Remove(ctx, p); err != nil {
			return err // only when ctx ends or the watcher stops
		}
	}
	for _, r := range fresh {
		var errs []error
		for _, p := range r.paths() {
			if err := l.watcher.Add(ctx, p); err != nil {
				if ctx.Err() != nil {
					return err
				}
				errs = append(errs, err)
			}
		}
		if err := errors.Join(errs...); err != nil {
			l.log.Warn("cannot watch the files of a secret; it is read when asked again", logkey.Secret, logkey.Untrusted(r.name), logkey.Error, logkey.Untrusted(err.Error()))
		}
		l.mu.Lock()
		l.stale[r] = true
		l.mu.Unlock()
	}
	return nil
}

// readsLocked reports whether a registered resource reads path.
func (l *fileLoader) readsLocked(path string) bool {
	for _, r := range l.resources {
		if slices.ContainsFunc(r.paths(), func(p string) bool { return filepath.Clean(p) == filepath.Clean(path) }) {
			return true
		}
	}
	return false
}

// maxClientReads bounds the reads of clients' files under way at once: plenty for files that
// answer, and a bound on those left hanging by a filesystem that does not.
const maxClientReads = 32

// readStale starts a read of each resource marked stale, on a goroutine of its own, so that a
// read that hangs (on a hung filesystem) holds up only its resource. A resource is read once at a
// time, so that its subscribers are told in order; one that changes meanwhile is read again after.
func (l *fileLoader) readStale() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for r := range l.stale {
		switch {
		case r.reading:
			r.again = true
		case r.allowed != nil && l.clientReads >= maxClientReads:
			continue // still stale: looked at again when a read ends
		default:
			r.reading = true
			if r.allowed != nil {
				l.clientReads++
			}
			l.reads.Add(1)
			go l.read(r)
		}
		delete(l.stale, r)
	}
}

// read reads r and tells its subscribers what changed.
func (l *fileLoader) read(r *fileResource) {
	defer l.reads.Done()
	now := l.clock.Now()
	s, err := l.readFiles(r, now)

	l.mu.Lock()
	if err != nil && r.again && l.resources[r.name] == r {
		// The files changed while they were read (a ..data swap removing the generation being
		// read, say): the error may be the change's, not the files'. The read after it decides.
		r.reading, r.again = false, false
		if r.allowed != nil {
			l.clientReads--
		}
		l.stale[r] = true
		l.mu.Unlock()
		l.poke()
		return
	}
	had, failed, hung := r.current, r.failed, r.hung
	// A file system that does not answer is asked again at once: the read joins the one left
	// hanging (no goroutine more), and the first to answer is taken. Told once.
	noAnswer := errors.Is(err, fsutil.ErrNoAnswer)
	r.hung = noAnswer
	switch {
	case err != nil:
		if r.current != nil && !r.current.validAt(now) {
			r.current = nil
		}
		r.failed = true
	case had != nil && had.Version == s.Version:
		r.failed = false
	default:
		r.current, r.failed = s, false
	}
	l.mu.Unlock()

	switch {
	case noAnswer && hung:
	case err != nil:
		// The name and the error's paths are the client's.
		name, why := logkey.Untrusted(r.name), logkey.Untrusted(err.Error())
		switch reason := refusal(err); {
		case reason != "":
			l.metrics.fileRefusals.WithLabelValues(reason).Inc()
			l.log.Warn("file secret refused", logkey.Secret, name, logkey.Reason, reason, logkey.Error, why)
		case had != nil:
			l.log.Warn("files not usable; the last good secret keeps serving while it is valid", logkey.Secret, name, logkey.Error, why)
		default:
			l.log.Warn("files not usable yet; read again when they change", logkey.Secret, name, logkey.Error, why)
		}
		r.deliver(nil, err)
	case had != nil && had.Version == s.Version:
		if failed {
			// The files hold the pair in service again: clear the failure reported meanwhile.
			r.deliver(had, nil)
		}
	default:
		l.log.Info("secret loaded from files", logkey.Secret, logkey.Untrusted(r.name), logkey.Version, s.Version, logkey.Paths, logkey.UntrustedList(r.paths()))
		r.deliver(s, nil)
	}

	l.mu.Lock()
	r.reading = false
	if r.allowed != nil {
		l.clientReads--
	}
	if (r.again || noAnswer) && l.resources[r.name] == r {
		l.stale[r] = true
	}
	r.again = false
	l.mu.Unlock()
	l.poke() // for the next expiry, and the reads waiting for this one
}

// nextExpiry is when the first key pair read expires; zero when none is held.
func (l *fileLoader) nextExpiry() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	var next time.Time
	for _, r := range l.resources {
		if r.current == nil || r.current.KeyPair == nil {
			continue
		}
		if at := r.current.NotAfter(); next.IsZero() || at.Before(next) {
			next = at
		}
	}
	return next
}

// markExpired marks every resource whose key pair expired to be read again: files replaced
// without an event are then seen, and an expired pair is reported as such.
func (l *fileLoader) markExpired() {
	now := l.clock.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range l.resources {
		if r.current != nil && !r.current.validAt(now) {
			l.stale[r] = true
		}
	}
}

// filesChanged marks every resource that reads one of the changed paths to be read again.
func (l *fileLoader) filesChanged(changed []string) {
	l.mu.Lock()
	for _, r := range l.resources {
		if slices.ContainsFunc(r.paths(), func(p string) bool { return slices.Contains(changed, filepath.Clean(p)) }) {
			l.stale[r] = true
		}
	}
	l.mu.Unlock()
	l.poke()
}
