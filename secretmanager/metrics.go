package secretmanager

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	valid          prometheus.Gauge
	expiry         prometheus.Gauge
	nextRenewal    prometheus.Gauge
	rotations      prometheus.Counter
	failures       prometheus.Counter
	outputFailures prometheus.Counter
	fileRefusals   *prometheus.CounterVec
}

func newMetrics() *metrics {
	return &metrics{
		valid: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "cert_valid",
			Help: "1 while a valid workload certificate is held, else 0.",
		}),
		expiry: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "cert_expiry_timestamp_seconds",
			Help: "Unix time at which the workload certificate in service expires.",
		}),
		nextRenewal: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "cert_next_renewal_timestamp_seconds",
			Help: "Unix time at which the workload certificate in service will be renewed.",
		}),
		rotations: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "cert_rotations_total",
			Help: "Workload certificates obtained from the CA.",
		}),
		failures: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "cert_renewal_failures_total",
			Help: "Failed attempts to obtain a workload certificate.",
		}),
		outputFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "output_certs_write_failures_total",
			Help: "Failed attempts to write OUTPUT_CERTS.",
		}),
		fileRefusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "agent", Name: "file_secret_refusals_total",
			Help: "Reads of file secrets refused, by reason: forbidden_path, not_regular_file, too_large, ca_certificate.",
		}, []string{"reason"}),
	}
}

func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.valid, m.expiry, m.nextRenewal, m.rotations, m.failures, m.outputFailures, m.fileRefusals} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
