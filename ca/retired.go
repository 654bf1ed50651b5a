package ca

import (
	"bytes"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/logkey"
)

// RetiredRootsFile, in the state dir, records when each root the CA keeps trusting after a
// rotation was replaced, so that --trust-bundle-overlap counts from the replacement and not from
// the last start. It describes the roots of root-cert.pem and is written (atomically) before it,
// each time they change. It holds fingerprints and times only. The format, one line per root:
//
//	meshid retired roots v1
//	<hex SHA-256 of the root's DER> anchor
//	<hex SHA-256 of the root's DER> retired <RFC 3339 time>
//	<hex SHA-256 of the root's DER> retired unknown
//
// "anchor" is a root of the key material in service; "retired" one kept after it was replaced,
// with when ("unknown" when a start found it in root-cert.pem without a record of it).
const RetiredRootsFile = "retired-roots"

const retiredRootsHeader = "meshid retired roots v1"

// retiredRecord is RetiredRootsFile parsed.
type retiredRecord struct {
	anchors map[[32]byte]bool
	retired map[[32]byte]time.Time // zero: not known
}

// retiredAt returns when the record says the root with fingerprint fp was replaced (zero: not
// known). A nil record knows nothing.
func (r *retiredRecord) retiredAt(fp [32]byte) (time.Time, bool) {
	if r == nil {
		return time.Time{}, false
	}
	at, ok := r.retired[fp]
	return at, ok
}

// readRetiredRecord reads the state dir's record; (nil, nil) when there is none.
func readRetiredRecord(stateDir string) (*retiredRecord, error) {
	data, ok, err := fsutil.ReadOptional(filepath.Join(stateDir, RetiredRootsFile))
	if err != nil || !ok {
		return nil, err
	}
	return parseRetiredRecord(data)
}

func parseRetiredRecord(data []byte) (*retiredRecord, error) {
	lines := strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
	if lines[0] != retiredRootsHeader {
		return nil, fmt.Errorf("%s: first line is not %q", RetiredRootsFile, retiredRootsHeader)
	}
	rec := &retiredRecord{anchors: map[[32]byte]bool{}, retired: map[[32]byte]time.Time{}}
	for i, line := range lines[1:] {
		fp, at, err := parseRetiredLine(line)
		if err != nil {
			return nil, fmt.Errorf("%s line %d: %w", RetiredRootsFile, i+2, err)
		}
		if at == nil {
			rec.anchors[fp] = true
		} else {
			rec.retired[fp] = *at
		}
	}
	return rec, nil
}

// parseRetiredLine returns a line's fingerprint and, for a retired root, when (zero: unknown).
func parseRetiredLine(line string) ([32]byte, *time.Time, error) {
	var fp [32]byte
	fields := strings.Split(line, " ")
	if n, err := hex.Decode(fp[:], []byte(fields[0])); err != nil || n != len(fp) || len(fields[0]) != 2*len(fp) {
		return fp, nil, errors.New("not a hex SHA-256 fingerprint")
	}
	switch {
	case len(fields) == 2 && fields[1] == "anchor":
		return fp, nil, nil
	case len(fields) == 3 && fields[1] == "retired" && fields[2] == "unknown":
		return fp, &time.Time{}, nil
	case len(fields) == 3 && fields[1] == "retired":
		at, err := time.Parse(time.RFC3339Nano, fields[2])
		if err != nil {
			return fp, nil, fmt.Errorf("retirement time: %w", err)
		}
		return fp, &at, nil
	}
	return fp, nil, errors.New(`want "<fingerprint> anchor" or "<fingerprint> retired <time|unknown>"`)
}

// formatRetiredRecord describes b's roots in the format of RetiredRootsFile.
func formatRetiredRecord(b *Bundle) []byte {
	var buf bytes.Buffer
	buf.WriteString(retiredRootsHeader + "\n")
	for _, r := range b.anchors {
		fmt.Fprintf(&buf, "%x anchor\n", fingerprint(r.Raw))
	}
	for _, r := range b.retained {
		at := "unknown"
		if ri := b.retired[fingerprint(r.Raw)]; !ri.at.IsZero() {
			at = ri.at.UTC().Format(time.RFC3339Nano)
		}
		fmt.Fprintf(&buf, "%x retired %s\n", fingerprint(r.Raw), at)
	}
	return buf.Bytes()
}

// writeRetiredRecord atomically writes the record of b's roots, unless the file already holds it.
// Written before root-cert.pem: a crash between the two leaves a record that says more, never a
// root-cert.pem with a root the record does not know (which a start would have to guess about).
func writeRetiredRecord(stateDir string, b *Bundle) error {
	path, data := filepath.Join(stateDir, RetiredRootsFile), formatRetiredRecord(b)
	if current, ok, err := fsutil.ReadOptional(path); err == nil && ok && bytes.Equal(current, data) {
		return nil
	}
	return fsutil.WriteFileAtomic(path, data, fsutil.PublicFileMode)
}

// retainPrevious returns b also trusting the roots of the previous trust bundle that it does not
// anchor and that are still trusted: each replaced when the record says, or now if the record
// says it anchored the CA until this start. One the record does not know (no record: a state dir
// of an older meshid, or a removed or damaged file) is replaced at an unknown time, which under
// an overlap ends its trust at once (see newRetirement).
func retainPrevious(cfg StartupConfig, b *Bundle, previous []*x509.Certificate) *Bundle {
	var candidates []*x509.Certificate
	for _, c := range stillValidRoots(previous, cfg.Now) {
		if !containsCert(b.anchors, c) {
			candidates = append(candidates, c)
		}
	}
	if len(candidates) == 0 {
		return b
	}
	log, path := cfg.Logger, filepath.Join(cfg.StateDir, RetiredRootsFile)
	rec, err := readRetiredRecord(cfg.StateDir)
	switch {
	case err != nil:
		log.Warn("the record of replaced roots is unreadable: when they were replaced is unknown", logkey.Path, path, logkey.Error, err.Error())
	case rec == nil:
		log.Warn("no record of when the replaced roots in the trust bundle were replaced (a state dir of an older meshid, or the file was removed)", logkey.Path, path)
	}
	var kept []*x509.Certificate
	retired := map[[32]byte]retirement{}
	for _, r := range candidates {
		fp := fingerprint(r.Raw)
		var at time.Time
		if rec != nil {
			if t, ok := rec.retired[fp]; ok {
				at = t
			} else if rec.anchors[fp] {
				at = cfg.Now // it anchored the CA until this start
			}
		}
		ri := newRetirement(at, cfg.TrustBundleOverlap, cfg.Now)
		if !ri.until.IsZero() && !cfg.Now.Before(ri.until) {
			if at.IsZero() {
				log.Warn("a replaced root left the trust bundle: when it was replaced is not known, and counting --trust-bundle-overlap from now could trust it longer than configured",
					logkey.Root, r.Subject.String(), logkey.NotAfter, r.NotAfter)
			} else {
				log.Info("a replaced root left the trust bundle: its overlap ended", logkey.Root, r.Subject.String(), logkey.Replaced, at, logkey.Expires, ri.until)
			}
			continue
		}
		kept = append(kept, r)
		retired[fp] = ri
	}
	return b.withRetained(kept, retired)
}
