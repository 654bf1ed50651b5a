//go:build !external

package interop_test

import "testing"

// Every test of this package runs a real Istio pilot-agent, which hack/istio-env.sh builds from
// the module proxy: they are built with -tags external, as make test does, so that a plain go
// test needs nothing from outside.
func TestPilotAgentNeedsTagExternal(t *testing.T) {
	t.Skip("the tests with a real pilot-agent are built with -tags external: run make test (or hack/istio-env.sh, then go test -tags external)")
}
