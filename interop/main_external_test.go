//go:build external

package interop_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// istioBinEnv names the directory holding pilot-agent: make test sets it from hack/istio-env.sh,
// and TestMain sets it for the re-executed children when it is not set.
const istioBinEnv = "MESHID_ISTIO_BIN"

// TestMain finds (building it the first time) the pilot-agent the tests run, once for the whole
// package: parallel tests would otherwise race to build it. A pilot-agent that cannot be had
// fails the package loudly: the tests are never skipped.
func TestMain(m *testing.M) {
	if _, envoy := os.LookupEnv(fakeEnvoyEnv); envoy {
		os.Exit(fakeEnvoy())
	}
	if _, child := os.LookupEnv(childEnv); !child {
		dir, err := istioBinaries()
		if err != nil {
			fmt.Fprintf(os.Stderr, "interop: cannot build pilot-agent for the tests: %v\n", err)
			os.Exit(1)
		}
		// pilot-agent runs from a directory of its own.
		if dir, err = filepath.Abs(dir); err != nil {
			fmt.Fprintf(os.Stderr, "interop: %v\n", err)
			os.Exit(1)
		}
		if err := os.Setenv(istioBinEnv, dir); err != nil {
			fmt.Fprintf(os.Stderr, "interop: %v\n", err)
			os.Exit(1)
		}
	}
	os.Exit(m.Run())
}

// fakeEnvoyEnv marks the test binary started by pilot-agent as its Envoy.
const fakeEnvoyEnv = "MESHID_INTEROP_FAKE_ENVOY"

// fakeEnvoy stands in for Envoy, which is not to be had here. pilot-agent serves SDS only when
// it runs an Envoy (with DISABLE_ENVOY it keeps the certificate to itself), and ends when its
// Envoy does; so this one does nothing but live until pilot-agent stops it or dies, and the
// tests speak to pilot-agent's sockets as Envoy would.
func fakeEnvoy() int {
	// Killed with pilot-agent, however it ends.
	if err := unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(unix.SIGKILL), 0, 0, 0); err != nil {
		fmt.Fprintf(os.Stderr, "fake envoy: %v\n", err)
		return 1
	}
	fmt.Printf("fake envoy: started as %q\n", os.Args[1:])
	ctx, stop := signal.NotifyContext(context.Background(), unix.SIGTERM, unix.SIGINT)
	defer stop()
	<-ctx.Done()
	fmt.Println("fake envoy: stopped")
	return 0
}

// istioBinaries returns the directory holding pilot-agent: $MESHID_ISTIO_BIN when set, else what
// hack/istio-env.sh prints, building it the first time.
func istioBinaries() (string, error) {
	if dir := os.Getenv(istioBinEnv); dir != "" {
		return dir, nil
	}
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("cannot locate the repository")
	}
	script := filepath.Join(filepath.Dir(file), "..", "hack", "istio-env.sh")
	var stderr bytes.Buffer
	cmd := exec.Command(script)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("%s: %w\n%s", script, err, stderr.String())
	}
	return strings.TrimSpace(string(out)), nil
}
