// Package kubetest runs a real kube-apiserver and etcd on loopback for the Kubernetes tests, from
// the binaries hack/kube-env.sh builds into a cache outside the repository. One Env serves a whole
// test package (start it in TestMain with Main); tests isolate themselves by namespace.
//
// There is no controller-manager: a new namespace gets no service account, a deleted one stays
// Terminating, and nothing is garbage-collected. Tests use namespaces of their own.
package kubetest

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Issuer is the service-account token issuer the API server is started with.
const Issuer = "https://kubernetes.default.svc.cluster.local"

// Env is a running API server and its etcd.
type Env struct {
	// Admin is a client configuration in system:masters.
	Admin *rest.Config
	// Host is the API server's https URL; CAFile its serving certificate, to trust it.
	Host   string
	CAFile string

	dir   string
	procs []*exec.Cmd
	core  *corev1client.CoreV1Client
}

// Main starts an Env in *env, runs the package's tests and stops it, for TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(kubetest.Main(m, &env)) }
//
// An API server that cannot be had fails the package loudly: the tests are never skipped.
func Main(m *testing.M, env **Env) int {
	e, err := Start()
	if err != nil {
		fmt.Fprintf(os.Stderr, "kubetest: cannot start a kube-apiserver for the tests: %v\n", err)
		return 1
	}
	*env = e
	defer e.Stop()
	return m.Run()
}

// Binaries returns the directory holding kube-apiserver and etcd: $MESHID_KUBE_BIN when set
// (make test sets it), else what hack/kube-env.sh prints, building them the first time.
func Binaries() (string, error) {
	if dir := os.Getenv("MESHID_KUBE_BIN"); dir != "" {
		return dir, nil
	}
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("cannot locate the repository")
	}
	script := filepath.Join(filepath.Dir(file), "..", "..", "..", "..", "hack", "kube-env.sh")
	var stderr bytes.Buffer
	cmd := exec.Command(script) //nolint:gosec // the repository's own script
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("%s: %w\n%s", script, err, stderr.String())
	}
	return strings.TrimSpace(string(out)), nil
}

// Start starts etcd and kube-apiserver on free loopback ports and waits until the API server is
// ready. Both are killed if the test process dies.
func Start() (_ *Env, err error) {
	bin, err := Binaries()
	if err != nil {
		return nil, err
	}
	sweepStale(os.TempDir(), time.Now())
	dir, err := os.MkdirTemp("", dirPrefix)
	if err != nil {
		return nil, err
	}
	e := &Env{dir: dir}
	if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(strconv.Itoa(os.Getpid())), 0o600); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	defer func() {
		if err != nil {
			err = fmt.Errorf("%w\n%s", err, e.logTails())
			e.Stop()
		}
	}()
	ports, err := freePorts(3)
	if err != nil {
		return nil, err
	}
	clientURL := "http://127.0.0.1:" + strconv.Itoa(ports[0])
	peerURL := "http://127.0.0.1:" + strconv.Itoa(ports[1])
	if err := e.start(filepath.Join(bin, "etcd"), "etcd",
		"--name", "kubetest", "--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", clientURL, "--advertise-client-urls", clientURL,
		"--listen-peer-urls", peerURL, "--initial-advertise-peer-urls", peerURL,
		"--initial-cluster", "kubetest="+peerURL, "--unsafe-no-fsync", "--log-level", "error",
	); err != nil {
		return nil, err
	}

	saKey := filepath.Join(dir, "sa.key")
	if err := writeRSAKey(saKey); err != nil {
		return nil, err
	}
	adminToken := randomHex()
	if err := os.WriteFile(filepath.Join(dir, "tokens.csv"), []byte(adminToken+`,admin,admin,"system:masters"`+"\n"), 0o600); err != nil {
		return nil, err
	}
	certDir := filepath.Join(dir, "certs")
	if err := e.start(filepath.Join(bin, "kube-apiserver"), "kube-apiserver",
		"--etcd-servers", clientURL,
		"--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--endpoint-reconciler-type", "none",
		"--secure-port", strconv.Itoa(ports[2]), "--cert-dir", certDir,
		"--service-cluster-ip-range", "10.0.0.0/24",
		"--service-account-issuer", Issuer,
		"--service-account-key-file", saKey, "--service-account-signing-key-file", saKey,
		"--token-auth-file", filepath.Join(dir, "tokens.csv"),
		"--authorization-mode", "RBAC",
	); err != nil {
		return nil, err
	}
	e.Host = "https://127.0.0.1:" + strconv.Itoa(ports[2])
	e.CAFile = filepath.Join(certDir, "apiserver.crt")
	e.Admin = &rest.Config{Host: e.Host, BearerToken: adminToken, TLSClientConfig: rest.TLSClientConfig{CAFile: e.CAFile}, QPS: 1000, Burst: 1000}
	if err := e.waitReady(90 * time.Second); err != nil {
		return nil, err
	}
	if e.core, err = corev1client.NewForConfig(e.Admin); err != nil {
		return nil, err
	}
	return e, nil
}

// What Start leaves in the temporary directory: a directory per API server, named with dirPrefix,
// holding ownerFile, the pid of the test process it serves.
const (
	dirPrefix = "kubetest-"
	ownerFile = "owner.pid"
)

// staleUnowned is the age after which a directory of Start's with no owner file (made before
// there was one, or by a process that died before writing it) is taken for left behind.
const staleUnowned = time.Hour

// sweepStale removes the directories under tmp that Start made for test processes that have
// died: Stop removes its own, but a test process that is killed, or times out, never calls it,
// and each left behind holds an etcd (over 100 MB). A directory whose owner still runs is kept.
func sweepStale(tmp string, now time.Time) {
	dirs, err := filepath.Glob(filepath.Join(tmp, dirPrefix+"*"))
	if err != nil {
		return
	}
	for _, dir := range dirs {
		if stale(dir, now) {
			_ = os.RemoveAll(dir)
		}
	}
}

// DirsOf returns the directories Start made, and that are still there, for the test process
// pid: for a test that runs its own binary as a helper, to check that it started no API server.
func DirsOf(pid int) []string {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), dirPrefix+"*"))
	var owned []string
	for _, dir := range dirs {
		if owner, err := ownerOf(dir); err == nil && owner == pid {
			owned = append(owned, dir)
		}
	}
	return owned
}

// ownerOf reads the pid of the test process dir was made for.
func ownerOf(dir string) (int, error) {
	data, err := os.ReadFile(filepath.Join(dir, ownerFile))
	if err != nil {
		return 0, err
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("%s: no pid in %q", dir, data)
	}
	return pid, nil
}

func stale(dir string, now time.Time) bool {
	info, err := os.Lstat(dir)
	if err != nil || !info.IsDir() {
		return false
	}
	// Only this user's: another's is not ours to judge, whoever runs the tests.
	if st, ok := info.Sys().(*syscall.Stat_t); !ok || int(st.Uid) != os.Getuid() {
		return false
	}
	pid, err := ownerOf(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return now.Sub(info.ModTime()) > staleUnowned
	}
	if err != nil {
		return false
	}
	// Signal 0 checks that the process exists; EPERM means it does, as another user's.
	return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
}

func (e *Env) start(path, name string, args ...string) error {
	cmd := exec.Command(path, args...) //nolint:gosec // etcd and kube-apiserver from hack/kube-env.sh
	log, err := os.Create(filepath.Join(e.dir, name+".log"))
	if err != nil {
		return err
	}
	cmd.Stdout, cmd.Stderr = log, log
	// Killed with the test binary, however it ends.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		_ = log.Close()
		return fmt.Errorf("start %s: %w", name, err)
	}
	_ = log.Close()
	e.procs = append(e.procs, cmd)
	return nil
}

// waitReady polls /readyz until it answers ok, a process exits, or the time is up.
func (e *Env) waitReady(limit time.Duration) error {
	var client *http.Client // once the API server has written its serving certificate
	deadline := time.Now().Add(limit)
	err := errors.New("no serving certificate yet")
	for {
		if client == nil {
			if _, statErr := os.Stat(e.CAFile); statErr == nil {
				transport, terr := rest.TransportFor(e.Admin)
				if terr != nil {
					return terr
				}
				client = &http.Client{Transport: transport, Timeout: 5 * time.Second}
			}
		}
		if client != nil {
			var resp *http.Response
			if resp, err = client.Get(e.Host + "/readyz"); err == nil {
				body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
				_ = resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					return nil
				}
				err = fmt.Errorf("/readyz: %s %s", resp.Status, body)
			}
		}
		for _, p := range e.procs {
			if p.Process.Signal(syscall.Signal(0)) != nil {
				return fmt.Errorf("%s exited", filepath.Base(p.Path))
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kube-apiserver not ready after %s: %w", limit, err)
		}
		time.Sleep(100 * time.Millisecond) // polling processes we do not control
	}
}

// logTails returns the end of each process's log, for an error that is about to remove them.
func (e *Env) logTails() string {
	var b strings.Builder
	for _, name := range []string{"etcd", "kube-apiserver"} {
		data, err := os.ReadFile(filepath.Join(e.dir, name+".log"))
		if err != nil {
			continue
		}
		data = data[max(0, len(data)-2048):]
		fmt.Fprintf(&b, "--- %s.log (end)\n%s\n", name, data)
	}
	return b.String()
}

// Stop kills the API server and etcd and removes their files.
func (e *Env) Stop() {
	for i := len(e.procs) - 1; i >= 0; i-- {
		p := e.procs[i]
		_ = p.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = p.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = p.Process.Kill()
			<-done
		}
	}
	_ = os.RemoveAll(e.dir)
}

// Core returns an admin client of the core API group.
func (e *Env) Core() *corev1client.CoreV1Client { return e.core }

// Namespace creates a namespace of its own for t, with labels, and returns its name.
func (e *Env) Namespace(t testing.TB, labels map[string]string) string {
	t.Helper()
	ns, err := e.core.Namespaces().Create(context.Background(), &corev1.Namespace{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "t-", Labels: labels},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create namespace: %v", err)
	}
	return ns.Name
}

// ServiceAccount creates a service account.
func (e *Env) ServiceAccount(t testing.TB, namespace, name string) {
	t.Helper()
	if _, err := e.core.ServiceAccounts(namespace).Create(context.Background(), &corev1.ServiceAccount{
		ObjectMeta: metav1.ObjectMeta{Name: name},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create service account %s/%s: %v", namespace, name, err)
	}
}

// Token returns a token for a service account from the TokenRequest API, for audiences (none:
// the API server's own).
func (e *Env) Token(t testing.TB, namespace, serviceAccount string, ttl time.Duration, audiences ...string) string {
	t.Helper()
	seconds := int64(ttl / time.Second)
	tr, err := e.core.ServiceAccounts(namespace).CreateToken(context.Background(), serviceAccount, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{Audiences: audiences, ExpirationSeconds: &seconds},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("request a token for %s/%s: %v", namespace, serviceAccount, err)
	}
	return tr.Status.Token
}

// Pod creates a pod of namespace/serviceAccount bound to node, as a scheduler would have placed
// it. The ServiceAccount admission plugin refuses a pod until its informer has seen the account,
// so the create is tried again until then (the API server says when by no other means).
func (e *Env) Pod(t testing.TB, namespace, name, serviceAccount, node string) *corev1.Pod {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		pod, err := e.core.Pods(namespace).Create(context.Background(), &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: corev1.PodSpec{ServiceAccountName: serviceAccount, NodeName: node, AutomountServiceAccountToken: new(false),
				Containers: []corev1.Container{{Name: "app", Image: "example.invalid/app"}}},
		}, metav1.CreateOptions{})
		if err == nil {
			return pod
		}
		if time.Now().After(deadline) {
			t.Fatalf("create pod %s/%s: %v", namespace, name, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// BoundToken returns a token of namespace/serviceAccount for the audience istio-ca, bound to pod
// as the kubelet's projected tokens are, valid for an hour.
func (e *Env) BoundToken(t testing.TB, namespace, serviceAccount string, pod *corev1.Pod) string {
	t.Helper()
	seconds := int64(3600)
	tr, err := e.core.ServiceAccounts(namespace).CreateToken(context.Background(), serviceAccount, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{Audiences: []string{"istio-ca"}, ExpirationSeconds: &seconds,
			BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("request a token for %s/%s bound to pod %s: %v", namespace, serviceAccount, pod.Name, err)
	}
	return tr.Status.Token
}

// As returns a client configuration that authenticates as a service account, with a token from
// TokenRequest: what a pod running as it would use.
func (e *Env) As(t testing.TB, namespace, serviceAccount string) *rest.Config {
	t.Helper()
	return &rest.Config{
		Host: e.Host, BearerToken: e.Token(t, namespace, serviceAccount, time.Hour),
		TLSClientConfig: rest.TLSClientConfig{CAFile: e.CAFile}, QPS: 1000, Burst: 1000,
	}
}

// WaitLimit bounds every wait on the API server and its watches.
const WaitLimit = 30 * time.Second

// Eventually polls cond, state held by the API server or reached through its watches (which tell
// a test nothing), until it holds, failing t with what and cond's last error after WaitLimit.
func Eventually(t testing.TB, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(WaitLimit)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s: %v", what, WaitLimit, err)
		}
		time.Sleep(20 * time.Millisecond) // waiting on other processes' watches, not on time
	}
}

// Until is Eventually for a condition that cannot say why it does not hold yet.
func Until(t testing.TB, what string, cond func() bool) {
	t.Helper()
	Eventually(t, what, func() error {
		if cond() {
			return nil
		}
		return errors.New("not yet")
	})
}

// Kubeconfig writes cfg as a kubeconfig file in dir and returns its path.
func Kubeconfig(t testing.TB, dir string, cfg *rest.Config) string {
	t.Helper()
	kc := clientcmdapi.NewConfig()
	kc.Clusters["test"] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthority: cfg.CAFile}
	kc.AuthInfos["test"] = &clientcmdapi.AuthInfo{Token: cfg.BearerToken}
	kc.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: "test"}
	kc.CurrentContext = "test"
	path := filepath.Join(dir, "kubeconfig")
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// Apply applies every object of the YAML files (several documents to a file) with server-side
// apply as admin, in file order, and returns them. With dryRun the server validates and admits
// them but stores nothing.
func (e *Env) Apply(t testing.TB, dryRun bool, files ...string) []*unstructured.Unstructured {
	t.Helper()
	applied, err := e.TryApply(dryRun, files...)
	if err != nil {
		t.Fatal(err)
	}
	return applied
}

// TryApply is Apply returning the first error instead of failing the test, for tests that expect
// the API server to refuse an object; what it applied before the error stays applied.
func (e *Env) TryApply(dryRun bool, files ...string) ([]*unstructured.Unstructured, error) {
	resources, err := e.resources()
	if err != nil {
		return nil, err
	}
	var applied []*unstructured.Unstructured
	for _, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			return applied, err
		}
		decoder := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
		for {
			obj := &unstructured.Unstructured{}
			if err := decoder.Decode(&obj.Object); err != nil {
				if errors.Is(err, io.EOF) {
					break
				}
				return applied, fmt.Errorf("%s: %w", file, err)
			}
			if len(obj.Object) == 0 {
				continue
			}
			ri, err := resources(obj)
			if err != nil {
				return applied, fmt.Errorf("%s: %w", file, err)
			}
			body, err := obj.MarshalJSON()
			if err != nil {
				return applied, err
			}
			opts := metav1.PatchOptions{FieldManager: "kubetest", Force: new(true)}
			if dryRun {
				opts.DryRun = []string{metav1.DryRunAll}
			}
			out, err := ri.Patch(context.Background(), obj.GetName(), types.ApplyPatchType, body, opts)
			if err != nil {
				return applied, fmt.Errorf("%s: apply %s %s/%s: %w", file, obj.GetKind(), obj.GetNamespace(), obj.GetName(), err)
			}
			applied = append(applied, out)
		}
	}
	return applied, nil
}

// Delete deletes objs as admin, as Apply returned them; one already gone is no error. It is for
// a test that applies cluster-wide objects and must leave the API server as it found it, so that
// it can run again (-count).
func (e *Env) Delete(t testing.TB, objs ...*unstructured.Unstructured) {
	t.Helper()
	resources, err := e.resources()
	if err != nil {
		t.Fatal(err)
	}
	for _, obj := range objs {
		ri, err := resources(obj)
		if err != nil {
			t.Fatal(err)
		}
		if err := ri.Delete(context.Background(), obj.GetName(), metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Fatalf("delete %s %s/%s: %v", obj.GetKind(), obj.GetNamespace(), obj.GetName(), err)
		}
	}
}

// resources returns what maps an object to its resource's client, as admin.
func (e *Env) resources() (func(*unstructured.Unstructured) (dynamic.ResourceInterface, error), error) {
	dc, err := discovery.NewDiscoveryClientForConfig(e.Admin)
	if err != nil {
		return nil, err
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	dyn, err := dynamic.NewForConfig(e.Admin)
	if err != nil {
		return nil, err
	}
	return func(obj *unstructured.Unstructured) (dynamic.ResourceInterface, error) {
		gvk := obj.GroupVersionKind()
		mapping, err := mapper.RESTMapping(schema.GroupKind{Group: gvk.Group, Kind: gvk.Kind}, gvk.Version)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", gvk, err)
		}
		if mapping.Scope.Name() == "namespace" {
			return dyn.Resource(mapping.Resource).Namespace(obj.GetNamespace()), nil
		}
		return dyn.Resource(mapping.Resource), nil
	}, nil
}

func freePorts(n int) ([]int, error) {
	var ports []int
	var listeners []net.Listener
	defer func() {
		for _, l := range listeners {
			_ = l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		listeners = append(listeners, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

func writeRSAKey(path string) error {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	der := x509.MarshalPKCS1PrivateKey(key)
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: der}), 0o600)
}

func randomHex() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
