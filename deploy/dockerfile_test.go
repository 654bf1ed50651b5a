package deploy_test

import (
	"bufio"
	"bytes"
	"context"
	"debug/elf"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

const repoRoot = ".."

// stage is what the checks need of one stage of the Dockerfile.
type stage struct {
	name, from string
	copied     []string          // destinations of COPY
	chowned    map[string]string // destination of COPY --chown → its owner
	user       string            // the last USER
	entrypoint string            // raw arguments of ENTRYPOINT and CMD
	cmd        string
	runs       []string
}

type dockerfile struct {
	stages map[string]*stage
	order  []string
}

// loadDockerfile splits the Dockerfile into instructions (continuation lines joined, comment
// lines dropped, as Docker does) and groups them by stage.
func loadDockerfile(t *testing.T) dockerfile {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(repoRoot, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	df := dockerfile{stages: map[string]*stage{}}
	var cur *stage
	var pending strings.Builder
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if cont, ok := strings.CutSuffix(line, `\`); ok {
			pending.WriteString(cont + " ")
			continue
		}
		pending.WriteString(line)
		instr := pending.String()
		pending.Reset()

		word, args, _ := strings.Cut(instr, " ")
		args = strings.TrimSpace(args)
		switch strings.ToUpper(word) {
		case "FROM":
			f := strings.Fields(args)
			cur = &stage{from: f[0], name: strconv.Itoa(len(df.order)), chowned: map[string]string{}}
			if len(f) == 3 && strings.EqualFold(f[1], "AS") {
				cur.name = f[2]
			}
			if _, dup := df.stages[cur.name]; dup {
				t.Fatalf("Dockerfile: two stages named %s", cur.name)
			}
			df.stages[cur.name] = cur
			df.order = append(df.order, cur.name)
		case "COPY":
			if cur == nil {
				t.Fatal("Dockerfile: COPY before FROM")
			}
			f := strings.Fields(args)
			dest := f[len(f)-1]
			cur.copied = append(cur.copied, dest)
			var from string
			var srcs []string
			for _, a := range f[:len(f)-1] {
				switch {
				case strings.HasPrefix(a, "--chown="):
					cur.chowned[dest] = strings.TrimPrefix(a, "--chown=")
				case strings.HasPrefix(a, "--from="):
					from = strings.TrimPrefix(a, "--from=")
				case strings.HasPrefix(a, "--"):
				default:
					srcs = append(srcs, a)
				}
			}
			if from != "" {
				if _, ok := df.stages[from]; !ok || from == cur.name {
					t.Errorf("Dockerfile: COPY --from=%s, not an earlier stage", from)
				}
				continue
			}
			// From the build context: the repository itself, nothing made beforehand.
			for _, src := range srcs {
				if _, err := os.Stat(filepath.Join(repoRoot, src)); err != nil {
					t.Errorf("Dockerfile: COPY %s: not in the repository: %v", src, err)
				}
			}
		case "USER":
			cur.user = args
		case "ENTRYPOINT":
			cur.entrypoint = args
		case "CMD":
			cur.cmd = args
		case "RUN":
			cur.runs = append(cur.runs, args)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return df
}

func TestDockerfile(t *testing.T) {
	t.Parallel()
	df := loadDockerfile(t)
	if last := df.order[len(df.order)-1]; last != "meshid" {
		t.Errorf("the default target (the last stage) is %s, want meshid", last)
	}
	for _, name := range df.order {
		s := df.stages[name]
		if err := pinned(s.from); err != "" {
			t.Errorf("stage %s: %s", name, err)
		}
	}
	for _, target := range []string{"meshid", "agent"} {
		s, ok := df.stages[target]
		if !ok {
			t.Errorf("no stage %s", target)
			continue
		}
		// No shell, no package manager: only the static binary and its directories.
		if !strings.HasPrefix(s.from, "gcr.io/distroless/static") {
			t.Errorf("target %s runs on %s, want distroless static", target, s.from)
		}
		uid, gid, _ := strings.Cut(s.user, ":")
		if u, err := strconv.Atoi(uid); err != nil || u == 0 {
			t.Errorf("target %s: USER %q, want a numeric non-root uid", target, s.user)
		}
		if g, err := strconv.Atoi(gid); err != nil || g == 0 {
			t.Errorf("target %s: USER %q, want a numeric non-root gid", target, s.user)
		}
		if s.entrypoint == "" {
			t.Errorf("target %s has no ENTRYPOINT", target)
		}
		for what, raw := range map[string]string{"ENTRYPOINT": s.entrypoint, "CMD": s.cmd} {
			if raw == "" {
				continue
			}
			var argv []string
			if err := json.Unmarshal([]byte(raw), &argv); err != nil || len(argv) == 0 {
				t.Errorf("target %s: %s %s is not in exec form (a JSON list)", target, what, raw)
			}
		}
		var argv []string
		if json.Unmarshal([]byte(s.entrypoint), &argv) == nil && len(argv) > 0 && !slices.Contains(s.copied, argv[0]) {
			t.Errorf("target %s runs %s, which it does not copy in (%v)", target, argv[0], s.copied)
		}
	}
	checkProxyStage(t, df.stages["proxy"])
	// What the test below builds is what the image builds.
	build := strings.Join(df.stages["build"].runs, "\n")
	for _, want := range []string{"CGO_ENABLED=0", "go build -trimpath -tags grpcnotrace", "meshid meshid-agent", "./cmd/$cmd"} {
		if !strings.Contains(build, want) {
			t.Errorf("the build stage no longer runs %q; keep TestDockerBinaries in step", want)
		}
	}
}

// The proxy target is Envoy's official image running the agent, which runs Envoy: as Envoy's
// non-root user, who owns the directories the agent writes the bootstrap and its sockets in.
func checkProxyStage(t *testing.T, s *stage) {
	t.Helper()
	if s == nil {
		t.Error("no stage proxy")
		return
	}
	if !strings.HasPrefix(s.from, "envoyproxy/envoy:v") {
		t.Errorf("target proxy runs on %s, want Envoy's official image at a release tag", s.from)
	}
	if u, _, _ := strings.Cut(s.user, ":"); u == "" || u == "root" || u == "0" {
		t.Errorf("target proxy: USER %q, want Envoy's non-root user", s.user)
	}
	var argv []string
	if err := json.Unmarshal([]byte(s.entrypoint), &argv); err != nil {
		t.Errorf("target proxy: ENTRYPOINT %s is not in exec form (a JSON list)", s.entrypoint)
	}
	want := []string{"/usr/local/bin/meshid-agent", "agent", "--envoy-path", "/usr/local/bin/envoy"}
	if !slices.Equal(argv, want) {
		t.Errorf("target proxy: ENTRYPOINT %q, want %q", argv, want)
	}
	if !slices.Contains(s.copied, want[0]) {
		t.Errorf("target proxy runs %s, which it does not copy in (%v)", want[0], s.copied)
	}
	if s.cmd != "" {
		t.Errorf("target proxy: CMD %s would be arguments to the agent", s.cmd)
	}
	for _, dir := range []string{"/var/run/secrets/workload-spiffe-uds", "/etc/istio/proxy"} {
		if s.chowned[dir] != s.user+":"+s.user {
			t.Errorf("target proxy: %s is owned by %q, want the image's user %s", dir, s.chowned[dir], s.user)
		}
	}
}

// The volumes the compose demo mounts where the images write start out owned by the non-root
// user: Docker gives a new named volume the owner of the image's directory.
func TestDockerImagesOwnTheDemoVolumes(t *testing.T) {
	t.Parallel()
	df := loadDockerfile(t)
	f := loadCompose(t)
	for name, svc := range f.Services {
		if svc.Build == nil {
			continue
		}
		s := df.stages[svc.Build.Target]
		if s == nil {
			continue // TestComposeStructure reports it
		}
		for _, m := range svc.Volumes {
			if m.Type == "volume" && !m.ReadOnly && s.chowned[m.Target] != s.user {
				t.Errorf("%s writes to volume %s at %s, which the %s image does not give to its user", name, m.Source, m.Target, svc.Build.Target)
			}
		}
	}
}

// The build stage's go build, run here: both binaries build from the repository alone and are
// static, as a distroless static image needs; and meshid, run with the compose file's own command
// for the CA, starts on the demo's manifests and discovery configuration.
func TestDockerBinaries(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("builds both binaries")
	}
	out := t.TempDir()
	start := time.Now()
	cmd := exec.Command("go", "build", "-trimpath", "-tags", "grpcnotrace", "-o", out+string(filepath.Separator), "./cmd/meshid", "./cmd/meshid-agent")
	cmd.Dir = repoRoot
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if msg, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, msg)
	}
	t.Logf("go build took %s", time.Since(start).Round(time.Millisecond))

	t.Run("static", func(t *testing.T) {
		for _, bin := range []string{"meshid", "meshid-agent"} {
			f, err := elf.Open(filepath.Join(out, bin))
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range f.Progs {
				if p.Type == elf.PT_INTERP {
					t.Errorf("%s has a program interpreter: it is not static", bin)
				}
			}
			if libs, err := f.ImportedLibraries(); err != nil || len(libs) > 0 {
				t.Errorf("%s needs shared libraries %v (%v)", bin, libs, err)
			}
			if err := f.Close(); err != nil {
				t.Error(err)
			}
		}
	})

	t.Run("the demo's CA starts", func(t *testing.T) {
		runDemoCA(t, filepath.Join(out, "meshid"))
	})
}

// runDemoCA runs the compose file's command for the CA, its container paths mapped to the demo
// folder and a temporary state dir and its ports to free ones, until it logs that it started; an
// invalid --xds-config or --manifests makes it exit first.
func runDemoCA(t *testing.T, meshid string) {
	t.Helper()
	ca := loadCompose(t).Services["ca"]
	demo, err := filepath.Abs(demoDir)
	if err != nil {
		t.Fatal(err)
	}
	var bind, state mount
	for _, m := range ca.Volumes {
		switch m.Type {
		case "bind":
			bind = m
		case "volume":
			state = m
		}
	}
	args := []string{}
	for _, a := range ca.Command {
		a = strings.Replace(a, bind.Target, filepath.Join(demo, bind.Source), 1)
		a = strings.Replace(a, state.Target, t.TempDir(), 1)
		args = append(args, a)
	}
	args = append(args, "--grpc-addr", "127.0.0.1:0", "--monitoring-addr", "127.0.0.1:0")

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, meshid, args...)
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var logged []string
	started, manifests := false, false
	sc := bufio.NewScanner(stderr)
	for !started && sc.Scan() {
		line := sc.Text()
		logged = append(logged, line)
		started = strings.Contains(line, `msg="CA started"`)
		manifests = manifests || strings.Contains(line, `msg="manifests loaded"`) && strings.Contains(line, "namespaces=2 service_accounts=2")
	}
	cancel()
	_, _ = io.Copy(io.Discard, stderr)
	_ = cmd.Wait()
	if !started {
		t.Fatalf("meshid %s did not start:\n%s", strings.Join(args, " "), strings.Join(logged, "\n"))
	}
	if !manifests {
		t.Errorf("meshid ca did not load the demo's two namespaces and service accounts:\n%s", strings.Join(logged, "\n"))
	}
}
