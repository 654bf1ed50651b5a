package main

import (
	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/controlplane"
)

// embedControlPlane runs `meshid ca` inside an agent given no CA address.
func embedControlPlane(e agent.EmbedConfig) (agent.ControlPlane, error) {
	cp, err := controlplane.NewEmbedded(controlplane.EmbeddedConfig{
		StateDir: e.StateDir, SocketPath: e.SocketPath, TrustDomain: e.TrustDomain,
		Identity: e.Identity, NodeAgent: e.NodeAgent, Clock: e.Clock, Logger: e.Logger,
	})
	if err != nil {
		return nil, err
	}
	return cp, nil
}
