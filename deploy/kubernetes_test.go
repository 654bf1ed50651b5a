package deploy_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/fsutil"
)

// The CA of deploy/kubernetes starts on the volumes the kubelet gives it: an emptyDir is made
// 0777 (group-writable and setgid with fsGroup), which the CA refuses as a state dir, so the
// state dir is a directory the CA makes in it, its own.
func TestKubernetesCAStateDirIsItsOwn(t *testing.T) {
	t.Parallel()
	data, err := os.ReadFile(filepath.Join("kubernetes", "ca.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	type mount struct {
		Name      string `json:"name"`
		MountPath string `json:"mountPath"`
	}
	var (
		args    []string
		mounts  []mount
		volumes = map[string]bool{} // name → an emptyDir
	)
	for _, doc := range strings.Split(string(data), "\n---\n") {
		var d struct {
			Kind string `json:"kind"`
			Spec struct {
				Template struct {
					Spec struct {
						Containers []struct {
							Name         string   `json:"name"`
							Args         []string `json:"args"`
							VolumeMounts []mount  `json:"volumeMounts"`
						} `json:"containers"`
						Volumes []struct {
							Name     string    `json:"name"`
							EmptyDir *struct{} `json:"emptyDir"`
						} `json:"volumes"`
					} `json:"spec"`
				} `json:"template"`
			} `json:"spec"`
		}
		if err := yaml.Unmarshal([]byte(doc), &d); err != nil {
			t.Fatal(err)
		}
		if d.Kind != "Deployment" {
			continue
		}
		for _, c := range d.Spec.Template.Spec.Containers {
			if c.Name == "ca" {
				args, mounts = c.Args, c.VolumeMounts
			}
		}
		for _, v := range d.Spec.Template.Spec.Volumes {
			volumes[v.Name] = v.EmptyDir != nil
		}
	}
	var stateDir string
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--state-dir="); ok {
			stateDir = v
		}
	}
	if stateDir == "" {
		t.Fatalf("the ca container's args %q set no --state-dir", args)
	}
	// The kubelet's side: the mount that holds the state dir, made as an emptyDir with fsGroup is.
	host := t.TempDir()
	var onHost string
	for _, m := range mounts {
		rel, err := filepath.Rel(m.MountPath, stateDir)
		if err != nil || strings.HasPrefix(rel, "..") {
			continue
		}
		if !volumes[m.Name] {
			t.Fatalf("--state-dir %s is on volume %s, not an emptyDir", stateDir, m.Name)
		}
		if err := os.Chmod(host, os.ModeSetgid|0o777); err != nil {
			t.Fatal(err)
		}
		onHost = filepath.Join(host, rel)
	}
	if onHost == "" {
		t.Fatalf("--state-dir %s is on no volume: the root file system is read-only", stateDir)
	}
	// What meshid ca does with it: check it, then make it private.
	if err := ca.CheckStateDir(onHost); err != nil {
		t.Fatalf("--state-dir %s on an emptyDir: %v", stateDir, err)
	}
	if err := fsutil.EnsureOwnedDir(onHost, fsutil.PrivateDirMode); err != nil {
		t.Fatalf("--state-dir %s on an emptyDir: %v", stateDir, err)
	}
}
