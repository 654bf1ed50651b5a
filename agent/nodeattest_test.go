package agent_test

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/jwtsvid"
	spiffeapi "github.com/spiffe/go-spiffe/v2/workloadapi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/agent/nodemode"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/sds/sdsclient"
	"github.com/meshid/meshid/sds/sdstest"
)

// sdsClientEnv names the SDS socket a copy of the test binary fetches "default" from.
const sdsClientEnv = "MESHID_TEST_SDS_CLIENT"

// sdsClientMain fetches "default" from socket and prints the leaf's SPIFFE ID, or "code=CODE"
// when the call is refused.
func sdsClientMain(socket string) int {
	c, err := sdsclient.Dial(socket, sdsclient.WithNode(&core.Node{Id: sdstest.NodeID}))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer func() { _ = c.Close() }()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	got, err := c.Fetch(ctx, "default")
	if err != nil {
		fmt.Println("code=" + status.Code(err).String())
		return 0
	}
	chain, err := pemLeafURI(got["default"].GetTlsCertificate().GetCertificateChain().GetInlineBytes())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	fmt.Println(chain)
	return 0
}

// pemLeafURI is the URI SAN of the first certificate of a PEM chain.
func pemLeafURI(chainPEM []byte) (string, error) {
	certs, err := pki.ParseCertificates(chainPEM)
	if err != nil {
		return "", err
	}
	if len(certs) == 0 || len(certs[0].URIs) != 1 {
		return "", fmt.Errorf("no leaf with one URI SAN in %d certificates", len(certs))
	}
	return certs[0].URIs[0].String(), nil
}

// copyExecutable copies the test binary to dir/name, resolved as the kernel names it.
func copyExecutable(t *testing.T, dir, name string) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	in, err := os.Open(self)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = in.Close() }()
	path := filepath.Join(dir, name)
	out, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o700)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
	return realPath(t, path)
}

func realPath(t *testing.T, path string) string {
	t.Helper()
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		t.Fatal(err)
	}
	return real
}

// A node agent with its embedded CA (which trusts the agent's own account as a node account)
// and rules naming real executables by path: two copies of an SDS client (this test binary)
// each get "default" for their own identity, a third copy that no rule names is refused, and
// go-spiffe's client in this process gets the X.509-SVID and a JWT-SVID of the test binary's
// rule, which verifies against the JWT bundle.
func TestNodeAgentServesEachAttestedExecutableItsIdentity(t *testing.T) {
	t.Parallel()
	bin := t.TempDir()
	clientA, clientB, stranger := copyExecutable(t, bin, "client-a"), copyExecutable(t, bin, "client-b"), copyExecutable(t, bin, "stranger")
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	rules := filepath.Join(t.TempDir(), "rules.yaml")
	if err := os.WriteFile(rules, fmt.Appendf(nil, `rules:
  - {path: %q, namespace: shop, serviceAccount: a}
  - {path: %q, namespace: shop, serviceAccount: b}
  - {path: %q, namespace: node, serviceAccount: tests}
`, clientA, clientB, realPath(t, self)), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t, newFakeClock(), newLogSink(t), nil)
	cfg.SDS.WorkloadAttestation, cfg.SDS.Node, cfg.XDS.Proxy = rules, nodemode.New(newAttestor), false
	a := newAgent(t, cfg)
	runAgent(t, a)
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()

	fetch := func(exe string) string {
		t.Helper()
		cmd := exec.CommandContext(ctx, exe, "-test.run=^$")
		cmd.Env = append(os.Environ(), sdsClientEnv+"="+a.SocketPath())
		cmd.Stderr = os.Stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("%s: %v", filepath.Base(exe), err)
		}
		return strings.TrimSpace(string(out))
	}
	for exe, want := range map[string]string{
		clientA:  "spiffe://cluster.local/ns/shop/sa/a",
		clientB:  "spiffe://cluster.local/ns/shop/sa/b",
		stranger: "code=" + codes.PermissionDenied.String(),
	} {
		if got := fetch(exe); got != want {
			t.Errorf("%s got %q, want %q", filepath.Base(exe), got, want)
		}
	}
	if got := metric(t, a, `meshid_agent_attestation_refusals_total{reason="no_rule"}`); got != "1" {
		t.Errorf("no_rule refusals %q, want 1", got)
	}
	if got := metric(t, a, `meshid_sds_refusals_total{code="PermissionDenied",reason="unidentified"}`); got != "1" {
		t.Errorf("unidentified SDS refusals %q, want 1", got)
	}
	// Each identity's secret manager's series, labelled with it.
	for _, id := range []string{"spiffe://cluster.local/ns/shop/sa/a", "spiffe://cluster.local/ns/shop/sa/b"} {
		if got := metric(t, a, `meshid_agent_cert_valid{identity="`+id+`"}`); got != "1" {
			t.Errorf("cert_valid of %s %q, want 1", id, got)
		}
	}

	addr := spiffeapi.WithAddr("unix://" + a.SocketPath())
	x509ctx, err := spiffeapi.FetchX509Context(ctx, addr)
	if err != nil {
		t.Fatalf("FetchX509Context: %v", err)
	}
	if len(x509ctx.SVIDs) != 1 || x509ctx.SVIDs[0].ID.String() != "spiffe://cluster.local/ns/node/sa/tests" {
		t.Fatalf("SVIDs %v, want the test binary's rule's identity", x509ctx.SVIDs)
	}
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	if _, err := x509ctx.Bundles.GetX509BundleForTrustDomain(td); err != nil {
		t.Fatal(err)
	}
	jwt, err := spiffeapi.FetchJWTSVID(ctx, jwtsvid.Params{Audience: "bank"}, addr)
	if err != nil {
		t.Fatalf("FetchJWTSVID: %v", err)
	}
	if jwt.ID.String() != "spiffe://cluster.local/ns/node/sa/tests" {
		t.Fatalf("JWT-SVID of %s, want the test binary's rule's identity", jwt.ID)
	}
	bundles, err := spiffeapi.FetchJWTBundles(ctx, addr)
	if err != nil {
		t.Fatalf("FetchJWTBundles: %v", err)
	}
	// Verified as the application receiving it would, with the bundle (at the CA's time).
	if _, err := jwtsvid.ParseAndValidate(jwt.Marshal(), bundles, []string{"bank"}); err != nil {
		t.Fatalf("the JWT-SVID does not verify against the JWT bundle: %v", err)
	}

	_, page := httpGet(t, "http://"+a.DebugAddr()+"/debug/secrets")
	if !strings.Contains(page, `"identities": [
    "spiffe://cluster.local/ns/node/sa/tests",
    "spiffe://cluster.local/ns/shop/sa/a",
    "spiffe://cluster.local/ns/shop/sa/b"
  ]`) {
		t.Errorf("/debug/secrets does not list the identities held:\n%s", page)
	}

	// Envoy's SDS from this process is the test binary's identity too.
	stream := sdstest.Dial(t, a.SocketPath()).StreamSecrets()
	stream.Subscribe("default")
	got := stream.Collect("default")
	if id := workloadChain(t, got["default"])[0].URIs[0].String(); id != "spiffe://cluster.local/ns/node/sa/tests" {
		t.Fatalf("SDS default of %s", id)
	}
}
