package deploy_test

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	"sigs.k8s.io/yaml"
)

// recordingDocker writes a stand-in for the docker CLI that appends each call (its working
// directory and arguments, tab-separated) to the returned log, and fails `build --target
// <failTarget>`.
func recordingDocker(t *testing.T, failTarget string) (docker, log string) {
	t.Helper()
	dir := t.TempDir()
	docker, log = filepath.Join(dir, "docker"), filepath.Join(dir, "calls")
	script := `#!/bin/sh
{ printf '%s' "$PWD"; for a in "$@"; do printf '\t%s' "$a"; done; printf '\n'; } >>'` + log + `'
[ "$1 $2 $3" != "build --target ` + failTarget + `" ]
`
	if err := os.WriteFile(docker, []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}
	return docker, log
}

// call is one recorded docker call.
type call struct {
	dir  string
	args []string
}

func calls(t *testing.T, log string) []call {
	t.Helper()
	data, err := os.ReadFile(log)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var out []call
	for _, line := range strings.Split(strings.TrimSuffix(string(data), "\n"), "\n") {
		f := strings.Split(line, "\t")
		out = append(out, call{dir: f[0], args: f[1:]})
	}
	return out
}

// runMake runs the README's make command in the repository.
func runMake(t *testing.T, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("no make here")
	}
	cmd := exec.Command("make", append([]string{"-s", "-C", repoRoot}, args...)...)
	cmd.Env = append(os.Environ(), "MAKEFLAGS=")
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err = cmd.Run()
	return out.String(), errOut.String(), err
}

// flagArg returns the value after name in args.
func flagArg(args []string, name string) string {
	if i := slices.Index(args, name); i >= 0 && i+1 < len(args) {
		return args[i+1]
	}
	return ""
}

const (
	userRegistry = "registry.example.com:5000/team/mesh"
	userTag      = "v9.8.7-rc.1"
)

// make images builds every image target of the Dockerfile from the repository under the user's
// registry and tag, and pushes exactly those when PUSH=1, after all of them built.
func TestMakeImages(t *testing.T) {
	t.Parallel()
	root, err := filepath.Abs(repoRoot)
	if err != nil {
		t.Fatal(err)
	}
	stages := loadDockerfile(t).stages
	want := map[string]string{ // target → image
		"meshid": userRegistry + "/meshid:" + userTag,
		"agent":  userRegistry + "/meshid-agent:" + userTag,
		"proxy":  userRegistry + "/meshid-proxy:" + userTag,
	}
	for _, push := range []bool{false, true} {
		docker, log := recordingDocker(t, "none")
		args := []string{"images", "REGISTRY=" + userRegistry, "TAG=" + userTag, "DOCKER=" + docker, "VERSION=v9.8.7"}
		if push {
			args = append(args, "PUSH=1")
		}
		stdout, stderr, err := runMake(t, args...)
		if err != nil {
			t.Fatalf("make %s: %v\n%s", strings.Join(args, " "), err, stderr)
		}
		built := map[string]string{}
		var pushed []string
		for i, c := range calls(t, log) {
			if c.dir != root {
				t.Errorf("docker %q runs in %s, want the repository %s (the build context)", c.args, c.dir, root)
			}
			switch c.args[0] {
			case "build":
				if len(pushed) > 0 {
					t.Errorf("call %d: a build after a push: a failed build would leave some images pushed", i)
				}
				target := flagArg(c.args, "--target")
				if _, ok := stages[target]; !ok {
					t.Errorf("docker build --target %s: no such stage in the Dockerfile", target)
				}
				if c.args[len(c.args)-1] != "." || flagArg(c.args, "--build-arg") != "VERSION=v9.8.7" {
					t.Errorf("docker %q: want the repository as context and VERSION as build argument", c.args)
				}
				built[target] = flagArg(c.args, "--tag")
			case "push":
				pushed = append(pushed, c.args[1:]...)
			default:
				t.Errorf("docker %q: unexpected", c.args)
			}
		}
		if !mapsEqual(built, want) {
			t.Errorf("built %v, want %v", built, want)
		}
		var wantPushed []string
		if push {
			for _, image := range want {
				wantPushed = append(wantPushed, image)
			}
		}
		slices.Sort(pushed)
		slices.Sort(wantPushed)
		if !slices.Equal(pushed, wantPushed) {
			t.Errorf("PUSH=%v pushed %v, want %v", push, pushed, wantPushed)
		}
		printed := strings.Fields(stdout)
		slices.Sort(printed)
		if all := sortedValues(want); !slices.Equal(printed, all) {
			t.Errorf("make images printed %q, want the images %q", printed, all)
		}
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

func sortedValues(m map[string]string) []string {
	var out []string
	for _, v := range m {
		out = append(out, v)
	}
	slices.Sort(out)
	return out
}

// A build that fails stops make images before anything is pushed; names docker would refuse,
// or a PUSH that is neither 0 nor 1, are refused before docker runs.
func TestMakeImagesRefuses(t *testing.T) {
	t.Parallel()
	docker, log := recordingDocker(t, "agent")
	if _, _, err := runMake(t, "images", "REGISTRY="+userRegistry, "TAG="+userTag, "DOCKER="+docker, "PUSH=1"); err == nil {
		t.Error("make images succeeded with a failing build")
	}
	for _, c := range calls(t, log) {
		if c.args[0] == "push" || flagArg(c.args, "--target") == "proxy" {
			t.Errorf("docker %q ran after the agent's build failed", c.args)
		}
	}

	for _, tc := range []struct{ arg, says string }{
		{"TAG=v1 2", "TAG="},
		{"TAG=-v1", "TAG="},
		{"TAG=v1:2", "TAG="},
		{"REGISTRY=registry.example.com/Team", "REGISTRY="},
		{"REGISTRY=https://registry.example.com", "REGISTRY="},
		{"PUSH=yes", "PUSH="},
	} {
		docker, log := recordingDocker(t, "none")
		args := []string{"images", "REGISTRY=" + userRegistry, "TAG=" + userTag, "DOCKER=" + docker, tc.arg}
		_, stderr, err := runMake(t, args...)
		if err == nil || !strings.Contains(stderr, tc.says) {
			t.Errorf("make images %s: %v, want a refusal naming %s; stderr:\n%s", tc.arg, err, tc.says, stderr)
		}
		if c := calls(t, log); len(c) > 0 {
			t.Errorf("make images %s ran docker %v", tc.arg, c)
		}
	}
}

// make manifests prints each directory's manifests as kubectl apply -f reads them (same files,
// same order, same objects), with the images named as make images names them.
func TestMakeManifests(t *testing.T) {
	t.Parallel()
	dirs := make([]string, len(kubeDirs))
	for i, d := range kubeDirs {
		dirs[i] = filepath.Join("deploy", d)
	}
	stdout, stderr, err := runMake(t, "manifests", "REGISTRY="+userRegistry, "TAG="+userTag, "MANIFESTS="+strings.Join(dirs, " "))
	if err != nil {
		t.Fatalf("make manifests: %v\n%s", err, stderr)
	}
	rendered := decodeDocs(t, "make manifests", []byte(stdout))
	var original []doc
	for _, dir := range kubeDirs {
		for _, file := range kubectlFiles(t, dir) {
			original = append(original, readDocs(t, file)...)
		}
	}
	if len(rendered) != len(original) {
		t.Fatalf("make manifests printed %d objects, the directories hold %d", len(rendered), len(original))
	}
	ours := map[string]bool{}
	for _, name := range []string{"meshid", "meshid-agent", "meshid-proxy"} {
		ours["ghcr.io/meshid/"+name+":latest"] = true
	}
	var used []string
	for i, got := range rendered {
		orig := original[i]
		if got.meta != orig.meta {
			t.Errorf("object %d is %+v, want %+v (%s)", i, got.meta, orig.meta, orig)
			continue
		}
		if orig.meta.Kind != "Deployment" {
			if !bytes.Equal(got.json, orig.json) {
				t.Errorf("%s changed", orig)
			}
			continue
		}
		var before, after appsv1.Deployment
		if err := yaml.Unmarshal(orig.json, &before); err != nil {
			t.Fatal(err)
		}
		if err := yaml.Unmarshal(got.json, &after); err != nil {
			t.Fatal(err)
		}
		for j, c := range before.Spec.Template.Spec.Containers {
			image := after.Spec.Template.Spec.Containers[j].Image
			after.Spec.Template.Spec.Containers[j].Image = c.Image
			if !ours[c.Image] {
				if image != c.Image {
					t.Errorf("%s: container %s's image %s became %s", orig, c.Name, c.Image, image)
				}
				continue
			}
			name := strings.TrimSuffix(strings.TrimPrefix(c.Image, "ghcr.io/meshid/"), ":latest")
			if want := userRegistry + "/" + name + ":" + userTag; image != want {
				t.Errorf("%s: container %s runs %s, want %s", orig, c.Name, image, want)
			}
			used = append(used, name)
		}
		b1, _ := yaml.Marshal(before)
		b2, _ := yaml.Marshal(after)
		if !bytes.Equal(b1, b2) {
			t.Errorf("%s: more than the images changed", orig)
		}
	}
	slices.Sort(used)
	if used = slices.Compact(used); !slices.Equal(used, []string{"meshid", "meshid-agent", "meshid-proxy"}) {
		t.Errorf("the manifests run the images %v, want each of make images'", used)
	}
}
