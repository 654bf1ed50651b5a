//go:build external

package interop_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
)

// notRegistered is how the pilot-agent built here ends with CA_PROVIDER=GoogleCA: Istio removed
// its Mesh CA client (istio/istio#50989, "sds: remove Google CA clients", May 2024), and the
// module proxy serves no istio.io/istio older than that.
const notRegistered = `CA provider "GoogleCA" not registered`

// A real, unmodified pilot-agent cannot be checked against meshid's Mesh CA service: today's
// refuses CA_PROVIDER=GoogleCA before it asks any CA. This test states that fact, so that the day
// a pilot-agent speaks the Mesh CA protocol again it fails, and is replaced by one that gets a
// certificate from meshid ca through it (as TestPilotAgentServesACertificateFromMeshidCA does
// through Istio's protocol). meshid's own GoogleCA client and service are checked against each
// other in caclient, ca/server and agent.
func TestPilotAgentRefusesGoogleCA(t *testing.T) {
	t.Parallel()
	if !isolated(t) {
		return
	}
	m := startMesh(t, "prod", xdsConfig, "CA_PROVIDER=GoogleCA")
	<-m.Ctx.Done()
	cause := context.Cause(m.Ctx)
	if errors.Is(cause, context.DeadlineExceeded) || !strings.Contains(cause.Error(), "pilot-agent ended") {
		t.Fatalf("pilot-agent with CA_PROVIDER=GoogleCA did not end (%v): does it speak the Mesh CA protocol again? Then check it against meshid ca instead", cause)
	}
	out, err := os.ReadFile(m.Log)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), notRegistered) {
		t.Fatalf("pilot-agent with CA_PROVIDER=GoogleCA ended (%v) without saying %q: why it ends has changed", cause, notRegistered)
	}
}
