package controlplane_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/controlplane"
	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/internal/filewatch"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

func namespaceManifest(name, labels string) []byte {
	return []byte("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: " + name + "\n  labels: {" + labels + "}\n")
}

// `meshid ca --manifests DIR`: the CA serves the namespaces the manifests' labels give it, refuses
// the others with PermissionDenied saying why, counts the refusals, and follows edits.
func TestTargetingFromManifests(t *testing.T) {
	t.Parallel()
	manifests := t.TempDir()
	testutil.WriteFiles(t, manifests, map[string][]byte{
		"web.yaml":  namespaceManifest("web", `ca.istio.io/env: istio-system`),
		"prod.yaml": namespaceManifest("prod", `ca.istio.io/override: "false"`),
	})
	clk := testutil.NewFakeClock(time.Now().Truncate(time.Second))
	cfg := testConfig(t.TempDir())
	cfg.Manifests = manifests
	cfg.EnableNamespacesByDefault = false
	cfg.Clock = clk
	cp := start(t, cfg)
	rootFile := filepath.Join(cfg.StateDir, "root-cert.pem")
	ask := func(ns string) error {
		t.Helper()
		tok := controlplanetest.Token(t, cfg.StateDir, ns, "demo", clk.Now(), time.Hour)
		_, err := createCertificate(t, cp.GRPCAddr(), rootFile, tok, pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: ns, ServiceAccount: "demo"}.String())
		return err
	}

	if err := ask("web"); err != nil {
		t.Fatalf("web, labelled for this CA: %v", err)
	}
	for ns, why := range map[string][]string{
		"prod":    {"namespace prod", `ca.istio.io/override="false"`, "row 12", "no CA instance serves it"},
		"default": {"namespace default", "unknown to the store", "row 18", "--enable-namespaces-by-default=false"},
	} {
		err := ask(ns)
		if status.Code(err) != codes.PermissionDenied {
			t.Fatalf("%s: %v, want PermissionDenied", ns, err)
		}
		for _, want := range why {
			if !strings.Contains(status.Convert(err).Message(), want) {
				t.Errorf("%s: refused with %q, which does not name %q", ns, status.Convert(err).Message(), want)
			}
		}
	}
	_, metrics := get(t, "http://"+cp.MonitoringAddr()+"/metrics")
	if !strings.Contains(metrics, `meshid_ca_requests_refused_total{code="PermissionDenied",reason="namespace_not_targeted"} 2`) {
		t.Errorf("the two refusals are not counted:\n%s", metrics)
	}

	// An edit takes effect without a restart.
	testutil.WriteFiles(t, manifests, map[string][]byte{"prod.yaml": namespaceManifest("prod", `ca.istio.io/override: "true"`)})
	store := cp.Namespaces()
	for {
		changed := store.Changed()
		if labels, _, _ := store.NamespaceLabels(t.Context(), "prod"); labels["ca.istio.io/override"] == "true" {
			break
		}
		testutil.Drive(t, clk, filewatch.DefaultDebounce, 2, changed) // 2: the root check and secret resync timers
	}
	if err := ask("prod"); err != nil {
		t.Fatalf("prod, relabelled override=true: %v", err)
	}
}

// A --manifests that is not a directory is refused before anything is written.
func TestNewRefusesMissingManifestsDir(t *testing.T) {
	t.Parallel()
	base := t.TempDir()
	cfg := testConfig(filepath.Join(base, "state"))
	cfg.Manifests = filepath.Join(base, "manifests-typo")
	_, err := controlplane.New(t.Context(), cfg)
	if err == nil || !strings.Contains(err.Error(), "Manifests") || !strings.Contains(err.Error(), cfg.Manifests) {
		t.Fatalf("error %v, want one naming Manifests and %s", err, cfg.Manifests)
	}
	if _, err := os.Stat(cfg.StateDir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the refused start left a state dir behind (stat: %v)", err)
	}
}

// `meshid ca targets`: every namespace the manifests name, and the rule for the others.
func TestTargetsReport(t *testing.T) {
	t.Parallel()
	manifests := t.TempDir()
	testutil.WriteFiles(t, manifests, map[string][]byte{"ns.yaml": append(append(
		namespaceManifest("web", `ca.istio.io/env: istio-system`), "---\n"...),
		namespaceManifest("batch", `ca.istio.io/env: other-ca`)...)})
	report, err := controlplane.Targets(t.Context(), controlplane.TargetsConfig{Manifests: manifests, CANamespace: "istio-system", EnableNamespacesByDefault: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(report.Namespaces) != 2 || report.Namespaces[0].Namespace != "batch" || report.Namespaces[0].Served || report.Namespaces[0].Row != 15 ||
		report.Namespaces[1].Namespace != "web" || !report.Namespaces[1].Served || report.Namespaces[1].Row != 13 {
		t.Fatalf("namespaces %+v", report.Namespaces)
	}
	if !report.Others.Served || report.Others.Row != 17 {
		t.Fatalf("others %+v, want served by row 17", report.Others)
	}
	if _, err := controlplane.Targets(t.Context(), controlplane.TargetsConfig{Manifests: filepath.Join(manifests, "nope"), CANamespace: "istio-system"}); err == nil || !strings.Contains(err.Error(), "Manifests") {
		t.Fatalf("a missing manifests dir: %v", err)
	}
	if _, err := controlplane.Targets(t.Context(), controlplane.TargetsConfig{CANamespace: "Bad_NS"}); err == nil || !strings.Contains(err.Error(), "CANamespace") {
		t.Fatalf("a bad CA namespace: %v", err)
	}
}

// The embedded control plane reads <state dir>/manifests when it exists.
func TestEmbeddedReadsManifestsWhenPresent(t *testing.T) {
	t.Parallel()
	for _, present := range []bool{false, true} {
		stateDir := t.TempDir()
		if present {
			testutil.WriteFiles(t, filepath.Join(stateDir, controlplane.EmbeddedManifestsDir), map[string][]byte{
				"ns.yaml": namespaceManifest("default", `ca.istio.io/override: "false"`),
			})
		}
		id, err := pki.NewSPIFFEID("cluster.local", "default", "default")
		if err != nil {
			t.Fatal(err)
		}
		e, err := controlplane.NewEmbedded(controlplane.EmbeddedConfig{
			StateDir: stateDir, SocketPath: filepath.Join(testutil.ShortTempDir(t), "ca.sock"), TrustDomain: "cluster.local", Identity: id,
		})
		if err != nil {
			t.Fatal(err)
		}
		e.Close()
		store := e.Namespaces()
		if (store != nil) != present {
			t.Fatalf("manifests dir present %v: store %v", present, store)
		}
		if present {
			if labels, found, _ := store.NamespaceLabels(t.Context(), "default"); !found || labels["ca.istio.io/override"] != "false" {
				t.Fatalf("default: %v %v", labels, found)
			}
		}
	}
}
