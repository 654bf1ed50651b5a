package secretmanager

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// FuzzParseFileResource feeds arbitrary resource names, as a client sends them, to the parsing of
// file resources and reads what it accepts. In a name, $A stands for the allowed dir and $O for a
// dir outside it, which hold files, links leading in and out, a FIFO and a link loop. Nothing may
// panic, every path accepted must be inside the allowed dir as written and once resolved, and no
// read may return a byte of a file outside.
func FuzzParseFileResource(f *testing.F) {
	base := f.TempDir()
	allowed, outside := filepath.Join(base, "allowed"), filepath.Join(base, "outside")
	const outsideMark = "OUTSIDE THE ALLOWED DIR"
	for _, d := range []string{allowed, filepath.Join(allowed, "sub"), outside} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			f.Fatal(err)
		}
	}
	for path, content := range map[string]string{
		filepath.Join(allowed, "cert.pem"):         "inside",
		filepath.Join(allowed, "key.pem"):          "inside",
		filepath.Join(allowed, "sub", "roots.pem"): "inside",
		filepath.Join(outside, "key.pem"):          outsideMark,
		filepath.Join(outside, "roots.pem"):        outsideMark,
	} {
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			f.Fatal(err)
		}
	}
	for link, target := range map[string]string{
		"link-out":      filepath.Join(outside, "key.pem"),
		"link-out-rel":  "../outside/roots.pem",
		"link-in":       "cert.pem",
		"dir-out":       outside,
		"dir-in":        "sub",
		"dangling-out":  filepath.Join(outside, "nothing.pem"),
		"loop":          "loop",
		"link-to-link":  "link-out",
		"link-to-allow": allowed,
	} {
		if err := os.Symlink(target, filepath.Join(allowed, link)); err != nil {
			f.Fatal(err)
		}
	}
	if err := syscall.Mkfifo(filepath.Join(allowed, "fifo"), 0o600); err != nil {
		f.Fatal(err)
	}
	dirs := []string{allowed}
	resolvedDirs := resolveDirs(dirs)

	for _, seed := range []string{
		"file-cert:$A/cert.pem~$A/key.pem",
		"file-root:$A/sub/roots.pem",
		"file-root:$A/dir-in/roots.pem",
		"file-cert:$A/cert.pem~$A/link-out",
		"file-root:$A/link-out-rel",
		"file-root:$A/dir-out/roots.pem",
		"file-root:$A/link-to-link",
		"file-root:$A/dangling-out",
		"file-root:$A/loop",
		"file-root:$A/fifo",
		"file-root:$A/link-to-allow/cert.pem",
		"file-root:$A/../outside/roots.pem",
		"file-root:$O/roots.pem",
		"file-root:$A",
		"file-root:$A/",
		"file-root:$A/./cert.pem",
		"file-root:$A-evil/x",
		"file-cert:$A/cert.pem~",
		"file-cert:~$A/key.pem",
		"file-cert:$A/cert.pem~$A/key.pem~$A/key.pem",
		"file-root:",
		"default",
		"file-root:relative/path",
		"file-root:$A/sub/../../outside/roots.pem",
		"file-root:$A/\x00",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, name string) {
		name = strings.ReplaceAll(strings.ReplaceAll(name, "$A", allowed), "$O", outside)
		r, err := parseFileResource(name, dirs)
		if err != nil {
			if !errors.Is(err, ErrForbiddenPath) && !errors.Is(err, ErrUnknownSecret) {
				t.Fatalf("%q refused with %v, want ErrForbiddenPath or ErrUnknownSecret", name, err)
			}
			return
		}
		if r.name != name {
			t.Fatalf("%q parsed as %q", name, r.name)
		}
		for _, p := range r.paths() {
			if !filepath.IsAbs(p) || filepath.Clean(p) != p || !inside(p, dirs) {
				t.Fatalf("%q accepted the path %q, not a clean path inside %s", name, p, allowed)
			}
			if resolved, err := filepath.EvalSymlinks(p); err == nil && !inside(resolved, resolvedDirs) {
				t.Fatalf("%q accepted the path %q, which leads to %q", name, p, resolved)
			}
			if data, err := readFile(p, dirs); err == nil && strings.Contains(string(data), outsideMark) {
				t.Fatalf("%q read %q from outside %s", name, p, allowed)
			}
		}
	})
}
