package attest

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/meshid/meshid/internal/logkey"
)

// DefaultProc is where the kernel's process facts are mounted.
const DefaultProc = "/proc"

// Process is what the kernel tells of a caller: its credentials when it connected (SO_PEERCRED)
// and what /proc said of its pid at the handshake.
type Process struct {
	PID      int32
	UID, GID uint32
	// StartTime is when the process started, in clock ticks after boot (field 22 of
	// /proc/PID/stat): a pid reused by another process has another start time.
	StartTime uint64
	// Exe is the executable's path (/proc/PID/exe); "" when it could not be read (another
	// user's process, to an agent that is not root), so that no path rule matches.
	Exe string
	// Groups are the supplementary group ids (Groups: in /proc/PID/status).
	Groups []uint32
	// Cgroups are the process's cgroup paths, one per hierarchy (cgroup v1) or the one of v2.
	Cgroups []string
	// PodUID and ContainerID are read from the cgroup paths as the kubelet lays them out; ""
	// when the process is not in a Kubernetes pod (or not in a container of it).
	PodUID, ContainerID string
}

// String names the process for a log line; the executable's path is the caller's to choose, so
// it is bounded.
func (p Process) String() string {
	s := fmt.Sprintf("pid=%d uid=%d gid=%d", p.PID, p.UID, p.GID)
	if p.Exe != "" {
		s += " exe=" + logkey.Untrusted(p.Exe)
	}
	return s
}

// hasGID reports whether gid is the process's primary or a supplementary group.
func (p Process) hasGID(gid uint32) bool {
	return p.GID == gid || slices.Contains(p.Groups, gid)
}

// Errors of reading a process.
var (
	// ErrProcessGone: the pid has no entry in /proc (the process exited).
	ErrProcessGone = errors.New("process not found")
)

// ProcFS reads process facts from a /proc tree; the zero value reads DefaultProc.
type ProcFS struct {
	Root string
}

func (p ProcFS) dir(pid int32) string {
	root := p.Root
	if root == "" {
		root = DefaultProc
	}
	return filepath.Join(root, strconv.FormatInt(int64(pid), 10))
}

// maxProcFile bounds what is read of one /proc file: a process chooses its command name and
// its cgroup paths' names are not ours, so nothing is read without a bound.
const maxProcFile = 64 << 10

func readBounded(name string) ([]byte, error) { return readFile(name, maxProcFile) }

// readFile reads at most limit bytes of name, or fails.
func readFile(name string, limit int64) ([]byte, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%s: longer than %d bytes", name, limit)
	}
	return b, nil
}

// StartTime reads the start time of pid (field 22 of its stat).
func (p ProcFS) StartTime(pid int32) (uint64, error) {
	stat, err := readBounded(filepath.Join(p.dir(pid), "stat"))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return 0, fmt.Errorf("pid %d: %w", pid, ErrProcessGone)
		}
		return 0, fmt.Errorf("read stat of pid %d: %w", pid, err)
	}
	return parseStartTime(stat)
}

// parseStartTime reads field 22 of a stat line. The command name (field 2) is in parentheses and
// may hold spaces and parentheses itself, so the fields are counted after the last ')'.
func parseStartTime(stat []byte) (uint64, error) {
	end := bytes.LastIndexByte(stat, ')')
	if end < 0 {
		return 0, errors.New("stat: no command name")
	}
	fields := strings.Fields(string(stat[end+1:]))
	const startTime = 22 - 3 // fields[0] is field 3, the state
	if len(fields) <= startTime {
		return 0, fmt.Errorf("stat: %d fields after the command name, want more than %d", len(fields), startTime)
	}
	t, err := strconv.ParseUint(fields[startTime], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("stat: start time: %w", err)
	}
	return t, nil
}

// Read fills in what /proc tells of pid: start time, executable, supplementary groups and
// cgroups. The credentials (uid, gid) are the kernel's at connect time and are not read here.
func (p ProcFS) Read(pid int32) (Process, error) {
	if pid <= 0 {
		// 0: the peer is in a pid namespace this one cannot see.
		return Process{}, fmt.Errorf("pid %d: not visible from this pid namespace", pid)
	}
	proc := Process{PID: pid}
	start, err := p.StartTime(pid)
	if err != nil {
		return Process{}, err
	}
	proc.StartTime = start
	if exe, err := os.Readlink(filepath.Join(p.dir(pid), "exe")); err == nil {
		proc.Exe = exe
	}
	status, err := readBounded(filepath.Join(p.dir(pid), "status"))
	if err != nil {
		return Process{}, fmt.Errorf("read status of pid %d: %w", pid, err)
	}
	if proc.Groups, err = parseGroups(status); err != nil {
		return Process{}, fmt.Errorf("pid %d: %w", pid, err)
	}
	cgroup, err := readBounded(filepath.Join(p.dir(pid), "cgroup"))
	if err != nil {
		return Process{}, fmt.Errorf("read cgroup of pid %d: %w", pid, err)
	}
	proc.Cgroups = parseCgroups(cgroup)
	proc.PodUID, proc.ContainerID = kubernetesIDs(proc.Cgroups)
	// Read last, so that a pid reused while its files were read is seen.
	if again, err := p.StartTime(pid); err != nil {
		return Process{}, err
	} else if again != start {
		return Process{}, fmt.Errorf("pid %d: %w", pid, ErrPIDReused)
	}
	return proc, nil
}

// parseGroups reads the supplementary groups of a status file ("Groups:\t10 20 ").
func parseGroups(status []byte) ([]uint32, error) {
	for line := range strings.SplitSeq(string(status), "\n") {
		rest, ok := strings.CutPrefix(line, "Groups:")
		if !ok {
			continue
		}
		var groups []uint32
		for _, f := range strings.Fields(rest) {
			g, err := strconv.ParseUint(f, 10, 32)
			if err != nil {
				return nil, fmt.Errorf("status: group %q: %w", logkey.Untrusted(f), err)
			}
			groups = append(groups, uint32(g))
		}
		return groups, nil
	}
	return nil, errors.New("status: no Groups line")
}

// parseCgroups reads the paths of a cgroup file: "ID:controllers:path" lines, several for cgroup
// v1's hierarchies, one "0::path" for v2, both in a hybrid setup. Duplicates are dropped.
func parseCgroups(cgroup []byte) []string {
	var paths []string
	for line := range strings.SplitSeq(strings.TrimSpace(string(cgroup)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 || !strings.HasPrefix(parts[2], "/") {
			continue
		}
		if p := parts[2]; !slices.Contains(paths, p) {
			paths = append(paths, p)
		}
	}
	return paths
}

// A pod's cgroup as the kubelet names it: "pod<uid>" (cgroupfs driver) or
// "kubepods[-<qos>]-pod<uid with _ for ->.slice" (systemd driver). A static pod's uid is a hash:
// 32 hex digits without dashes.
var podSegment = regexp.MustCompile(`^(?:kubepods(?:-[a-z]+)?-)?pod([0-9a-f]{8}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{12})(?:\.slice)?$`)

// podUIDPattern is a pod UID as the API server writes it, or a static pod's hash.
var podUIDPattern = regexp.MustCompile(`^(?:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32})$`)

// A container's cgroup under its pod's: "<id>" (cgroupfs), "<runtime>-<id>.scope" (systemd:
// cri-containerd, crio, docker), or containerd's "…pod<uid>.slice:cri-containerd:<id>" where the
// pod's slice and the container share one segment. crio-conmon-<id> is CRI-O's monitor, not the
// container, and is not matched.
var (
	containerSegment = regexp.MustCompile(`^(?:(?:cri-containerd|crio|docker)-)?([0-9a-f]{64})(?:\.scope)?$`)
	podAndContainer  = regexp.MustCompile(`^(.+\.slice):[a-z-]+:([0-9a-f]{64})$`)
)

// kubernetesIDs finds the pod UID and container ID in cgroup paths. The first pod segment of a
// path wins: it is the one the kubelet placed (a kind node nests the kubelet's cgroups under its
// own container's, which is no pod), and one a process with a delegated subtree makes inside its
// own cgroup comes after it. The container is the segment right under the pod's.
func kubernetesIDs(cgroups []string) (podUID, containerID string) {
	for _, p := range cgroups {
		segs := strings.Split(path.Clean(p), "/")
		pod, container := "", ""
		for i, seg := range segs {
			if m := podAndContainer.FindStringSubmatch(seg); m != nil {
				if pm := podSegment.FindStringSubmatch(m[1]); pm != nil {
					pod, container = pm[1], m[2]
					break
				}
			}
			m := podSegment.FindStringSubmatch(seg)
			if m == nil {
				continue
			}
			pod = m[1]
			if i+1 < len(segs) {
				if c := containerSegment.FindStringSubmatch(segs[i+1]); c != nil {
					container = c[1]
				}
			}
			break
		}
		if pod != "" {
			return normalizePodUID(pod), container
		}
	}
	return "", ""
}

// normalizePodUID writes a pod UID as the API server does: the systemd driver's '_' are '-'.
func normalizePodUID(uid string) string {
	return strings.ToLower(strings.ReplaceAll(uid, "_", "-"))
}
