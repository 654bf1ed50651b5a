// Package e2e_test runs the whole product as processes, as an operator would: `meshid ca`, two
// `meshid-agent`s, and next to each agent a stand-in for Envoy that takes its configuration and
// its certificates from the agent, then speaks mutual TLS with them. Start reading at TestMesh.
package e2e_test

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"

	"github.com/meshid/meshid/internal/testutil"
)

const (
	frontendID = "spiffe://cluster.local/ns/default/sa/frontend"
	backendID  = "spiffe://cluster.local/ns/backend/sa/backend"
)

// mesh is the cluster as the CA's --manifests directory describes it: two namespaces with one
// service account each. The labels of a namespace decide whether this CA serves it; with none,
// --enable-namespaces-by-default (true) does.
func mesh(backendLabels string) string {
	return `
apiVersion: v1
kind: Namespace
metadata: {name: default}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: frontend, namespace: default}
---
apiVersion: v1
kind: Namespace
metadata:
  name: backend
  labels: {` + backendLabels + `}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: backend, namespace: backend}
`
}

// xdsConfig is what the CA's discovery server hands each Envoy, in Envoy's own field names: the
// same resources would work in an Envoy bootstrap's static_resources. The discovery server picks
// the set by the namespace of the caller's credential: the top-level set goes to namespace
// default (the frontend), the namespaces.backend set replaces it for the backend.
//
// The frontend's outbound listener proxies to the cluster "backend", which speaks TLS with the
// workload's key pair ("default" over SDS), trusts the roots of "ROOTCA" (over SDS), and accepts
// only the backend's SPIFFE ID. The backend's inbound listener terminates TLS the same way,
// requires a client certificate, and accepts only the frontend's SPIFFE ID. "sds-grpc" is the
// bootstrap cluster of the agent's SDS socket, as in Istio.
const xdsConfig = `
listeners:
  - name: outbound|backend
    address: {socket_address: {address: 127.0.0.1, port_value: 15001}}
    filter_chains:
      - filters:
          - name: envoy.filters.network.tcp_proxy
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
              stat_prefix: outbound_backend
              cluster: backend
clusters:
  - name: backend
    connect_timeout: 1s
    type: STATIC
    load_assignment:
      cluster_name: backend
      endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 15006}}}}]}]
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          tls_certificate_sds_secret_configs:
            - name: default
              sds_config: &sds
                api_config_source:
                  api_type: GRPC
                  transport_api_version: V3
                  grpc_services: [{envoy_grpc: {cluster_name: sds-grpc}}]
                resource_api_version: V3
          combined_validation_context:
            default_validation_context:
              match_typed_subject_alt_names:
                - {san_type: URI, matcher: {exact: "spiffe://cluster.local/ns/backend/sa/backend"}}
            validation_context_sds_secret_config: {name: ROOTCA, sds_config: *sds}
namespaces:
  backend:
    listeners:
      - name: inbound
        address: {socket_address: {address: 0.0.0.0, port_value: 15006}}
        filter_chains:
          - filters:
              - name: envoy.filters.network.tcp_proxy
                typed_config:
                  "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
                  stat_prefix: inbound
                  cluster: inbound|app
            transport_socket:
              name: envoy.transport_sockets.tls
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
                require_client_certificate: true
                common_tls_context:
                  tls_certificate_sds_secret_configs: [{name: default, sds_config: *sds}]
                  combined_validation_context:
                    default_validation_context:
                      match_typed_subject_alt_names:
                        - {san_type: URI, matcher: {exact: "spiffe://cluster.local/ns/default/sa/frontend"}}
                    validation_context_sds_secret_config: {name: ROOTCA, sds_config: *sds}
    clusters:
      - name: inbound|app
        connect_timeout: 1s
        type: STATIC
        load_assignment:
          cluster_name: inbound|app
          endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8080}}}}]}]
`

func TestMesh(t *testing.T) {
	// ---- 1. A CA, two agents, two Envoys ----

	// The CA signs with a self-signed root it makes at its first start, and serves the
	// discovery configuration on the same port.
	ca := startCA(t, mesh(""), xdsConfig)
	firstRoot := readRoots(t, ca.rootFile())[0]

	// Each agent gets its own service-account token and asks for short-lived certificates,
	// renewed at half their life: the frontend's every 1.5 s, the backend's every 10 s, which
	// leaves the frontend several renewals in which to move to a new root before the backend does,
	// even on a loaded machine.
	frontendAgent := startAgent(t, ca, workload{name: "frontend", namespace: "default", serviceAccount: "frontend", secretTTL: 3 * time.Second})
	backendAgent := startAgent(t, ca, workload{name: "backend", namespace: "backend", serviceAccount: "backend", secretTTL: 20 * time.Second})

	// Each Envoy takes its listener (and the frontend its cluster) over ADS through its agent,
	// then the secrets they name over SDS.
	frontend := startEnvoy(t, frontendAgent)
	backend := startEnvoy(t, backendAgent)
	if p := frontend.outbound; p == nil || p.peerID != backendID || p.certName != "default" || p.rootsName != "ROOTCA" {
		t.Fatalf("the frontend's configuration: outbound TLS %+v, want default and ROOTCA, and the peer %s", p, backendID)
	}
	if p := backend.inbound; p == nil || p.peerID != frontendID || !p.requireClientCert {
		t.Fatalf("the backend's configuration: inbound TLS %+v, want a client certificate of %s", p, frontendID)
	}
	for _, e := range []*envoy{frontend, backend} {
		if !chainsTo(t, e.secret("default"), firstRoot) {
			t.Fatalf("%s: its certificate does not chain to the CA's root", e.name)
		}
	}

	// ---- 2. They talk mutual TLS, each checking the other's SPIFFE ID ----

	backend.serve(t)
	got, err := frontend.call(backend)
	if err != nil {
		t.Fatal(err)
	}
	if got.server != backendID || got.client != frontendID {
		t.Fatalf("the frontend verified the backend as %q and the backend the frontend as %q; want %q and %q",
			got.server, got.client, backendID, frontendID)
	}

	// ---- 3. The CA's root is replaced while traffic flows ----

	// From here on the frontend calls the backend without pause, each call a new handshake
	// with the certificates each side holds at that moment.
	running := startTraffic(frontend, backend, backendID, frontendID)

	// An operator plugs a CA under a new root into --cacerts-dir (Istio's cacerts layout,
	// swapped in at once as the kubelet swaps a mounted secret), in two steps: first the new
	// root is trusted while the CA still signs with its first key, then the new CA signs. In
	// one step, a workload renewed under the new root before its peers have loaded it would be
	// refused by them until they do: the agents' watch of the CA's root file, here; on
	// Kubernetes, the propagation of the root ConfigMap.
	newRoot := testutil.NewRootCA(t, testutil.CAOptions{CommonName: "new root"})
	newCA := newRoot.NewIntermediate(t, testutil.CAOptions{CommonName: "new intermediate"})
	ca.cacerts.Update(map[string][]byte{
		"ca-cert.pem":    readFile(t, filepath.Join(ca.stateDir, "ca-cert.pem")), // the self-signed first root
		"ca-key.pem":     readFile(t, filepath.Join(ca.stateDir, "ca-key.pem")),
		"cert-chain.pem": nil,
		"root-cert.pem":  testutil.CertPEM(firstRoot, newRoot.Cert),
	})
	for _, e := range []*envoy{frontend, backend} {
		e.awaitSecret(t, "ROOTCA", "both roots", func(s *tlsv3.Secret) bool {
			return trusts(s, firstRoot) && trusts(s, newRoot.Cert)
		})
	}

	// The new CA comes right after one of the backend's renewals, so that the frontend,
	// renewing more often, holds a certificate under the new root while the backend still
	// holds one under the first. Its root-cert.pem has the new root only: the first one
	// stays trusted for --trust-bundle-overlap.
	serial := chainOf(t, backend.secret("default"))[0].SerialNumber
	backend.awaitSecret(t, "default", "a renewal", func(s *tlsv3.Secret) bool {
		return chainOf(t, s)[0].SerialNumber.Cmp(serial) != 0
	})
	ca.cacerts.Update(map[string][]byte{
		"ca-cert.pem":    testutil.CertPEM(newCA.Cert),
		"ca-key.pem":     testutil.KeyPEM(t, newCA.Key),
		"cert-chain.pem": testutil.CertPEM(newCA.Cert, newRoot.Cert),
		"root-cert.pem":  testutil.CertPEM(newRoot.Cert),
	})

	// The frontend's next certificate chains to the new root, and to it only.
	renewed := frontend.awaitSecret(t, "default", "a certificate under the new root", func(s *tlsv3.Secret) bool {
		return chainsTo(t, s, newRoot.Cert)
	})
	if chainsTo(t, renewed, firstRoot) {
		t.Fatal("the frontend's new certificate still chains to the first root")
	}
	// The first root is still trusted, for the overlap: in the CA's root file, and in what
	// each Envoy verifies its peers with.
	if roots := readRoots(t, ca.rootFile()); len(roots) != 2 || !slices.ContainsFunc(roots, firstRoot.Equal) || !slices.ContainsFunc(roots, newRoot.Cert.Equal) {
		t.Fatalf("%s holds %d roots; want the new one and the first one", ca.rootFile(), len(roots))
	}
	for _, e := range []*envoy{frontend, backend} {
		if s := e.secret("ROOTCA"); !trusts(s, firstRoot) || !trusts(s, newRoot.Cert) {
			t.Fatalf("%s: ROOTCA holds %d roots; want the new one and the first one", e.name, len(rootsOf(s)))
		}
	}
	// A workload holding a new-root certificate and one still holding a first-root one accept
	// each other: the backend verifies the frontend up to the new root, the frontend the backend
	// up to the first.
	if !chainsTo(t, backend.secret("default"), firstRoot) {
		t.Fatal("the backend renewed before the frontend: the plug-in came too late after its renewal to test a mixed pair")
	}
	if got, err := frontend.call(backend); err != nil || got.server != backendID || got.client != frontendID {
		t.Fatalf("new-root frontend → first-root backend: %+v, %v", got, err)
	}
	// Then the backend renews under the new root too, and they still talk.
	backend.awaitSecret(t, "default", "a certificate under the new root", func(s *tlsv3.Secret) bool {
		return chainsTo(t, s, newRoot.Cert)
	})
	if got, err := frontend.call(backend); err != nil || got.server != backendID || got.client != frontendID {
		t.Fatalf("new-root frontend → new-root backend: %+v, %v", got, err)
	}
	// Not one call failed while the root changed under them.
	calls, failures := running.stop()
	if len(failures) > 0 {
		t.Fatalf("%d of %d calls failed during the rotation; the first: %v", len(failures), calls, failures[0])
	}
	t.Logf("%d calls during the rotation, none failed", calls)

	// ---- 4. A manifest edit takes the backend's namespace away from the CA ----

	// ca.istio.io/override=false: no CA instance serves the namespace. At its next renewal the
	// backend's agent is refused, counts it, shows why in /debug/secrets, and keeps serving the
	// certificate it holds while it is valid.
	ca.writeManifests(t, mesh(`ca.istio.io/override: "false"`))
	refusal := backendAgent.awaitLog(t, "workload certificate renewal failed; the current one keeps serving", func(rec map[string]any) bool {
		return strings.Contains(fmt.Sprint(rec["error"]), "PermissionDenied")
	})
	t.Logf("the backend's agent: %s", refusal["error"])
	if n := metric(t, backendAgent.statusAddr, "meshid_agent_cert_renewal_failures_total"); n < 1 {
		t.Errorf("the backend's agent: meshid_agent_cert_renewal_failures_total = %v after a refusal", n)
	}
	const refusals = `meshid_ca_requests_refused_total{code="PermissionDenied",reason="namespace_not_targeted"}`
	if n := metric(t, ca.monitoringAddr, refusals); n < 1 {
		t.Errorf("the CA: %s = %v after a refusal", refusals, n)
	}
	st := backendAgent.debugSecret(t, "default")
	for _, want := range []string{"PermissionDenied", "namespace backend", `ca.istio.io/override="false"`} {
		if !strings.Contains(st.Error, want) {
			t.Errorf("/debug/secrets default: error %q does not name %q", st.Error, want)
		}
	}
	if !st.Valid || st.SPIFFEID != backendID {
		t.Errorf("/debug/secrets default: %+v; want the backend's certificate, still valid", st)
	}
	httpGet(t, "http://"+backendAgent.statusAddr+"/healthz/ready") // 200: a valid certificate is held
	// The backend's Envoy still holds that certificate, and the frontend, whose namespace is
	// still served and which still renews, still reaches it.
	if leaf := chainOf(t, backend.secret("default"))[0]; leaf.SerialNumber.Text(16) != st.Serial || time.Now().After(leaf.NotAfter) {
		t.Errorf("the backend's Envoy holds serial %x (until %s); the agent shows %s", leaf.SerialNumber, leaf.NotAfter, st.Serial)
	}
	serial = chainOf(t, frontend.secret("default"))[0].SerialNumber
	frontend.awaitSecret(t, "default", "a renewal", func(s *tlsv3.Secret) bool {
		return chainOf(t, s)[0].SerialNumber.Cmp(serial) != 0
	})
	if got, err := frontend.call(backend); err != nil || got.server != backendID || got.client != frontendID {
		t.Fatalf("frontend → refused backend, its certificate still valid: %+v, %v", got, err)
	}
}
