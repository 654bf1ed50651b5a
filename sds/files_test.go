package sds_test

import (
	"context"
	"crypto/x509"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"

	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds/sdsclient"
	"github.com/meshid/meshid/sds/sdstest"
	"github.com/meshid/meshid/secretmanager"
)

// fileSetup is the real secret manager in file mode, serving file resources from allowed, with
// an SDS server in front of it.
type fileSetup struct {
	clock   *testutil.FakeClock
	ca      *testutil.CA
	allowed string // FileResourceDirs
	outside string // a directory files may not be served from
	h       *harness
}

func startFileSetup(t *testing.T) *fileSetup {
	t.Helper()
	fs := &fileSetup{
		clock:   testutil.NewFakeClock(time.Now()),
		ca:      testutil.NewRootCA(t, testutil.CAOptions{}),
		allowed: t.TempDir(),
		outside: t.TempDir(),
	}
	workload := t.TempDir()
	fs.writePair(t, workload, "cert-chain.pem", "key.pem")
	testutil.WriteFiles(t, workload, map[string][]byte{"root-cert.pem": testutil.CertPEM(fs.ca.Cert)})
	fs.writePair(t, fs.allowed, "cert.pem", "key.pem")
	testutil.WriteFiles(t, fs.allowed, map[string][]byte{"root.pem": testutil.CertPEM(fs.ca.Cert)})
	fs.writePair(t, fs.outside, "cert.pem", "key.pem")
	if err := os.Symlink(filepath.Join(fs.outside, "key.pem"), filepath.Join(fs.allowed, "link-key.pem")); err != nil {
		t.Fatal(err)
	}

	m, err := secretmanager.New(secretmanager.Config{
		Workload: &secretmanager.MountedFiles{
			CertChain: filepath.Join(workload, "cert-chain.pem"),
			Key:       filepath.Join(workload, "key.pem"),
			Root:      filepath.Join(workload, "root-cert.pem"),
		},
		FileResourceDirs: []string{fs.allowed},
		Clock:            fs.clock,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("secret manager: %v", err)
		}
	})
	// The manager reads the workload files once its watches are in place: from then on, a
	// change is seen. The first state it tells of "default" says that it has read them.
	read := make(chan error, 1)
	stop, err := m.Subscribe(secretmanager.WorkloadCertName, func(s *secretmanager.Secret, err error) {
		select {
		case read <- err:
		default:
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	if err := receive(t, read); err != nil {
		t.Fatalf("the workload files: %v", err)
	}
	fs.h = startServer(t, m)
	return fs
}

// writePair writes a new workload key pair into dir, each file replaced atomically by a rename.
func (fs *fileSetup) writePair(t *testing.T, dir, cert, key string) *secretmanager.Secret {
	t.Helper()
	leaf, k := fs.ca.IssueWorkload(t, workloadID, time.Hour)
	s := &secretmanager.Secret{KeyPair: &secretmanager.KeyPair{ChainPEM: testutil.CertPEM(leaf, fs.ca.Cert), KeyPEM: testutil.KeyPEM(t, k)}}
	for name, data := range map[string][]byte{cert: s.KeyPair.ChainPEM, key: s.KeyPair.KeyPEM} {
		tmp := filepath.Join(dir, "."+name+".tmp")
		if err := os.WriteFile(tmp, data, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	return s
}

func (fs *fileSetup) read(t *testing.T, name, cert, key string) *secretmanager.Secret {
	t.Helper()
	chain, err := os.ReadFile(cert)
	if err != nil {
		t.Fatal(err)
	}
	s := &secretmanager.Secret{Name: name, KeyPair: &secretmanager.KeyPair{ChainPEM: chain}}
	if s.KeyPair.KeyPEM, err = os.ReadFile(key); err != nil {
		t.Fatal(err)
	}
	return s
}

func TestFileResources(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// resource is the name asked for, given the allowed and the outside directories.
		resource func(allowed, outside string) string
		code     codes.Code
	}{
		{name: "inside the allowed dir", resource: func(a, _ string) string {
			return "file-cert:" + filepath.Join(a, "cert.pem") + "~" + filepath.Join(a, "key.pem")
		}},
		{name: "root inside the allowed dir", resource: func(a, _ string) string {
			return "file-root:" + filepath.Join(a, "root.pem")
		}},
		{name: "outside", code: codes.PermissionDenied, resource: func(_, o string) string {
			return "file-cert:" + filepath.Join(o, "cert.pem") + "~" + filepath.Join(o, "key.pem")
		}},
		{name: "key outside", code: codes.PermissionDenied, resource: func(a, o string) string {
			return "file-cert:" + filepath.Join(a, "cert.pem") + "~" + filepath.Join(o, "key.pem")
		}},
		{name: "symlink inside to a key outside", code: codes.PermissionDenied, resource: func(a, _ string) string {
			return "file-cert:" + filepath.Join(a, "cert.pem") + "~" + filepath.Join(a, "link-key.pem")
		}},
		{name: "dot-dot out of the allowed dir", code: codes.PermissionDenied, resource: func(a, o string) string {
			return "file-cert:" + a + "/../" + filepath.Base(o) + "/cert.pem~" + filepath.Join(a, "key.pem")
		}},
		{name: "malformed", code: codes.InvalidArgument, resource: func(a, _ string) string {
			return "file-cert:" + filepath.Join(a, "cert.pem")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			fs := startFileSetup(t)
			name := tc.resource(fs.allowed, fs.outside)
			s := fs.h.sotw()
			s.Subscribe(name)
			if tc.code != codes.OK {
				st := s.RecvErr()
				if st.Code() != tc.code || !strings.Contains(st.Message(), name) {
					t.Fatalf("stream ended with %v %q, want %v naming %s", st.Code(), st.Message(), tc.code, name)
				}
				return
			}
			got := s.Recv()
			if strings.HasPrefix(name, secretmanager.FileRootPrefix) {
				root, err := os.ReadFile(filepath.Join(fs.allowed, "root.pem"))
				if err != nil {
					t.Fatal(err)
				}
				expect(t, got, &secretmanager.Secret{Name: name, Bundle: &secretmanager.TrustBundle{Roots: []*x509.Certificate{fs.ca.Cert}, PEM: root}, Version: got.Version})
				return
			}
			want := fs.read(t, name, filepath.Join(fs.allowed, "cert.pem"), filepath.Join(fs.allowed, "key.pem"))
			if err := checkSecret(got.Secrets[name], want); err != nil || len(got.Secrets) != 1 {
				t.Fatalf("pushed %v: %v", got.Names(), err)
			}
		})
	}
}

// A swap of the files (each replaced by a rename) is pushed to the subscribed stream once the
// manager's debounce has passed on its fake clock.
func TestFileSwapIsPushed(t *testing.T) {
	t.Parallel()
	fs := startFileSetup(t)
	cert, key := filepath.Join(fs.allowed, "cert.pem"), filepath.Join(fs.allowed, "key.pem")
	name := "file-cert:" + cert + "~" + key
	s := fs.h.sotw()
	s.Subscribe(name)
	first := s.Recv()
	if err := checkSecret(first.Secrets[name], fs.read(t, name, cert, key)); err != nil {
		t.Fatal(err)
	}
	s.Ack(first, name)

	type result struct {
		resp *discovery.DiscoveryResponse
		err  error
	}
	pushed := make(chan result, 1)
	go func() {
		resp, err := s.Stream.Recv()
		pushed <- result{resp, err}
	}()
	want := fs.writePair(t, fs.allowed, "cert.pem", "key.pem")
	want.Name = name
	// Baseline 1: in file mode the manager's one long-lived timer is the expiry of the key pairs
	// it holds; every other pending one is the file watcher's debounce.
	r := testutil.Drive(t, fs.clock, filewatch.DefaultDebounce, 1, pushed)
	if r.err != nil {
		t.Fatalf("Recv: %v", r.err)
	}
	got := sdstest.Decode(t, nil, r.resp.GetResources())
	if len(got) != 1 {
		t.Fatalf("pushed %d secrets, want 1", len(got))
	}
	if err := checkSecret(got[name], want); err != nil {
		t.Fatal(err)
	}
}

// In file mode, default and ROOTCA come from the workload files.
func TestFileModeWorkload(t *testing.T) {
	t.Parallel()
	fs := startFileSetup(t)
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	got, err := sdsclient.Get(ctx, fs.h.socket, nodeID, dflt, rootCA)
	if err != nil {
		t.Fatal(err)
	}
	if got[dflt].GetTlsCertificate() == nil || got[rootCA].GetValidationContext() == nil {
		t.Fatalf("got %v", got)
	}
}
