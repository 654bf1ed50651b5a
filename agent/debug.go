package agent

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/secretmanager"
)

// debugBoundary refuses debug requests that did not come from this machine's loopback by name,
// counted and logged at a bounded rate.
type debugBoundary struct {
	log      *slog.Logger
	logs     *admission.LogLimiter
	refusals *prometheus.CounterVec
}

func newDebugBoundary(clk clock.Clock, log *slog.Logger, reg prometheus.Registerer) (*debugBoundary, error) {
	b := &debugBoundary{
		log:  log,
		logs: admission.NewLogLimiter(clk),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "debug_refusals_total",
			Help: "Requests to the debug server refused, by reason (host: a Host header that does not name loopback, as a web page rebinding a name to 127.0.0.1 sends).",
		}, []string{"reason"}),
	}
	if err := reg.Register(b.refusals); err != nil {
		return nil, fmt.Errorf("register the debug server's metrics: %w", err)
	}
	return b, nil
}

// loopbackOnly answers only requests whose Host names loopback: a web page the user opens can
// make the browser send requests to 127.0.0.1 through a name it rebinds there (DNS rebinding),
// and reads the answers, since the browser takes the port for the page's own origin; its Host is
// then that name.
func (b *debugBoundary) loopbackOnly(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if loopbackHost(r.Host) {
			next.ServeHTTP(w, r)
			return
		}
		b.refusals.WithLabelValues("host").Inc()
		if ok, dropped := b.logs.Allow("host"); ok {
			attrs := []any{logkey.Peer, admission.Peer(r.Context()), logkey.Host, logkey.Untrusted(r.Host), logkey.Path, logkey.Untrusted(r.URL.Path)}
			if dropped > 0 {
				attrs = append(attrs, logkey.Dropped, dropped)
			}
			b.log.Warn("debug request refused: its Host does not name loopback", attrs...)
		}
		http.Error(w, "the debug server answers requests for localhost, 127.0.0.1 or [::1] only", http.StatusForbidden)
	})
}

// loopbackHost reports whether a Host header names loopback: localhost or a loopback address,
// with or without a port.
func loopbackHost(host string) bool {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	return strings.EqualFold(host, "localhost") || isLoopback(host)
}

// secretStatus is one secret as /debug/secrets shows it.
type secretStatus struct {
	Name string `json:"name"`
	// Valid says whether it is served now (as /healthz/ready judges "default"); Error why not, or
	// why the last attempt to replace it failed.
	Valid        bool      `json:"valid"`
	Error        string    `json:"error,omitempty"`
	SPIFFEID     string    `json:"spiffe_id,omitempty"`
	Serial       string    `json:"serial,omitempty"`
	Version      string    `json:"version,omitempty"`
	NotBefore    time.Time `json:"not_before,omitzero"`
	NotAfter     time.Time `json:"not_after,omitzero"`
	NextRotation time.Time `json:"next_rotation,omitzero"`
	TimeLeft     string    `json:"time_left,omitempty"`
	Roots        int       `json:"roots,omitempty"`
	Source       string    `json:"source,omitempty"`
	Streams      int       `json:"subscribed_streams"`
}

// xdsDebugHandler serves istio.io/debug/<type> from the discovery server, for this proxy's node.
func (a *Agent) xdsDebugHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/debug/", a.xds.DebugHandler())
	return mux
}

// debugHandler serves the debug server on --debug-addr: /debug/secrets, and /debug/<type> only
// when asked (--xds-debug-tcp): any local user can reach a loopback port, while the XDS socket's
// mode says who may read the configuration.
func (a *Agent) debugHandler(clk clock.Clock, cfg Config) http.Handler {
	mux := http.NewServeMux()
	switch {
	case a.xds == nil || !cfg.XDS.ProxyDebug:
	case cfg.XDS.DebugTCP:
		mux.Handle("/debug/", a.xds.DebugHandler())
	default:
		socket := a.XDSDebugSocket()
		mux.HandleFunc("/debug/", func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, fmt.Sprintf("%s is served on the Unix socket %s (curl --unix-socket %s http://localhost%s), "+
				"which only who may open the XDS socket can reach; --xds-debug-tcp serves it here too", r.URL.Path, socket, socket, r.URL.Path),
				http.StatusNotFound)
		})
	}
	mux.HandleFunc("GET /debug/secrets", func(w http.ResponseWriter, _ *http.Request) {
		out := []secretStatus{}
		if a.secrets != nil {
			subscribed := a.sds.Subscriptions()
			for _, st := range a.secrets.Snapshot() {
				out = append(out, describe(st.Name, st.Valid, st.Error, st.Secret, subscribed[st.Name], clk.Now()))
			}
		}
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		page := map[string]any{"source": a.source, "sds_socket": a.socketPath, "secrets": out}
		if a.node != nil {
			// Node mode: the identities whose certificates are held for callers.
			page["identities"] = a.node.Held()
		}
		_ = enc.Encode(page)
	})
	return mux
}

func describe(name string, valid bool, why string, s *secretmanager.Secret, streams int, now time.Time) secretStatus {
	st := secretStatus{Name: name, Valid: valid, Error: why, Streams: streams}
	if s == nil {
		return st
	}
	st.Version, st.Source = s.Version, string(s.Source)
	if s.Bundle != nil {
		st.Roots = len(s.Bundle.Roots)
	}
	if s.KeyPair != nil {
		leaf := s.KeyPair.Leaf()
		if len(leaf.URIs) == 1 {
			st.SPIFFEID = leaf.URIs[0].String()
		}
		st.Serial = leaf.SerialNumber.Text(16)
		st.NotBefore, st.NotAfter, st.NextRotation = leaf.NotBefore, leaf.NotAfter, s.RenewAt
		st.TimeLeft = leaf.NotAfter.Sub(now).Round(time.Second).String()
	}
	return st
}
