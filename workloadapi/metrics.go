package workloadapi

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	calls    *prometheus.CounterVec
	streams  *prometheus.GaugeVec
	updates  *prometheus.CounterVec
	refusals *prometheus.CounterVec
	jwtSVIDs *prometheus.CounterVec
}

func newMetrics() *metrics {
	return &metrics{
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent_workload_api", Name: "calls_total",
			Help: "SPIFFE Workload API calls and streams begun, refused ones included, by method.",
		}, []string{"method"}),
		streams: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "meshid", Subsystem: "agent_workload_api", Name: "streams",
			Help: "SPIFFE Workload API streams open, by method.",
		}, []string{"method"}),
		updates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent_workload_api", Name: "responses_sent_total",
			Help: "SPIFFE Workload API responses sent on streams (the first, and one per rotation or bundle change), by method.",
		}, []string{"method"}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent_workload_api", Name: "refusals_total",
			Help: "SPIFFE Workload API calls refused or streams ended by the server, by reason and gRPC code.",
		}, []string{"reason", "code"}),
		jwtSVIDs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent_workload_api", Name: "jwt_svids_total",
			Help: "JWT-SVIDs handed out, by source: cache (reused until half its life) or ca (signed for the call).",
		}, []string{"source"}),
	}
}

func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.calls, m.streams, m.updates, m.refusals, m.jwtSVIDs} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
