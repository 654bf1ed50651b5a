package workloadapi_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package when a goroutine outlives its tests: a stream's handler ends when
// its client goes.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
