package sds

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	streams *prometheus.GaugeVec
	pushes  prometheus.Counter
	nacks   prometheus.Counter
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
	}
}

func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.streams, m.pushes, m.nacks} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
