package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// BenchmarkCASecrets measures `meshid ca --manifests` keeping a secret for every service account:
// from exec until every secret directory holds its first generation, and the CA's resident set
// then (VmRSS). The store is 10,000 service accounts in 1,000 namespaces; the baseline, in the
// same run, is 10 in one namespace.
func BenchmarkCASecrets(b *testing.B) {
	bin := agentBinary(b) // meshid: the CA and its controller
	for _, tc := range []struct {
		name                 string
		namespaces, accounts int  // accounts per namespace
		tmpfs                bool // the state dir in memory: what the disk's inode allocation costs
	}{
		{"baseline-10-accounts", 1, 10, false},
		{"10000-accounts-1000-namespaces", 1000, 10, false},
		{"10000-accounts-1000-namespaces-tmpfs", 1000, 10, true},
	} {
		b.Run(tc.name, func(b *testing.B) {
			manifests := b.TempDir()
			writeManifests(b, manifests, tc.namespaces, tc.accounts)
			want := tc.namespaces * tc.accounts
			for range b.N {
				b.StopTimer()
				state := b.TempDir()
				if tc.tmpfs {
					state = memoryDir(b)
				}
				cmd := exec.Command(bin, "ca", "--state-dir", state, "--manifests", manifests,
					"--grpc-addr", "127.0.0.1:0", "--monitoring-addr", "127.0.0.1:0", "--log-level", "warn")
				cmd.Stderr = os.Stderr
				b.StartTimer()
				start := time.Now()
				if err := cmd.Start(); err != nil {
					b.Fatal(err)
				}
				for n := 0; n < want; n = secretsWritten(b, state) {
					if time.Since(start) > 2*time.Minute {
						_ = cmd.Process.Kill()
						b.Fatalf("%d of %d secrets after %s", n, want, time.Since(start))
					}
					time.Sleep(20 * time.Millisecond) // polling a process's output, not waiting for time
				}
				b.StopTimer()
				b.ReportMetric(time.Since(start).Seconds(), "s-to-all")
				b.ReportMetric(rssOf(b, cmd.Process.Pid)/1024, "rss-MB")
				_ = cmd.Process.Kill()
				_ = cmd.Wait()
				b.StartTimer()
			}
		})
	}
}

func writeManifests(b *testing.B, dir string, namespaces, accounts int) {
	b.Helper()
	var sb strings.Builder
	for ns := range namespaces {
		fmt.Fprintf(&sb, "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: ns-%d\n", ns)
		for sa := range accounts {
			fmt.Fprintf(&sb, "---\napiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: sa-%d\n  namespace: ns-%d\n", sa, ns)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "cluster.yaml"), []byte(sb.String()), 0o644); err != nil {
		b.Fatal(err)
	}
}

// secretsWritten counts the secret directories whose first generation is in place.
func secretsWritten(b *testing.B, state string) int {
	b.Helper()
	links, err := filepath.Glob(filepath.Join(state, "secrets", "*", "istio.*", "..data"))
	if err != nil {
		b.Fatal(err)
	}
	return len(links)
}

// memoryDir is a temporary directory on /dev/shm (tmpfs), removed when the benchmark ends.
func memoryDir(b *testing.B) string {
	b.Helper()
	dir, err := os.MkdirTemp("/dev/shm", "meshid-bench-")
	if err != nil {
		b.Skipf("no tmpfs at /dev/shm: %v", err)
	}
	b.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}
