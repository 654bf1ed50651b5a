package upstream_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/fsutil"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/internal/upstream"
)

// tlsServer serves TLS on 127.0.0.1 with a certificate for "istiod" issued by ca, completing
// every handshake.
func tlsServer(t *testing.T, ca *testutil.CA) string {
	t.Helper()
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		t.Fatal(err)
	}
	leaf := ca.Issue(t, &x509.Certificate{
		DNSNames: []string{"istiod"}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, key.Public())
	lis, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		MinVersion:   tls.VersionTLS12,
		Certificates: []tls.Certificate{{Certificate: [][]byte{leaf.Raw}, PrivateKey: key}},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lis.Close() })
	go func() {
		for {
			conn, err := lis.Accept()
			if err != nil {
				return
			}
			_ = conn.(*tls.Conn).Handshake()
			_ = conn.Close()
		}
	}()
	return lis.Addr().String()
}

// The roots are read from their file as each connection is made: a rotated root file reaches the
// next connection, whichever client (the CA client or the xDS proxy's) makes it.
func TestTLSConfigReadsTheRootFileAtEachHandshake(t *testing.T) {
	t.Parallel()
	serverCA, otherCA := testutil.NewRootCA(t, testutil.CAOptions{}), testutil.NewRootCA(t, testutil.CAOptions{})
	addr := tlsServer(t, serverCA)
	rootFile := filepath.Join(t.TempDir(), "root-cert.pem")
	creds := &upstream.Credentials{RootCertFile: rootFile, ServerName: "istiod"}
	handshake := func() error {
		conn, err := tls.Dial("tcp", addr, creds.TLSConfig())
		if err == nil {
			_ = conn.Close()
		}
		return err
	}
	for _, step := range []struct {
		roots []*x509.Certificate
		ok    bool
	}{{[]*x509.Certificate{otherCA.Cert}, false}, {[]*x509.Certificate{otherCA.Cert, serverCA.Cert}, true}, {[]*x509.Certificate{otherCA.Cert}, false}} {
		if err := os.WriteFile(rootFile, testutil.CertPEM(step.roots...), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := handshake(); (err == nil) != step.ok {
			t.Fatalf("with %d roots in the file: handshake %v, want success %v", len(step.roots), err, step.ok)
		}
	}
	creds.ServerName = "evil.example"
	if err := os.WriteFile(rootFile, testutil.CertPEM(serverCA.Cert), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := handshake(); err == nil {
		t.Fatal("a server certificate for another name was accepted")
	}
}

func TestMetadata(t *testing.T) {
	t.Parallel()
	tokenFile := filepath.Join(t.TempDir(), "istio-token")
	if err := os.WriteFile(tokenFile, []byte("tok\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := upstream.FileToken(filepath.Join(t.TempDir(), "missing"), nil)
	cert := &tls.Certificate{}
	for _, tc := range []struct {
		name      string
		creds     upstream.Credentials
		wantAuth  string
		tokenErr  string // "": a token was sent
		noCallErr bool   // nothing may be sent
	}{
		{"a token from its file", upstream.Credentials{Token: upstream.FileToken(tokenFile, nil), ClusterID: "Kubernetes"}, "Bearer tok", "", false},
		{"no token, a certificate", upstream.Credentials{Token: missing, ClientCertificate: func() *tls.Certificate { return cert }}, "", "the token file", false},
		{"no token, no certificate", upstream.Credentials{Token: missing, ClientCertificate: func() *tls.Certificate { return nil }}, "", "the token file", true},
		{"no token source, no certificate", upstream.Credentials{}, "", "no token configured", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			haveCert := tc.creds.ClientCertificate != nil && tc.creds.ClientCertificate() != nil
			md, tokenErr, err := tc.creds.Metadata(context.Background(), haveCert)
			if tc.noCallErr {
				if !errors.Is(err, upstream.ErrNoCredentials) || !strings.Contains(err.Error(), tc.tokenErr) {
					t.Fatalf("error %v, want ErrNoCredentials saying %q", err, tc.tokenErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if md["authorization"] != tc.wantAuth || md["ClusterID"] != tc.creds.ClusterID {
				t.Fatalf("metadata %v", md)
			}
			if (tc.tokenErr == "") != (tokenErr == nil) || tokenErr != nil && !strings.Contains(tokenErr.Error(), tc.tokenErr) {
				t.Fatalf("token error %v, want %q", tokenErr, tc.tokenErr)
			}
		})
	}
}

// A token or root file on a file system that does not answer (here a FIFO no one writes: its open
// blocks as a read on a dead NFS mount does) fails the call after the bound, instead of holding
// it and every call after it; once the file system answers, the next read works.
func TestReadsOnAHungFileSystemGiveUp(t *testing.T) {
	t.Parallel()
	fifo := filepath.Join(t.TempDir(), "hung")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	clk := testutil.NewFakeClock(time.Now())
	reads := fsutil.NewBoundedReads(clk, 0, 0)
	creds := upstream.Credentials{RootCertFile: fifo, Token: upstream.FileToken(fifo, reads), Reads: reads}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	tokenErr, rootErr := make(chan error, 1), make(chan error, 1)
	go func() { _, err := creds.Token(ctx); tokenErr <- err }()
	go func() { rootErr <- creds.TLSConfig().VerifyConnection(tls.ConnectionState{}) }()
	// Both wait on the one read of the file, each on a timer of its own.
	if err := clk.WaitForTimers(ctx, 2); err != nil {
		t.Fatal(err)
	}
	clk.Advance(fsutil.DefaultReadBound)
	for what, ch := range map[string]chan error{"token": tokenErr, "root": rootErr} {
		if err := <-ch; !errors.Is(err, fsutil.ErrNoAnswer) || !strings.Contains(err.Error(), fifo) {
			t.Errorf("the %s read from a hung file system: %v, want ErrNoAnswer naming the file", what, err)
		}
	}

	// The file system answers: the stuck read ends, and the next read of the file starts afresh.
	w, err := os.OpenFile(fifo, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.WriteString("tok\n"); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(fifo); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(fifo, []byte("fresh\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for {
		tok, err := creds.Token(ctx)
		if err == nil && tok == "fresh" {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("after the file system answered: token %q, %v", tok, err)
		}
		// The stuck read's goroutine may not have returned yet; this read joins it and gets
		// its answer ("tok"), then the next one reads the new file.
	}
}
