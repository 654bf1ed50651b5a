package controlplane_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/internal/pki"
)

// Two control planes: an upstream that signs CA certificates for one identity, and a downstream
// that gets its signing certificate from it. A workload certificate from the downstream verifies
// against the upstream's root, with the chain leaf, intermediate, root; the downstream publishes
// the upstream's root as its trust anchor. A third CA, whose identity is not listed, cannot start.
func TestDownstreamCASignsUnderUpstreamRoot(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	upCfg := testConfig(filepath.Join(dir, "upstream"))
	upCfg.SignCACerts = true
	upCfg.CACertIdentities = []string{"spiffe://cluster.local/ns/site-a/sa/meshid-ca"}
	up := start(t, upCfg)
	upRoot := ca.RootCertPath(upCfg.StateDir)

	tokenFile := filepath.Join(dir, "upstream-token")
	if err := os.WriteFile(tokenFile, []byte(mint(t, upCfg.StateDir, "site-a", "meshid-ca")), 0o600); err != nil {
		t.Fatal(err)
	}
	downCfg := testConfig(filepath.Join(dir, "downstream"))
	downCfg.Upstream.Address = up.GRPCAddr()
	downCfg.Upstream.RootCertFile = upRoot
	downCfg.Upstream.TokenPath = tokenFile
	downCfg.Upstream.RequestedTTL = 48 * time.Hour
	down := start(t, downCfg)

	if b := down.Authority().Bundle(); b.Source() != ca.SourceUpstream || !b.Root().Equal(up.Authority().Bundle().Root()) {
		t.Fatalf("downstream signs with %q (%s) under %q, want an upstream-signed certificate under the upstream root",
			b.SigningCert().Subject, b.Source(), b.Root().Subject)
	}
	published, err := os.ReadFile(ca.RootCertPath(downCfg.StateDir))
	if err != nil {
		t.Fatal(err)
	}
	if want, _ := os.ReadFile(upRoot); string(published) != string(want) {
		t.Fatalf("the downstream's root-cert.pem is not the upstream's root:\n%s", published)
	}

	// The signing certificate's expiry is on /metrics and /debug/ca.
	notAfter := down.Authority().Bundle().NotAfter()
	_, metrics := get(t, "http://"+down.MonitoringAddr()+"/metrics")
	for _, want := range []string{
		fmt.Sprintf(`meshid_ca_signing_cert_expiry_timestamp_seconds{source="upstream"} %g`, float64(notAfter.Unix())),
		`meshid_ca_upstream_renewals_total{outcome="ok"} 1`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	code, debug := get(t, "http://"+down.MonitoringAddr()+"/debug/ca")
	var shown struct {
		Source   string    `json:"source"`
		NotAfter time.Time `json:"not_after"`
		Chain    []struct {
			Subject string `json:"subject"`
		} `json:"chain"`
	}
	if err := json.Unmarshal([]byte(debug), &shown); err != nil || code != http.StatusOK {
		t.Fatalf("/debug/ca: %d %v\n%s", code, err, debug)
	}
	if shown.Source != string(ca.SourceUpstream) || !shown.NotAfter.Equal(notAfter) || len(shown.Chain) != 2 {
		t.Fatalf("/debug/ca shows %+v, want the upstream-signed certificate expiring at %s and its root", shown, notAfter)
	}

	// createCertificate verifies the leaf against the file it is given: the upstream's root.
	chain, err := createCertificate(t, down.GRPCAddr(), upRoot, mint(t, downCfg.StateDir, "default", "web"), "spiffe://cluster.local/ns/default/sa/web")
	if err != nil {
		t.Fatal(err)
	}
	if len(chain) != 3 || !chain[1].Equal(down.Authority().Bundle().SigningCert()) || !chain[2].Equal(up.Authority().Bundle().Root()) {
		t.Fatalf("chain of %d certificates, want leaf, the downstream's intermediate, the upstream root", len(chain))
	}
	if !chain[1].IsCA || chain[1].MaxPathLen != 0 || !chain[1].MaxPathLenZero {
		t.Fatalf("intermediate: IsCA %v, MaxPathLen %d", chain[1].IsCA, chain[1].MaxPathLen)
	}
	if id, err := pki.SPIFFEIDFromURL(chain[1].URIs[0]); err != nil || id.String() != upCfg.CACertIdentities[0] {
		t.Fatalf("intermediate names %v, want the downstream's identity", chain[1].URIs)
	}
	if !chain[1].NotAfter.Before(time.Now().Add(48*time.Hour + time.Minute)) {
		t.Fatalf("intermediate expires %s, longer than the requested 48h", chain[1].NotAfter)
	}

	// A workload of the upstream asking for a CA certificate is refused; its own certificate
	// is still signed.
	if _, err := createCertificate(t, up.GRPCAddr(), upRoot, mint(t, upCfg.StateDir, "default", "web"), "spiffe://cluster.local/ns/default/sa/web"); err != nil {
		t.Fatal(err)
	}
	rogueToken := filepath.Join(dir, "rogue-token")
	if err := os.WriteFile(rogueToken, []byte(mint(t, upCfg.StateDir, "default", "web")), 0o600); err != nil {
		t.Fatal(err)
	}
	rogueCfg := testConfig(filepath.Join(dir, "rogue"))
	rogueCfg.Upstream = downCfg.Upstream
	rogueCfg.Upstream.TokenPath = rogueToken
	rogueCfg.Upstream.StartTimeout = 30 * time.Second
	if cp, err := controlplane.New(t.Context(), rogueCfg); status.Code(err) != codes.PermissionDenied {
		if err == nil {
			cp.Close()
		}
		t.Fatalf("a CA whose identity is not listed started, or failed otherwise: %v", err)
	}
	if _, err := os.Stat(ca.UpstreamPath(rogueCfg.StateDir)); err == nil {
		t.Fatal("the refused CA wrote an upstream-signed key")
	}
}
