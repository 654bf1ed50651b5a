package sds

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	streams  *prometheus.GaugeVec
	pushes   prometheus.Counter
	nacks    prometheus.Counter
	refusals *prometheus.CounterVec
	// socketTaken counts the times the socket path was found to lead elsewhere.
	socketTaken prometheus.Counter
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
		socketTaken: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "sds", Name: "socket_taken_total",
			Help: "Times the SDS socket path was found removed or taken by another server, so that Envoy's new connections reach that one.",
		}),
	}
}

func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.streams, m.pushes, m.nacks, m.refusals, m.socketTaken} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
