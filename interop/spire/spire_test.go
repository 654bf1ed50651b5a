//go:build external

package spire_test

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/spiffe/go-spiffe/v2/bundle/jwtbundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/jwtsvid"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds/sdsclient"
)

// The identity the agents of these tests hold: not the default one, so that what spire-agent
// shows came from the agent's configuration.
const (
	namespace      = "spire-ns"
	serviceAccount = "spire-sa"
	spiffeID       = "spiffe://cluster.local/ns/" + namespace + "/sa/" + serviceAccount
)

// nodeID is the Envoy node the SDS clients of these tests present.
const nodeID = "sidecar~127.0.0.1~spire-1.spire-ns~spire-ns.svc.cluster.local"

// startAgent runs `meshid agent` under a root dir of its own, with args besides, and returns it
// with its SDS socket once it has started: the socket listens from then on.
func startAgent(t *testing.T, args ...string) (*process, string) {
	t.Helper()
	args = append([]string{"agent",
		"--root-dir", testutil.ShortTempDir(t),
		"--namespace", namespace,
		"--service-account", serviceAccount,
		"--status-addr", "127.0.0.1:0",
		"--debug-addr", "127.0.0.1:0",
		"--log-format", "json",
	}, args...)
	p := start(t, "meshid agent", filepath.Join(binDir, "meshid"), args...)
	socket, _ := p.awaitLog(t, "agent started")["sds_socket"].(string)
	if socket == "" {
		t.Fatal("the agent logged no sds_socket when it started")
	}
	return p, socket
}

// spireRun runs spire-agent with args to its end and returns its exit code, its stdout and its
// stderr.
func spireRun(t *testing.T, spire string, args ...string) (int, string, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	cmd := exec.CommandContext(ctx, spire, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case ctx.Err() != nil:
		t.Fatalf("spire-agent %s: no end within %s\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), wait, &stdout, &stderr)
	case errors.As(err, &exit):
	case err != nil:
		t.Fatalf("spire-agent %s: %v", strings.Join(args, " "), err)
	}
	return cmd.ProcessState.ExitCode(), stdout.String(), stderr.String()
}

// fetchX509 runs `spire-agent api fetch x509 -write DIR` on socket, expecting success, and
// returns what it wrote: the chain, the key and the bundle of SVID #0.
func fetchX509(t *testing.T, spire, socket string) (chain []*x509.Certificate, key []byte, bundle []*x509.Certificate) {
	t.Helper()
	out := t.TempDir()
	// -timeout: a first certificate may be on its way; the Workload API stream waits for it.
	code, stdout, stderr := spireRun(t, spire, "api", "fetch", "x509", "-socketPath", socket, "-write", out, "-timeout", wait.String())
	if code != 0 {
		t.Fatalf("spire-agent api fetch x509: exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	// Its report, as spire-agent prints it for one SVID.
	for _, line := range []string{
		"Received 1 svid after ",
		"SPIFFE ID:\t\t" + spiffeID,
		"Writing SVID #0 to file " + filepath.Join(out, "svid.0.pem") + ".",
		"Writing key #0 to file " + filepath.Join(out, "svid.0.key") + ".",
		"Writing bundle #0 to file " + filepath.Join(out, "bundle.0.pem") + ".",
	} {
		if !slices.ContainsFunc(strings.Split(stdout, "\n"), func(l string) bool { return strings.HasPrefix(l, line) }) {
			t.Errorf("spire-agent api fetch x509 printed no line %q:\n%s", line, stdout)
		}
	}
	if entries, err := os.ReadDir(out); err != nil || len(entries) != 3 {
		t.Errorf("spire-agent wrote %v (%v), want svid.0.pem, svid.0.key and bundle.0.pem only", entries, err)
	}
	read := func(name string) []byte {
		data, err := os.ReadFile(filepath.Join(out, name))
		if err != nil {
			t.Fatal(err)
		}
		return data
	}
	var err error
	if chain, err = pki.ParseCertificates(read("svid.0.pem")); err != nil {
		t.Fatalf("svid.0.pem: %v", err)
	}
	if bundle, err = pki.ParseCertificates(read("bundle.0.pem")); err != nil {
		t.Fatalf("bundle.0.pem: %v", err)
	}
	return chain, read("svid.0.key"), bundle
}

// checkSVID checks what spire-agent wrote: the leaf is an X.509-SVID of spiffeID, the key is
// its, and the bundle verifies the chain.
func checkSVID(t *testing.T, chain []*x509.Certificate, keyPEM []byte, bundle []*x509.Certificate) {
	t.Helper()
	leaf := chain[0]
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != spiffeID {
		t.Errorf("the leaf's URI SANs are %v, want %s alone", leaf.URIs, spiffeID)
	}
	key, err := pki.ParsePrivateKey(keyPEM)
	if err != nil {
		t.Fatalf("svid.0.key: %v", err)
	}
	if !pki.KeyMatchesCertificate(key, leaf) {
		t.Error("svid.0.key does not match the leaf of svid.0.pem")
	}
	roots, inter := x509.NewCertPool(), x509.NewCertPool()
	for _, c := range bundle {
		roots.AddCert(c)
	}
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Errorf("bundle.0.pem does not verify svid.0.pem: %v", err)
	}
}

// sdsKeyPair asks the agent's SDS for the workload's chain and the roots, as Envoy would.
func sdsKeyPair(t *testing.T, socket string) ([]*x509.Certificate, []*x509.Certificate) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	got, err := sdsclient.Get(ctx, socket, nodeID, sdsclient.WorkloadCertName, sdsclient.RootCertName)
	if err != nil {
		t.Fatal(err)
	}
	chain, _, err := sdsclient.KeyPair(got[sdsclient.WorkloadCertName])
	if err != nil {
		t.Fatal(err)
	}
	roots, err := sdsclient.Roots(got[sdsclient.RootCertName])
	if err != nil {
		t.Fatal(err)
	}
	return chain, roots
}

func sameCerts(a, b []*x509.Certificate) bool {
	return slices.EqualFunc(a, b, func(x, y *x509.Certificate) bool { return x.Equal(y) })
}

// `spire-agent api fetch x509 -write DIR` against an agent with its embedded CA: the files hold
// the agent's certificate for its SPIFFE ID, with its key, and the bundle verifies the chain;
// they are what Envoy gets over SDS on the same socket.
func TestFetchX509WritesTheAgentsSVID(t *testing.T) {
	t.Parallel()
	spire := spireAgent(t)
	_, socket := startAgent(t)

	chain, key, bundle := fetchX509(t, spire, socket)
	checkSVID(t, chain, key, bundle)

	sdsChain, sdsRoots := sdsKeyPair(t, socket)
	// SDS's chain ends with the root, as Istio's does; the Workload API's leaves it to the bundle.
	if len(sdsChain) != len(chain)+1 || !sameCerts(chain, sdsChain[:len(chain)]) || !sameCerts(sdsChain[len(chain):], bundle) {
		t.Errorf("svid.0.pem (%d certificates) followed by bundle.0.pem is not the chain SDS serves as %q (%d)", len(chain), sdsclient.WorkloadCertName, len(sdsChain))
	}
	if !sameCerts(bundle, sdsRoots) {
		t.Errorf("bundle.0.pem is not the roots SDS serves as %q", sdsclient.RootCertName)
	}
}

// credentials are one generation of a credentials dir: a leaf under an intermediate and a root.
type credentials struct {
	root, intermediate, leaf *x509.Certificate
	files                    map[string][]byte
}

func newCredentials(t *testing.T, root *testutil.CA, ttl time.Duration) credentials {
	t.Helper()
	inter := root.NewIntermediate(t, testutil.CAOptions{})
	leaf, key := inter.IssueWorkload(t, spiffeID, ttl)
	return credentials{root: root.Cert, intermediate: inter.Cert, leaf: leaf, files: map[string][]byte{
		"cert-chain.pem": testutil.CertPEM(leaf, inter.Cert),
		"key.pem":        testutil.KeyPEM(t, key),
		"root-cert.pem":  testutil.CertPEM(root.Cert),
	}}
}

// awaitSVID waits for the next update `spire-agent api watch` prints from the line numbered from
// on, checks that it shows c and nothing else, and returns the number of the line after it.
func awaitSVID(t *testing.T, watch *process, from int, c credentials) int {
	t.Helper()
	header := watch.awaitLine(t, from, "an update", func(l string) bool { return strings.HasPrefix(l, "Received ") })
	// spire-agent's whole report of one SVID, as its printer lays it out.
	want := []string{
		"",
		"SPIFFE ID:\t\t" + spiffeID,
		fmt.Sprintf("SVID Valid After:\t%v", c.leaf.NotBefore),
		fmt.Sprintf("SVID Valid Until:\t%v", c.leaf.NotAfter),
		fmt.Sprintf("Intermediate #1 Valid After:\t%v", c.intermediate.NotBefore),
		fmt.Sprintf("Intermediate #1 Valid Until:\t%v", c.intermediate.NotAfter),
		fmt.Sprintf("CA #1 Valid After:\t%v", c.root.NotBefore),
		fmt.Sprintf("CA #1 Valid Until:\t%v", c.root.NotAfter),
		"",
	}
	end := watch.awaitLine(t, header+len(want), "the end of an update", func(string) bool { return true })
	got := watch.span(header, end+1)
	if !strings.HasPrefix(got[0], "Received 1 svid after ") || !slices.Equal(got[1:], want) {
		t.Fatalf("spire-agent api watch printed\n%s\nwant\nReceived 1 svid after ...\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	return end + 1
}

// sdsStream is an SDS subscription to the workload's certificate held open as Envoy's is.
type sdsStream struct {
	leaves chan *x509.Certificate
	ended  chan error
}

// followSDS subscribes to the workload's certificate on socket's SDS until the test ends.
func followSDS(t *testing.T, socket string) *sdsStream {
	t.Helper()
	c, err := sdsclient.Dial(socket, sdsclient.WithNode(&corev3.Node{Id: nodeID}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &sdsStream{leaves: make(chan *x509.Certificate), ended: make(chan error, 1)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.ended <- c.Follow(ctx, []string{sdsclient.WorkloadCertName}, nil, func(r sdsclient.Response) error {
			chain, _, err := sdsclient.KeyPair(r.Secrets[sdsclient.WorkloadCertName])
			if err != nil {
				return err
			}
			select {
			case s.leaves <- chain[0]:
			case <-ctx.Done():
			}
			return nil
		})
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		_ = c.Close()
	})
	return s
}

// awaitLeaf waits for the next certificate SDS pushes, which must be want.
func (s *sdsStream) awaitLeaf(t *testing.T, want *x509.Certificate) {
	t.Helper()
	select {
	case got := <-s.leaves:
		if !got.Equal(want) {
			t.Fatalf("SDS pushed the certificate with serial %x, want %x", got.SerialNumber, want.SerialNumber)
		}
	case err := <-s.ended:
		t.Fatalf("the SDS stream ended: %v", err)
	case <-time.After(wait):
		t.Fatalf("SDS pushed no certificate within %s", wait)
	}
}

// `spire-agent api watch` across a rotation. The agent serves a credentials dir laid out as the
// kubelet mounts a secret; a new generation swapped in under ..data reaches the watch as one
// update holding the new SVID, and, on the same socket, Envoy's SDS stream open all along.
func TestWatchFollowsARotation(t *testing.T) {
	t.Parallel()
	spire := spireAgent(t)
	root := testutil.NewRootCA(t, testutil.CAOptions{})
	first := newCredentials(t, root, time.Hour)
	vol := testutil.NewSecretVolume(t, filepath.Join(t.TempDir(), "credentials"))
	vol.Update(first.files)
	_, socket := startAgent(t, "--credentials-dir", vol.Dir)

	sds := followSDS(t, socket)
	watch := start(t, "spire-agent api watch", spire, "api", "watch", "-socketPath", socket)
	next := awaitSVID(t, watch, 0, first)
	sds.awaitLeaf(t, first.leaf)

	// A new key pair under a new intermediate, with a later expiry, which the watch prints.
	second := newCredentials(t, root, 2*time.Hour)
	vol.Update(second.files)
	awaitSVID(t, watch, next, second)
	sds.awaitLeaf(t, second.leaf)

	// What a client connecting now gets is the new pair too.
	chain, key, bundle := fetchX509(t, spire, socket)
	checkSVID(t, chain, key, bundle)
	if !sameCerts(chain, []*x509.Certificate{second.leaf, second.intermediate}) {
		t.Error("svid.0.pem is not the new generation's cert-chain.pem")
	}
	if !sameCerts(bundle, []*x509.Certificate{root.Cert}) {
		t.Error("bundle.0.pem is not root-cert.pem")
	}
}

// With --workload-api=false the socket serves SDS alone: spire-agent is told the service is not
// there, and says so with exit status 1.
func TestFetchX509WithTheWorkloadAPIOff(t *testing.T) {
	t.Parallel()
	spire := spireAgent(t)
	_, socket := startAgent(t, "--workload-api=false")

	code, stdout, stderr := spireRun(t, spire, "api", "fetch", "x509", "-socketPath", socket, "-timeout", wait.String())
	if code != 1 || !strings.Contains(stderr, "code = Unimplemented") {
		t.Errorf("spire-agent api fetch x509: exit %d, stderr %q, want 1 and code = Unimplemented (stdout %q)", code, stderr, stdout)
	}
	sdsKeyPair(t, socket) // Envoy's SDS is still served
}

// spire-agent's `api fetch jwt` gets a JWT-SVID of the agent's identity for the audience asked,
// with the trust domain's JWT bundle; go-spiffe verifies the token against that bundle, and
// spire-agent's `api validate jwt` (the agent's ValidateJWTSVID) accepts it for its audience and
// refuses it for another.
func TestFetchAndValidateJWT(t *testing.T) {
	t.Parallel()
	spire := spireAgent(t)
	_, socket := startAgent(t)

	code, stdout, stderr := spireRun(t, spire, "api", "fetch", "jwt", "-audience", "demo", "-socketPath", socket, "-output", "json", "-timeout", wait.String())
	if code != 0 {
		t.Fatalf("spire-agent api fetch jwt: exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	var fetched []struct {
		SVIDs []struct {
			SPIFFEID string `json:"spiffe_id"`
			SVID     string `json:"svid"`
		} `json:"svids"`
		Bundles map[string][]byte `json:"bundles"`
	}
	if err := json.Unmarshal([]byte(stdout), &fetched); err != nil || len(fetched) != 2 || len(fetched[0].SVIDs) != 1 {
		t.Fatalf("spire-agent api fetch jwt printed %q (%v), want one SVID and the bundles", stdout, err)
	}
	svid := fetched[0].SVIDs[0]
	if svid.SPIFFEID != spiffeID {
		t.Fatalf("JWT-SVID of %s, want %s", svid.SPIFFEID, spiffeID)
	}
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	bundle, err := jwtbundle.Parse(td, fetched[1].Bundles[td.IDString()])
	if err != nil {
		t.Fatalf("the JWT bundle spire-agent got: %v", err)
	}
	parsed, err := jwtsvid.ParseAndValidate(svid.SVID, bundle, []string{"demo"})
	if err != nil || parsed.ID.String() != spiffeID {
		t.Fatalf("go-spiffe on the token: %v (%v), want a JWT-SVID of %s", parsed, err, spiffeID)
	}

	code, stdout, stderr = spireRun(t, spire, "api", "validate", "jwt", "-audience", "demo", "-svid", svid.SVID, "-socketPath", socket, "-output", "json")
	if code != 0 || !strings.Contains(stdout, `"spiffe_id":"`+spiffeID+`"`) {
		t.Fatalf("spire-agent api validate jwt: exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	code, stdout, stderr = spireRun(t, spire, "api", "validate", "jwt", "-audience", "other", "-svid", svid.SVID, "-socketPath", socket)
	if code != 1 || !strings.Contains(stdout+stderr, `not for the audience "other"`) {
		t.Fatalf("spire-agent api validate jwt for another audience: exit %d, want 1 naming the audience\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
}
