package xdsproxy

import "github.com/prometheus/client_golang/prometheus"

// Values of the direction label.
const (
	directionRequest  = "request"
	directionResponse = "response"
)

type metrics struct {
	streams        prometheus.Gauge
	streamsTotal   prometheus.Counter
	messages       *prometheus.CounterVec
	upstreamErrors *prometheus.CounterVec
	refusals       *prometheus.CounterVec
	// socketTaken counts the times the socket path was found to lead elsewhere.
	socketTaken prometheus.Counter
}

func newMetrics() *metrics {
	return &metrics{
		streams: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "meshid", Subsystem: "xds_proxy", Name: "streams",
			Help: "Envoy's ADS streams open through the proxy.",
		}),
		streamsTotal: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "xds_proxy", Name: "streams_total",
			Help: "Envoy's ADS streams opened through the proxy; its growth counts reconnects.",
		}),
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "xds_proxy", Name: "messages_total",
			Help: "Messages proxied, counted as they are taken: requests from Envoy to the upstream, responses from the upstream to Envoy.",
		}, []string{"direction"}),
		upstreamErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "xds_proxy", Name: "upstream_errors_total",
			Help: "Envoy streams ended by an upstream error, by gRPC code.",
		}, []string{"code"}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "xds_proxy", Name: "refusals_total",
			Help: "Streams, connections and debug requests refused, by reason and the gRPC code (or HTTP status) of the answer (\"closed\": the connection was closed before any stream).",
		}, []string{"reason", "code"}),
		socketTaken: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "xds_proxy", Name: "socket_taken_total",
			Help: "Times the xDS proxy's socket path was found removed or taken by another server, so that Envoy's new connections reach that one.",
		}),
	}
}

func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.streams, m.streamsTotal, m.messages, m.upstreamErrors, m.refusals, m.socketTaken} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
