package ca

import (
	"bytes"
	"crypto"
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/meshid/meshid/internal/logkey"

	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/istio"
	"github.com/meshid/meshid/internal/pki"
)

// File names of a plugged-in CA (Istio's cacerts secret, two layouts) and of the CA state dir.
const (
	CACertFile    = "ca-cert.pem"
	CAKeyFile     = "ca-key.pem"
	CertChainFile = istio.CertChainFile
	RootCertFile  = istio.RootCertFile

	TLSCertFile = "tls.crt"
	TLSKeyFile  = "tls.key"
	TLSCAFile   = "ca.crt"

	TokenKeyFile = "token-key.pem" //nolint:gosec // a file name, not a credential
)

// The two plugged-in layouts, by their file names.
func istioLayout() []string { return []string{CACertFile, CAKeyFile, CertChainFile, RootCertFile} }
func tlsLayout() []string   { return []string{TLSCertFile, TLSKeyFile, TLSCAFile} }

// ErrNoPluggedInCA reports a cacerts directory that holds none of the files of either layout.
var ErrNoPluggedInCA = errors.New("no plugged-in CA files")

// CheckCACertsDir refuses a plugged-in CA directory that does not exist or is not a directory,
// which is most likely a typo that would otherwise fall back to a self-signed CA unnoticed. An
// empty directory is fine: Kubernetes mounts an optional secret that does not exist yet as one,
// and files that appear in it later take over.
func CheckCACertsDir(dir string) error {
	info, err := os.Stat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("plugged-in CA directory %s: %w (an empty directory is fine)", dir, fs.ErrNotExist)
	case err != nil:
		return fmt.Errorf("plugged-in CA directory: %w", err)
	case !info.IsDir():
		return fmt.Errorf("plugged-in CA directory %s is not a directory", dir)
	}
	return nil
}

// LoadPluggedIn reads a plugged-in CA from dir, in either layout:
//   - ca-cert.pem (signing cert), ca-key.pem, cert-chain.pem (its chain, may end with the root),
//     root-cert.pem (one or more roots);
//   - tls.crt (signing cert, optionally followed by its chain), tls.key, ca.crt (the roots; when
//     empty, tls.crt must be a self-signed root).
//
// A directory holding some but not all files of a layout is an error naming the missing files.
func LoadPluggedIn(dir string, now time.Time) (*Bundle, error) {
	files, err := readLayouts(dir)
	if err != nil {
		return nil, err
	}
	return bundleFromLayouts(dir, files, now, SourcePluggedIn)
}

// BundleFromData builds the bundle of a cacerts Secret's data, in either layout of LoadPluggedIn;
// where names the Secret in errors ("secret istio-system/cacerts"). Its Source is SourceSecret,
// which the key manager's self-signed rotator never touches: the Secret's owner rotates it.
func BundleFromData(files map[string][]byte, where string, now time.Time) (*Bundle, error) {
	return bundleFromLayouts(where, files, now, SourceSecret)
}

// bundleFromLayouts builds the bundle of the files of dir, by name, in whichever layout they
// complete. It reads nothing: FuzzLoadCACerts calls it with arbitrary contents.
func bundleFromLayouts(dir string, files map[string][]byte, now time.Time, source Source) (*Bundle, error) {
	if complete(files, istioLayout()) {
		return bundleFromFiles(dir, files, [4]string{CACertFile, CAKeyFile, CertChainFile, RootCertFile}, now, source)
	}
	if complete(files, tlsLayout()) {
		return bundleFromFiles(dir, files, [4]string{TLSCertFile, TLSKeyFile, "", TLSCAFile}, now, source)
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("%s: %w", dir, ErrNoPluggedInCA)
	}
	return nil, fmt.Errorf("incomplete plugged-in CA in %s: %s", dir, describeMissing(files))
}

func readLayouts(dir string) (map[string][]byte, error) {
	files := map[string][]byte{}
	for _, name := range append(istioLayout(), tlsLayout()...) {
		data, ok, err := fsutil.ReadOptional(filepath.Join(dir, name))
		if err != nil {
			return nil, err
		}
		if ok {
			files[name] = data
		}
	}
	return files, nil
}

func complete(files map[string][]byte, layout []string) bool {
	for _, name := range layout {
		if _, ok := files[name]; !ok {
			return false
		}
	}
	return true
}

func describeMissing(files map[string][]byte) string {
	var parts []string
	for _, layout := range [][]string{istioLayout(), tlsLayout()} {
		var present, missing []string
		for _, name := range layout {
			if _, ok := files[name]; ok {
				present = append(present, name)
			} else {
				missing = append(missing, name)
			}
		}
		if len(present) > 0 {
			parts = append(parts, fmt.Sprintf("has %s but is missing %s", strings.Join(present, ", "), strings.Join(missing, ", ")))
		}
	}
	return strings.Join(parts, "; ")
}

// bundleFromFiles builds a bundle from the files named (signing cert, key, chain, roots); an empty
// chain name means the layout has no chain file.
func bundleFromFiles(dir string, files map[string][]byte, names [4]string, now time.Time, source Source) (*Bundle, error) {
	certName, keyName, chainName, rootName := names[0], names[1], names[2], names[3]
	certs, err := pki.ParseCertificates(files[certName])
	if err != nil {
		return nil, fmt.Errorf("plugged-in CA in %s: %s (signing certificate): %w", dir, certName, err)
	}
	key, err := pki.ParsePrivateKey(files[keyName])
	if err != nil {
		return nil, fmt.Errorf("plugged-in CA in %s: %s (signing key): %w", dir, keyName, err)
	}
	intermediates := certs[1:]
	if chainName != "" && len(bytes.TrimSpace(files[chainName])) > 0 {
		chain, err := pki.ParseCertificates(files[chainName])
		if err != nil {
			return nil, fmt.Errorf("plugged-in CA in %s: %s: %w", dir, chainName, err)
		}
		intermediates = append(intermediates, chain...)
	}
	var roots []*x509.Certificate
	if len(bytes.TrimSpace(files[rootName])) > 0 {
		roots, err = pki.ParseCertificates(files[rootName])
		if err != nil {
			return nil, fmt.Errorf("plugged-in CA in %s: %s (root certificates): %w", dir, rootName, err)
		}
	}
	b, err := NewBundle(BundleParams{
		SigningCert:   certs[0],
		SigningKey:    key,
		Intermediates: intermediates,
		Roots:         roots,
		Source:        source,
		Now:           now,
	})
	if err != nil {
		return nil, fmt.Errorf("plugged-in CA in %s: %w", dir, err)
	}
	return b, nil
}

// SelfSignedConfig describes the root the CA generates when it has no other key material.
type SelfSignedConfig struct {
	KeyAlgorithm pki.KeyAlgorithm
	RSAKeySize   int
	Org          string
	TTL          time.Duration
}

// LoadSelfSigned reads the persisted self-signed CA (ca-cert.pem, ca-key.pem) from stateDir.
// It reports (nil, nil) when neither file exists; one without the other is an error, because
// generating a new root over it would silently change the trust anchor.
func LoadSelfSigned(stateDir string, now time.Time) (*Bundle, error) {
	cert, key, err := readSelfSigned(stateDir)
	if err != nil || cert == nil {
		return nil, err
	}
	b, err := NewBundle(BundleParams{SigningCert: cert, SigningKey: key, Source: SourceSelfSigned, Now: now})
	if err != nil {
		return nil, fmt.Errorf("self-signed CA in %s: %w", stateDir, err)
	}
	return b, nil
}

func readSelfSigned(stateDir string) (*x509.Certificate, crypto.Signer, error) {
	certPEM, certOK, err := fsutil.ReadOptional(filepath.Join(stateDir, CACertFile))
	if err != nil {
		return nil, nil, err
	}
	keyPEM, keyOK, err := readStateKey(stateDir)
	if err != nil {
		return nil, nil, err
	}
	switch {
	case !certOK && !keyOK:
		return nil, nil, nil
	case !keyOK:
		return nil, nil, fmt.Errorf("state dir %s has %s but no %s; restore the key or remove both to generate a new root", stateDir, CACertFile, CAKeyFile)
	case !certOK:
		return nil, nil, fmt.Errorf("state dir %s has %s but no %s; restore the certificate or remove both to generate a new root", stateDir, CAKeyFile, CACertFile)
	}
	certs, err := pki.ParseCertificates(certPEM)
	if err != nil {
		return nil, nil, fmt.Errorf("self-signed CA in %s: %s: %w", stateDir, CACertFile, err)
	}
	key, err := pki.ParsePrivateKey(keyPEM)
	if err != nil {
		return nil, nil, fmt.Errorf("self-signed CA in %s: %s: %w", stateDir, CAKeyFile, err)
	}
	return certs[0], key, nil
}

// readStateKey reads the self-signed CA's key in stateDir, if there is one, and only when it is
// ours alone (fsutil.CheckKeyFile): another user could have put their own there.
func readStateKey(stateDir string) ([]byte, bool, error) {
	path := filepath.Join(stateDir, CAKeyFile)
	if err := fsutil.CheckKeyFile(path); err != nil {
		return nil, false, err
	}
	return fsutil.ReadOptional(path)
}

// persistKey atomically writes the self-signed CA's key (0600).
func persistKey(stateDir string, key crypto.Signer) error {
	keyPEM, err := pki.EncodePrivateKey(key)
	if err != nil {
		return err
	}
	return fsutil.WritePrivateFile(filepath.Join(stateDir, CAKeyFile), keyPEM)
}

// persistRoot atomically replaces the persisted self-signed root certificate; the key is unchanged.
func persistRoot(stateDir string, root *x509.Certificate) error {
	return fsutil.WriteFileAtomic(filepath.Join(stateDir, CACertFile), pki.EncodeCertificate(root), fsutil.PublicFileMode)
}

// pendingRootFile holds a new self-signed root until its key is in place. Two files cannot be
// replaced at once, and a CA killed between them used to leave ca-key.pem without ca-cert.pem,
// which every later start refused (rightly: a key without its certificate may be one an operator
// restored). The root written first, under this name, is the proof that the key is ours.
const pendingRootFile = "ca-cert.pem.pending"

// persistPair writes a self-signed key and root as one unit: the root to pendingRootFile, then
// the key (0600), then the root renamed to ca-cert.pem, each step atomic and synced. A process
// killed in between leaves either no key (the next start generates afresh) or the key with the
// root that matches it, which completeInterruptedPair puts in place.
func persistPair(stateDir string, key crypto.Signer, root *x509.Certificate) error {
	if err := stagePendingRoot(stateDir, root); err != nil {
		return err
	}
	if err := persistKey(stateDir, key); err != nil {
		return err
	}
	return commitPendingRoot(stateDir)
}

func stagePendingRoot(stateDir string, root *x509.Certificate) error {
	return fsutil.WriteFileAtomic(filepath.Join(stateDir, pendingRootFile), pki.EncodeCertificate(root), fsutil.PublicFileMode)
}

func commitPendingRoot(stateDir string) error {
	if err := os.Rename(filepath.Join(stateDir, pendingRootFile), filepath.Join(stateDir, CACertFile)); err != nil {
		return fmt.Errorf("put the self-signed root in place: %w", err)
	}
	return fsutil.SyncDir(stateDir)
}

// completeInterruptedPair finishes a persistPair that was killed after the key was written: a
// ca-key.pem without ca-cert.pem next to a pending root that is self-signed by that very key.
// Anything else is left for readSelfSigned to judge; in particular a key without a matching
// pending root is never paired with a new root.
func completeInterruptedPair(cfg StartupConfig) error {
	dir := cfg.StateDir
	pending, ok, err := fsutil.ReadOptional(filepath.Join(dir, pendingRootFile))
	if err != nil || !ok {
		return err
	}
	_, certOK, err := fsutil.ReadOptional(filepath.Join(dir, CACertFile))
	if err != nil || certOK {
		return err // a complete pair: the pending root is a leftover, replaced at the next write
	}
	keyPEM, keyOK, err := readStateKey(dir)
	if err != nil || !keyOK {
		return err // killed before the key: nothing of ours to keep
	}
	certs, certErr := pki.ParseCertificates(pending)
	key, keyErr := pki.ParsePrivateKey(keyPEM)
	if certErr != nil || keyErr != nil || !pki.KeyMatchesCertificate(key, certs[0]) || !pki.IsSelfSigned(certs[0]) {
		return nil
	}
	if err := commitPendingRoot(dir); err != nil {
		return err
	}
	cfg.Logger.Warn("completed the self-signed CA whose first write was interrupted: its key had no certificate, the pending root signed by that key is now in place",
		logkey.Path, filepath.Join(dir, CACertFile), logkey.NotAfter, certs[0].NotAfter)
	return nil
}

// GenerateSelfSignedRoot generates a root key and its self-signed certificate, valid from now
// for cfg.TTL, and persists nothing.
func GenerateSelfSignedRoot(cfg SelfSignedConfig, now time.Time) (*x509.Certificate, crypto.Signer, error) {
	key, err := pki.GenerateKey(cfg.KeyAlgorithm, cfg.RSAKeySize)
	if err != nil {
		return nil, nil, err
	}
	root, err := NewRootCertificate(key, cfg.Org, cfg.TTL, now)
	if err != nil {
		return nil, nil, err
	}
	return root, key, nil
}

// CreateSelfSigned generates a root key and certificate and persists them in stateDir as one
// unit (see persistPair); stateDir is made private when missing, and refused when it is not ours
// alone (fsutil.EnsureOwnedDir).
func CreateSelfSigned(stateDir string, cfg SelfSignedConfig, now time.Time) (*Bundle, error) {
	root, key, err := GenerateSelfSignedRoot(cfg, now)
	if err != nil {
		return nil, err
	}
	if err := fsutil.EnsureOwnedDir(stateDir, fsutil.PrivateDirMode); err != nil {
		return nil, err
	}
	if err := persistPair(stateDir, key, root); err != nil {
		return nil, err
	}
	return NewBundle(BundleParams{SigningCert: root, SigningKey: key, Source: SourceSelfSigned, Now: now})
}

// Origin says which step of the start-up order produced the key material.
type Origin string

// Start-up origins.
const (
	OriginPluggedIn Origin = "plugged-in cacerts"
	OriginPersisted Origin = "persisted self-signed CA"
	OriginGenerated Origin = "new self-signed CA"
	// The key material of the cacerts Secret (seed 001): found there, copied there from
	// istio-ca-secret, or generated and stored there by this replica.
	OriginCACertsSecret   Origin = "cacerts secret"
	OriginIstioCASecret   Origin = "cacerts secret created from istio-ca-secret"
	OriginGeneratedSecret Origin = "new self-signed CA in the cacerts secret"
)

// StartupConfig configures LoadOrCreate.
type StartupConfig struct {
	CACertsDir string // optional; must exist (empty is fine), see CheckCACertsDir
	StateDir   string
	SelfSigned SelfSignedConfig
	// TrustBundleOverlap is how long a replaced root stays trusted; 0 keeps it until it expires.
	TrustBundleOverlap time.Duration
	Now                time.Time
	Logger             *slog.Logger
	// OnTempFileRemoved, when set, is told of each temporary file left by an interrupted write
	// that LoadOrCreate removed from StateDir.
	OnTempFileRemoved func(path string)
	// Initial, when set, is the key material, found outside the state dir (the cacerts Secret)
	// with InitialOrigin: the plugged-in and self-signed steps are skipped, the rest is done.
	Initial       *Bundle
	InitialOrigin Origin
}

// lockFile serialises replicas that share a state dir while they create or rotate the root.
const lockFile = ".lock"

// LoadOrCreate finds the CA's key material in Istio's start-up order: a complete plugged-in
// bundle in CACertsDir (a missing CACertsDir is refused before anything is written; an empty one
// holds no bundle), else the self-signed CA persisted in StateDir (renewed with the same key
// if it has expired), else a new self-signed root, persisted there; cfg.Initial, when set, takes
// the place of those steps. Roots that the previous
// root-cert.pem trusted and that are still within their overlap stay trusted, as retained roots
// (see retainPrevious). It then writes the record of replaced roots and the trust bundle to
// StateDir/root-cert.pem for clients. Replicas sharing StateDir take turns. A StateDir that
// another user owns or can write in, or a CA key in it that is not ours alone, is refused
// (fsutil.ErrNotOwned) before anything is read from it or written to it.
func LoadOrCreate(cfg StartupConfig) (*Bundle, Origin, error) {
	if cfg.CACertsDir != "" {
		if err := CheckCACertsDir(cfg.CACertsDir); err != nil {
			return nil, "", err
		}
	}
	if err := fsutil.EnsureOwnedDir(cfg.StateDir, fsutil.PrivateDirMode); err != nil {
		return nil, "", err
	}
	unlock, err := fsutil.Lock(filepath.Join(cfg.StateDir, lockFile))
	if err != nil {
		return nil, "", err
	}
	defer unlock()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	removeTempFiles(cfg)
	b, origin := cfg.Initial, cfg.InitialOrigin
	if b == nil {
		if b, origin, err = loadOrCreate(cfg); err != nil {
			return nil, "", err
		}
	}
	previous, err := readTrustBundle(cfg.StateDir)
	if err != nil {
		return nil, "", err
	}
	b = retainPrevious(cfg, b, previous)
	if err := writeRetiredRecord(cfg.StateDir, b); err != nil {
		return nil, "", err
	}
	if err := WriteTrustBundle(cfg.StateDir, b); err != nil {
		return nil, "", err
	}
	return b, origin, nil
}

// removeTempFiles removes what a CA killed in the middle of an atomic write (during its first
// start, say) left in the state dir: a copy of a key, possibly. Replicas create and rotate the
// root under the lock the caller holds, so none of those writes is in flight; a replica's
// root-cert.pem rewrite after a plugged-in reload is not under it, and would fail (and be logged
// there) in the rare case that it overlaps this sweep.
func removeTempFiles(cfg StartupConfig) {
	removed, err := fsutil.RemoveTempFiles(cfg.StateDir)
	for _, path := range removed {
		cfg.Logger.Warn("removed a temporary file left by an interrupted write", logkey.Path, path)
		if cfg.OnTempFileRemoved != nil {
			cfg.OnTempFileRemoved(path)
		}
	}
	if err != nil {
		// Not fatal: the state files are read by name, and a leftover is as private as the file
		// it was written for.
		cfg.Logger.Warn("cannot remove the temporary files left by an interrupted write", logkey.Error, err.Error())
	}
}

func loadOrCreate(cfg StartupConfig) (*Bundle, Origin, error) {
	log := cfg.Logger
	if cfg.CACertsDir != "" {
		b, err := LoadPluggedIn(cfg.CACertsDir, cfg.Now)
		if err == nil {
			return b, OriginPluggedIn, nil
		}
		if !errors.Is(err, ErrNoPluggedInCA) {
			return nil, "", err
		}
		log.Info("no plugged-in CA, using the self-signed CA", logkey.CACertsDir, cfg.CACertsDir)
	}
	if err := completeInterruptedPair(cfg); err != nil {
		return nil, "", err
	}
	cert, key, err := readSelfSigned(cfg.StateDir)
	if err != nil {
		return nil, "", err
	}
	if cert == nil {
		b, err := CreateSelfSigned(cfg.StateDir, cfg.SelfSigned, cfg.Now)
		if err != nil {
			return nil, "", err
		}
		return b, OriginGenerated, nil
	}
	if !cfg.Now.Before(cert.NotAfter) && pki.KeyMatchesCertificate(key, cert) {
		// A CA that was down past its root's expiry renews it as the rotator would have.
		renewed, err := RenewRoot(cert, key, cfg.SelfSigned.TTL, cfg.Now)
		if err != nil {
			return nil, "", err
		}
		if err := persistRoot(cfg.StateDir, renewed); err != nil {
			return nil, "", err
		}
		log.Warn("the persisted self-signed root had expired; renewed it with the same key",
			logkey.Expired, cert.NotAfter, logkey.NotAfter, renewed.NotAfter)
		cert = renewed
	}
	b, err := NewBundle(BundleParams{SigningCert: cert, SigningKey: key, Source: SourceSelfSigned, Now: cfg.Now})
	if err != nil {
		return nil, "", fmt.Errorf("self-signed CA in %s: %w", cfg.StateDir, err)
	}
	return b, OriginPersisted, nil
}

// readTrustBundle returns the certificates of StateDir/root-cert.pem; a missing or unreadable
// bundle is empty (it is rewritten from the key material anyway).
func readTrustBundle(stateDir string) ([]*x509.Certificate, error) {
	data, ok, err := fsutil.ReadOptional(filepath.Join(stateDir, RootCertFile))
	if err != nil || !ok {
		return nil, err
	}
	certs, err := pki.ParseCertificates(data)
	if err != nil {
		return nil, nil //nolint:nilerr // a damaged trust bundle is replaced, not fatal
	}
	return certs, nil
}

func stillValidRoots(certs []*x509.Certificate, now time.Time) []*x509.Certificate {
	var out []*x509.Certificate
	for _, c := range certs {
		if c.IsCA && now.Before(c.NotAfter) {
			out = append(out, c)
		}
	}
	return out
}

// WriteTrustBundle atomically writes every trusted root of b to stateDir/root-cert.pem.
// The file is left alone when it already holds them, so that a restart neither syncs the disk
// nor wakes the clients watching it.
func WriteTrustBundle(stateDir string, b *Bundle) error {
	if err := fsutil.EnsureDir(stateDir, fsutil.PrivateDirMode); err != nil {
		return err
	}
	path, roots := filepath.Join(stateDir, RootCertFile), b.RootsPEM()
	if current, ok, err := fsutil.ReadOptional(path); err == nil && ok && bytes.Equal(current, roots) {
		return nil
	}
	return fsutil.WriteFileAtomic(path, roots, fsutil.PublicFileMode)
}
