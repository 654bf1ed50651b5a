package sds

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	streams  *prometheus.GaugeVec
	pushes   prometheus.Counter
	nacks    prometheus.Counter
	refusals *prometheus.CounterVec
}

func newMetrics() *metrics {
	return &metrics{
		streams: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "meshid", Subsystem: "sds", Name: "streams",
			Help: "Open SDS streams, by protocol (sotw, delta).",
		}, []string{"protocol"}),
		pushes: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "sds", Name: "secrets_pushed_total",
			Help: "Secrets sent to Envoy, counting each secret of each response.",
		}),
		nacks: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "sds", Name: "nacks_total",
			Help: "Responses Envoy rejected.",
		}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "sds", Name: "refusals_total",
			Help: "Requests refused, by reason and the gRPC code the stream ended with (\"dropped\": the request was ignored and the stream went on; \"closed\": the connection was closed before any stream).",
		}, []string{"reason", "code"}),
	}
}

func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.streams, m.pushes, m.nacks, m.refusals} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
