package controller

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/istio"
	"github.com/meshid/meshid/internal/pki"
)

// SecretKey names one service-account secret: istio.<ServiceAccount> in Namespace.
type SecretKey struct{ Namespace, ServiceAccount string }

func (k SecretKey) String() string { return k.Namespace + "/" + k.ServiceAccount }

// StoredSecret is a secret as its store holds it.
type StoredSecret struct {
	Exists bool
	// Ours: the secret carries this controller's mark; only those are ever replaced or removed.
	Ours bool
	// Data holds the files by name (istio.KeyFile, istio.CertChainFile, istio.RootCertFile); it
	// may be shared with the store's cache and must not be modified.
	Data map[string][]byte
	// Problem is what the store finds wrong beyond the data, e.g. a key readable by others.
	Problem string
}

// ErrForeignSecret is returned by a SecretStore's Write when a secret of that name exists that
// the controller did not make: it is left alone.
var ErrForeignSecret = errors.New("a secret of that name exists that this controller did not make")

// ErrSecretRefused is returned by a SecretStore that will not hold a secret as things stand: its
// directory is reached through a link, or its name is too long for the store. The controller
// logs it once, counts it and does not retry it before the next resync.
var ErrSecretRefused = errors.New("refused by the secret store")

// SecretStore keeps service-account secrets: directories on disk (FileSecrets) or Secrets of type
// istio.io/key-and-cert in the Kubernetes API.
type SecretStore interface {
	// Keys lists the secrets present in namespace ("" is every namespace), ours or not.
	Keys(ctx context.Context, namespace string) ([]SecretKey, error)
	Read(ctx context.Context, k SecretKey) (StoredSecret, error)
	// Write replaces the secret's data, marking it as ours for identity.
	Write(ctx context.Context, k SecretKey, data map[string][]byte, identity string) error
	// Delete removes one of our secrets; one already gone is not an error.
	Delete(ctx context.Context, k SecretKey) error
	// Where names the secret in logs and events.
	Where(k SecretKey) string
}

// FileSecrets keeps secrets in directories <dir>/<namespace>/istio.<sa>, laid out as the kubelet
// mounts a secret ("..data"), so that an agent can use one as --credentials-dir. A directory is
// ours when it holds SecretMarkerFile. Nothing in the tree is followed through a link: dir, a
// namespace directory or a secret directory that is a link, or that another user owns or can
// write in, is refused (ErrSecretRefused), never read, replaced nor removed.
type FileSecrets struct{ dir string }

// NewFileSecrets returns the secrets kept under dir.
func NewFileSecrets(dir string) *FileSecrets { return &FileSecrets{dir: dir} }

// Where returns the secret's directory.
func (f *FileSecrets) Where(k SecretKey) string {
	return filepath.Join(f.dir, k.Namespace, SecretDirName(k.ServiceAccount))
}

// Long service-account names in the file store.
const (
	// maxFileName is the longest file name Linux file systems take (NAME_MAX), in bytes.
	maxFileName = 255
	// shortSeparator joins a shortened name's prefix and hash: no service-account name holds it,
	// so a shortened name is never another account's own.
	shortSeparator = "_"
	// shortHashDigits is how many hex digits of the name's SHA-256 end a shortened name.
	shortHashDigits = 16
)

// SecretDirName is the directory of a service account's secret in the file store: istio.<sa>, or,
// when that is longer than a file name may be (a service-account name may have 253 bytes),
// istio.<the first 232 bytes of sa>_<the first 16 hex digits of the SHA-256 of sa>, 255 bytes.
// The same name always gives the same directory, and its marker names the service account.
func SecretDirName(sa string) string {
	name := SecretPrefix + sa
	if len(name) <= maxFileName {
		return name
	}
	sum := sha256.Sum256([]byte(sa))
	suffix := shortSeparator + hex.EncodeToString(sum[:])[:shortHashDigits]
	return name[:maxFileName-len(suffix)] + suffix
}

// isShortened reports whether name is a shortened SecretDirName.
func isShortened(name string) bool {
	if len(name) != maxFileName || !strings.HasPrefix(name, SecretPrefix) {
		return false
	}
	sep := maxFileName - shortHashDigits - len(shortSeparator)
	if name[sep:sep+len(shortSeparator)] != shortSeparator {
		return false
	}
	_, err := hex.DecodeString(name[sep+len(shortSeparator):])
	return err == nil
}

// markedServiceAccount reads the service account the marker in dir names, as Write put it there.
func markedServiceAccount(dir string) (SecretKey, bool) {
	path := filepath.Join(dir, SecretMarkerFile)
	if info, err := os.Lstat(path); err != nil || !info.Mode().IsRegular() || info.Size() > 4096 {
		return SecretKey{}, false
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return SecretKey{}, false
	}
	for line := range strings.Lines(string(data)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), markerIdentity); ok {
			id, err := pki.ParseSPIFFEID(v)
			if err != nil {
				return SecretKey{}, false
			}
			return SecretKey{Namespace: id.Namespace, ServiceAccount: id.ServiceAccount}, true
		}
	}
	return SecretKey{}, false
}

// markerIdentity starts the marker's line that names the secret's identity.
const markerIdentity = "identity: "

// refused reports what the store will not use, as ErrSecretRefused.
func refused(err error) error { return fmt.Errorf("%w: %w", ErrSecretRefused, err) }

// checkTree refuses the secret's namespace directory, or the tree's top, when it is a link or not
// ours alone; a missing one passes.
func (f *FileSecrets) checkTree(k SecretKey) error {
	for _, dir := range []string{f.dir, filepath.Join(f.dir, k.Namespace)} {
		if err := fsutil.CheckOwnedSubdir(dir); err != nil {
			return refused(err)
		}
	}
	return nil
}

// Keys lists the entries named istio.<sa> under the namespace directories; a namespace directory
// that is a link is not looked into.
func (f *FileSecrets) Keys(_ context.Context, namespace string) ([]SecretKey, error) {
	if err := fsutil.CheckOwnedSubdir(f.dir); err != nil {
		return nil, refused(err)
	}
	namespaces := []string{namespace}
	if namespace == "" {
		entries, err := os.ReadDir(f.dir)
		if errors.Is(err, os.ErrNotExist) {
			return nil, nil // nothing written yet
		}
		if err != nil {
			return nil, err
		}
		namespaces = namespaces[:0]
		for _, e := range entries {
			if e.IsDir() { // the entry's own type: a link is not a directory
				namespaces = append(namespaces, e.Name())
			}
		}
	}
	var keys []SecretKey
	for _, ns := range namespaces {
		if info, err := os.Lstat(filepath.Join(f.dir, ns)); err != nil || !info.IsDir() {
			continue
		}
		entries, err := os.ReadDir(filepath.Join(f.dir, ns))
		if err != nil {
			continue
		}
		for _, e := range entries {
			sa, ok := strings.CutPrefix(e.Name(), SecretPrefix)
			if !ok || sa == "" {
				continue
			}
			// A shortened name is a long one's, which its marker names. One whose marker does not
			// (not ours) is listed as it is: no account has that name, and it is left alone.
			if isShortened(e.Name()) {
				if marked, ok := markedServiceAccount(filepath.Join(f.dir, ns, e.Name())); ok && marked.Namespace == ns &&
					SecretDirName(marked.ServiceAccount) == e.Name() {
					sa = marked.ServiceAccount
				}
			}
			keys = append(keys, SecretKey{ns, sa})
		}
	}
	return keys, nil
}

// Read reads one of our directories' files; a key file readable by others is a problem.
func (f *FileSecrets) Read(_ context.Context, k SecretKey) (StoredSecret, error) {
	if err := f.checkTree(k); err != nil {
		return StoredSecret{}, err
	}
	dir := f.Where(k)
	ours, exists, err := owned(dir)
	if err != nil || !exists || !ours {
		return StoredSecret{Exists: exists}, err
	}
	if isShortened(filepath.Base(dir)) {
		// Ours only when the marker names this account: the name alone does not.
		if marked, ok := markedServiceAccount(dir); !ok || marked != k {
			return StoredSecret{Exists: true}, nil
		}
	}
	// Generations a write interrupted by a crash left behind; the next write would remove them,
	// but a secret that stays valid is not written again.
	for _, stale := range fsutil.StaleGenerations(dir, generationPrefix) {
		_ = os.RemoveAll(stale)
	}
	s := StoredSecret{Exists: true, Ours: true, Data: map[string][]byte{}}
	for _, name := range []string{istio.KeyFile, istio.CertChainFile, istio.RootCertFile} {
		data, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			s.Problem = "cannot read " + name
			return s, nil
		}
		s.Data[name] = data
	}
	if info, err := os.Stat(filepath.Join(dir, istio.KeyFile)); err != nil || info.Mode().Perm() != fsutil.PrivateFileMode {
		s.Problem = istio.KeyFile + " is not private"
	}
	return s, nil
}

// Write writes the files as a new generation, marking the directory ours first.
func (f *FileSecrets) Write(_ context.Context, k SecretKey, data map[string][]byte, identity string) error {
	if err := f.checkTree(k); err != nil {
		return err
	}
	dir := f.Where(k)
	ours, exists, err := owned(dir)
	if err != nil {
		return err
	}
	if exists && !ours {
		return fmt.Errorf("%s: %w", dir, ErrForeignSecret)
	}
	// Each made private, or found ours alone and no link, before anything goes into it.
	for _, d := range []string{f.dir, filepath.Dir(dir), dir} {
		if err := fsutil.EnsureOwnedSubdir(d, fsutil.PrivateDirMode); err != nil {
			return refused(err)
		}
	}
	// The marker first: a write interrupted after it leaves a directory we still own.
	marker := filepath.Join(dir, SecretMarkerFile)
	if _, err := os.Lstat(marker); err != nil {
		if err := fsutil.WriteFileAtomic(marker, []byte("type: "+SecretType+"\n"+markerIdentity+identity+"\n"), fsutil.PublicFileMode); err != nil {
			return err
		}
	}
	files := make([]fsutil.DataFile, 0, len(data))
	for name, content := range data {
		mode := fsutil.PublicFileMode
		if name == istio.KeyFile {
			mode = fsutil.PrivateFileMode
		}
		files = append(files, fsutil.DataFile{Name: name, Data: content, Mode: mode})
	}
	slices.SortFunc(files, func(a, b fsutil.DataFile) int { return strings.Compare(a.Name, b.Name) })
	return fsutil.WriteData(dir, generationPrefix, fsutil.PrivateDirMode, files)
}

// Delete removes the directory, and the namespace's directory with its last secret.
func (f *FileSecrets) Delete(_ context.Context, k SecretKey) error {
	if err := f.checkTree(k); err != nil {
		return err
	}
	dir := f.Where(k)
	if err := fsutil.CheckOwnedSubdir(dir); err != nil {
		return refused(err)
	}
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("remove %s: %w", dir, err)
	}
	// One holding anything else stays.
	_ = os.Remove(filepath.Dir(dir))
	return nil
}

// owned reports whether dir exists and whether it is ours (it holds our marker). A link, or a
// directory that another user owns or can write in, is refused.
func owned(dir string) (ours, exists bool, err error) {
	info, err := os.Lstat(dir)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return false, false, nil
	case err != nil:
		return false, false, err
	case info.Mode()&os.ModeSymlink != 0:
		return false, true, refused(fsutil.CheckOwnedSubdir(dir))
	case !info.IsDir():
		return false, true, nil
	}
	if err := fsutil.CheckOwnedSubdir(dir); err != nil {
		return false, true, refused(err)
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
