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
	}
}

func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.streams, m.streamsTotal, m.messages, m.upstreamErrors} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
