package agent_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package when a goroutine outlives its tests: Run returns once every
// goroutine it started (SDS streams and pushes, watchers, the xDS proxy) has ended.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
