package server_test

import (
	"testing"
	"time"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/pki"
)

// BenchmarkCreateCertificate measures signings per second end to end (TLS gRPC on loopback, a
// JWT, a P-256 CSR, parallel clients) and, in the same run, the in-process bound: verify the JWT,
// verify the CSR and create the certificate, with nothing else. The grpc line reports its rate as
// a share of the bound measured just before it.
func BenchmarkCreateCertificate(b *testing.B) {
	h := newHarness(b, harnessOptions{})
	tok := h.token(b, mintOptions{ttl: 24 * time.Hour})
	req := request(b, p256(b), []string{demoID()}, nil, time.Hour)
	rates := map[string]float64{}
	rate := func(b *testing.B) { rates[b.Name()] = float64(b.N) / b.Elapsed().Seconds() }
	parent := b.Name()

	b.Run("bound", func(b *testing.B) {
		keys, err := token.NewKeySet(h.tokenKey.Public())
		if err != nil {
			b.Fatal(err)
		}
		verifier, err := token.NewVerifier(token.VerifierConfig{Keys: keys, Audience: "istio-ca", Now: h.clock.Now})
		if err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				claims, err := verifier.Verify(tok)
				if err != nil {
					b.Error(err)
					return
				}
				ns, sa, err := claims.ServiceAccount()
				if err != nil {
					b.Error(err)
					return
				}
				csr, err := ca.ParseCSR([]byte(req.Csr))
				if err != nil {
					b.Error(err)
					return
				}
				if _, err := h.authority.SignWorkload(b.Context(), ca.WorkloadRequest{
					CSR:      csr,
					Identity: pki.SPIFFEID{TrustDomain: trustDomain, Namespace: ns, ServiceAccount: sa},
					TTL:      time.Hour,
				}); err != nil {
					b.Error(err)
					return
				}
			}
		})
		b.StopTimer()
		rate(b)
		b.ReportMetric(rates[b.Name()], "signings/s")
	})

	b.Run("grpc", func(b *testing.B) {
		client := h.dial(b, nil)
		ctx := withToken(b.Context(), tok)
		if _, err := client.CreateCertificate(ctx, req); err != nil { // handshake outside the timing
			b.Fatal(err)
		}
		b.SetParallelism(8) // many agents: keep requests in flight while others are being signed
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if _, err := client.CreateCertificate(ctx, req); err != nil {
					b.Error(err)
					return
				}
			}
		})
		b.StopTimer()
		rate(b)
		b.ReportMetric(rates[b.Name()], "signings/s")
		if bound := rates[parent+"/bound"]; bound > 0 {
			b.ReportMetric(100*rates[b.Name()]/bound, "%_of_bound")
		}
	})

}

// BenchmarkCreateCertificateUpstream compares, in one run, the signing rate end to end (as
// BenchmarkCreateCertificate's grpc line) of a single self-signed CA and of a downstream CA whose
// signing certificate an upstream issued (path length 0, a URI name constraint): its chain is one
// certificate longer. The downstream line reports its rate as a share of the single CA's.
func BenchmarkCreateCertificateUpstream(b *testing.B) {
	rates := map[string]float64{}
	parent := b.Name()
	for _, layout := range []string{"root", "downstream"} {
		name := map[string]string{"root": "single", "downstream": "downstream"}[layout]
		b.Run(name, func(b *testing.B) {
			h := newHarness(b, harnessOptions{layout: layout})
			tok := h.token(b, mintOptions{ttl: 24 * time.Hour})
			req := request(b, p256(b), []string{demoID()}, nil, time.Hour)
			client := h.dial(b, nil)
			ctx := withToken(b.Context(), tok)
			resp, err := client.CreateCertificate(ctx, req) // handshake outside the timing
			if err != nil {
				b.Fatal(err)
			}
			if want := map[string]int{"root": 2, "downstream": 3}[layout]; len(resp.GetCertChain()) != want {
				b.Fatalf("chain of %d certificates, want %d", len(resp.GetCertChain()), want)
			}
			b.SetParallelism(8)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := client.CreateCertificate(ctx, req); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.StopTimer()
			rates[b.Name()] = float64(b.N) / b.Elapsed().Seconds()
			b.ReportMetric(rates[b.Name()], "signings/s")
			if single := rates[parent+"/single"]; layout == "downstream" && single > 0 {
				b.ReportMetric(100*rates[b.Name()]/single, "%_of_single")
			}
		})
	}
}
