package server

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics counts what the CA server does. Create one per server with NewMetrics.
type Metrics struct {
	issued  *prometheus.CounterVec
	refused *prometheus.CounterVec
	signing prometheus.Histogram
	// requests counts the certificate requests of each service by outcome, so that the Mesh CA's
	// traffic is told from Istio's; issued and refused above count both services together.
	requests *prometheus.CounterVec
	// impersonated counts, among issued, the certificates a node agent asked for a workload.
	impersonated *prometheus.CounterVec
	// jwtSVIDs counts the JWT-SVIDs signed, by authentication method as issued does;
	// jwtRequests the calls of JWTSVIDService, by method and outcome.
	jwtSVIDs    *prometheus.CounterVec
	jwtRequests *prometheus.CounterVec
}

// NewMetrics creates the server's metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		issued: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "certificates_issued_total",
			Help: "Workload certificates issued, by authentication method.",
		}, []string{"auth_method"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "requests_refused_total",
			Help: "CreateCertificate requests refused, by reason and gRPC status code.",
		}, []string{"reason", "code"}),
		signing: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "signing_duration_seconds",
			Help:    "Time to check a CSR, sign it and verify the result.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 14), // 100µs to ~1.6s
		}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "certificate_requests_total",
			Help: "Certificate requests, by service (IstioCertificateService, MeshCertificateService) and gRPC status code.",
		}, []string{"service", "code"}),
		impersonated: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "impersonated_certificates_issued_total",
			Help: "Workload certificates issued to a trusted node account for another identity (ImpersonatedIdentity), by authentication method; also counted in meshid_ca_certificates_issued_total.",
		}, []string{"auth_method"}),
		jwtSVIDs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "jwt_svids_issued_total",
			Help: "JWT-SVIDs signed, by authentication method.",
		}, []string{"auth_method"}),
		jwtRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "meshid", Subsystem: "ca", Name: "jwt_svid_requests_total",
			Help: "JWTSVIDService calls (MintJWTSVID, FetchJWTBundle), by method and gRPC status code.",
		}, []string{"method", "code"}),
	}
	for _, c := range []prometheus.Collector{m.issued, m.refused, m.signing, m.requests, m.impersonated, m.jwtSVIDs, m.jwtRequests} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
