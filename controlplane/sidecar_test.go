//go:build external

package controlplane_test

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/meshid/meshid/ca/controller/kube"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/istio"
)

// deploy/kubernetes/sidecar passes the API server's validation and admission, and wires the pod
// as the agent and Envoy expect: the projected token of audience istio-ca and the root ConfigMap
// the CA publishes at the agent's default paths, the two sockets shared with Envoy, Envoy started
// on the compose demo's bootstrap, readiness on the agent, nothing root, nothing writable.
func TestSidecarManifestOnKubernetes(t *testing.T) {
	t.Parallel()
	dir := filepath.Join("..", "deploy", "kubernetes", "sidecar")
	kubeEnv.Apply(t, false, filepath.Join(dir, "00-namespace.yaml"))
	var deployment appsv1.Deployment
	var bootstrap corev1.ConfigMap
	for _, obj := range kubeEnv.Apply(t, true, filepath.Join(dir, "demo.yaml")) {
		var into any
		switch obj.GetKind() {
		case "Deployment":
			into = &deployment
		case "ConfigMap":
			into = &bootstrap
		default:
			continue
		}
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(obj.Object, into); err != nil {
			t.Fatal(err)
		}
	}
	pod := deployment.Spec.Template.Spec

	compose, err := os.ReadFile(filepath.Join("..", "deploy", "compose", "envoy.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if bootstrap.Data["envoy.yaml"] != string(compose) {
		t.Error("the envoy-bootstrap ConfigMap differs from deploy/compose/envoy.yaml")
	}

	volumes := map[string]corev1.Volume{}
	for _, v := range pod.Volumes {
		volumes[v.Name] = v
	}
	mountOf := func(c corev1.Container, path string) corev1.Volume {
		t.Helper()
		for _, m := range c.VolumeMounts {
			if m.MountPath == path {
				return volumes[m.Name]
			}
		}
		t.Errorf("container %s mounts nothing at %s", c.Name, path)
		return corev1.Volume{}
	}
	containers := map[string]corev1.Container{}
	for _, c := range pod.Containers {
		containers[c.Name] = c
		sc := c.SecurityContext
		if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
			t.Errorf("container %s: root filesystem writable or privilege escalation allowed", c.Name)
		}
	}
	if psc := pod.SecurityContext; psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser == 0 {
		t.Error("the pod may run as root")
	}
	if pod.AutomountServiceAccountToken == nil || *pod.AutomountServiceAccountToken {
		t.Error("the pod mounts the default service-account token; the agent needs only the projected one")
	}

	agentC, envoy := containers["meshid-agent"], containers["istio-proxy"]
	tokenVol := mountOf(agentC, "/var/run/secrets/tokens")
	if p := tokenVol.Projected; p == nil || len(p.Sources) != 1 || p.Sources[0].ServiceAccountToken == nil ||
		p.Sources[0].ServiceAccountToken.Audience != token.DefaultAudience || p.Sources[0].ServiceAccountToken.Path != "istio-token" {
		t.Errorf("the agent's token volume %+v: want a projected token of audience %s at istio-token", tokenVol, token.DefaultAudience)
	}
	if cm := mountOf(agentC, "/var/run/secrets/istio").ConfigMap; cm == nil || cm.Name != kube.RootCertConfigMap {
		t.Errorf("the agent's CA root: %+v, want the %s ConfigMap (its key is %s)", cm, kube.RootCertConfigMap, istio.RootCertFile)
	}
	for _, path := range []string{"/var/run/secrets/workload-spiffe-uds", "/etc/istio/proxy"} {
		if a, e := mountOf(agentC, path), mountOf(envoy, path); a.Name != e.Name || a.EmptyDir == nil {
			t.Errorf("%s: the agent mounts %q, Envoy %q; want one emptyDir shared", path, a.Name, e.Name)
		}
	}
	if mountOf(envoy, "/etc/envoy").ConfigMap.Name != bootstrap.Name || !slices.Contains(envoy.Args, "--config-path=/etc/envoy/envoy.yaml") {
		t.Errorf("Envoy is not started on the bootstrap ConfigMap: args %v", envoy.Args)
	}
	if p := agentC.ReadinessProbe; p == nil || p.HTTPGet == nil || p.HTTPGet.Path != "/healthz/ready" || p.HTTPGet.Port.String() != "status" {
		t.Errorf("the agent's readiness probe: %+v, want /healthz/ready on its status port", p)
	}
}
