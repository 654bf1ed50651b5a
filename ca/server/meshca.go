package server

import (
	"context"
	"fmt"
	"time"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/meshcapb"
)

// MeshCAServer serves the Mesh CA protocol (google.security.meshca.v1, what Istio's agent spoke
// with CA_PROVIDER=GoogleCA) on the pipeline of the Server it was made from: the same
// authentication, targeting, signing, refusals and metrics as IstioCertificateService.
type MeshCAServer struct {
	meshcapb.UnimplementedMeshCertificateServiceServer
	s *Server
}

// MeshCA returns the Mesh CA front of s.
func (s *Server) MeshCA() *MeshCAServer { return &MeshCAServer{s: s} }

// CreateCertificate signs the CSR for the caller's own identity. The validity is clamped as
// IstioCertificateService's validity_duration is: none asks for the default, more than the
// maximum gets the maximum, a negative one is refused.
func (m *MeshCAServer) CreateCertificate(ctx context.Context, req *meshcapb.MeshCertificateRequest) (*meshcapb.MeshCertificateResponse, error) {
	ir := issueRequest{csrPEM: req.GetCsr(), requestID: req.GetRequestId()}
	ir.ttl, ir.ttlErr = validity(req)
	chain, err := m.s.issue(ctx, ServiceMeshCA, ir)
	if err != nil {
		return nil, err
	}
	return &meshcapb.MeshCertificateResponse{CertChain: chain}, nil
}

// validity reads the request's Duration, saturating beyond time.Duration's range as
// secondsToDuration does.
func validity(req *meshcapb.MeshCertificateRequest) (time.Duration, error) {
	v := req.GetValidity()
	if v == nil {
		return 0, nil
	}
	if err := v.CheckValid(); err != nil {
		return 0, fmt.Errorf("%w: validity: %w", ca.ErrInvalidTTL, err)
	}
	return v.AsDuration(), nil
}
