package main

import (
	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/internal/attest"
)

// newAttestor makes node mode's attestor, which meshid-agent, a sidecar's binary serving one
// workload, leaves out with its rules parser.
func newAttestor(c agent.AttestConfig) (agent.Attestor, error) {
	a, err := attest.New(attest.Config{RulesFile: c.RulesFile, Clock: c.Clock, Logger: c.Logger, Registerer: c.Registerer})
	if err != nil {
		return nil, err
	}
	return a, nil
}
