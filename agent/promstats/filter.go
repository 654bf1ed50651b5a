package promstats

import (
	"bytes"
	"errors"
	"fmt"
	"strings"

	dto "github.com/prometheus/client_model/go"
)

// errCut is a page that does not end with a newline: the connection ended within its last line.
var errCut = errors.New("the page does not end with a newline: it was cut short")

// Suffixes of the samples of histograms and summaries in Prometheus' text format, and of
// counters in OpenMetrics.
const (
	suffixBucket = "_bucket"
	suffixSum    = "_sum"
	suffixCount  = "_count"
	suffixTotal  = "_total"
)

// sampleNames appends to dst the names a family's samples have in the text format: its name, or
// for a histogram its _bucket, _sum and _count, as expfmt's parser reads them back.
func sampleNames(dst []string, name string, typ dto.MetricType) []string {
	dst = append(dst, name)
	switch typ {
	case dto.MetricType_HISTOGRAM, dto.MetricType_GAUGE_HISTOGRAM:
		dst = append(dst, name+suffixBucket, name+suffixSum, name+suffixCount)
	case dto.MetricType_SUMMARY:
		dst = append(dst, name+suffixSum, name+suffixCount)
	default:
	}
	return dst
}

// claims appends to dst the names no later family may use: the family's sample names and, for
// a counter, its name with _total taken off or added, which OpenMetrics reads as the same family.
func claims(dst []string, name string, typ dto.MetricType) []string {
	dst = sampleNames(dst, name, typ)
	if typ == dto.MetricType_COUNTER {
		if base, ok := strings.CutSuffix(name, suffixTotal); ok {
			dst = append(dst, base)
		} else {
			dst = append(dst, name+suffixTotal)
		}
	}
	return dst
}

// claimed reports whether one of a family's claims is in taken; scratch is reused.
func claimed(taken map[string]struct{}, scratch []string, name string, typ dto.MetricType) ([]string, bool) {
	scratch = claims(scratch[:0], name, typ)
	for _, c := range scratch {
		if _, ok := taken[c]; ok {
			return scratch, true
		}
	}
	return scratch, false
}

// span is a range of a page's bytes written through.
type span struct{ from, to int }

// filtered is what of a trusted page the merged page writes.
type filtered struct {
	spans     []span
	conflicts int      // families left out because a claim of theirs was taken
	claims    []string // the claims of the families kept
}

// pageFamily is the family a filter is in: the one whose HELP, TYPE or sample line came last.
type pageFamily struct {
	name []byte
	typ  dto.MetricType
	drop bool
}

// belongs reports whether a sample named name is one of f's, as expfmt's parser assigns it.
func (f *pageFamily) belongs(name []byte) bool {
	if f.name == nil || !bytes.HasPrefix(name, f.name) {
		return false
	}
	switch suffix := string(name[len(f.name):]); f.typ {
	case dto.MetricType_HISTOGRAM, dto.MetricType_GAUGE_HISTOGRAM:
		return suffix == "" || suffix == suffixBucket || suffix == suffixSum || suffix == suffixCount
	case dto.MetricType_SUMMARY:
		return suffix == "" || suffix == suffixSum || suffix == suffixCount
	default:
		return suffix == ""
	}
}

// filterPage returns the spans of page, a text-format page as a trusted source writes it, that
// keep every family none of whose claims is in taken: the page is not parsed, its lines are
// only read as far as their HELP and TYPE names and their sample names. The page must end with
// a newline (an empty page is none) and its names must be Prometheus' legacy names, or it is
// refused whole.
func filterPage(page []byte, taken map[string]struct{}) (filtered, error) {
	var out filtered
	if len(page) > 0 && page[len(page)-1] != '\n' {
		return out, errCut
	}
	var (
		cur     pageFamily
		header  = -1                // where cur's HELP and TYPE lines began while no sample has followed them
		members = map[string]bool{} // each sample name of the page's families: whether its family is left out
		scratch []string
	)
	keep := func(from, to int) {
		if n := len(out.spans); n > 0 && out.spans[n-1].to == from {
			out.spans[n-1].to = to
			return
		}
		out.spans = append(out.spans, span{from, to})
	}
	// decide settles cur, whose lines from from to to have been held back.
	decide := func(from, to int) {
		header = -1
		name := string(cur.name)
		if drop, seen := members[name]; seen {
			// More of a family met before (expfmt's parser merges it into that family).
			cur.drop = drop
		} else {
			var drop bool
			scratch, drop = claimed(taken, scratch, name, cur.typ)
			cur.drop = drop
			if drop {
				out.conflicts++
			} else {
				out.claims = append(out.claims, scratch...)
			}
			for _, n := range sampleNames(scratch[:0], name, cur.typ) {
				members[n] = drop
			}
		}
		if !cur.drop && from < to {
			keep(from, to)
		}
	}
	for start, lineNo := 0, 1; start < len(page); lineNo++ {
		end := start + bytes.IndexByte(page[start:], '\n') + 1 // the page ends with a newline
		line := bytes.TrimLeft(page[start:end-1], " \t")
		keyword, name, rest, err := readLine(line)
		if err != nil {
			return filtered{}, fmt.Errorf("line %d: %w", lineNo, err)
		}
		switch {
		case keyword != "":
			// A family's HELP and TYPE lines come in either order, before its samples.
			if header < 0 || !bytes.Equal(name, cur.name) {
				if header >= 0 {
					decide(header, start)
				}
				cur, header = pageFamily{name: name, typ: dto.MetricType_UNTYPED}, start
			}
			if keyword == "TYPE" {
				typ, err := metricType(rest)
				if err != nil {
					return filtered{}, fmt.Errorf("line %d: %w", lineNo, err)
				}
				cur.typ = typ
			}
		case name != nil:
			if !cur.belongs(name) {
				if header >= 0 {
					decide(header, start) // a header with no samples
				}
				cur, header = pageFamily{name: name, typ: dto.MetricType_UNTYPED}, start
			}
			if header >= 0 {
				decide(header, start)
			}
			if !cur.drop {
				keep(start, end)
			}
		case header >= 0:
			// A blank line or a comment within a family's header lines: held back with them.
		case cur.name == nil || !cur.drop:
			keep(start, end)
		}
		start = end
	}
	if header >= 0 {
		decide(header, len(page))
	}
	return out, nil
}

// readLine reads a line (without its newline and leading blanks): a HELP or TYPE line gives its
// keyword, name and what follows; a sample line its name; a blank line or another comment
// nothing.
func readLine(line []byte) (keyword string, name, rest []byte, err error) {
	if len(line) == 0 {
		return "", nil, nil, nil
	}
	if line[0] == '#' {
		fields := bytes.TrimLeft(line[1:], " \t")
		i := bytes.IndexAny(fields, " \t")
		if i < 0 {
			return "", nil, nil, nil // a keyword alone is no HELP or TYPE line for expfmt either
		}
		kw, after := fields[:i], fields[i:]
		switch string(kw) {
		case "HELP", "TYPE":
			keyword = string(kw)
		default:
			return "", nil, nil, nil
		}
		after = bytes.TrimLeft(after, " \t")
		n := nameLen(after)
		if n == 0 || (n < len(after) && after[n] != ' ' && after[n] != '\t') {
			return "", nil, nil, fmt.Errorf("invalid metric name in %s line", keyword)
		}
		return keyword, after[:n], bytes.Trim(after[n:], " \t"), nil
	}
	n := nameLen(line)
	if n == 0 || n == len(line) || (line[n] != '{' && line[n] != ' ' && line[n] != '\t') {
		return "", nil, nil, errors.New("invalid metric name, or no value")
	}
	return "", line[:n], nil, nil
}

// nameLen returns the length of the legacy metric name b starts with.
func nameLen(b []byte) int {
	for i, c := range b {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c == '_', c == ':':
		case c >= '0' && c <= '9' && i > 0:
		default:
			return i
		}
	}
	return len(b)
}

// metricType reads a TYPE line's type as expfmt's parser does: any case, gaugehistogram too.
func metricType(b []byte) (dto.MetricType, error) {
	if len(b) == 0 {
		return dto.MetricType_UNTYPED, nil // expfmt leaves the family untyped then
	}
	for _, t := range []struct {
		name string
		typ  dto.MetricType
	}{
		{"counter", dto.MetricType_COUNTER},
		{"gauge", dto.MetricType_GAUGE},
		{"histogram", dto.MetricType_HISTOGRAM},
		{"summary", dto.MetricType_SUMMARY},
		{"untyped", dto.MetricType_UNTYPED},
		{"gauge_histogram", dto.MetricType_GAUGE_HISTOGRAM},
		{"gaugehistogram", dto.MetricType_GAUGE_HISTOGRAM},
	} {
		if bytes.EqualFold(b, []byte(t.name)) {
			return t.typ, nil
		}
	}
	return 0, fmt.Errorf("unknown metric type %q", b)
}
