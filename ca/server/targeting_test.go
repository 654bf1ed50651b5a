package server_test

import (
	"context"
	"strings"
	"testing"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/ca/controller"
)

// labelStore is a namespace store over a map; a namespace absent from it is unknown.
type labelStore map[string]map[string]string

func (s labelStore) NamespaceLabels(_ context.Context, ns string) (map[string]string, bool, error) {
	labels, ok := s[ns]
	return labels, ok, nil
}

func (s labelStore) Namespaces(context.Context) ([]controller.Namespace, error) {
	var out []controller.Namespace
	for name, labels := range s {
		out = append(out, controller.Namespace{Name: name, Labels: labels})
	}
	return out, nil
}

// A caller from a namespace this instance does not serve is refused with PermissionDenied and
// told which namespace, labels and rule excluded it; the refusal is logged once with who asked,
// and counted. A namespace the store does not know counts as unlabelled.
func TestCreateCertificateTargetingFromStore(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{store: labelStore{
		"default": {controller.LabelOverride: "false"},
		"web":     {controller.LabelEnv: "istio-system"},
		"batch":   {controller.LabelEnv: "other-ca"},
	}})
	client := h.dial(t, nil)
	tests := []struct {
		ns   string
		code codes.Code
		why  []string
	}{
		{"default", codes.PermissionDenied, []string{"namespace default", `ca.istio.io/override="false"`, "ca.istio.io/env unset", "row 11", "no CA instance serves it"}},
		{"batch", codes.PermissionDenied, []string{"namespace batch", `ca.istio.io/env="other-ca"`, "row 15", "another CA instance"}},
		{"web", codes.OK, nil},
		{"not-in-store", codes.OK, nil}, // unlabelled, and enabled by default
	}
	refused := 0
	for _, tc := range tests {
		_, err := client.CreateCertificate(withToken(t.Context(), h.token(t, mintOptions{ns: tc.ns})), request(t, p256(t), nil, nil, 0))
		if status.Code(err) != tc.code {
			t.Fatalf("%s: code %v (%v), want %v", tc.ns, status.Code(err), err, tc.code)
		}
		if tc.code == codes.OK {
			continue
		}
		refused++
		msg := status.Convert(err).Message()
		for _, want := range tc.why {
			if !strings.Contains(msg, want) {
				t.Errorf("%s: the caller was told %q, which does not name %q", tc.ns, msg, want)
			}
		}
		if got := strings.Count(h.logs.String(), "identity=spiffe://cluster.local/ns/"+tc.ns+"/sa/demo"); got != 1 {
			t.Errorf("%s: the refusal is logged %d times with the caller's identity, want once:\n%s", tc.ns, got, h.logs.String())
		}
	}
	labels := map[string]string{"reason": "namespace_not_targeted", "code": codes.PermissionDenied.String()}
	if got := promtest.ToFloat64(counter(t, h.registry, "meshid_ca_requests_refused_total", labels)); int(got) != refused {
		t.Fatalf("%v refusals counted under %v, want %d", got, labels, refused)
	}
}
