package testutil

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// SecretVolume lays files out as the kubelet's atomic writer mounts a secret or config map: each
// generation in its own "..<timestamp>" directory, "..data" a symlink to the current one, swapped
// by renaming a new link onto it, and every visible name a symlink through "..data".
type SecretVolume struct {
	t   testing.TB
	Dir string
	n   int
	cur string // the generation ..data points to
}

// NewSecretVolume makes dir (if missing) a volume; it holds nothing until the first Update.
func NewSecretVolume(t testing.TB, dir string) *SecretVolume {
	t.Helper()
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	return &SecretVolume{t: t, Dir: dir}
}

// Update is the kubelet's whole update: Stage, then Swap. It returns the new generation.
func (v *SecretVolume) Update(files map[string][]byte) string {
	v.t.Helper()
	gen := v.Stage(files)
	v.Swap(gen)
	return gen
}

// Stage writes a new generation, not yet visible, and returns its directory's name.
func (v *SecretVolume) Stage(files map[string][]byte) string {
	v.t.Helper()
	v.n++
	gen := fmt.Sprintf("..2026_01_01_00_00_00.%09d", v.n)
	WriteFiles(v.t, filepath.Join(v.Dir, gen), files)
	return gen
}

// Swap points ..data at gen, links every visible name of gen through ..data, and removes the
// previous generation.
func (v *SecretVolume) Swap(gen string) {
	v.t.Helper()
	v.Link("..data", gen)
	entries, err := os.ReadDir(filepath.Join(v.Dir, gen))
	if err != nil {
		v.t.Fatal(err)
	}
	for _, e := range entries {
		want := filepath.Join("..data", e.Name())
		if got, err := os.Readlink(filepath.Join(v.Dir, e.Name())); err != nil || got != want {
			v.Link(e.Name(), want)
		}
	}
	if v.cur != "" && v.cur != gen {
		if err := os.RemoveAll(filepath.Join(v.Dir, v.cur)); err != nil {
			v.t.Fatal(err)
		}
	}
	v.cur = gen
}

// Link makes Dir/name a symlink to target in one step: a new link renamed onto the old name.
func (v *SecretVolume) Link(name, target string) {
	v.t.Helper()
	tmp := filepath.Join(v.Dir, name+"_tmp")
	_ = os.Remove(tmp)
	if err := os.Symlink(target, tmp); err != nil {
		v.t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(v.Dir, name)); err != nil {
		v.t.Fatal(err)
	}
}

// Path returns the visible path of name.
func (v *SecretVolume) Path(name string) string { return filepath.Join(v.Dir, name) }
