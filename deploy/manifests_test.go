package deploy_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/meshid/meshid/agent/appprobe"
)

// The directories a user applies with `kubectl apply -f DIR`, each on its own.
var kubeDirs = []string{
	filepath.Join("kubernetes"),
	filepath.Join("kubernetes", "sidecar"),
	filepath.Join("kubernetes", "proxy"),
}

// kubectlFiles lists the files `kubectl apply -f dir` applies, in its order: the directory's
// *.json, *.yaml and *.yml files in lexical order, not its subdirectories (that takes -R).
func kubectlFiles(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir) // sorted by name, as kubectl's filepath.Walk
	if err != nil {
		t.Fatal(err)
	}
	var files []string
	for _, e := range entries {
		switch filepath.Ext(e.Name()) {
		case ".json", ".yaml", ".yml":
			if !e.IsDir() {
				files = append(files, filepath.Join(dir, e.Name()))
			}
		}
	}
	if len(files) == 0 {
		t.Fatalf("%s holds no manifest", dir)
	}
	return files
}

// doc is one document of a manifest file, raw and as JSON.
type doc struct {
	file  string
	index int
	json  []byte
	meta  struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Metadata   struct {
			Name      string `json:"name"`
			Namespace string `json:"namespace"`
		} `json:"metadata"`
	}
}

func (d doc) String() string { return d.file + " document " + strconv.Itoa(d.index+1) }

// decodeDocs splits a YAML stream into its non-empty documents, as kubectl does.
func decodeDocs(t *testing.T, file string, data []byte) []doc {
	t.Helper()
	var docs []doc
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for i := 0; ; i++ {
		raw, err := r.Read()
		if errors.Is(err, io.EOF) {
			return docs
		}
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		js, err := yaml.YAMLToJSON(raw)
		if err != nil {
			t.Fatalf("%s document %d: %v", file, i+1, err)
		}
		if string(js) == "null" {
			i--
			continue
		}
		d := doc{file: file, index: i, json: js}
		if err := json.Unmarshal(js, &d.meta); err != nil {
			t.Fatalf("%s: %v", d, err)
		}
		docs = append(docs, d)
	}
}

func readDocs(t *testing.T, file string) []doc {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	return decodeDocs(t, file, data)
}

// The objects this repository ships, decoded strictly as their kind: a misspelt field is an error
// here rather than a field the API server drops.
func strictObject(kind string) any {
	switch kind {
	case "Namespace":
		return &corev1.Namespace{}
	case "ServiceAccount":
		return &corev1.ServiceAccount{}
	case "ConfigMap":
		return &corev1.ConfigMap{}
	case "Service":
		return &corev1.Service{}
	case "Deployment":
		return &appsv1.Deployment{}
	case "Role":
		return &rbacv1.Role{}
	case "RoleBinding":
		return &rbacv1.RoleBinding{}
	case "ClusterRole":
		return &rbacv1.ClusterRole{}
	case "ClusterRoleBinding":
		return &rbacv1.ClusterRoleBinding{}
	}
	return nil
}

var clusterScoped = map[string]bool{"Namespace": true, "ClusterRole": true, "ClusterRoleBinding": true}

// Every manifest decodes as its kind, and `kubectl apply -f DIR` of each directory on a fresh
// cluster creates every namespace before the objects in it (the API server's NamespaceLifecycle
// admission refuses the others; the external test applies them for real); so does
// `kubectl apply -R -f deploy/kubernetes/`, which walks the subdirectories in lexical order too.
func TestKubernetesManifestsApplyInOrder(t *testing.T) {
	t.Parallel()
	for _, dir := range kubeDirs {
		checkApplyOrder(t, "kubectl apply -f "+dir, kubectlFiles(t, dir))
	}
	var all []string
	err := filepath.WalkDir(kubeDirs[0], func(path string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && slices.Contains([]string{".json", ".yaml", ".yml"}, filepath.Ext(path)) {
			all = append(all, path)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	checkApplyOrder(t, "kubectl apply -R -f "+kubeDirs[0], all)
}

func checkApplyOrder(t *testing.T, what string, files []string) {
	t.Helper()
	created := map[string]bool{}
	for _, file := range files {
		for _, d := range readDocs(t, file) {
			if d.meta.APIVersion == "" || d.meta.Kind == "" || d.meta.Metadata.Name == "" {
				t.Errorf("%s: apiVersion %q, kind %q, name %q: kubectl refuses it", d, d.meta.APIVersion, d.meta.Kind, d.meta.Metadata.Name)
				continue
			}
			obj := strictObject(d.meta.Kind)
			if obj == nil {
				t.Errorf("%s: kind %s is not one this test checks; add it", d, d.meta.Kind)
				continue
			}
			if err := yaml.UnmarshalStrict(d.json, obj); err != nil {
				t.Errorf("%s: %v", d, err)
			}
			ns := d.meta.Metadata.Namespace
			switch {
			case d.meta.Kind == "Namespace":
				created[d.meta.Metadata.Name] = true
			case clusterScoped[d.meta.Kind]:
				if ns != "" {
					t.Errorf("%s: %s %s is cluster-scoped but names namespace %s", d, d.meta.Kind, d.meta.Metadata.Name, ns)
				}
			case ns == "":
				t.Errorf("%s: %s %s names no namespace: it would land in the user's current one", d, d.meta.Kind, d.meta.Metadata.Name)
			case !created[ns]:
				t.Errorf("%s: %s %s is in namespace %s, which %s has not created yet", d, d.meta.Kind, d.meta.Metadata.Name, ns, what)
			}
		}
	}
}

// The one-container pod of deploy/kubernetes/proxy is shaped as Istio's injector shapes one; the
// agent's side of it (its flags and variables) is checked against the command in
// cmd/meshid-agent.
func TestProxyManifest(t *testing.T) {
	t.Parallel()
	var dep *appsv1.Deployment
	for _, d := range readDocs(t, filepath.Join("kubernetes", "proxy", "demo.yaml")) {
		if d.meta.Kind == "Deployment" {
			dep = &appsv1.Deployment{}
			if err := yaml.UnmarshalStrict(d.json, dep); err != nil {
				t.Fatal(err)
			}
		}
	}
	if dep == nil {
		t.Fatal("no Deployment in kubernetes/proxy/demo.yaml")
	}
	pod := dep.Spec.Template
	if len(pod.Spec.Containers) < 2 {
		t.Fatalf("%d containers, want the proxy and the application", len(pod.Spec.Containers))
	}
	// The kubelet starts containers in order, each after the previous one's postStart hook.
	proxy := pod.Spec.Containers[0]
	if proxy.Image != "ghcr.io/meshid/meshid-proxy:latest" {
		t.Errorf("the first container runs %s, want the proxy image hack/images.sh names (ghcr.io/meshid/meshid-proxy:latest)", proxy.Image)
	}
	if len(proxy.Command) != 0 {
		t.Errorf("the proxy's command %q replaces the image's entrypoint (the agent with --envoy-path)", proxy.Command)
	}
	hook := proxy.Lifecycle
	if hook == nil || hook.PostStart == nil || hook.PostStart.Exec == nil {
		t.Fatal("the proxy has no postStart exec hook: the application could start before the proxy")
	}
	if cmd := hook.PostStart.Exec.Command; len(cmd) < 2 || cmd[0] != "/usr/local/bin/meshid-agent" || cmd[1] != "wait" ||
		!slices.Contains(loadDockerfile(t).stages["proxy"].copied, cmd[0]) {
		t.Errorf("postStart runs %q, want the proxy image's /usr/local/bin/meshid-agent wait", cmd)
	}

	env := map[string]corev1.EnvVar{}
	for _, e := range proxy.Env {
		env[e.Name] = e
	}
	for name, field := range map[string]string{
		"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace",
		"INSTANCE_IP": "status.podIP", "SERVICE_ACCOUNT": "spec.serviceAccountName",
	} {
		if e := env[name]; e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != field {
			t.Errorf("%s is not the downward API's %s: %+v", name, field, e)
		}
	}

	statusPort := func(p *corev1.Probe) bool {
		return p != nil && p.HTTPGet != nil && p.HTTPGet.Port.IntValue() == 15020
	}
	if p := proxy.ReadinessProbe; !statusPort(p) || p.HTTPGet.Path != "/healthz/ready" {
		t.Errorf("the proxy's readiness probe %+v, want /healthz/ready on 15020", p)
	}
	if a := pod.Annotations; a["prometheus.io/scrape"] != "true" || a["prometheus.io/port"] != "15020" || a["prometheus.io/path"] != "/stats/prometheus" {
		t.Errorf("prometheus annotations %v, want the merged /stats/prometheus on 15020", a)
	}

	// Each probe of each application container goes to the agent, which runs the original kept
	// in ISTIO_KUBE_APP_PROBERS.
	probers, err := appprobe.Parse(env["ISTIO_KUBE_APP_PROBERS"].Value)
	if err != nil {
		t.Fatalf("ISTIO_KUBE_APP_PROBERS: %v", err)
	}
	rewritten := map[string]bool{}
	for _, c := range pod.Spec.Containers[1:] {
		for kind, p := range map[string]*corev1.Probe{"livez": c.LivenessProbe, "readyz": c.ReadinessProbe, "startupz": c.StartupProbe} {
			if p == nil {
				continue
			}
			path := "/app-health/" + c.Name + "/" + kind
			if !statusPort(p) || p.HTTPGet.Path != path {
				t.Errorf("container %s: %s probe %+v, want %s on the agent's port 15020", c.Name, kind, p.ProbeHandler, path)
			}
			if _, ok := probers[path]; !ok {
				t.Errorf("container %s: ISTIO_KUBE_APP_PROBERS has no %s", c.Name, path)
			}
			rewritten[path] = true
		}
	}
	for path := range probers {
		if !rewritten[path] {
			t.Errorf("ISTIO_KUBE_APP_PROBERS has %s, which no container's probe asks for", path)
		}
	}

	// The kubelet's SIGKILL comes terminationGracePeriodSeconds after SIGTERM: Envoy's drain
	// must end before it.
	grace := time.Duration(*pod.Spec.TerminationGracePeriodSeconds) * time.Second
	drain, err := strconv.Atoi(env["TERMINATION_DRAIN_DURATION_SECONDS"].Value)
	if err != nil {
		t.Fatalf("TERMINATION_DRAIN_DURATION_SECONDS: %v", err)
	}
	minDrain, err := time.ParseDuration(env["MINIMUM_DRAIN_DURATION"].Value)
	if err != nil {
		t.Fatalf("MINIMUM_DRAIN_DURATION: %v", err)
	}
	if d := max(time.Duration(drain)*time.Second, minDrain); grace <= d {
		t.Errorf("terminationGracePeriodSeconds %s is not longer than the drain (%s)", grace, d)
	}

	sc := pod.Spec.SecurityContext
	if sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser == 0 {
		t.Error("the pod may run as root")
	}
	for _, c := range pod.Spec.Containers {
		if s := c.SecurityContext; s == nil || s.ReadOnlyRootFilesystem == nil || !*s.ReadOnlyRootFilesystem {
			t.Errorf("container %s may write its root filesystem", c.Name)
		}
	}
}

// The Envoy bootstrap the two-container demo ships validates as compose's does.
func TestSidecarEnvoyBootstrap(t *testing.T) {
	t.Parallel()
	var found bool
	for _, d := range readDocs(t, filepath.Join("kubernetes", "sidecar", "demo.yaml")) {
		if d.meta.Kind != "ConfigMap" {
			continue
		}
		var cm corev1.ConfigMap
		if err := yaml.UnmarshalStrict(d.json, &cm); err != nil {
			t.Fatal(err)
		}
		for name, data := range cm.Data {
			if strings.HasSuffix(name, ".yaml") {
				found = true
				validateBootstrap(t, d.String()+" "+name, []byte(data))
			}
		}
	}
	if !found {
		t.Error("no Envoy bootstrap in the sidecar demo")
	}
}
