// Package archtest checks the dependency direction of DESIGN.md and STYLE.md on the real import
// graph, so that a wrong import fails `make test` rather than waiting for a reviewer.
package archtest

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
)

const module = "github.com/meshid/meshid/"

// allowed maps a package (or, with a trailing slash, a package tree) to the module packages it may
// import. The longest matching key applies. "internal/" means any internal helper.
func allowed() map[string][]string {
	return map[string][]string{
		// sds/sdsclient: the SDS client of `certs`; ca/token: `meshid token`; ca: the layout of
		// the CA's state dir, where `meshid token` and `meshid vm` find the token key and roots.
		"cmd/": {"cmd/internal/", "agent", "controlplane", "ca", "ca/controller/kube", "ca/token", "sds/sdsclient", "internal/"},
		// meshid alone checks Envoy's bootstrap with Envoy's types, and serves node mode, which
		// meshid-agent leaves out.
		"cmd/meshid": {"cmd/internal/", "agent", "agent/envoy/bootstrapcheck", "agent/nodemode", "controlplane", "ca", "ca/controller/kube", "ca/token", "sds/sdsclient", "internal/"},
		// The agent reaches an embedded control plane through a hook cmd/meshid supplies, so
		// that meshid-agent links no CA.
		"agent":                      {"sds", "secretmanager", "caclient", "xdsproxy", "workloadapi", "agent/appprobe", "agent/envoy", "agent/promstats", "internal/"},
		"agent/appprobe":             {"internal/"},   // the status port's application probes
		"agent/envoy":                {"internal/"},   // Envoy's bootstrap, process and admin
		"agent/envoy/bootstrapcheck": {"agent/envoy"}, // the bootstrap checked with Envoy's types
		"agent/promstats":            {"internal/"},   // the status port's merged /stats/prometheus
		// Node mode, reached through the agent's hook (agent.Config.SDS.Node) that only
		// cmd/meshid sets: the agent's types, a secret manager per identity, the Workload API's
		// names, and the socket's admission.
		"agent/nodemode":                {"agent", "secretmanager", "workloadapi", "internal/admission", "internal/clock", "internal/logkey", "internal/pki"},
		"controlplane":                  {"ca", "ca/", "caclient", "discovery", "internal/"},
		"controlplane/controlplanetest": {"controlplane", "ca", "ca/token", "agent"}, // ca: the token key's path
		"sds/sdsclient":                 {"internal/"},                               // nothing of the server it tests
		"sds/sdstest":                   {"sds/sdsclient"},
		"ca/server":                     {"ca", "ca/token", "internal/"},
		"ca/controller/":                {"ca", "ca/controller", "internal/"},
		"ca/controller":                 {"ca", "internal/"},
		"ca/token":                      {"internal/"},
		"ca":                            {"internal/"},
		"sds":                           {"secretmanager", "internal/"},
		// The SPIFFE Workload API: secrets as SDS has them, the socket's admission and its logs,
		// and a chain's root told as pki tells it.
		"workloadapi":       {"secretmanager", "internal/admission", "internal/clock", "internal/logkey", "internal/pki"},
		"secretmanager":     {"internal/"},
		"caclient":          {"internal/"},
		"xdsproxy":          {"internal/"},
		"discovery":         {"internal/"},
		"internal/testutil": {"internal/"},
		// Tests only: what they import is not listed here.
		"interop": {},
		// Tests only: SPIRE's client against the agent's Workload API.
		"interop/spire": {},
		// Helpers import nothing of the module but two leaves: the clock, so that a helper that
		// schedules (filewatch's debounce) runs on its caller's injected time, and the log keys.
		"internal/clock":  {},
		"internal/logkey": {},
		"internal/":       {"internal/clock", "internal/logkey"},
		// The Envoy stand-in for tests and its helpers: a program on Envoy's protos, nothing of
		// the module, so that it behaves as Envoy and not as meshid's own code would.
		"internal/envoytest":         {},
		"internal/envoytest/standin": {},
		// Workload attestation: its refusals' logs are paced as a server's admission paces
		// them, its rules file is watched, and a rule's identity is checked as pki checks names.
		"internal/attest": {"internal/admission", "internal/clock", "internal/filewatch", "internal/logkey", "internal/pki"},
		// A server's admission names the process at the other end of a Unix connection as the
		// socket helpers do.
		"internal/admission": {"internal/clock", "internal/logkey", "internal/fsutil"},
		// The control plane's clients check its certificate as pki tells validity, clock skew
		// included, and read its root and their token with fsutil's bound.
		"internal/upstream": {"internal/clock", "internal/fsutil", "internal/logkey", "internal/pki"},
		// The GCE credential fetcher times its fetch on the injected clock and speaks HTTP with
		// localhttp's one request per connection, which keeps http.Transport out of the agent.
		"internal/gcemetadata": {"internal/clock", "internal/localhttp", "internal/tokencache"},
		// The token exchange likewise: its exchange is timed on the clock, spoken with localhttp.
		"internal/tokenexchange": {"internal/clock", "internal/localhttp", "internal/tokencache"},
		// The Mesh CA protocol's generated stubs (caclient and ca/server speak it): nothing of
		// the module.
		"internal/meshcapb": {},
		// meshid's JWT-SVID protocol's generated stubs (caclient and ca/server speak it).
		"internal/jwtsvidpb": {},

		// The TokenReview authenticator is one of ca/server's authenticators, and refuses a user
		// that is not a service account as ca/token's verifier does.
		"ca/controller/kube": {"ca", "ca/controller", "ca/server", "ca/token", "internal/"},

		// The end-to-end test runs the binaries as processes; it has test files only, which
		// import nothing of the module but the helpers (archtest reads non-test imports).
		"e2e": {"internal/"},
		// Tests only: the compose demo's checks load its files with discovery and ca/controller.
		"deploy": {},
	}
}

// kubernetesImporters may import Kubernetes' own modules (k8s.io/..., sigs.k8s.io/...): the
// namespace stores, which decode Kubernetes objects, and the commands that wire them. Everything
// else stays free of them, so that the slim agent links none.
func kubernetesImporters() []string {
	return []string{"ca/controller", "ca/controller/", "cmd/meshid"}
}

// slim are the packages whose whole dependency graph must stay free of Kubernetes' modules.
func slim() []string {
	return []string{"cmd/meshid-agent", "agent"}
}

// slimEnvoyTypes are the only Envoy and go-control-plane packages the slim agent may link: SDS,
// the xDS proxy's ADS stubs, and what their messages are made of. go-control-plane's server,
// cache and resource packages link every Envoy configuration type, whose descriptors cost each
// sidecar memory and start-up time (BENCHMARKS.md, issue 15); so do the bootstrap's types and
// their validation (6 MB of binary, 5 MB of memory): agent/envoy writes the bootstrap without
// them, and only meshid checks it with them (agent/envoy/bootstrapcheck, issue 26).
var slimEnvoyTypes = []string{
	"github.com/envoyproxy/go-control-plane/envoy/annotations",
	"github.com/envoyproxy/go-control-plane/envoy/config/core/v3",
	"github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3",
	"github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3",
	"github.com/envoyproxy/go-control-plane/envoy/service/secret/v3",
	"github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3",
	"github.com/envoyproxy/go-control-plane/envoy/type/v3",
	"github.com/envoyproxy/protoc-gen-validate/validate",
}

func isKubernetes(imp string) bool {
	// sigs.k8s.io/yaml is YAML read as JSON (go-yaml underneath), no Kubernetes in it: the
	// discovery configuration is read with it too.
	if imp == "sigs.k8s.io/yaml" {
		return false
	}
	return strings.HasPrefix(imp, "k8s.io/") || strings.HasPrefix(imp, "sigs.k8s.io/")
}

// imports lists, for each package of the module, what it imports.
func imports(t *testing.T) map[string][]string {
	t.Helper()
	out, err := exec.Command("go", "list", "-f", "{{.ImportPath}}{{range .Imports}} {{.}}{{end}}", module+"...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	graph := map[string][]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		fields := strings.Fields(line)
		graph[strings.TrimPrefix(fields[0], module)] = fields[1:]
	}
	return graph
}

func TestKubernetesImports(t *testing.T) {
	t.Parallel()
	importers := kubernetesImporters()
	for pkg, deps := range imports(t) {
		for _, imp := range deps {
			if isKubernetes(imp) && !permits(importers, pkg) {
				t.Errorf("%s must not import %s: only %v may import Kubernetes' modules", pkg, imp, importers)
			}
		}
	}
	for _, pkg := range slim() {
		out, err := exec.Command("go", "list", "-deps", module+pkg).Output()
		if err != nil {
			t.Fatalf("go list -deps %s: %v", pkg, err)
		}
		for _, dep := range strings.Fields(string(out)) {
			if isKubernetes(dep) {
				t.Errorf("%s links %s; it must link no Kubernetes module", pkg, dep)
			}
		}
	}
}

func TestSlimAgentLinksOnlySDSTypes(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-deps", module+"cmd/meshid-agent").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	for _, dep := range strings.Fields(string(out)) {
		if strings.HasPrefix(dep, "github.com/envoyproxy/") && !slices.Contains(slimEnvoyTypes, dep) {
			t.Errorf("meshid-agent links %s; it may link only %v", dep, slimEnvoyTypes)
		}
	}
}

// The binaries link only go-spiffe's generated Workload API stubs: its client, SVID and bundle
// packages (and go-jose under them) are for tests, where they play the SPIFFE-aware application.
func TestOnlyWorkloadAPIStubsOfGoSPIFFE(t *testing.T) {
	t.Parallel()
	const stubs = "github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	for _, pkg := range []string{"cmd/meshid-agent", "cmd/meshid"} {
		out, err := exec.Command("go", "list", "-deps", module+pkg).Output()
		if err != nil {
			t.Fatalf("go list -deps %s: %v", pkg, err)
		}
		for _, dep := range strings.Fields(string(out)) {
			if strings.HasPrefix(dep, "github.com/spiffe/go-spiffe/") && dep != stubs {
				t.Errorf("%s links %s; of go-spiffe it may link only %s", pkg, dep, stubs)
			}
		}
	}
}

func TestDependencyDirection(t *testing.T) {
	t.Parallel()
	rules := allowed()
	keys := make([]string, 0, len(rules))
	for k := range rules {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return len(keys[i]) > len(keys[j]) })

	for pkg, deps := range imports(t) {
		rule, ok := matchRule(keys, pkg)
		if !ok {
			t.Errorf("package %s has no dependency rule; add it to allowed()", pkg)
			continue
		}
		for _, imp := range deps {
			dep, inModule := strings.CutPrefix(imp, module)
			if !inModule {
				continue
			}
			if dep == "internal/testutil" || dep == "controlplane/controlplanetest" || dep == "sds/sdstest" || dep == "ca/controller/kube/kubetest" {
				t.Errorf("%s imports the test helper %s outside its tests", pkg, dep)
			}
			if !permits(rules[rule], dep) {
				t.Errorf("%s must not import %s (allowed: %v)", pkg, dep, rules[rule])
			}
		}
	}
}

func matchRule(keys []string, pkg string) (string, bool) {
	for _, k := range keys {
		if pkg == k || (strings.HasSuffix(k, "/") && strings.HasPrefix(pkg, k)) {
			return k, true
		}
	}
	return "", false
}

func permits(allowed []string, dep string) bool {
	return slices.ContainsFunc(allowed, func(a string) bool {
		return dep == a || (strings.HasSuffix(a, "/") && strings.HasPrefix(dep, a))
	})
}

// TestSlimAgentLinksNoHTTPClient builds meshid-agent as `make build` does and fails if it links
// net/http's client: every page of the binary is resident in every sidecar, and the Transport
// (pooling, proxies, HTTP/2) is 400 kB of it that the agent has no use for.
func TestSlimAgentLinksNoHTTPClient(t *testing.T) {
	t.Parallel()
	bin := filepath.Join(t.TempDir(), "meshid-agent")
	build := exec.Command("go", "build", "-trimpath", "-tags", "grpcnotrace", "-o", bin, module+"cmd/meshid-agent")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v: %s", err, out)
	}
	out, err := exec.Command("go", "tool", "nm", bin).Output()
	if err != nil {
		t.Fatalf("go tool nm: %v", err)
	}
	const roundTrip = "net/http.(*Transport).roundTrip"
	if !strings.Contains(string(out), " T net/http.(*Server).Serve\n") {
		t.Fatalf("go tool nm lists no net/http.(*Server).Serve: the check below would prove nothing")
	}
	if strings.Contains(string(out), " T "+roundTrip+"\n") {
		t.Errorf("meshid-agent links %s; use the server's parser over one connection (cli.Probe)", roundTrip)
	}
}
