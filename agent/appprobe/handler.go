package appprobe

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/localhttp"
	"github.com/meshid/meshid/internal/logkey"
)

// Defaults of Config.
const (
	DefaultHost        = "127.0.0.1"
	DefaultMaxInFlight = 4
	// maxBody is what is read of an HTTP probe's answer, which is discarded: the status is the
	// answer.
	maxBody = 1 << 10
)

// Config configures a Handler; New fills in zero values.
type Config struct {
	Probers Probers
	// Host is where the application is probed when a probe names no host (DefaultHost).
	Host string
	// MaxInFlight bounds the probes of one path running at once (DefaultMaxInFlight): a kubelet
	// storm cannot make the agent open unbounded connections. The excess is answered 503.
	MaxInFlight int
	Registerer  prometheus.Registerer // nil: metrics are not registered
	Logger      *slog.Logger
	Clock       clock.Clock // paces the refusals' log lines; nil: the real clock
}

// Handler answers the configured paths by probing the application; any other path is 404.
type Handler struct {
	probers  Probers
	host     string
	slots    map[string]chan struct{}
	log      *slog.Logger
	logs     *admission.LogLimiter
	refusals *prometheus.CounterVec
}

// New returns the Handler of cfg.Probers.
func New(cfg Config) (*Handler, error) {
	if cfg.Host == "" {
		cfg.Host = DefaultHost
	}
	if cfg.MaxInFlight <= 0 {
		cfg.MaxInFlight = DefaultMaxInFlight
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	h := &Handler{
		probers: cfg.Probers,
		host:    cfg.Host,
		slots:   make(map[string]chan struct{}, len(cfg.Probers)),
		log:     cfg.Logger,
		logs:    admission.NewLogLimiter(cfg.Clock),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "app_probe_refusals_total",
			Help: "Application probes answered 503 without probing, because as many probes of the same path were running already.",
		}, []string{"path"}),
	}
	for path := range cfg.Probers {
		h.slots[path] = make(chan struct{}, cfg.MaxInFlight)
		h.refusals.WithLabelValues(path) // present at 0
	}
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(h.refusals); err != nil {
			return nil, fmt.Errorf("register app probe metrics: %w", err)
		}
	}
	return h, nil
}

// ServeHTTP probes the application as the path's probe says, within its timeout and the
// request's context: an HTTP probe answers the application's status (500 when it does not
// answer), a TCP or gRPC probe 200 or 500.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	probe, ok := h.probers[r.URL.Path]
	if !ok {
		http.NotFound(w, r)
		return
	}
	slots := h.slots[r.URL.Path]
	select {
	case slots <- struct{}{}:
		defer func() { <-slots }()
	default:
		h.refusals.WithLabelValues(r.URL.Path).Inc()
		if ok, dropped := h.logs.Allow("busy"); ok {
			h.log.Warn("application probe refused: as many probes of this path are running already",
				logkey.Peer, r.RemoteAddr, logkey.Path, r.URL.Path, logkey.Dropped, dropped)
		}
		http.Error(w, "too many probes of this path at once", http.StatusServiceUnavailable)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), probe.Timeout)
	defer cancel()
	code, err := h.run(ctx, probe)
	if err != nil {
		h.log.Debug("application probe failed", logkey.Path, r.URL.Path, logkey.Error, err)
	}
	w.WriteHeader(code)
}

// run returns the status to answer and, when the probe failed, why.
func (h *Handler) run(ctx context.Context, p Probe) (int, error) {
	switch {
	case p.HTTPGet != nil:
		return h.probeHTTP(ctx, p.HTTPGet)
	case p.TCPSocket != nil:
		var d net.Dialer
		conn, err := d.DialContext(ctx, "tcp", h.addr(p.TCPSocket.Host, p.TCPSocket.Port))
		if err != nil {
			return http.StatusInternalServerError, err
		}
		_ = conn.Close()
		return http.StatusOK, nil
	case p.GRPC != nil:
		return h.probeGRPC(ctx, p.GRPC)
	}
	return http.StatusInternalServerError, errors.New("empty probe")
}

func (h *Handler) addr(host string, port Port) string {
	if host == "" {
		host = h.host
	}
	return net.JoinHostPort(host, strconv.Itoa(int(port)))
}

// probeHTTP sends one request on one connection of its own (localhttp): a probe of a local port
// needs none of http.Transport's pooling, proxies or HTTP/2, which would add 400 kB to every
// sidecar (see cli.Probe). Nothing is followed: a redirect is a 3xx, which passes, as the kubelet
// counts it.
func (h *Handler) probeHTTP(ctx context.Context, g *HTTPGet) (int, error) {
	addr := h.addr(g.Host, g.Port)
	scheme := strings.ToLower(g.Scheme)
	if scheme == "" {
		scheme = "http"
	}
	path := g.Path
	if path == "" {
		path = "/"
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, scheme+"://"+addr+path, nil)
	if err != nil {
		return http.StatusInternalServerError, err
	}
	req.Header.Set("User-Agent", "istio-probe/1.0")
	for _, hd := range g.Headers {
		if strings.EqualFold(hd.Name, "Host") {
			req.Host = hd.Value
			continue
		}
		req.Header.Add(hd.Name, hd.Value)
	}
	var resp *http.Response
	err = localhttp.Do(req, maxBody, func(r *http.Response) error {
		// The answer's body is discarded, up to maxBody: the status is the answer.
		_, _ = io.Copy(io.Discard, r.Body)
		resp = r
		return nil
	})
	if err != nil {
		return http.StatusInternalServerError, err
	}
	switch code := resp.StatusCode; {
	case code >= 200 && code < 400:
		return code, nil
	case code >= 400 && code <= 599:
		return code, fmt.Errorf("the application answered %s", resp.Status)
	default:
		return http.StatusInternalServerError, fmt.Errorf("the application answered %s", resp.Status)
	}
}

// probeGRPC asks the application's grpc.health.v1 service, in plaintext, on a connection of its
// own.
func (h *Handler) probeGRPC(ctx context.Context, g *GRPC) (int, error) {
	conn, err := grpc.NewClient("passthrough:///"+h.addr("", g.Port), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return http.StatusInternalServerError, err
	}
	defer func() { _ = conn.Close() }()
	req := &healthpb.HealthCheckRequest{}
	if g.Service != nil {
		req.Service = *g.Service
	}
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, req)
	if err != nil {
		return http.StatusInternalServerError, err
	}
	if s := resp.GetStatus(); s != healthpb.HealthCheckResponse_SERVING {
		return http.StatusInternalServerError, fmt.Errorf("the application's health service answered %s", s)
	}
	return http.StatusOK, nil
}
