package secretmanager

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/meshid/meshid/internal/logkey"

	"github.com/meshid/meshid/internal/pki"
)

// Prefixes of the resource names that read files, as Istio's agent names them:
// file-cert:<cert-chain>~<key> and file-root:<roots>.
const (
	FileCertPrefix = "file-cert:"
	FileRootPrefix = "file-root:"
)

// ErrForbiddenPath reports a file resource outside the directories files may be served from.
var ErrForbiddenPath = errors.New("path outside the directories files may be served from")

// ErrTooManyFiles reports a file resource past MaxFileSecrets: each is watched and kept for the
// agent's life, so a client may not ask for names without end.
var ErrTooManyFiles = errors.New("too many file secrets")

// MaxFileSecrets bounds the file resources one agent serves.
const MaxFileSecrets = 256

// FilePaths names the files of a workload key pair and trust bundle.
type FilePaths struct {
	CertChain string
	Key       string
	Root      string
}

// fileSecret is a secret read from files, kept at its last valid content: a rewrite that leaves
// the pair mismatched (a ..data swap caught half way) keeps serving the previous pair.
type fileSecret struct {
	name      string
	certChain string // the key pair; empty for a trust bundle
	key       string
	root      string // the trust bundle; empty for a key pair
	current   *Secret
	lastErr   error
}

func (f *fileSecret) paths() []string {
	if f.root != "" {
		return []string{f.root}
	}
	return []string{f.certChain, f.key}
}

// parseFileResource splits a file resource name into its paths.
func parseFileResource(name string) (*fileSecret, error) {
	switch {
	case strings.HasPrefix(name, FileCertPrefix):
		cert, key, ok := strings.Cut(strings.TrimPrefix(name, FileCertPrefix), "~")
		if !ok || cert == "" || key == "" {
			return nil, fmt.Errorf("%w %q: want %s<cert-chain>~<key>", ErrUnknownSecret, name, FileCertPrefix)
		}
		return &fileSecret{name: name, certChain: cert, key: key}, nil
	case strings.HasPrefix(name, FileRootPrefix):
		root := strings.TrimPrefix(name, FileRootPrefix)
		if root == "" {
			return nil, fmt.Errorf("%w %q: want %s<roots>", ErrUnknownSecret, name, FileRootPrefix)
		}
		return &fileSecret{name: name, root: root}, nil
	default:
		return nil, fmt.Errorf("%w %q: this agent serves %q, %q, %s… and %s…", ErrUnknownSecret, name, WorkloadCertName, RootCertName, FileCertPrefix, FileRootPrefix)
	}
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
	var resolvedDirs []string
	for _, d := range dirs {
		if r, err := filepath.EvalSymlinks(d); err == nil {
			resolvedDirs = append(resolvedDirs, r)
		}
	}
	if !inside(resolved, resolvedDirs) {
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

// load reads f's files and, when they hold a usable secret, makes it current. It reports whether
// the current secret changed.
func (m *Manager) loadFileSecret(f *fileSecret) (changed bool, err error) {
	var s *Secret
	if f.root != "" {
		s, err = m.readRoots(f)
	} else {
		s, err = m.readKeyPair(f)
	}
	if err != nil {
		f.lastErr = err
		return false, err
	}
	f.lastErr = nil
	if f.current != nil && f.current.Version == s.Version {
		return false, nil
	}
	f.current = s
	return true, nil
}

func (m *Manager) readKeyPair(f *fileSecret) (*Secret, error) {
	for _, p := range f.paths() {
		if err := checkAllowed(p, m.allowedDirs(f)); err != nil {
			return nil, err
		}
	}
	chainPEM, err := os.ReadFile(f.certChain)
	if err != nil {
		return nil, err
	}
	keyPEM, err := os.ReadFile(f.key)
	if err != nil {
		return nil, err
	}
	chain, err := pki.ParseCertificates(chainPEM)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", f.certChain, err)
	}
	key, err := pki.ParsePrivateKey(keyPEM)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", f.key, err)
	}
	if err := pki.CheckKeyPair(chain, key, "", m.clock.Now()); err != nil {
		return nil, fmt.Errorf("%s and %s: %w", f.certChain, f.key, err)
	}
	return &Secret{
		Name:      f.name,
		Chain:     chain,
		ChainPEM:  chainPEM,
		Key:       key,
		KeyPEM:    keyPEM,
		Version:   contentVersion(chainPEM, keyPEM),
		CreatedAt: m.clock.Now(),
		ExpiresAt: chain[0].NotAfter,
		Source:    "files",
	}, nil
}

func (m *Manager) readRoots(f *fileSecret) (*Secret, error) {
	if err := checkAllowed(f.root, m.allowedDirs(f)); err != nil {
		return nil, err
	}
	data, err := os.ReadFile(f.root)
	if err != nil {
		return nil, err
	}
	roots, err := pki.ParseCertificates(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", f.root, err)
	}
	return &Secret{Name: f.name, Roots: roots, RootsPEM: pki.EncodeCertificates(roots...), Version: contentVersion(data), Source: "files"}, nil
}

// allowedDirs are the directories f may read: those of the workload files in file mode (they are
// the operator's own), else the file resource directories.
func (m *Manager) allowedDirs(f *fileSecret) []string {
	if wf := m.cfg.WorkloadFiles; wf != nil && (f.name == WorkloadCertName || f.name == RootCertName) {
		return []string{filepath.Dir(wf.CertChain), filepath.Dir(wf.Key), filepath.Dir(wf.Root)}
	}
	return m.cfg.FileResourceDirs
}

func contentVersion(parts ...[]byte) string {
	h := sha256.New()
	for _, p := range parts {
		h.Write(p)
	}
	return hex.EncodeToString(h.Sum(nil)[:8])
}

// CheckName reports whether name is a secret this manager can serve: an error wrapping
// ErrUnknownSecret for a name it does not know, ErrForbiddenPath for a file it may not read.
func (m *Manager) CheckName(name string) error {
	if name == WorkloadCertName || name == RootCertName {
		return nil
	}
	f, err := parseFileResource(name)
	if err != nil {
		return err
	}
	for _, p := range f.paths() {
		if err := checkAllowed(p, m.cfg.FileResourceDirs); err != nil {
			return err
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, known := m.files[name]; !known && len(m.files) >= MaxFileSecrets {
		return fmt.Errorf("%w: %d are served already", ErrTooManyFiles, len(m.files))
	}
	return nil
}

// fileSecretFor returns the file secret serving name, creating and watching it on first use.
func (m *Manager) fileSecretFor(ctx context.Context, name string) (*fileSecret, error) {
	m.mu.Lock()
	f, ok := m.files[name]
	m.mu.Unlock()
	if ok {
		return f, nil
	}
	if err := m.CheckName(name); err != nil {
		return nil, err
	}
	f, err := parseFileResource(name)
	if err != nil {
		return nil, err
	}
	// Watch before the first read, so that no change between the two goes unseen.
	for _, p := range f.paths() {
		if err := m.watcher.Add(ctx, p); err != nil {
			return nil, fmt.Errorf("watch %s: %w", p, err)
		}
	}
	m.publishMu.Lock()
	defer m.publishMu.Unlock()
	m.mu.Lock()
	if existing, ok := m.files[name]; ok {
		m.mu.Unlock()
		return existing, nil
	}
	m.files[name] = f
	m.mu.Unlock()
	m.reloadFileSecret(f)
	return f, nil
}

// reloadFileSecret re-reads f and tells subscribers when its content changed. Called with
// publishMu held.
func (m *Manager) reloadFileSecret(f *fileSecret) {
	m.mu.Lock()
	changed, err := m.loadFileSecret(f)
	current := f.current
	m.mu.Unlock()
	if err != nil {
		if current != nil {
			m.log.Warn("files not usable; the last good secret keeps serving", logkey.Secret, f.name, logkey.Error, err.Error())
		} else {
			m.log.Warn("files not usable yet", logkey.Secret, f.name, logkey.Error, err.Error())
		}
		return
	}
	if changed {
		m.log.Info("secret loaded from files", logkey.Secret, f.name, logkey.Version, current.Version, logkey.Paths, f.paths())
		if f.name == WorkloadCertName {
			m.metrics.expiry.Set(float64(current.ExpiresAt.Unix()))
		}
		m.notify(current)
	}
}

// filesChanged reloads every file secret that reads one of the changed paths.
func (m *Manager) filesChanged(changed []string) {
	m.reloadFiles(func(f *fileSecret) bool {
		return slices.ContainsFunc(f.paths(), func(p string) bool { return slices.Contains(changed, filepath.Clean(p)) })
	})
}

// reloadAllFiles reloads every file secret.
func (m *Manager) reloadAllFiles() { m.reloadFiles(func(*fileSecret) bool { return true }) }

func (m *Manager) reloadFiles(affects func(*fileSecret) bool) {
	m.publishMu.Lock()
	defer m.publishMu.Unlock()
	m.mu.Lock()
	var affected []*fileSecret
	for _, name := range slices.Sorted(maps.Keys(m.files)) {
		if f := m.files[name]; affects(f) {
			affected = append(affected, f)
		}
	}
	m.mu.Unlock()
	for _, f := range affected {
		m.reloadFileSecret(f)
	}
}
