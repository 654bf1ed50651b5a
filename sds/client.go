package sds

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"slices"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	secretservice "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/secretmanager"
)

// Get asks the SDS server on the Unix socket at socketPath for names and returns each secret.
// It asks with FetchSecrets, which a server that holds nothing valid answers at once with the
// reason; a server without FetchSecrets (Istio's agent) is asked over StreamSecrets, as Envoy
// does, until every name has arrived or ctx ends.
func Get(ctx context.Context, socketPath, nodeID string, names ...string) (map[string]*tlsv3.Secret, error) {
	conn, err := grpc.NewClient("unix://"+socketPath, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("SDS socket %s: %w", socketPath, err)
	}
	defer func() { _ = conn.Close() }()
	client := secretservice.NewSecretDiscoveryServiceClient(conn)
	req := &discovery.DiscoveryRequest{Node: &core.Node{Id: nodeID}, ResourceNames: names, TypeUrl: SecretTypeURL}
	resp, err := client.FetchSecrets(ctx, req)
	switch {
	case status.Code(err) == codes.Unimplemented:
		return streamGet(ctx, client, req)
	case err != nil:
		return nil, fmt.Errorf("SDS at %s: %w", socketPath, err)
	}
	got, err := decodeSecrets(resp, names)
	if err != nil {
		return nil, fmt.Errorf("SDS at %s: %w", socketPath, err)
	}
	for _, n := range names {
		if got[n] == nil {
			return nil, fmt.Errorf("SDS at %s did not send %q", socketPath, n)
		}
	}
	return got, nil
}

func streamGet(ctx context.Context, client secretservice.SecretDiscoveryServiceClient, req *discovery.DiscoveryRequest) (map[string]*tlsv3.Secret, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := client.StreamSecrets(ctx)
	if err != nil {
		return nil, err
	}
	if err := st.Send(req); err != nil {
		return nil, err
	}
	names := req.GetResourceNames()
	got := map[string]*tlsv3.Secret{}
	for len(got) < len(names) {
		resp, err := st.Recv()
		if err != nil {
			return nil, err
		}
		secrets, err := decodeSecrets(resp, names)
		if err != nil {
			return nil, err
		}
		for n, s := range secrets {
			got[n] = s
		}
		// Acknowledge, as Envoy does, so that the rest is sent.
		ack := &discovery.DiscoveryRequest{VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce(), ResourceNames: names, TypeUrl: SecretTypeURL}
		if err := st.Send(ack); err != nil {
			return nil, err
		}
	}
	return got, nil
}

func decodeSecrets(resp *discovery.DiscoveryResponse, names []string) (map[string]*tlsv3.Secret, error) {
	got := map[string]*tlsv3.Secret{}
	for _, r := range resp.GetResources() {
		s := &tlsv3.Secret{}
		if err := r.UnmarshalTo(s); err != nil {
			return nil, fmt.Errorf("an unreadable secret: %w", err)
		}
		if slices.Contains(names, s.GetName()) {
			got[s.GetName()] = s
		}
	}
	return got, nil
}

// CertReport is what an SDS server hands Envoy, as `meshid certs` shows it.
type CertReport struct {
	Socket    string    `json:"socket"`
	SPIFFEID  string    `json:"spiffe_id"`
	Subject   string    `json:"subject"`
	Issuer    string    `json:"issuer"`
	Serial    string    `json:"serial"`
	NotBefore time.Time `json:"not_before"`
	NotAfter  time.Time `json:"not_after"`
	TimeLeft  string    `json:"time_left"`
	ChainLen  int       `json:"chain_length"`
	Roots     []string  `json:"roots"`
	// Verified says whether the chain of "default" verifies against "ROOTCA" now; VerifyError why not.
	Verified    bool   `json:"verified"`
	VerifyError string `json:"verify_error,omitempty"`
}

// Inspect fetches "default" and "ROOTCA" from the SDS server on socketPath and reports the
// certificate and whether its chain verifies against the trust bundle at now.
func Inspect(ctx context.Context, socketPath string, now time.Time) (*CertReport, error) {
	got, err := Get(ctx, socketPath, "meshid-certs", secretmanager.WorkloadCertName, secretmanager.RootCertName)
	if err != nil {
		return nil, err
	}
	tlsCert := got[secretmanager.WorkloadCertName].GetTlsCertificate()
	if tlsCert == nil {
		return nil, errors.New(`the "default" secret holds no certificate`)
	}
	chain, err := pki.ParseCertificates(tlsCert.GetCertificateChain().GetInlineBytes())
	if err != nil {
		return nil, fmt.Errorf(`the "default" secret: %w`, err)
	}
	roots, err := pki.ParseCertificates(got[secretmanager.RootCertName].GetValidationContext().GetTrustedCa().GetInlineBytes())
	if err != nil {
		return nil, fmt.Errorf(`the "ROOTCA" secret: %w`, err)
	}
	leaf := chain[0]
	r := &CertReport{
		Socket:    socketPath,
		Subject:   leaf.Subject.String(),
		Issuer:    leaf.Issuer.String(),
		Serial:    leaf.SerialNumber.Text(16),
		NotBefore: leaf.NotBefore,
		NotAfter:  leaf.NotAfter,
		TimeLeft:  leaf.NotAfter.Sub(now).Round(time.Second).String(),
		ChainLen:  len(chain),
	}
	if len(leaf.URIs) > 0 {
		r.SPIFFEID = leaf.URIs[0].String()
	}
	rootPool, interPool := x509.NewCertPool(), x509.NewCertPool()
	for _, root := range roots {
		rootPool.AddCert(root)
		r.Roots = append(r.Roots, root.Subject.String())
	}
	for _, c := range chain[1:] {
		interPool.AddCert(c)
	}
	_, err = leaf.Verify(x509.VerifyOptions{Roots: rootPool, Intermediates: interPool, CurrentTime: now,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}})
	r.Verified = err == nil
	if err != nil {
		r.VerifyError = err.Error()
	}
	return r, nil
}
