package sds

import (
	"context"
	"fmt"
	"slices"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	secretservice "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// Get asks the SDS server on the Unix socket at socketPath for names over StreamSecrets, as
// Envoy does, and returns each secret once every name has arrived (or ctx ends).
func Get(ctx context.Context, socketPath, nodeID string, names ...string) (map[string]*tlsv3.Secret, error) {
	conn, err := grpc.NewClient("unix://"+socketPath, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("SDS socket %s: %w", socketPath, err)
	}
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := secretservice.NewSecretDiscoveryServiceClient(conn).StreamSecrets(ctx)
	if err != nil {
		return nil, fmt.Errorf("SDS at %s: %w", socketPath, err)
	}
	req := &discovery.DiscoveryRequest{Node: &core.Node{Id: nodeID}, ResourceNames: names, TypeUrl: SecretTypeURL}
	if err := stream.Send(req); err != nil {
		return nil, fmt.Errorf("SDS at %s: %w", socketPath, err)
	}
	got := map[string]*tlsv3.Secret{}
	for len(got) < len(names) {
		resp, err := stream.Recv()
		if err != nil {
			return nil, fmt.Errorf("SDS at %s: %w", socketPath, err)
		}
		for _, r := range resp.GetResources() {
			s := &tlsv3.Secret{}
			if err := r.UnmarshalTo(s); err != nil {
				return nil, fmt.Errorf("SDS at %s sent an unreadable secret: %w", socketPath, err)
			}
			if slices.Contains(names, s.GetName()) {
				got[s.GetName()] = s
			}
		}
		// Acknowledge, as Envoy does, so that the rest is sent.
		ack := &discovery.DiscoveryRequest{VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce(), ResourceNames: names, TypeUrl: SecretTypeURL}
		if err := stream.Send(ack); err != nil {
			return nil, fmt.Errorf("SDS at %s: %w", socketPath, err)
		}
	}
	return got, nil
}
