package server_test

import (
	"context"
	"crypto/x509"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshid/meshid/ca/controller"
	"github.com/meshid/meshid/ca/server"
	"github.com/meshid/meshid/internal/pki"
)

// nodeAgent is the trusted node account of these tests, as ztunnel runs.
var nodeAgent = server.NodeAccount{Namespace: "istio-system", ServiceAccount: "ztunnel"}

// fakeNodes places workloads on the node of the caller's pod: it knows the pod "agent-pod" only,
// whose node runs the identities in onNode.
type fakeNodes struct {
	onNode      map[string]bool // SPIFFE IDs with a pod on agent-pod's node
	unavailable bool
}

func (f fakeNodes) OnCallersNode(_ context.Context, caller server.Caller, target pki.SPIFFEID) error {
	switch {
	case f.unavailable:
		return server.ErrNodesUnavailable
	case caller.Pod == (server.BoundPod{}):
		return server.ErrNoBoundPod
	case caller.Pod != server.BoundPod{Name: "agent-pod", UID: "agent-uid"}:
		return server.ErrCallerPodUnknown
	case !f.onNode[target.String()]:
		return server.ErrNotOnNode
	}
	return nil
}

// boundToken is a token of ns/sa bound to a pod, as the kubelet mounts it; pod "" binds none.
func (h *harness) boundToken(t testing.TB, ns, sa, pod, uid string) string {
	t.Helper()
	k8s := map[string]any{"namespace": ns, "serviceaccount": map[string]any{"name": sa, "uid": "sa-uid"}}
	if pod != "" {
		k8s["pod"] = map[string]any{"name": pod, "uid": uid}
	}
	return signClaims(t, h.tokenKey, jwt.MapClaims{
		"aud": []string{"istio-ca"}, "sub": "system:serviceaccount:" + ns + ":" + sa,
		"exp": h.clock.Now().Add(time.Hour).Unix(), "kubernetes.io": k8s,
	})
}

// impersonating adds the ImpersonatedIdentity metadata to req, as ztunnel sends it.
func impersonating(t testing.TB, req *pb.IstioCertificateRequest, value any) *pb.IstioCertificateRequest {
	t.Helper()
	md, err := structpb.NewStruct(map[string]any{"ClusterID": "Kubernetes", server.ImpersonatedIdentityKey: value})
	if err != nil {
		t.Fatal(err)
	}
	req.Metadata = md
	return req
}

// A trusted node account gets certificates for the workloads of its node, and for nothing else;
// a request without the metadata is answered as ever, for the caller's own identity.
func TestCreateCertificateImpersonation(t *testing.T) {
	t.Parallel()
	const other = "spiffe://cluster.local/ns/default/sa/other"
	store := labelStore{
		// The node agent's own namespace is not served: targeting is the workload's.
		"istio-system": {controller.LabelOverride: "false"},
		"blocked":      {controller.LabelOverride: "false"},
	}
	newH := func(nodes server.NodeAuthorizer) *harness {
		return newHarness(t, harnessOptions{store: store, trustedNodes: []server.NodeAccount{nodeAgent}, nodes: nodes})
	}
	h := newH(fakeNodes{onNode: map[string]bool{demoID(): true, "spiffe://cluster.local/ns/blocked/sa/app": true}})
	offK8s := newH(nil) // manifests or local store: the trusted account alone decides
	unavailable := newH(fakeNodes{unavailable: true})

	// Each harness has its own token key: a token is minted for the harness that checks it.
	bound := func(ns, sa, pod, uid string) func(*harness) string {
		return func(h *harness) string { return h.boundToken(t, ns, sa, pod, uid) }
	}
	agentToken := bound(nodeAgent.Namespace, nodeAgent.ServiceAccount, "agent-pod", "agent-uid")
	good := func(uris ...string) *pb.IstioCertificateRequest { return request(t, p256(t), uris, nil, 0) }
	agentID := "spiffe://cluster.local/ns/istio-system/sa/ztunnel"
	tests := []struct {
		name   string
		h      *harness
		tok    func(*harness) string
		req    *pb.IstioCertificateRequest
		code   codes.Code
		reason string // of a refusal
		want   string // the leaf's identity when signed
	}{
		{"trusted node account, workload on its node", h, agentToken, impersonating(t, good(demoID()), demoID()), codes.OK, "", demoID()},
		{"CSR naming no identity", h, agentToken, impersonating(t, good(), demoID()), codes.OK, "", demoID()},
		{"off Kubernetes the trusted account suffices", offK8s, agentToken, impersonating(t, good(other), other), codes.OK, "", other},
		{"empty metadata value asks for nothing", h, bound("default", "demo", "", ""), impersonating(t, good(demoID()), ""), codes.OK, "", demoID()},
		{"no metadata: the caller's own identity", h, bound("default", "demo", "", ""), good(demoID()), codes.OK, "", demoID()},
		{"untrusted caller", h, bound("default", "demo", "agent-pod", "agent-uid"), impersonating(t, good(other), other),
			codes.PermissionDenied, "impersonation_not_trusted", ""},
		{"untrusted caller off Kubernetes", offK8s, bound("istio-system", "other-agent", "", ""), impersonating(t, good(other), other),
			codes.PermissionDenied, "impersonation_not_trusted", ""},
		{"other trust domain", h, agentToken, impersonating(t, good(), "spiffe://example.org/ns/default/sa/demo"),
			codes.PermissionDenied, "impersonation_trust_domain", ""},
		{"malformed identity", h, agentToken, impersonating(t, good(), "spiffe://cluster.local/default/demo"),
			codes.InvalidArgument, "impersonation_malformed", ""},
		{"identity not canonical", h, agentToken, impersonating(t, good(), demoID()+"?"), codes.InvalidArgument, "impersonation_malformed", ""},
		{"not a string", h, agentToken, impersonating(t, good(), 42.0), codes.InvalidArgument, "impersonation_malformed", ""},
		{"namespace not targeted", h, agentToken, impersonating(t, good(), "spiffe://cluster.local/ns/blocked/sa/app"),
			codes.PermissionDenied, "namespace_not_targeted", ""},
		{"CSR naming another identity", h, agentToken, impersonating(t, good(other), demoID()), codes.PermissionDenied, "csr_identity", ""},
		{"CSR naming the node agent", h, agentToken, impersonating(t, good(agentID), demoID()), codes.PermissionDenied, "csr_identity", ""},
		{"CA certificate", h, agentToken, impersonating(t, caRequest(t, 0), demoID()), codes.PermissionDenied, "impersonation_ca_cert", ""},
		{"workload not on the node", h, agentToken, impersonating(t, good(), other), codes.PermissionDenied, "impersonation_not_on_node", ""},
		{"token bound to no pod", h, bound(nodeAgent.Namespace, nodeAgent.ServiceAccount, "", ""), impersonating(t, good(), demoID()),
			codes.PermissionDenied, "impersonation_no_bound_pod", ""},
		{"token bound to another pod", h, bound(nodeAgent.Namespace, nodeAgent.ServiceAccount, "agent-pod", "old-uid"),
			impersonating(t, good(), demoID()), codes.PermissionDenied, "impersonation_caller_pod", ""},
		{"pods not known yet", unavailable, agentToken, impersonating(t, good(), demoID()), codes.Unavailable, "impersonation_unavailable", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			resp, err := tt.h.dial(t, nil).CreateCertificate(withToken(t.Context(), tt.tok(tt.h)), tt.req)
			if got := status.Code(err); got != tt.code {
				t.Fatalf("code = %v (%v), want %v", got, err, tt.code)
			}
			if tt.code != codes.OK {
				labels := map[string]string{"reason": tt.reason, "code": tt.code.String()}
				if got := promtest.ToFloat64(counter(t, tt.h.registry, "meshid_ca_requests_refused_total", labels)); got < 1 {
					t.Fatalf("refusal not counted under %v", labels)
				}
				if !strings.Contains(tt.h.logs.String(), "reason="+tt.reason) {
					t.Fatalf("refusal %s not logged:\n%s", tt.reason, tt.h.logs)
				}
				return
			}
			leaf := parseChain(t, resp.CertChain)[0]
			if len(leaf.URIs) != 1 || leaf.URIs[0].String() != tt.want {
				t.Fatalf("leaf names %v, want %s", leaf.URIs, tt.want)
			}
		})
	}
}

// A signing for another identity is counted apart, by the node agent's authentication method,
// and its log names both identities; a refusal names who asked and for whom.
func TestCreateCertificateImpersonationMetricsAndLogs(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{trustedNodes: []server.NodeAccount{nodeAgent}})
	client := h.dial(t, nil)
	agent := withToken(t.Context(), h.boundToken(t, nodeAgent.Namespace, nodeAgent.ServiceAccount, "", ""))
	if _, err := client.CreateCertificate(agent, impersonating(t, request(t, p256(t), nil, nil, 0), demoID())); err != nil {
		t.Fatal(err)
	}
	if _, err := client.CreateCertificate(withToken(t.Context(), h.token(t, mintOptions{})), request(t, p256(t), nil, nil, 0)); err != nil {
		t.Fatal(err)
	}
	impersonated := counter(t, h.registry, "meshid_ca_impersonated_certificates_issued_total", map[string]string{"auth_method": "jwt"})
	issued := counter(t, h.registry, "meshid_ca_certificates_issued_total", map[string]string{"auth_method": "jwt"})
	if got, all := promtest.ToFloat64(impersonated), promtest.ToFloat64(issued); got != 1 || all != 2 {
		t.Fatalf("impersonated %v of %v issued, want 1 of 2", got, all)
	}
	logs := h.logs.String()
	if !strings.Contains(logs, "identity="+demoID()) || !strings.Contains(logs, "caller=spiffe://cluster.local/ns/istio-system/sa/ztunnel") {
		t.Fatalf("issuance log lacks the workload or the node agent:\n%s", logs)
	}

	untrusted := withToken(t.Context(), h.token(t, mintOptions{sa: "intruder"}))
	const target = "spiffe://cluster.local/ns/kube-system/sa/admin"
	_, err := client.CreateCertificate(untrusted, impersonating(t, request(t, p256(t), nil, nil, 0), target))
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("untrusted caller: %v, want PermissionDenied", err)
	}
	var line string
	for l := range strings.Lines(h.logs.String()) {
		if strings.Contains(l, "reason=impersonation_not_trusted") {
			line = l
		}
	}
	if !strings.Contains(line, "identity=spiffe://cluster.local/ns/default/sa/intruder") || !strings.Contains(line, "impersonated_identity="+target) {
		t.Fatalf("refusal log does not say who asked for whom: %q", line)
	}
}

// A client certificate never asks for another identity, even a trusted node account's: any CA
// under the root can mint one naming that account (Istio refuses it too: a certificate carries no
// Kubernetes pod).
func TestCreateCertificateImpersonationNotByClientCertificate(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{trustedNodes: []server.NodeAccount{nodeAgent}})
	leaf, key := h.intermediate.IssueWorkload(t, "spiffe://cluster.local/ns/istio-system/sa/ztunnel", time.Hour)
	cert := tlsCert([]*x509.Certificate{leaf, h.intermediate.Cert}, key)
	_, err := h.dial(t, cert).CreateCertificate(t.Context(), impersonating(t, request(t, p256(t), nil, nil, 0), demoID()))
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("code = %v (%v), want PermissionDenied", status.Code(err), err)
	}
	labels := map[string]string{"reason": "impersonation_credential", "code": codes.PermissionDenied.String()}
	if got := promtest.ToFloat64(counter(t, h.registry, "meshid_ca_requests_refused_total", labels)); got != 1 {
		t.Fatalf("refusal counted %v times under %v, want 1", got, labels)
	}
}
