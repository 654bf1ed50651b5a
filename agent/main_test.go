package agent_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package when a goroutine outlives its tests: Run returns once every
// goroutine it started (SDS streams and pushes, watchers, the xDS proxy) has ended. Run with
// sdsClientEnv set, the test binary (or a copy of it) is instead an SDS client of that socket,
// for node mode's attestation of real executables (sdsClientMain); with sdsStreamEnv, it follows
// one stream (sdsStreamMain).
func TestMain(m *testing.M) {
	if socket := os.Getenv(sdsClientEnv); socket != "" {
		os.Exit(sdsClientMain(socket))
	}
	if socket := os.Getenv(sdsStreamEnv); socket != "" {
		os.Exit(sdsStreamMain(socket))
	}
	goleak.VerifyTestMain(m)
}
