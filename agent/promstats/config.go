// Package promstats serves GET /stats/prometheus on the agent's status port, as Istio's agent
// does on :15020: one Prometheus page with the agent's own metrics, Envoy's (its admin
// /stats/prometheus) and the application's (where ISTIO_PROMETHEUS_ANNOTATIONS says), so that
// one scrape of the pod sees all three through one port that Envoy's mTLS does not stand in front
// of. A source that fails is left out and counted; it never fails the scrape.
package promstats

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/hostport"
)

// Defaults of Config.
const (
	DefaultApplicationHost = "127.0.0.1"
	// DefaultTimeout bounds each source's answer, from the scrape's start. Prometheus' own default
	// scrape timeout is 10s: a source answering within 5s leaves the agent's page time to travel.
	DefaultTimeout = 5 * time.Second
	// DefaultMaxBytes bounds each source's page. A sidecar's Envoy writes 0.1 to 2 MB; 16 MiB leaves
	// room for a large mesh, and caps what one scrape may make the agent read and hold.
	DefaultMaxBytes = 16 << 20
	// DefaultMaxInFlight bounds the scrapes served at once: Prometheus scrapes a pod once per
	// interval, a second one covers a second Prometheus or an overlap; each holds Envoy's page
	// and the application's, parsed.
	DefaultMaxInFlight = 2
)

// Istio's defaults for what the pod's prometheus.io annotations leave out.
const (
	defaultAppPath = "/metrics"
	defaultAppPort = 80
)

// Config configures a Handler; New fills in zero values and checks the rest.
type Config struct {
	// Agent is the agent's own metrics (its registry). Required.
	Agent prometheus.Gatherer
	// EnvoyAdmin is Envoy's admin HOST:PORT, whose /stats/prometheus is merged; empty: none.
	// EnvoyAdminAddr, when set instead, says it at each scrape: an admin on a port of the
	// kernel's choosing is known once Envoy has said which; until then Envoy is left out,
	// counted as a failure to connect.
	EnvoyAdmin     string
	EnvoyAdminAddr func() (string, error)
	// Application is ISTIO_PROMETHEUS_ANNOTATIONS as Istio's injector writes it
	// (ParseAnnotations); empty: the application is not scraped.
	Application string
	// ApplicationHost is where the application is scraped: the workload's address (INSTANCE_IP),
	// DefaultApplicationHost when empty.
	ApplicationHost string
	Timeout         time.Duration // DefaultTimeout when 0
	MaxBytes        int64         // DefaultMaxBytes when 0
	MaxInFlight     int           // DefaultMaxInFlight when 0
	Clock           clock.Clock   // times the sources out and paces the log; nil: the real clock
	Logger          *slog.Logger
	Registerer      prometheus.Registerer // nil: metrics are not registered
}

// Annotations is where the application serves its metrics: the pod's prometheus.io/{scrape,path,
// port} annotations, which Istio's injector moves into ISTIO_PROMETHEUS_ANNOTATIONS when it points
// Prometheus at the agent instead.
type Annotations struct {
	Path   string // the request target, query included; /metrics when the annotation is absent
	Port   int    // 80 when the annotation is absent, as Istio's agent takes it
	Scheme string // http, or https (the certificate is not verified, as the kubelet's probes)
}

// annotationsJSON is the variable's shape: Istio's injector writes {"scrape":"...","path":"...",
// "port":"..."}, each empty when the pod has no such annotation; scheme is the
// prometheus.io/scheme convention, which Istio's injector does not pass.
type annotationsJSON struct {
	Scrape string          `json:"scrape"`
	Path   string          `json:"path"`
	Port   json.RawMessage `json:"port"`
	Scheme string          `json:"scheme"`
}

// parsePort reads a port given as a string, as Istio writes it, or as a number; 0 when absent
// or empty.
func parsePort(raw json.RawMessage) (int, error) {
	s := string(raw)
	if unq, err := strconv.Unquote(s); err == nil {
		s = unq
	}
	if s == "" || s == "null" {
		return 0, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > 65535 {
		return 0, fmt.Errorf("port: %s: want a port number from 1 to 65535", raw)
	}
	return n, nil
}

// ParseAnnotations reads ISTIO_PROMETHEUS_ANNOTATIONS. It returns nil, and no error, when s is
// empty or its scrape is false: the application is not scraped. Istio's injector writes an empty
// scrape when the pod sets prometheus.io/port or path but not scrape, and Istio's agent scrapes
// it then, so an empty scrape means true. Bad JSON, an unknown field, a scrape that is neither
// true nor false, a port that is not a number from 1 to 65535, a path that is not an absolute
// request target and a scheme other than http and https are refused, the error naming the field.
func ParseAnnotations(s string) (*Annotations, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	d := json.NewDecoder(bytes.NewReader([]byte(s)))
	d.DisallowUnknownFields()
	var raw annotationsJSON
	if err := d.Decode(&raw); err != nil {
		return nil, fmt.Errorf(`want JSON as {"scrape":"true","path":"/metrics","port":"9090"}: %w`, err)
	}
	if d.More() {
		return nil, errors.New("want one JSON object, got more after it")
	}
	if raw.Scrape != "" {
		scrape, err := strconv.ParseBool(raw.Scrape)
		if err != nil {
			return nil, fmt.Errorf("scrape: %q: want \"true\" or \"false\"", raw.Scrape)
		}
		if !scrape {
			return nil, nil
		}
	}
	port, err := parsePort(raw.Port)
	if err != nil {
		return nil, err
	}
	a := &Annotations{Path: raw.Path, Port: port, Scheme: strings.ToLower(raw.Scheme)}
	if a.Path == "" {
		a.Path = defaultAppPath
	}
	if _, err := url.ParseRequestURI(a.Path); err != nil || !strings.HasPrefix(a.Path, "/") || strings.ContainsAny(a.Path, " \t\r\n#") {
		return nil, fmt.Errorf("path: %q: want an absolute path, as /metrics", raw.Path)
	}
	if a.Port == 0 {
		a.Port = defaultAppPort
	}
	switch a.Scheme {
	case "":
		a.Scheme = "http"
	case "http", "https":
	default:
		return nil, fmt.Errorf("scheme: %q: want http or https", raw.Scheme)
	}
	return a, nil
}

// url returns where the application is scraped on host.
func (a *Annotations) url(host string) string {
	return a.Scheme + "://" + net.JoinHostPort(host, strconv.Itoa(a.Port)) + a.Path
}

// check fills in cfg's zero values and refuses what cannot work.
func (cfg *Config) check() (*Annotations, error) {
	if cfg.Agent == nil {
		return nil, errors.New("promstats: no agent metrics (Config.Agent)")
	}
	if cfg.EnvoyAdmin != "" {
		if err := hostport.CheckDial(cfg.EnvoyAdmin); err != nil {
			return nil, fmt.Errorf("promstats: Envoy admin address %q: %w", cfg.EnvoyAdmin, err)
		}
	}
	app, err := ParseAnnotations(cfg.Application)
	if err != nil {
		return nil, fmt.Errorf("promstats: ISTIO_PROMETHEUS_ANNOTATIONS: %w", err)
	}
	if cfg.ApplicationHost == "" {
		cfg.ApplicationHost = DefaultApplicationHost
	}
	if strings.ContainsAny(cfg.ApplicationHost, "/[]@ ") {
		return nil, fmt.Errorf("promstats: application host %q: want an IP address or a host name", cfg.ApplicationHost)
	}
	if cfg.Timeout < 0 || cfg.MaxBytes < 0 || cfg.MaxInFlight < 0 {
		return nil, fmt.Errorf("promstats: negative bound: timeout %s, max bytes %d, max in flight %d", cfg.Timeout, cfg.MaxBytes, cfg.MaxInFlight)
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.MaxBytes == 0 {
		cfg.MaxBytes = DefaultMaxBytes
	}
	if cfg.MaxInFlight == 0 {
		cfg.MaxInFlight = DefaultMaxInFlight
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	cfg.Clock = clock.OrReal(cfg.Clock)
	return app, nil
}
