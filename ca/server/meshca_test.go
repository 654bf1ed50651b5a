package server_test

import (
	"context"
	"crypto/x509"
	"strings"
	"testing"
	"time"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshid/meshid/internal/meshcapb"
)

// meshRequest is req as the Mesh CA protocol asks it: the same CSR, the validity as a Duration
// (none when req asks for the default).
func meshRequest(req *pb.IstioCertificateRequest, id string) *meshcapb.MeshCertificateRequest {
	out := &meshcapb.MeshCertificateRequest{RequestId: id, Csr: req.GetCsr()}
	if s := req.GetValidityDuration(); s != 0 {
		out.Validity = durationpb.New(time.Duration(s) * time.Second)
	}
	return out
}

func TestMeshCAIssuesCallerIdentityWithChainOrder(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{maxTTL: 2 * time.Hour})
	client := h.dialMeshCA(t, nil)
	tests := []struct {
		name     string
		validity *durationpb.Duration
		want     time.Duration
	}{
		{"no validity: the default", nil, time.Hour},
		{"requested validity", durationpb.New(30 * time.Minute), 30 * time.Minute},
		{"clamped to the maximum", durationpb.New(100 * time.Hour), 2 * time.Hour},
		{"beyond time.Duration: clamped", &durationpb.Duration{Seconds: 315576000000}, 2 * time.Hour},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			key := p256(t)
			req := meshRequest(request(t, key, []string{demoID()}, nil, 0), "3f0c2b4e-8a1d-4c7e-9f5a-2d6b1e0a7c93")
			req.Validity = tt.validity
			resp, err := client.CreateCertificate(withToken(t.Context(), h.token(t, mintOptions{})), req)
			if err != nil {
				t.Fatal(err)
			}
			chain := parseChain(t, resp.GetCertChain())
			if len(chain) != 3 || !chain[1].Equal(h.intermediate.Cert) || !chain[2].Equal(h.root.Cert) {
				t.Fatalf("chain of %d is not leaf, intermediate, root", len(chain))
			}
			leaf := chain[0]
			if len(leaf.URIs) != 1 || leaf.URIs[0].String() != demoID() {
				t.Fatalf("leaf URIs = %v, want [%s]", leaf.URIs, demoID())
			}
			if got := leaf.NotAfter.Sub(h.clock.Now()); got != tt.want {
				t.Fatalf("lifetime %s, want %s", got, tt.want)
			}
		})
	}
	t.Cleanup(func() {
		if got := promtest.ToFloat64(counter(t, h.registry, "meshid_ca_certificate_requests_total",
			map[string]string{"service": "MeshCertificateService", "code": "OK"})); got != float64(len(tests)) {
			t.Errorf("Mesh CA requests counted %v, want %d", got, len(tests))
		}
		if got := promtest.ToFloat64(counter(t, h.registry, "meshid_ca_certificates_issued_total", map[string]string{"auth_method": "jwt"})); got != float64(len(tests)) {
			t.Errorf("issued counter = %v, want %d", got, len(tests))
		}
		if !strings.Contains(h.logs.String(), "request_id=3f0c2b4e-8a1d-4c7e-9f5a-2d6b1e0a7c93") || !strings.Contains(h.logs.String(), "grpc_service=MeshCertificateService") {
			t.Errorf("the issuance log names neither the request id nor the service:\n%s", h.logs.String())
		}
	})
}

// Both services refuse the same requests with the same code, counted under the same reason,
// logged once each: they share one pipeline.
func TestMeshCARefusesAsIstioCertificateService(t *testing.T) {
	t.Parallel()
	disabled := false
	h := newHarness(t, harnessOptions{})
	hDisabled := newHarness(t, harnessOptions{enabledByDefault: &disabled})
	tests := refusalCases(t, h, hDisabled)
	// The Mesh CA's own malformed validity.
	bad := meshRequest(request(t, p256(t), []string{demoID()}, nil, 0), "")
	bad.Validity = &durationpb.Duration{Seconds: 1, Nanos: -1}
	type call func(ctx context.Context, tc refusalCase) error
	services := map[string]call{
		"IstioCertificateService": func(ctx context.Context, tc refusalCase) error {
			_, err := tc.h.dial(t, nil).CreateCertificate(ctx, tc.req)
			return err
		},
		"MeshCertificateService": func(ctx context.Context, tc refusalCase) error {
			_, err := tc.h.dialMeshCA(t, nil).CreateCertificate(ctx, meshRequest(tc.req, "r"))
			return err
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Not parallel: the refusal counter's delta is this case's.
			refused := map[string]string{"reason": tt.reason, "code": tt.code.String()}
			before := promtest.ToFloat64(counter(t, tt.h.registry, "meshid_ca_requests_refused_total", refused))
			for service, send := range services {
				ctx := t.Context()
				if tt.auth != "" {
					ctx = metadata.AppendToOutgoingContext(ctx, "authorization", tt.auth)
				}
				if got := status.Code(send(ctx, tt)); got != tt.code {
					t.Fatalf("%s: code = %v, want %v", service, got, tt.code)
				}
				labels := map[string]string{"service": service, "code": tt.code.String()}
				if got := promtest.ToFloat64(counter(t, tt.h.registry, "meshid_ca_certificate_requests_total", labels)); got < 1 {
					t.Fatalf("%s: request not counted under %v", service, labels)
				}
			}
			// One reason, counted once by each service.
			if got := promtest.ToFloat64(counter(t, tt.h.registry, "meshid_ca_requests_refused_total", refused)) - before; got != 2 {
				t.Fatalf("refusal counted %v times under %v, want once per service", got, refused)
			}
		})
	}
	t.Run("malformed validity", func(t *testing.T) {
		_, err := h.dialMeshCA(t, nil).CreateCertificate(withToken(t.Context(), h.token(t, mintOptions{})), bad)
		if status.Code(err) != codes.InvalidArgument {
			t.Fatalf("code = %v (%v), want InvalidArgument", status.Code(err), err)
		}
		labels := map[string]string{"reason": "validity_duration", "code": "InvalidArgument"}
		if got := promtest.ToFloat64(counter(t, h.registry, "meshid_ca_requests_refused_total", labels)); got < 1 {
			t.Fatalf("refusal not counted under %v", labels)
		}
	})
}

// A workload that holds a certificate renews it over the Mesh CA with mTLS alone, as over
// Istio's protocol.
func TestMeshCAMTLS(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	leaf, key := h.intermediate.IssueWorkload(t, demoID(), time.Hour)
	client := h.dialMeshCA(t, tlsCert([]*x509.Certificate{leaf, h.intermediate.Cert}, key))
	resp, err := client.CreateCertificate(t.Context(), meshRequest(request(t, p256(t), nil, nil, 0), "renew"))
	if err != nil {
		t.Fatal(err)
	}
	if got := parseChain(t, resp.GetCertChain())[0].URIs[0].String(); got != demoID() {
		t.Fatalf("leaf names %s, want %s", got, demoID())
	}
	if got := promtest.ToFloat64(counter(t, h.registry, "meshid_ca_certificates_issued_total", map[string]string{"auth_method": "mtls"})); got != 1 {
		t.Fatalf("issued counter (mtls) = %v, want 1", got)
	}
}
