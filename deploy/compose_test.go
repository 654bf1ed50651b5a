package deploy_test

import (
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"
)

// composeFile is the part of the compose specification the demo uses. It is decoded strictly, so
// a key outside it (a typo, or a feature the checks below do not look at) fails the test, and a
// shell-form command (a string) does not decode.
type composeFile struct {
	Name     string                 `json:"name"`
	Services map[string]service     `json:"services"`
	Volumes  map[string]*volumeSpec `json:"volumes"`
}

type volumeSpec struct{}

type service struct {
	Image       string                `json:"image,omitempty"`
	Build       *build                `json:"build,omitempty"`
	User        string                `json:"user"`
	Command     []string              `json:"command,omitempty"`
	Environment map[string]string     `json:"environment,omitempty"`
	Volumes     []mount               `json:"volumes,omitempty"`
	Healthcheck *healthcheck          `json:"healthcheck,omitempty"`
	DependsOn   map[string]dependency `json:"depends_on,omitempty"`
	NetworkMode string                `json:"network_mode,omitempty"`
}

type build struct {
	Context string `json:"context"`
	Target  string `json:"target"`
}

type mount struct {
	Type     string `json:"type"`
	Source   string `json:"source"`
	Target   string `json:"target"`
	ReadOnly bool   `json:"read_only,omitempty"`
}

type healthcheck struct {
	Test     []string `json:"test"`
	Interval string   `json:"interval"`
	Timeout  string   `json:"timeout"`
	Retries  int      `json:"retries"`
}

type dependency struct {
	Condition string `json:"condition"`
}

func loadCompose(t *testing.T) composeFile {
	t.Helper()
	var f composeFile
	if err := yaml.UnmarshalStrict(readDemo(t, "compose.yaml"), &f); err != nil {
		t.Fatalf("compose.yaml (every command must be a list, exec form): %v", err)
	}
	return f
}

// flagValue returns the value of --name in an exec-form command, given as "--name v" or
// "--name=v".
func flagValue(cmd []string, name string) string {
	for i, arg := range cmd {
		if v, ok := strings.CutPrefix(arg, name+"="); ok {
			return v
		}
		if arg == name && i+1 < len(cmd) {
			return cmd[i+1]
		}
	}
	return ""
}

// mountOf returns the mount of svc that holds the absolute path p (or is p, a file), and p
// relative to it.
func mountOf(svc service, p string) (mount, string, bool) {
	var best mount
	var rel string
	found := false
	for _, m := range svc.Volumes {
		r, ok := strings.CutPrefix(p, m.Target+"/")
		if p == m.Target {
			r, ok = "", true
		}
		if ok && (!found || len(m.Target) > len(best.Target)) {
			best, rel, found = m, r, true
		}
	}
	return best, rel, found
}

// The compose CLI, where it exists, is the real parser; the structural checks run either way.
func TestComposeConfigWithDocker(t *testing.T) {
	t.Parallel()
	if err := exec.Command("docker", "compose", "version").Run(); err != nil {
		t.Skip("no docker compose plugin here; TestComposeStructure checks the file")
	}
	out, err := exec.Command("docker", "compose", "-f", filepath.Join(demoDir, "compose.yaml"), "config", "--quiet").CombinedOutput()
	if err != nil {
		t.Fatalf("docker compose config: %v\n%s", err, out)
	}
}

func TestComposeStructure(t *testing.T) {
	t.Parallel()
	f := loadCompose(t)
	stages := loadDockerfile(t).stages
	if f.Name == "" {
		t.Error("the project has no name")
	}
	usedVolumes := map[string]bool{}
	for name, svc := range f.Services {
		t.Run(name, func(t *testing.T) {
			switch {
			case svc.Image != "" && svc.Build != nil:
				t.Error("both image and build: the image name would be pulled or pushed")
			case svc.Image != "":
				if err := pinned(svc.Image); err != "" {
					t.Error(err)
				}
			case svc.Build != nil:
				if _, err := os.Stat(filepath.Join(demoDir, svc.Build.Context, "Dockerfile")); err != nil {
					t.Errorf("build context %s: %v", svc.Build.Context, err)
				}
				stage, ok := stages[svc.Build.Target]
				if !ok {
					t.Fatalf("build target %q is not a stage of the Dockerfile", svc.Build.Target)
				}
				// No shell in a distroless image: whatever the healthcheck runs must be one of
				// the image's own files.
				if hc := svc.Healthcheck; hc != nil && len(hc.Test) > 1 && !slices.Contains(stage.copied, hc.Test[1]) {
					t.Errorf("the healthcheck runs %s, which the %s image does not have (%v)", hc.Test[1], svc.Build.Target, stage.copied)
				}
			default:
				t.Error("neither image nor build")
			}

			uid, _, _ := strings.Cut(svc.User, ":")
			if n, err := strconv.Atoi(uid); err != nil || n == 0 {
				t.Errorf("user %q: want an explicit numeric non-root uid", svc.User)
			}

			if hc := svc.Healthcheck; hc != nil {
				if len(hc.Test) < 2 || hc.Test[0] != "CMD" || !path.IsAbs(hc.Test[1]) {
					t.Errorf("healthcheck %v: want [CMD, /absolute/binary, args...] (no shell)", hc.Test)
				}
				for _, d := range []string{hc.Interval, hc.Timeout} {
					if _, err := time.ParseDuration(d); err != nil {
						t.Errorf("healthcheck: %v", err)
					}
				}
			}

			for _, m := range svc.Volumes {
				switch m.Type {
				case "volume":
					if _, ok := f.Volumes[m.Source]; !ok {
						t.Errorf("volume %q is not declared", m.Source)
					}
					usedVolumes[m.Source] = true
				case "bind":
					if _, err := os.Stat(filepath.Join(demoDir, m.Source)); err != nil {
						t.Errorf("bind mount: %v", err)
					}
					if !m.ReadOnly {
						t.Errorf("bind mount of %s is writable", m.Source)
					}
				default:
					t.Errorf("mount type %q", m.Type)
				}
				if !path.IsAbs(m.Target) {
					t.Errorf("mount target %q is not absolute", m.Target)
				}
			}

			for dep, d := range svc.DependsOn {
				other, ok := f.Services[dep]
				if !ok {
					t.Errorf("depends on %q, no such service", dep)
					continue
				}
				switch d.Condition {
				case "service_started", "service_completed_successfully":
				case "service_healthy":
					if other.Healthcheck == nil {
						t.Errorf("waits for %s to be healthy, which has no healthcheck", dep)
					}
				default:
					t.Errorf("depends on %s with condition %q", dep, d.Condition)
				}
			}

			if svc.NetworkMode != "" {
				app, ok := strings.CutPrefix(svc.NetworkMode, "service:")
				if _, exists := f.Services[app]; !ok || !exists {
					t.Errorf("network_mode %q: want service:<a service of this file>", svc.NetworkMode)
				}
				if svc.DependsOn[app].Condition == "" {
					t.Errorf("shares %s's network namespace but does not depend on it", app)
				}
			}
		})
	}
	for v := range f.Volumes {
		if !usedVolumes[v] {
			t.Errorf("volume %q is declared but never mounted", v)
		}
	}
}

// pinned says what is wrong with an image reference that is not pinned to a version.
func pinned(image string) string {
	ref, _, _ := strings.Cut(image, "@")
	name := ref[strings.LastIndex(ref, "/")+1:]
	_, tag, ok := strings.Cut(name, ":")
	switch {
	case strings.Contains(image, "@sha256:"):
		return ""
	case !ok || tag == "":
		return "image " + image + " has no tag"
	case tag == "latest":
		return "image " + image + " is not pinned (latest)"
	}
	return ""
}

// The pieces of each workload meet: Envoy and its agent share the socket volumes at the paths the
// bootstrap names, the agent's token is the one minted for its identity, its CA root is the file
// the CA writes, and the CA's serving certificate carries the name the agents dial.
func TestComposeWorkloadsFitTogether(t *testing.T) {
	t.Parallel()
	f := loadCompose(t)
	ca := f.Services["ca"]
	caState, _, ok := mountOf(ca, flagValue(ca.Command, "--state-dir")+"/x")
	if !ok || caState.Type != "volume" {
		t.Fatalf("the CA's --state-dir is not on a volume")
	}
	if ca.Healthcheck == nil || flagValue(ca.Healthcheck.Test, "--addr") != "127.0.0.1:9093" {
		t.Errorf("the CA's healthcheck is not meshid probe on its monitoring port")
	}
	for _, p := range []string{flagValue(ca.Command, "--manifests"), flagValue(ca.Command, "--xds-config")} {
		m, rel, ok := mountOf(ca, p)
		if !ok || m.Type != "bind" {
			t.Errorf("the CA reads %s, which no bind mount of the demo folder holds", p)
			continue
		}
		if _, err := os.Stat(filepath.Join(demoDir, m.Source, rel)); err != nil {
			t.Errorf("the CA reads %s: %v", p, err)
		}
	}

	for _, w := range []struct{ app, namespace, serviceAccount string }{
		{"frontend", "default", "frontend"},
		{"backend", "backend", "backend"},
	} {
		t.Run(w.app, func(t *testing.T) {
			agent, ok := f.Services[w.app+"-agent"]
			if !ok || agent.Build == nil || agent.Build.Target != "agent" {
				t.Fatalf("no service %s-agent built from the agent target", w.app)
			}
			envoy, ok := f.Services[w.app+"-envoy"]
			if !ok || !strings.HasPrefix(envoy.Image, "envoyproxy/envoy:") {
				t.Fatalf("no service %s-envoy running envoyproxy/envoy", w.app)
			}
			if envoy.NetworkMode != "service:"+w.app {
				t.Errorf("%s-envoy's network_mode is %q, want service:%s", w.app, envoy.NetworkMode, w.app)
			}
			if envoy.DependsOn[w.app+"-agent"].Condition != "service_healthy" {
				t.Errorf("%s-envoy does not wait for its agent to hold a certificate", w.app)
			}
			if flagValue(envoy.Command, "--service-node") != w.app {
				t.Errorf("%s-envoy's node is %q", w.app, flagValue(envoy.Command, "--service-node"))
			}

			// The bootstrap, mounted where -c says, and its two sockets on volumes shared with
			// the agent at the same place.
			if m, rel, ok := mountOf(envoy, flagValue(envoy.Command, "-c")); !ok || m.Type != "bind" || path.Join(m.Source, rel) != "envoy.yaml" {
				t.Errorf("%s-envoy's -c %s is not the demo's envoy.yaml", w.app, flagValue(envoy.Command, "-c"))
			}
			for _, socket := range []string{sdsSocket, xdsSocket} {
				em, _, ok := mountOf(envoy, socket)
				am, _, ok2 := mountOf(agent, socket)
				if !ok || !ok2 || em.Type != "volume" || em != am || path.Dir(socket) != em.Target {
					t.Errorf("%s: Envoy (%+v) and the agent (%+v) do not share the directory of %s", w.app, em, am, socket)
				}
			}

			env := agent.Environment
			if env["POD_NAMESPACE"] != w.namespace || env["SERVICE_ACCOUNT"] != w.serviceAccount {
				t.Errorf("%s-agent runs as %s/%s, want %s/%s", w.app, env["POD_NAMESPACE"], env["SERVICE_ACCOUNT"], w.namespace, w.serviceAccount)
			}
			host, port, _ := strings.Cut(env["CA_ADDR"], ":")
			if _, exists := f.Services[host]; !exists || port != "15012" {
				t.Errorf("%s-agent's CA_ADDR %q is not the ca service's gRPC port", w.app, env["CA_ADDR"])
			}
			// The agent verifies ISTIOD_SAN in the CA's certificate, whatever host it dials.
			if env["ISTIOD_SAN"] != host {
				t.Errorf("%s-agent dials %s but verifies ISTIOD_SAN %q", w.app, host, env["ISTIOD_SAN"])
			}
			if !slices.Contains(strings.Split(flagValue(ca.Command, "--grpc-host-identities"), ","), env["ISTIOD_SAN"]) {
				t.Errorf("the CA's serving certificate does not name %q, which %s-agent verifies", env["ISTIOD_SAN"], w.app)
			}
			ttl := strings.TrimSuffix(strings.TrimPrefix(env["SECRET_TTL"], "${SECRET_TTL:-"), "}")
			if _, err := time.ParseDuration(ttl); err != nil {
				t.Errorf("%s-agent's SECRET_TTL: %v", w.app, err)
			}

			// The agent mounts nothing of the CA's state (its keys): the one-shot identity
			// service hands it its token and the CA's root, in a volume of its own.
			for _, m := range agent.Volumes {
				if m.Source == caState.Source {
					t.Errorf("%s-agent mounts the CA's state volume, keys and all", w.app)
				}
			}
			idSvc, ok := f.Services[w.app+"-identity"]
			if !ok {
				t.Fatalf("no service %s-identity", w.app)
			}
			if got := idSvc.Command[:2]; !slices.Equal(got, []string{"vm", "bootstrap"}) {
				t.Errorf("%s-identity runs %v, want meshid vm bootstrap", w.app, got)
			}
			if agent.DependsOn[w.app+"-identity"].Condition != "service_completed_successfully" {
				t.Errorf("%s-agent does not wait for its identity bundle", w.app)
			}
			if idSvc.DependsOn["ca"].Condition != "service_healthy" {
				t.Errorf("%s-identity does not wait for the CA's key", w.app)
			}
			if flagValue(idSvc.Command, "--namespace") != w.namespace || flagValue(idSvc.Command, "--service-account") != w.serviceAccount {
				t.Errorf("%s-identity mints for %s/%s", w.app, flagValue(idSvc.Command, "--namespace"), flagValue(idSvc.Command, "--service-account"))
			}
			if flagValue(idSvc.Command, "--ca-addr") != env["CA_ADDR"] {
				t.Errorf("%s-identity names the CA %s, the agent dials %s", w.app, flagValue(idSvc.Command, "--ca-addr"), env["CA_ADDR"])
			}
			if sm, _, ok := mountOf(idSvc, flagValue(idSvc.Command, "--state-dir")+"/x"); !ok || sm.Source != caState.Source || !sm.ReadOnly {
				t.Errorf("%s-identity does not read the CA's state volume read-only", w.app)
			}
			// Who reads whose files: the CA's state dir is 0700 and token-key.pem 0600, the token
			// 0600, the SDS and xDS sockets 0660.
			for _, pair := range [][2]string{{"ca", w.app + "-identity"}, {w.app + "-identity", w.app + "-agent"}} {
				if a, b := f.Services[pair[0]].User, f.Services[pair[1]].User; a != b {
					t.Errorf("%s runs as %s, %s as %s: the second cannot read the first's private files", pair[0], a, pair[1], b)
				}
			}
			_, agentGID, _ := strings.Cut(agent.User, ":")
			if _, envoyGID, _ := strings.Cut(envoy.User, ":"); envoyGID != agentGID {
				t.Errorf("%s-envoy's group %s is not the agent's %s: it cannot connect to the sockets (0660)", w.app, envoyGID, agentGID)
			}
			// The token and the root the agent reads are the files the bundle holds.
			tokenPath := flagValue(agent.Command, "--token-path")
			if tokenPath == "" {
				tokenPath = "/var/run/secrets/tokens/istio-token" // the agent's default
			}
			out := flagValue(idSvc.Command, "--out")
			written, _, ok1 := mountOf(idSvc, out+"/x")
			for file, at := range map[string]string{"istio-token": tokenPath, "root-cert.pem": env["CA_ROOT_CA"]} {
				read, rrel, ok2 := mountOf(agent, at)
				wrel := strings.TrimPrefix(path.Join(out, file), written.Target+"/")
				if !ok1 || !ok2 || written.Source != read.Source || wrel != rrel || written.Type != "volume" || !read.ReadOnly {
					t.Errorf("%s-agent reads %s at %s (%+v), not where %s-identity writes it (%+v)", w.app, file, at, read, w.app, written)
				}
			}
		})
	}
}
