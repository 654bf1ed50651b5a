package fsutil

// The "..data" layout: a set of files published the way the kubelet publishes a mounted secret,
// each generation in a fresh directory, then one atomic swap of a "..data" symlink, with the
// visible names symlinks through it. A reader therefore always sees one whole generation.

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
)

// DataLink is the symlink readers go through; it is swapped atomically.
const DataLink = "..data"

// DataFile is one file of a generation.
type DataFile struct {
	Name string
	Data []byte
	Mode os.FileMode
}

// DataOnDisk reports whether dir already shows exactly these files with these modes, so that they
// need not be written again.
func DataOnDisk(dir string, files []DataFile) bool {
	for _, f := range files {
		path := filepath.Join(dir, f.Name)
		info, err := os.Stat(path)
		if err != nil || info.Mode().Perm() != f.Mode {
			return false
		}
		data, err := os.ReadFile(path)
		if err != nil || !bytes.Equal(data, f.Data) {
			return false
		}
	}
	return true
}

// WriteData publishes files in dir so that a reader always sees one whole generation, whatever
// moment the writer is killed at. Each generation goes into a fresh directory named with prefix,
// which no reader looks into until it is whole and synced; then DataLink is renamed onto it in
// one step, and the visible names are symlinks through DataLink. Older generations with prefix
// are removed. The files are synced together: on most filesystems their syncs share one journal
// commit, where one file after the other would wait for a commit each.
func WriteData(dir, prefix string, dirMode os.FileMode, files []DataFile) error {
	return Syncer(nil).WriteData(dir, prefix, dirMode, files)
}

// WriteData is the package's WriteData, each file and directory flushed with s.
func (s Syncer) WriteData(dir, prefix string, dirMode os.FileMode, files []DataFile) error {
	if err := EnsureDir(dir, dirMode); err != nil {
		return err
	}
	// An existing directory is opened to the group when asked; otherwise it is left as it is.
	if dirMode != PrivateDirMode {
		if err := os.Chmod(dir, dirMode); err != nil {
			return fmt.Errorf("set the mode of %s: %w", dir, err)
		}
	}
	version, err := os.MkdirTemp(dir, prefix) // 0700
	if err != nil {
		return fmt.Errorf("create a new generation in %s: %w", dir, err)
	}
	if err := os.Chmod(version, dirMode); err != nil {
		_ = os.RemoveAll(version)
		return fmt.Errorf("set the mode of %s: %w", version, err)
	}
	if err := s.writeGeneration(version, files); err != nil {
		_ = os.RemoveAll(version)
		return err
	}
	if err := replaceSymlink(dir, DataLink, filepath.Base(version)); err != nil {
		_ = os.RemoveAll(version)
		return err
	}
	for _, f := range files {
		target := filepath.Join(DataLink, f.Name)
		if current, err := os.Readlink(filepath.Join(dir, f.Name)); err == nil && current == target {
			continue
		}
		if err := replaceSymlink(dir, f.Name, target); err != nil {
			return err
		}
	}
	if err := s.SyncDir(dir); err != nil {
		return err
	}
	return removeGenerations(dir, prefix, filepath.Base(version))
}

// writeGeneration writes files into the private directory version, syncs them at once, then
// syncs version, so that its entries are durable before DataLink points at them.
func (s Syncer) writeGeneration(version string, files []DataFile) error {
	errs := make([]error, len(files))
	var wg sync.WaitGroup
	for i, f := range files {
		wg.Go(func() { errs[i] = s.writeSynced(filepath.Join(version, f.Name), f.Data, f.Mode) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	return s.SyncDir(version)
}

// writeSynced creates path with mode (whatever the umask) and data, and syncs it.
func (s Syncer) writeSynced(path string, data []byte, mode os.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, PrivateFileMode)
	if err != nil {
		return fmt.Errorf("create %s: %w", path, err)
	}
	// Chmod before any byte is written: a key file is never readable beyond its final mode.
	err = f.Chmod(mode)
	if err == nil {
		_, err = f.Write(data)
	}
	if err == nil {
		err = s.sync(f)
	}
	if closeErr := f.Close(); err == nil {
		err = closeErr
	}
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
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

// StaleGenerations lists the generation directories with prefix in dir that DataLink does not
// point at: what a writer killed mid-way left behind. A missing dir has none.
func StaleGenerations(dir, prefix string) []string {
	current, err := os.Readlink(filepath.Join(dir, DataLink))
	if err != nil {
		current = ""
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var stale []string
	for _, e := range entries {
		if e.IsDir() && strings.HasPrefix(e.Name(), prefix) && e.Name() != current {
			stale = append(stale, filepath.Join(dir, e.Name()))
		}
	}
	return stale
}

// removeGenerations removes every generation with prefix but keep.
func removeGenerations(dir, prefix, keep string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("list %s: %w", dir, err)
	}
	var errs []error
	for _, e := range entries {
		if e.IsDir() && strings.HasPrefix(e.Name(), prefix) && e.Name() != keep {
			errs = append(errs, os.RemoveAll(filepath.Join(dir, e.Name())))
		}
	}
	return errors.Join(errs...)
}
