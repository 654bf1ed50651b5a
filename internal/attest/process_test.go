package attest

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
)

const (
	containerID = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	podUID      = "4a2c6f4e-8b1d-4f7e-9c3a-2d5e6f7a8b9c"
	podUIDSnake = "4a2c6f4e_8b1d_4f7e_9c3a_2d5e6f7a8b9c"
)

// fakeProc is a /proc tree in a temp dir.
type fakeProc struct {
	t    *testing.T
	root string
}

func newFakeProc(t *testing.T) *fakeProc {
	t.Helper()
	return &fakeProc{t: t, root: t.TempDir()}
}

// statLine is a stat file's line with start time start and a command name that holds what
// trips a naive parser: spaces and parentheses.
func statLine(pid int32, start uint64) string {
	fields := []string{strconv.Itoa(int(pid)), "(my (odd) app)", "S"}
	for i := 4; i <= 52; i++ {
		v := strconv.Itoa(i * 10)
		if i == 22 {
			v = strconv.FormatUint(start, 10)
		}
		fields = append(fields, v)
	}
	return strings.Join(fields, " ") + "\n"
}

// add writes a process's stat, status, cgroup and exe link.
func (f *fakeProc) add(pid int32, start uint64, exe, groups, cgroup string) {
	f.t.Helper()
	dir := filepath.Join(f.root, strconv.Itoa(int(pid)))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		f.t.Fatal(err)
	}
	f.write(pid, "stat", statLine(pid, start))
	f.write(pid, "status", "Name:\tapp\nUid:\t1000\t1000\t1000\t1000\nGroups:\t"+groups+"\nVmRSS:\t10 kB\n")
	f.write(pid, "cgroup", cgroup)
	if exe != "" {
		if err := os.Symlink(exe, filepath.Join(dir, "exe")); err != nil {
			f.t.Fatal(err)
		}
	}
}

func (f *fakeProc) write(pid int32, name, content string) {
	f.t.Helper()
	path := filepath.Join(f.root, strconv.Itoa(int(pid)), name)
	// Written in place of the old file, as the kernel's view changes under a reader.
	tmp := path + ".new"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		f.t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		f.t.Fatal(err)
	}
}

func TestReadProcess(t *testing.T) {
	t.Parallel()
	proc := newFakeProc(t)
	cgroup := "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + podUIDSnake + ".slice/cri-containerd-" + containerID + ".scope\n"
	proc.add(4242, 987654, "/usr/bin/app", "10 20 65534 ", cgroup)
	got, err := ProcFS{Root: proc.root}.Read(4242)
	if err != nil {
		t.Fatal(err)
	}
	want := Process{
		PID: 4242, StartTime: 987654, Exe: "/usr/bin/app", Groups: []uint32{10, 20, 65534},
		Cgroups: []string{"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + podUIDSnake + ".slice/cri-containerd-" + containerID + ".scope"},
		PodUID:  podUID, ContainerID: containerID,
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("Read = %+v\nwant %+v", got, want)
	}
}

func TestReadProcessFailures(t *testing.T) {
	t.Parallel()
	proc := newFakeProc(t)
	proc.add(7, 1, "", "", "0::/\n")
	proc.write(7, "status", "Name:\tapp\n")
	proc.add(8, 1, "", "", "0::/\n")
	proc.write(8, "stat", "8 (app) S 1 2\n")
	proc.add(9, 1, "", "", "0::/\n") // no exe link: another user's process, to an agent not root
	fs := ProcFS{Root: proc.root}
	for _, tc := range []struct {
		name string
		pid  int32
		want error
		text string
	}{
		{name: "gone", pid: 6, want: ErrProcessGone},
		{name: "pid namespace not visible", pid: 0, text: "not visible"},
		{name: "no Groups line", pid: 7, text: "no Groups line"},
		{name: "short stat", pid: 8, text: "fields after the command name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := fs.Read(tc.pid)
			if err == nil || (tc.want != nil && !errors.Is(err, tc.want)) || !strings.Contains(err.Error(), tc.text) {
				t.Fatalf("Read(%d) = %v, want %v %q", tc.pid, err, tc.want, tc.text)
			}
		})
	}
	p, err := fs.Read(9)
	if err != nil || p.Exe != "" {
		t.Fatalf("Read without an exe link = %+v, %v; want no exe and no error", p, err)
	}
}

func TestParseStartTime(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, stat string
		want       uint64
		ok         bool
	}{
		{name: "odd command name", stat: statLine(1, 12345), want: 12345, ok: true},
		{name: "command name with a closing parenthesis and spaces", stat: strings.Replace(statLine(1, 77), "(my (odd) app)", "(a) S 1 2 3 )", 1), want: 77, ok: true},
		{name: "no command name", stat: "1 app S 1 2", ok: false},
		{name: "not a number", stat: strings.Replace(statLine(1, 5), " 5 ", " x ", 1), ok: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := parseStartTime([]byte(tc.stat))
			if (err == nil) != tc.ok || got != tc.want {
				t.Fatalf("parseStartTime = %d, %v; want %d, ok %v", got, err, tc.want, tc.ok)
			}
		})
	}
}

func TestParseGroups(t *testing.T) {
	t.Parallel()
	got, err := parseGroups([]byte("Name:\tx\nGroups:\t\nUid:\t0\n"))
	if err != nil || len(got) != 0 {
		t.Fatalf("no groups: %v, %v", got, err)
	}
	if _, err := parseGroups([]byte("Groups:\t1 x\n")); err == nil {
		t.Fatal("a group that is no number was accepted")
	}
}

func TestParseCgroups(t *testing.T) {
	t.Parallel()
	v1 := "12:pids:/kubepods/burstable/pod" + podUID + "/" + containerID + "\n" +
		"11:memory:/kubepods/burstable/pod" + podUID + "/" + containerID + "\n" +
		"1:name=systemd:/kubepods/burstable/pod" + podUID + "/" + containerID + "\n" +
		"0::/\n"
	got := parseCgroups([]byte(v1))
	want := []string{"/kubepods/burstable/pod" + podUID + "/" + containerID, "/"}
	if !slices.Equal(got, want) {
		t.Fatalf("parseCgroups(v1) = %q, want %q", got, want)
	}
	if got := parseCgroups([]byte("garbage\n0::relative\n")); len(got) != 0 {
		t.Fatalf("parseCgroups(garbage) = %q, want none", got)
	}
}

// Real-shaped cgroup paths, as the kubelet and the runtimes lay them out.
func TestKubernetesIDs(t *testing.T) {
	t.Parallel()
	const staticPod = "6e3e3a8b54a1c8e0f1d2c3b4a5968778"
	for _, tc := range []struct {
		name, path, pod, container string
	}{
		{name: "cgroupfs v1 burstable containerd", path: "/kubepods/burstable/pod" + podUID + "/" + containerID, pod: podUID, container: containerID},
		{name: "cgroupfs guaranteed", path: "/kubepods/pod" + podUID + "/" + containerID, pod: podUID, container: containerID},
		{name: "cgroupfs besteffort docker", path: "/kubepods/besteffort/pod" + podUID + "/" + containerID, pod: podUID, container: containerID},
		{name: "systemd v2 containerd", path: "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + podUIDSnake + ".slice/cri-containerd-" + containerID + ".scope", pod: podUID, container: containerID},
		{name: "systemd guaranteed cri-o", path: "/kubepods.slice/kubepods-pod" + podUIDSnake + ".slice/crio-" + containerID + ".scope", pod: podUID, container: containerID},
		{name: "systemd besteffort docker", path: "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + podUIDSnake + ".slice/docker-" + containerID + ".scope", pod: podUID, container: containerID},
		{name: "cri-o's conmon is not the container", path: "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + podUIDSnake + ".slice/crio-conmon-" + containerID + ".scope", pod: podUID},
		{name: "containerd under its own service", path: "/system.slice/containerd.service/kubepods-burstable-pod" + podUIDSnake + ".slice:cri-containerd:" + containerID, pod: podUID, container: containerID},
		{name: "kind node nests the kubelet's under its container", path: "/docker/" + containerID + "/kubepods/besteffort/pod" + podUID + "/" + strings.Repeat("f", 64), pod: podUID, container: strings.Repeat("f", 64)},
		{name: "static pod's hash uid", path: "/kubepods/burstable/pod" + staticPod + "/" + containerID, pod: staticPod, container: containerID},
		// A process with a delegated subtree names a cgroup inside its own like another pod's:
		// the kubelet's segment, outermost, is the one believed.
		{name: "a pod's cgroup made inside another pod's", path: "/kubepods/burstable/pod" + podUID + "/" + containerID + "/kubepods/besteffort/pod" + staticPod + "/" + strings.Repeat("e", 64), pod: podUID, container: containerID},
		{name: "a systemd pod slice made inside another pod's", path: "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + podUIDSnake + ".slice/cri-containerd-" + containerID + ".scope/kubepods-besteffort-pod" + staticPod + ".slice", pod: podUID, container: containerID},
		{name: "a process in the pod's cgroup itself", path: "/kubepods/burstable/pod" + podUID, pod: podUID},
		{name: "plain docker container", path: "/system.slice/docker-" + containerID + ".scope"},
		{name: "systemd service", path: "/system.slice/sshd.service"},
		{name: "root", path: "/"},
		{name: "a pod-like name that is not a uid", path: "/kubepods/burstable/podnotauid/" + containerID},
		{name: "uppercase is not the kubelet's", path: "/kubepods/burstable/pod" + strings.ToUpper(podUID) + "/" + containerID},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pod, container := kubernetesIDs([]string{tc.path})
			if pod != tc.pod || container != tc.container {
				t.Fatalf("kubernetesIDs(%s) = %q, %q; want %q, %q", tc.path, pod, container, tc.pod, tc.container)
			}
		})
	}
}
