package controlplane

import (
	"context"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/pki"
)

// EmbeddedConfig configures a control plane that an agent runs in-process.
type EmbeddedConfig struct {
	StateDir    string // locked by the agent
	SocketPath  string // the private socket the CA protocol is served on
	TrustDomain string
	Identity    pki.SPIFFEID // the workload the agent mints tokens for
	// NodeAgent trusts Identity's account as a node account (TrustedNodeAccounts): the agent
	// asks for its callers' identities.
	NodeAgent bool
	Clock     clock.Clock
	Logger    *slog.Logger
}

// Embedded is a control plane run in-process by an agent given no CA address: it serves on a
// private Unix socket, without a monitoring server, and mints the agent's tokens with its own
// key, so that the agent reaches it through its ordinary CA client.
type Embedded struct {
	*ControlPlane
	stateDir string
	identity pki.SPIFFEID
	clock    clock.Clock
	minter   *token.Minter
}

// embeddedTokenTTL is the life of a token minted for one request of the embedding agent.
const embeddedTokenTTL = 5 * time.Minute

// EmbeddedManifestsDir is where, in its state dir, an embedded control plane finds the
// Namespace and ServiceAccount manifests namespace targeting reads, when the directory exists.
const EmbeddedManifestsDir = "manifests"

// EmbeddedXDSConfig is where, in its state dir, an embedded control plane finds the discovery
// configuration it serves the agent's xDS proxy, when the file exists; without it, Envoy gets an
// empty configuration.
const EmbeddedXDSConfig = "xds.yaml"

// NewEmbedded builds the control plane for an agent; see New.
func NewEmbedded(e EmbeddedConfig) (*Embedded, error) {
	cfg := DefaultConfig()
	cfg.StateDir = e.StateDir
	if dir := filepath.Join(e.StateDir, EmbeddedManifestsDir); fsutil.IsDir(dir) {
		cfg.Manifests = dir
	}
	if file := filepath.Join(e.StateDir, EmbeddedXDSConfig); fsutil.IsRegular(file) {
		cfg.XDSConfig = file
	} else {
		cfg.embeddedXDSConfig = file
	}
	cfg.GRPCAddr = fsutil.UnixScheme + e.SocketPath
	cfg.MonitoringAddr = ""
	cfg.TrustDomain = e.TrustDomain
	if e.NodeAgent {
		cfg.TrustedNodeAccounts = []string{e.Identity.Namespace + "/" + e.Identity.ServiceAccount}
	}
	cfg.Clock = e.Clock
	cfg.Logger = e.Logger
	// No upstream CA and no Kubernetes: nothing of this start waits on the network, and there
	// is nothing for a caller's context to cut short (the agent builds it in New, before Run).
	cp, err := New(context.Background(), cfg)
	if err != nil {
		return nil, err
	}
	// New has created the token key: read it once.
	minter, err := token.LoadMinter(ca.TokenKeyPath(e.StateDir))
	if err != nil {
		cp.Close()
		return nil, err
	}
	return &Embedded{ControlPlane: cp, stateDir: e.StateDir, identity: e.Identity, clock: clock.OrReal(e.Clock), minter: minter}, nil
}

// RootCertFile is the trust bundle that verifies the control plane.
func (e *Embedded) RootCertFile() string { return ca.RootCertPath(e.stateDir) }

// Token mints a short-lived token for the agent's workload, afresh for every request so that none
// expires in use.
func (e *Embedded) Token(context.Context) (string, error) {
	return e.minter.Mint(token.MintParams{
		Issuer:         token.DefaultIssuer,
		Audiences:      []string{token.DefaultAudience},
		Namespace:      e.identity.Namespace,
		ServiceAccount: e.identity.ServiceAccount,
		TTL:            embeddedTokenTTL,
		Now:            e.clock.Now(),
	})
}
