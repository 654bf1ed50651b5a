package secretmanager

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/meshid/meshid/internal/fsutil"
)

// Names of the files in OUTPUT_CERTS, as Istio's agent writes them.
const (
	CertChainFile = "cert-chain.pem"
	KeyFile       = "key.pem"
	RootCertFile  = "root-cert.pem"
)

const (
	dataLink      = "..data"    // the symlink readers go through; swapped atomically
	versionPrefix = "..meshid_" // one directory per written generation
)

// writeOutput publishes a key pair and trust bundle in dir so that a reader always sees a
// matching pair, whatever moment the writer is killed at. As the kubelet does for mounted
// secrets, each generation goes into a fresh directory (key.pem first, mode 0600, then
// cert-chain.pem and root-cert.pem, each written atomically and synced); then the "..data"
// symlink is renamed onto it in one step, and the visible names are symlinks through "..data".
func writeOutput(dir string, keyPEM, chainPEM, rootsPEM []byte) error {
	if err := fsutil.EnsureDir(dir, fsutil.PrivateDirMode); err != nil {
		return err
	}
	version, err := os.MkdirTemp(dir, versionPrefix) // 0700
	if err != nil {
		return fmt.Errorf("create a new output generation in %s: %w", dir, err)
	}
	files := []struct {
		name string
		data []byte
		mode os.FileMode
	}{
		{KeyFile, keyPEM, fsutil.PrivateFileMode},
		{CertChainFile, chainPEM, fsutil.PublicFileMode},
		{RootCertFile, rootsPEM, fsutil.PublicFileMode},
	}
	for _, f := range files {
		if err := fsutil.WriteFileAtomic(filepath.Join(version, f.name), f.data, f.mode); err != nil {
			_ = os.RemoveAll(version)
			return err
		}
	}
	if err := replaceSymlink(dir, dataLink, filepath.Base(version)); err != nil {
		_ = os.RemoveAll(version)
		return err
	}
	for _, f := range files {
		target := filepath.Join(dataLink, f.name)
		if current, err := os.Readlink(filepath.Join(dir, f.name)); err == nil && current == target {
			continue
		}
		if err := replaceSymlink(dir, f.name, target); err != nil {
			return err
		}
	}
	if err := fsutil.SyncDir(dir); err != nil {
		return err
	}
	return removeOldGenerations(dir, filepath.Base(version))
}

// replaceSymlink points dir/name at target in one rename, whatever dir/name was before.
func replaceSymlink(dir, name, target string) error {
	tmp := filepath.Join(dir, name+".tmp")
	_ = os.Remove(tmp)
	if err := os.Symlink(target, tmp); err != nil {
		return fmt.Errorf("link %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("link %s: %w", filepath.Join(dir, name), err)
	}
	return nil
}

func removeOldGenerations(dir, keep string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("list %s: %w", dir, err)
	}
	var errs []error
	for _, e := range entries {
		if e.IsDir() && strings.HasPrefix(e.Name(), versionPrefix) && e.Name() != keep {
			errs = append(errs, os.RemoveAll(filepath.Join(dir, e.Name())))
		}
	}
	return errors.Join(errs...)
}
