package main

import (
	"fmt"
	"io"
	"regexp"
	"sort"
	"strings"
	"sync"
)

// stats is the stand-in's store of Envoy's counters and gauges, under Envoy's own names
// (https://www.envoyproxy.io/docs/envoy/latest/configuration/observability/statistics).
type stats struct {
	mu    sync.Mutex
	byKey map[string]*stat
}

type stat struct {
	gauge bool
	value int64
	used  bool
}

func newStats() *stats { return &stats{byKey: map[string]*stat{}} }

func (s *stats) get(name string, gauge bool) *stat {
	st, ok := s.byKey[name]
	if !ok {
		st = &stat{gauge: gauge}
		s.byKey[name] = st
	}
	return st
}

// declare makes stats exist at zero, as Envoy's do once their scope exists.
func (s *stats) declare(gauge bool, names ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, n := range names {
		s.get(n, gauge)
	}
}

func (s *stats) inc(name string) { s.add(name, false, 1) }

func (s *stats) gaugeAdd(name string, d int64) { s.add(name, true, d) }

func (s *stats) add(name string, gauge bool, d int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.get(name, gauge)
	st.value += d
	st.used = true
}

func (s *stats) set(name string, v int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.get(name, true)
	st.value = v
	st.used = true
}

type statValue struct {
	name  string
	gauge bool
	value int64
}

// snapshot lists the stats whose name matches filter (nil: all), only those ever written when
// usedOnly, sorted by name.
func (s *stats) snapshot(filter *regexp.Regexp, usedOnly bool) []statValue {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]statValue, 0, len(s.byKey))
	for name, st := range s.byKey {
		if (filter != nil && !filter.MatchString(name)) || (usedOnly && !st.used) {
			continue
		}
		out = append(out, statValue{name: name, gauge: st.gauge, value: st.value})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out
}

// writeText writes the admin's /stats: one "name: value" line per stat.
func writeText(w io.Writer, vals []statValue) {
	for _, v := range vals {
		_, _ = fmt.Fprintf(w, "%s: %d\n", v.name, v.value)
	}
}

// tagRule is one of Envoy's default tag extractors: a stat name prefix whose next segment becomes
// a label (source/common/config/well_known_names.cc).
type tagRule struct {
	prefix, label string
	// segment matches the tag's value; listener addresses hold dots.
	segment *regexp.Regexp
}

func tagRules() []tagRule {
	return []tagRule{
		{prefix: "listener.", label: "envoy_listener_address", segment: regexp.MustCompile(`^((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.`)},
		{prefix: "http.", label: "envoy_http_conn_manager_prefix", segment: regexp.MustCompile(`^([^.]*)\.`)},
		{prefix: "sds.", label: "envoy_sds_secret_name", segment: regexp.MustCompile(`^(.*)\.update_[a-z]+$`)},
	}
}

type promSample struct {
	labels string
	value  int64
}

type promFamily struct {
	gauge   bool
	samples []promSample
}

// writePrometheus writes the admin's /stats/prometheus as Envoy does: "envoy_" and the stat
// name with its tags taken out as labels and the rest made a legal metric name, a # TYPE line
// per family, counters before gauges, and "{}" for a sample with no labels.
func writePrometheus(w io.Writer, vals []statValue) {
	rules := tagRules()
	families := map[string]*promFamily{}
	for _, v := range vals {
		name, labels := extractTags(rules, v.name)
		metric := "envoy_" + sanitize(name)
		f, ok := families[metric]
		if !ok {
			f = &promFamily{gauge: v.gauge}
			families[metric] = f
		}
		f.samples = append(f.samples, promSample{labels: labels, value: v.value})
	}
	names := make([]string, 0, len(families))
	for n := range families {
		names = append(names, n)
	}
	sort.Slice(names, func(i, j int) bool {
		fi, fj := families[names[i]], families[names[j]]
		if fi.gauge != fj.gauge {
			return !fi.gauge
		}
		return names[i] < names[j]
	})
	for _, n := range names {
		f := families[n]
		typ := "counter"
		if f.gauge {
			typ = "gauge"
		}
		_, _ = fmt.Fprintf(w, "# TYPE %s %s\n", n, typ)
		for _, s := range f.samples {
			_, _ = fmt.Fprintf(w, "%s{%s} %d\n", n, s.labels, s.value)
		}
	}
}

func extractTags(rules []tagRule, name string) (string, string) {
	for _, r := range rules {
		rest, ok := strings.CutPrefix(name, r.prefix)
		if !ok {
			continue
		}
		m := r.segment.FindStringSubmatchIndex(rest)
		if m == nil || m[3] <= m[2] {
			continue
		}
		value := rest[m[2]:m[3]]
		stripped := r.prefix + strings.TrimPrefix(rest[m[3]:], ".")
		return stripped, fmt.Sprintf(`%s="%s"`, r.label, escapeLabel(value))
	}
	return name, ""
}

func sanitize(name string) string {
	var b strings.Builder
	for _, c := range name {
		if (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == ':' {
			b.WriteRune(c)
		} else {
			b.WriteByte('_')
		}
	}
	return b.String()
}

func escapeLabel(v string) string {
	return strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`).Replace(v)
}
