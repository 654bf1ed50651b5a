package agent

import (
	"context"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/secretmanager"
	"github.com/meshid/meshid/workloadapi"
)

// Node mode (--workload-attestation): one agent, one socket, many workloads. Its implementation
// is agent/nodemode, reached through Config.SDS.Node, so that meshid-agent, which serves one
// workload, links none of it.

// NodeFunc makes node mode's parts from what the agent built for it (agent/nodemode's New).
type NodeFunc func(NodeConfig) (Node, error)

// NodeConfig is what the agent gives a NodeFunc.
type NodeConfig struct {
	RulesFile string // SDS.WorkloadAttestation; "": none
	Pods      AttestPods
	// TrustDomain names the callers' identities; Self is the agent's own (the node account).
	TrustDomain string
	Self        pki.SPIFFEID
	Certificate CertificateConfig
	// CA is the CA client of the agent's own identity, which asks for each caller's.
	CA NodeCA
	// RootCertFile is where the CA's root is, for the identities' bundles.
	RootCertFile string
	// FileWatch is the agent's one inotify instance, for every identity's secret manager.
	FileWatch  *filewatch.Hub
	OnEvent    func(secretmanager.Event)
	Clock      clock.Clock
	Logger     *slog.Logger
	Registerer prometheus.Registerer
}

// NodeCA is what node mode asks of the CA: a signer (and JWT-SVID minter) of each caller's
// identity, as a trusted node account, and the JWT bundle. *caclient.Client is one.
type NodeCA interface {
	ForIdentity(id pki.SPIFFEID) (*caclient.IdentitySigner, error)
	FetchJWTBundle(ctx context.Context) (caclient.JWTBundle, error)
}

// Node is what the agent needs of node mode: the SDS server's secrets, names, credentials and
// stream interceptor, the Workload API's secrets, caller names and JWT issuer, a Run for its
// goroutines, why it cannot serve yet, and the identities it holds (/debug/secrets).
type Node interface {
	Subscribe(key string, fn func(*secretmanager.Secret, error)) (cancel func(), err error)
	Resolve(ctx context.Context, requested string) (string, error)
	Credentials(inner credentials.TransportCredentials) credentials.TransportCredentials
	StreamInterceptor(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error
	Identify(ctx context.Context) (workloadapi.Names, error)
	workloadapi.JWTIssuer
	Run(ctx context.Context) error
	Problem() error
	Held() []string
}
