package main

import (
	"context"
	"fmt"

	"golang.org/x/sync/errgroup"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/ca/controller/kube"
	"github.com/meshid/meshid/internal/attest"
	"github.com/meshid/meshid/internal/clock"
)

// newAttestor makes node mode's attestor, which meshid-agent, a sidecar's binary serving one
// workload, leaves out with its rules parser and the Kubernetes client.
func newAttestor(c agent.AttestConfig) (agent.Attestor, error) {
	if c.Pods.Enabled {
		routeClientGoLogs(c.Logger)
	}
	return newAttestorIn("", nil, c)
}

// newAttestorIn is newAttestor reading processes from the /proc tree at proc ("": the real
// one), and timing the wait for a pod not listed yet on podClock (nil: the agent's clock).
func newAttestorIn(proc string, podClock clock.Clock, c agent.AttestConfig) (agent.Attestor, error) {
	if podClock == nil {
		podClock = c.Clock
	}
	cfg := attest.Config{RulesFile: c.RulesFile, Proc: proc, Clock: c.Clock, Logger: c.Logger, Registerer: c.Registerer}
	var pods *kube.LocalPods
	if c.Pods.Enabled {
		rest, err := kube.LoadConfig(c.Pods.Kubeconfig) // "": in-cluster
		if err != nil {
			return nil, err
		}
		rest.UserAgent = "meshid-node-agent"
		clients, err := kube.NewClients(rest)
		if err != nil {
			return nil, fmt.Errorf("the node agent's Kubernetes client: %w", err)
		}
		if pods, err = kube.NewLocalPods(kube.LocalPodsConfig{Clients: clients, NodeName: c.Pods.NodeName, Clock: podClock,
			Logger: c.Logger, Registerer: c.Registerer}); err != nil {
			return nil, err
		}
		cfg.Pods = pods
	}
	a, err := attest.New(cfg)
	if err != nil {
		return nil, err
	}
	if pods == nil {
		return a, nil
	}
	return &podAttestor{Attestor: a, pods: pods}, nil
}

// podAttestor is an Attestor that asks the node's pods for a caller no rule matches.
type podAttestor struct {
	*attest.Attestor
	pods *kube.LocalPods
}

// Run watches the rules file and the node's pods until ctx ends.
func (a *podAttestor) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return a.Attestor.Run(ctx) })
	g.Go(func() error { return a.pods.Run(ctx) })
	return g.Wait()
}

// Problem says why callers in pods cannot be identified yet: the agent is not ready until the
// node's pods are listed.
func (a *podAttestor) Problem() error {
	select {
	case <-a.pods.Synced():
		return nil
	default:
		return fmt.Errorf("the pods of node %s have not been listed yet", a.pods.Node())
	}
}
