package ca

import (
	"github.com/prometheus/client_golang/prometheus"
)

// bundleCollector reports the expiry of the key material in service, read at scrape time.
type bundleCollector struct {
	authority   *Authority
	signingDesc *prometheus.Desc
	rootDesc    *prometheus.Desc
}

// RegisterMetrics registers the CA's key-material metrics with reg.
func RegisterMetrics(reg prometheus.Registerer, a *Authority) error {
	return reg.Register(&bundleCollector{
		authority: a,
		signingDesc: prometheus.NewDesc("meshid_ca_signing_cert_expiry_timestamp_seconds",
			"Unix time at which the CA's signing certificate expires.", []string{"source"}, nil),
		rootDesc: prometheus.NewDesc("meshid_ca_root_cert_expiry_timestamp_seconds",
			"Unix time at which each trusted root expires.", []string{"subject", "serial"}, nil),
	})
}

func (c *bundleCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.signingDesc
	ch <- c.rootDesc
}

func (c *bundleCollector) Collect(ch chan<- prometheus.Metric) {
	b := c.authority.Bundle()
	if b == nil {
		return
	}
	ch <- prometheus.MustNewConstMetric(c.signingDesc, prometheus.GaugeValue,
		float64(b.SigningCert().NotAfter.Unix()), string(b.Source()))
	for _, r := range b.Roots() {
		ch <- prometheus.MustNewConstMetric(c.rootDesc, prometheus.GaugeValue,
			float64(r.NotAfter.Unix()), r.Subject.String(), r.SerialNumber.Text(16))
	}
}
