//go:build external

package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshid/meshid/ca/controller/kube/kubetest"
	"github.com/meshid/meshid/internal/testutil"
)

// client-go's own log lines (here leader election's, which it logs at start) come out of
// `meshid ca --log-format json` as the CA's lines do: JSON, marked component=client-go. klog's
// logger is the process's, so only a process of its own shows it: this binary run as meshid.
func TestCAClientGoLogsAreTheCAsFormat(t *testing.T) {
	t.Parallel()
	kubeEnv.Apply(t, false, filepath.Join("..", "..", "deploy", "kubernetes", "00-namespace.yaml"))
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "--", "ca", "--state-dir", filepath.Join(t.TempDir(), "state"),
		"--grpc-addr", "127.0.0.1:0", "--monitoring-addr", "", "--log-format", "json",
		"--kubeconfig", kubetest.Kubeconfig(t, t.TempDir(), kubeEnv.Admin), "--ca-namespace", "istio-system")
	cmd.Env = append(os.Environ(), helperProcessEnv+"=1")
	ca := testutil.StartProcess(t, "meshid ca", cmd)
	at, err := ca.FindLine(0, kubetest.WaitLimit, "client-go's leader election line", func(l string) bool { return strings.Contains(l, "leader lease") })
	if err != nil {
		t.Fatal(err)
	}
	line := ca.Lines(at, at+1)[0]
	var rec map[string]any
	if err := json.Unmarshal([]byte(line), &rec); err != nil || rec["component"] != "client-go" {
		t.Fatalf("client-go's line %q is not JSON of component client-go (%v)", line, err)
	}
}
