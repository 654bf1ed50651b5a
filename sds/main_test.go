package sds_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package when a goroutine outlives its tests: every goroutine the server
// starts, for a stream or a push, ends before Run returns.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
