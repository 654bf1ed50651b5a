package attest

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	identified *prometheus.CounterVec
	refusals   *prometheus.CounterVec
	rules      prometheus.Gauge
	badRules   prometheus.Counter
	loads      *prometheus.CounterVec
}

func newMetrics() *metrics {
	m := &metrics{
		identified: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent_attestation", Name: "identified_total",
			Help: "Callers given an identity, by what gave it (rule, pod).",
		}, []string{"source"}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent_attestation", Name: "refusals_total",
			Help: "Callers given no identity, by reason.",
		}, []string{"reason"}),
		rules: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "meshid", Subsystem: "agent_attestation", Name: "rules",
			Help: "Workload attestation rules in force.",
		}),
		badRules: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent_attestation", Name: "rules_skipped_total",
			Help: "Rules of the rules file skipped as invalid, counted at each load.",
		}),
		loads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent_attestation", Name: "rules_loads_total",
			Help: "Loads of the rules file, by result (ok; error: the previous rules kept).",
		}, []string{"result"}),
	}
	// Every series exists from the start, so that a rate is defined before the first event.
	for _, source := range []string{"rule", "pod"} {
		m.identified.WithLabelValues(source)
	}
	for _, reason := range []string{ReasonPeerUnknown, ReasonPeerExited, ReasonPIDReused, ReasonNoRule, ReasonPodNotFound, ReasonPodsFailed} {
		m.refusals.WithLabelValues(reason)
	}
	for _, result := range []string{"ok", "error"} {
		m.loads.WithLabelValues(result)
	}
	return m
}

func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.identified, m.refusals, m.rules, m.badRules, m.loads} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
