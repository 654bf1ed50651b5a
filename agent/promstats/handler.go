package promstats

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/localhttp"
	"github.com/meshid/meshid/internal/logkey"
)

// The sources, in the order their families are kept and written.
const (
	SourceAgent       = "agent"
	SourceEnvoy       = "envoy"
	SourceApplication = "application"
)

// Why a source was left out of a scrape: the reason label of the failures metric.
const (
	reasonConnect  = "connect"   // no connection, or it broke before the page was read
	reasonStatus   = "status"    // an answer other than 200
	reasonTimeout  = "timeout"   // no whole page within Config.Timeout
	reasonTooLarge = "too_large" // a page over Config.MaxBytes
	reasonParse    = "parse"     // not Prometheus' text format
	reasonCanceled = "canceled"  // the scraper went away first
	reasonGather   = "gather"    // the agent's own registry failed (some of its families may remain)
)

// failureLogEvery paces each source's failure lines: a source down for an hour is one line a
// minute, not one per scrape.
const failureLogEvery = time.Minute

// agentPrefix is put before the agent's Go runtime and process families (go_*, process_*) in the
// merged page, so that a Go application's own come through, as Istio's agent does with istio_agent_.
const agentPrefix = "meshid_agent_"

// accept asks for the text format, which every exporter serves and the merged page is written in.
const accept = "text/plain;version=0.0.4;q=1,*/*;q=0.1"

var errTimeout = errors.New("the source did not answer within the scrape timeout")

// Handler serves the merged page.
type Handler struct {
	agent    prometheus.Gatherer
	sources  []source // Envoy, then the application: the order of keeping and writing
	timeout  time.Duration
	maxBytes int64
	clock    clock.Clock
	slots    chan struct{}
	log      *slog.Logger
	busyLogs *admission.LogLimiter
	// pages holds the buffers Envoy's pages are read into, kept from one scrape to the next:
	// a page is read whole before it is written, and is about the same size each time.
	pages sync.Pool
	// writers holds the buffered writers of the merged page, kept the same way.
	writers sync.Pool

	mu         sync.Mutex
	lastLogged map[string]time.Time // by source: when its last failure was logged
	held       map[string]int       // by source: failures not logged since

	failures  *prometheus.CounterVec
	conflicts *prometheus.CounterVec
	refusals  prometheus.Counter
}

type source struct {
	name, url string
	// addr, when set, says the host and port of url ("http://%s/path") at each fetch.
	addr func() (string, error)
	// trusted: the page is read whole and written through less the families an earlier source
	// has (Envoy's, which is large and local), not parsed as the application's is.
	trusted bool
}

// New returns the Handler of cfg, or why cfg cannot work.
func New(cfg Config) (*Handler, error) {
	app, err := cfg.check()
	if err != nil {
		return nil, err
	}
	h := &Handler{
		agent:      cfg.Agent,
		timeout:    cfg.Timeout,
		maxBytes:   cfg.MaxBytes,
		clock:      cfg.Clock,
		slots:      make(chan struct{}, cfg.MaxInFlight),
		log:        cfg.Logger,
		busyLogs:   admission.NewLogLimiter(cfg.Clock),
		lastLogged: map[string]time.Time{},
		held:       map[string]int{},
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "scrape_failures_total",
			Help: "Sources left out of a /stats/prometheus scrape, by source (agent, envoy, application) and reason (connect, status, timeout, too_large, parse, canceled, gather).",
		}, []string{"source", "reason"}),
		conflicts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "scrape_conflicts_total",
			Help: "Metric families of a source left out of a /stats/prometheus scrape because a source before it (agent, then envoy, then application) had a family claiming one of its names: the family's name, a histogram's or summary's _bucket, _sum and _count, a counter's name with or without _total.",
		}, []string{"source"}),
		refusals: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "scrape_refusals_total",
			Help: "/stats/prometheus scrapes answered 503, because as many scrapes were being served already.",
		}),
	}
	switch {
	case cfg.EnvoyAdminAddr != nil:
		h.sources = append(h.sources, source{name: SourceEnvoy, url: "http://%s/stats/prometheus", addr: cfg.EnvoyAdminAddr, trusted: true})
	case cfg.EnvoyAdmin != "":
		h.sources = append(h.sources, source{name: SourceEnvoy, url: "http://" + cfg.EnvoyAdmin + "/stats/prometheus", trusted: true})
	}
	if app != nil {
		h.sources = append(h.sources, source{name: SourceApplication, url: app.url(cfg.ApplicationHost)})
	}
	for _, s := range h.sources {
		h.conflicts.WithLabelValues(s.name) // present at 0
		for _, r := range []string{reasonConnect, reasonStatus, reasonTimeout, reasonTooLarge, reasonParse} {
			h.failures.WithLabelValues(s.name, r)
		}
	}
	h.pages.New = func() any { return new(bytes.Buffer) }
	h.writers.New = func() any { return bufio.NewWriterSize(nil, 32<<10) }
	if cfg.Registerer != nil {
		for _, c := range []prometheus.Collector{h.failures, h.conflicts, h.refusals} {
			if err := cfg.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("register /stats/prometheus metrics: %w", err)
			}
		}
	}
	return h, nil
}

type result struct {
	families map[string]*dto.MetricFamily // an untrusted source's page, parsed
	page     *bytes.Buffer                // a trusted source's page, whole, from h.pages
	reason   string
	err      error
}

// ServeHTTP answers one scrape: the sources are fetched at once, each bounded by the timeout
// (the same for all, from the scrape's start), the request's context and the size bound. The
// agent's families are written, then Envoy's page as it came less the families that claim a name
// the agent's have, then the application's parsed families less those that claim a name written
// before. A source that failed, or whose page is not whole, is counted and left out. The answer is
// 200 unless too many scrapes are being served.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	select {
	case h.slots <- struct{}{}:
		defer func() { <-h.slots }()
	default:
		h.refusals.Inc()
		if ok, dropped := h.busyLogs.Allow("busy"); ok {
			h.log.Warn("/stats/prometheus scrape refused: as many scrapes are being served already",
				logkey.Peer, r.RemoteAddr, logkey.Dropped, dropped)
		}
		http.Error(w, "too many scrapes at once", http.StatusServiceUnavailable)
		return
	}

	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	results := make([]result, len(h.sources))
	var wg sync.WaitGroup
	for i, s := range h.sources {
		wg.Go(func() { results[i] = h.fetch(ctx, s) })
	}
	// One timer for the scrape, on the injected clock; when it fires, the sources still
	// answering have their connections closed (localhttp ends with the context).
	timer := h.clock.NewTimer(h.timeout)
	fetched := make(chan struct{})
	go func() {
		wg.Wait()
		close(fetched)
	}()
	agentFamilies, gatherErr := h.agent.Gather()
	select {
	case <-fetched:
	case <-timer.C():
		cancel(errTimeout)
		<-fetched
	}
	timer.Stop()

	if gatherErr != nil {
		h.failed(SourceAgent, reasonGather, gatherErr)
	}
	// The agent's families first, then Envoy's, then the application's, as Istio's agent writes
	// them; a name claimed before keeps its first family: what the agent measures itself and what
	// Envoy reports are the mesh's own, and an application cannot shadow them.
	agentFamilies = renameRuntime(agentFamilies)
	taken := make(map[string]struct{}, 2*len(agentFamilies))
	var scratch []string
	for _, mf := range agentFamilies {
		scratch = claims(scratch[:0], mf.GetName(), mf.GetType())
		for _, c := range scratch {
			taken[c] = struct{}{}
		}
	}
	kept := make([][]*dto.MetricFamily, len(results))
	spans := make([][]span, len(results))
	for i, res := range results {
		if res.err == nil && res.page != nil {
			f, err := filterPage(res.page.Bytes(), taken)
			if err != nil {
				res.err, res.reason = err, reasonParse
			} else {
				spans[i] = f.spans
				h.conflicts.WithLabelValues(h.sources[i].name).Add(float64(f.conflicts))
				for _, c := range f.claims {
					taken[c] = struct{}{}
				}
			}
		}
		if res.err != nil {
			h.failed(h.sources[i].name, res.reason, res.err)
			h.release(res.page)
			results[i].page = nil
			continue
		}
		if res.page != nil {
			continue
		}
		names := make([]string, 0, len(res.families))
		for name := range res.families {
			names = append(names, name)
		}
		slices.Sort(names)
		for _, name := range names {
			mf := res.families[name]
			var dup bool
			if scratch, dup = claimed(taken, scratch, name, mf.GetType()); dup {
				h.conflicts.WithLabelValues(h.sources[i].name).Inc()
				continue
			}
			kept[i] = append(kept[i], mf)
		}
	}

	w.Header().Set("Content-Type", string(expfmt.FmtText))
	bw := h.writers.Get().(*bufio.Writer)
	bw.Reset(w)
	defer func() {
		bw.Reset(nil) // not to hold on to w
		h.writers.Put(bw)
	}()
	err := writeFamilies(bw, agentFamilies)
	for i, res := range results {
		if err == nil && res.page != nil {
			for _, sp := range spans[i] {
				if _, err = bw.Write(res.page.Bytes()[sp.from:sp.to]); err != nil {
					break
				}
			}
		}
		h.release(res.page)
		if err == nil {
			err = writeFamilies(bw, kept[i])
		}
	}
	if err == nil {
		err = bw.Flush()
	}
	if err != nil {
		// The scraper went away, or a family of the agent's own cannot be written; what was
		// written stands.
		h.log.Debug("/stats/prometheus: writing the page failed", logkey.Error, err)
	}
}

func writeFamilies(w *bufio.Writer, families []*dto.MetricFamily) error {
	for _, mf := range families {
		if _, err := expfmt.MetricFamilyToText(w, mf); err != nil {
			return err
		}
	}
	return nil
}

// renameRuntime returns the agent's families with its Go runtime and process families renamed
// with agentPrefix; the families Gather returned are left as they are.
func renameRuntime(families []*dto.MetricFamily) []*dto.MetricFamily {
	out := make([]*dto.MetricFamily, len(families))
	for i, mf := range families {
		name := mf.GetName()
		if !strings.HasPrefix(name, "go_") && !strings.HasPrefix(name, "process_") {
			out[i] = mf
			continue
		}
		name = agentPrefix + name
		out[i] = &dto.MetricFamily{Name: &name, Help: mf.Help, Type: mf.Type, Unit: mf.Unit, Metric: mf.Metric}
	}
	return out
}

// release gives a trusted page's buffer back for the next scrape.
func (h *Handler) release(page *bytes.Buffer) {
	if page != nil {
		page.Reset()
		h.pages.Put(page)
	}
}

// fetch reads one source's page.
func (h *Handler) fetch(ctx context.Context, s source) result {
	url := s.url
	if s.addr != nil {
		addr, err := s.addr()
		if err != nil {
			return result{reason: reasonConnect, err: err}
		}
		url = fmt.Sprintf(s.url, addr)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return result{reason: reasonConnect, err: err}
	}
	req.Header.Set("Accept", accept)
	req.Header.Set("User-Agent", "meshid-agent")
	var families map[string]*dto.MetricFamily
	var page *bytes.Buffer
	err = localhttp.Do(req, h.maxBytes, func(resp *http.Response) error {
		if resp.StatusCode != http.StatusOK {
			return &statusError{resp.Status}
		}
		if s.trusted {
			// Whole or not at all: what was read of a page cut short is not written.
			page = h.pages.Get().(*bytes.Buffer)
			_, err := page.ReadFrom(resp.Body)
			return err
		}
		// Legacy names only: the page is written in text format 0.0.4, whose grammar has no
		// quoted UTF-8 names, so that every Prometheus reads it.
		p := expfmt.NewTextParser(model.LegacyValidation)
		var err error
		families, err = p.TextToMetricFamilies(resp.Body)
		return err
	})
	if err == nil {
		return result{families: families, page: page}
	}
	// page, if any, is not given back: a read past the bound has grown it to MaxBytes.
	var status *statusError
	var parse expfmt.ParseError
	reason := reasonConnect
	switch {
	case errors.Is(context.Cause(ctx), errTimeout):
		reason, err = reasonTimeout, fmt.Errorf("%w: %w", errTimeout, err)
	case ctx.Err() != nil:
		reason = reasonCanceled
	case errors.Is(err, localhttp.ErrBodyTooLarge):
		reason = reasonTooLarge
	case errors.As(err, &status):
		reason = reasonStatus
	case errors.As(err, &parse):
		reason = reasonParse
	}
	return result{reason: reason, err: err}
}

type statusError struct{ status string }

func (e *statusError) Error() string { return "answered " + e.status + ", want 200 OK" }

// failed counts a source left out and logs it, at most once per source per failureLogEvery.
func (h *Handler) failed(name, reason string, err error) {
	h.failures.WithLabelValues(name, reason).Inc()
	now := h.clock.Now()
	h.mu.Lock()
	last, logged := h.lastLogged[name]
	if logged && now.Sub(last) < failureLogEvery && now.Sub(last) >= 0 {
		h.held[name]++
		h.mu.Unlock()
		return
	}
	h.lastLogged[name] = now
	held := h.held[name]
	h.held[name] = 0
	h.mu.Unlock()
	h.log.Warn("/stats/prometheus: a source was left out of the scrape", logkey.Source, name,
		logkey.Reason, reason, logkey.Error, err, logkey.Dropped, held)
}
