package promstats

import (
	"slices"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// agentPage is what the agent wrote before a trusted page in these tests.
const agentPage = `# TYPE a_total counter
a_total 1
# TYPE h histogram
h_bucket{le="+Inf"} 1
h_sum 1
h_count 1
# TYPE s summary
s_sum 1
s_count 1
# TYPE g gauge
g 1
`

// takenBy returns the names page's families claim, as ServeHTTP makes them from the agent's.
func takenBy(t *testing.T, page string) map[string]struct{} {
	t.Helper()
	families, err := parsePage(page)
	if err != nil {
		t.Fatal(err)
	}
	taken := map[string]struct{}{}
	for _, mf := range families {
		for _, c := range claims(nil, mf.GetName(), mf.GetType()) {
			taken[c] = struct{}{}
		}
	}
	return taken
}

func parsePage(page string) (map[string]*dto.MetricFamily, error) {
	p := expfmt.NewTextParser(model.LegacyValidation)
	return p.TextToMetricFamilies(strings.NewReader(page))
}

func written(page string, f filtered) string {
	var b strings.Builder
	for _, sp := range f.spans {
		b.WriteString(page[sp.from:sp.to])
	}
	return b.String()
}

func TestFilterPage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, page, want string
		conflicts        int
		claims           []string // of the families kept
	}{
		{name: "empty", page: "", want: ""},
		{name: "nothing shared", page: "# comment\n# TYPE e counter\ne{x=\"1\"} 1\ne{x=\"2\"} 2\n\n# TYPE f histogram\nf_bucket{le=\"+Inf\"} 1\nf_sum 1\nf_count 1\n",
			want: "# comment\n# TYPE e counter\ne{x=\"1\"} 1\ne{x=\"2\"} 2\n\n# TYPE f histogram\nf_bucket{le=\"+Inf\"} 1\nf_sum 1\nf_count 1\n",
			// A counter's name with _total added: OpenMetrics would read e_total as e's.
			claims: []string{"e", "e_total", "f", "f_bucket", "f_sum", "f_count"}},
		{name: "same name, help and type and a comment left out with it",
			page:      "# HELP g Envoy's g.\n# a comment\n# TYPE g gauge\ng{x=\"1\"} 1\ng{x=\"2\"} 2\n# after g\n# TYPE e gauge\ne 1\n",
			want:      "# TYPE e gauge\ne 1\n",
			conflicts: 1, claims: []string{"e"}},
		{name: "type before help", page: "# TYPE g gauge\n# HELP g Envoy's g.\ng 1\ne 1\n", want: "e 1\n", conflicts: 1, claims: []string{"e"}},
		{name: "a histogram's sample names", page: "# TYPE h_count gauge\nh_count 1\nh_bucket{le=\"1\"} 1\nh_sum 2\ne 1\n", want: "e 1\n", conflicts: 3, claims: []string{"e"}},
		{name: "a summary's sample names", page: "s_sum 1\n# TYPE s_count counter\ns_count 1\n", want: "", conflicts: 2},
		{name: "a histogram whose _sum is taken", page: "# TYPE s histogram\ns_bucket{le=\"+Inf\"} 1\ns_sum 1\ns_count 1\n", want: "", conflicts: 1},
		{name: "a counter's name with _total", page: "# TYPE a counter\na 1\n# TYPE b_total counter\nb_total 1\n",
			want: "# TYPE b_total counter\nb_total 1\n", conflicts: 1, claims: []string{"b_total", "b"}},
		{name: "a counter's name without _total", page: "# TYPE a gauge\na 1\n", want: "", conflicts: 1},
		{name: "a header with no samples", page: "# HELP g Envoy's g.\n# TYPE e gauge\ne 1\n", want: "# TYPE e gauge\ne 1\n", conflicts: 1, claims: []string{"e"}},
		{name: "a header with no samples last", page: "e 1\n# TYPE g gauge\n", want: "e 1\n", conflicts: 1, claims: []string{"e"}},
		{name: "samples of a family met again, counted once", page: "g{x=\"1\"} 1\ne 1\ng{x=\"2\"} 1\n  g{x=\"3\"} 1\n", want: "e 1\n", conflicts: 1, claims: []string{"e"}},
		// A blank line goes with the family it is in.
		{name: "blanks and tabs", page: "  #\tTYPE\tg   gauge  \n\tg 1\n \n# TYPE e GAUGE\ne\t1\n", want: "# TYPE e GAUGE\ne\t1\n", conflicts: 1, claims: []string{"e"}},
		{name: "keyword alone, other comments", page: "# HELP\n# TYPES g\ne 1\n", want: "# HELP\n# TYPES g\ne 1\n", claims: []string{"e"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			taken := takenBy(t, agentPage)
			f, err := filterPage([]byte(tc.page), taken)
			if err != nil {
				t.Fatalf("filterPage: %v", err)
			}
			if got := written(tc.page, f); got != tc.want {
				t.Errorf("wrote\n%s\nwant\n%s", got, tc.want)
			}
			if f.conflicts != tc.conflicts {
				t.Errorf("%d conflicts, want %d", f.conflicts, tc.conflicts)
			}
			if !slices.Equal(f.claims, tc.claims) {
				t.Errorf("claims %q, want %q", f.claims, tc.claims)
			}
			if len(f.spans) > strings.Count(tc.want, "\n") {
				t.Errorf("%d spans for %d lines: adjacent lines are not written together", len(f.spans), strings.Count(tc.want, "\n"))
			}
			merged := agentPage + tc.want
			if _, err := parsePage(merged); err != nil {
				t.Errorf("the merged page does not parse: %v\n%s", err, merged)
			}
		})
	}
}

func TestFilterPageRefuses(t *testing.T) {
	t.Parallel()
	for name, page := range map[string]string{
		"no final newline":   "e 1\ne 2",
		"no value":           "e 1\ne\n",
		"a quoted name":      "{\"e.x\"} 1\n",
		"a bad name":         "1e 1\n",
		"a bad name in HELP": "# HELP e.x help\n",
		"an unknown type":    "# TYPE e countre\n",
	} {
		if f, err := filterPage([]byte(page), map[string]struct{}{}); err == nil {
			t.Errorf("%s: filterPage(%q) = %+v, want an error", name, page, f)
		}
	}
}

// FuzzFilterPage checks that whatever page expfmt's parser takes, what filterPage keeps of it
// after the agent's page parses too, without a family of the agent's changed.
func FuzzFilterPage(f *testing.F) {
	for _, seed := range []string{
		"", "e 1\n", "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n", "g 1\n# TYPE e gauge\ne 2\n",
		"# HELP a help\n# TYPE a counter\na 1\n", "# TYPE s_sum gauge\ns_sum 1\n# TYPE x summary\nx{quantile=\"0.5\"} 1\nx_sum 1\nx_count 1\n",
	} {
		f.Add(seed)
	}
	agent, err := parsePage(agentPage)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, page string) {
		if _, err := parsePage(page); err != nil || !strings.HasSuffix(page, "\n") {
			return
		}
		taken := map[string]struct{}{}
		for _, mf := range agent {
			for _, c := range claims(nil, mf.GetName(), mf.GetType()) {
				taken[c] = struct{}{}
			}
		}
		out, err := filterPage([]byte(page), taken)
		if err != nil {
			return // expfmt is more lenient than the filter in places (quoted names, for one)
		}
		merged := agentPage + written(page, out)
		families, err := parsePage(merged)
		if err != nil {
			t.Fatalf("the merged page does not parse: %v\n%s", err, merged)
		}
		for name, mf := range agent {
			if got := families[name]; got.String() != mf.String() {
				t.Fatalf("the agent's %s came out as %v, want %v\n%s", name, got, mf, merged)
			}
		}
	})
}
