package controller

import "github.com/prometheus/client_golang/prometheus"

// RegisterManifestProblems exports what the last load of m's directory skipped, by kind: an
// operator alerts on it rather than reading logs for a typo that leaves a namespace unlabelled.
func RegisterManifestProblems(reg prometheus.Registerer, m *Manifests) error {
	for kind, count := range map[string]func(ManifestProblems) int{
		"file":      func(p ManifestProblems) int { return p.Files },
		"object":    func(p ManifestProblems) int { return p.Objects },
		"duplicate": func(p ManifestProblems) int { return p.Duplicates },
	} {
		if err := reg.Register(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        "meshid_ca_manifest_problems",
			Help:        "What the last load of --manifests skipped: unreadable files, objects that could not be used, objects defined twice.",
			ConstLabels: prometheus.Labels{"kind": kind},
		}, func() float64 { return float64(count(m.Problems())) })); err != nil {
			return err
		}
	}
	return nil
}
