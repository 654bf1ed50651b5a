package e2e_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	tcpproxyv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/tcp_proxy/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
	"github.com/meshid/meshid/sds/sdsclient"
)

// wait bounds, in real time, how long the test waits for something that should happen: a
// process starting, a renewal, a push. Reaching it fails the test.
const wait = 30 * time.Second

// binDir holds meshid and meshid-agent, built once by TestMain from this checkout.
var binDir string

func TestMain(m *testing.M) {
	// The test binary re-executed as the wrapper of an agent on a tmpfs of its own (see
	// startTmpfsAgent): it is that, and not a test run.
	if dir, ok := os.LookupEnv(tmpfsWrapperEnv); ok {
		os.Exit(tmpfsWrapper(dir, os.Args[1:]))
	}
	os.Exit(buildAndRun(m))
}

func buildAndRun(m *testing.M) int {
	dir, err := testutil.BuildCommands("./cmd/meshid", "./cmd/meshid-agent")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer func() { _ = os.RemoveAll(dir) }()
	binDir = dir
	return m.Run()
}

// ---- processes ----

// process is one of the binaries running, started with --log-format json: its log records can be
// waited for.
type process struct{ *testutil.Process }

// start runs binary (meshid or meshid-agent) with args; the process is killed when the test ends.
func start(t *testing.T, label, binary string, args ...string) *process {
	t.Helper()
	return startPath(t, label, filepath.Join(binDir, binary), nil, args...)
}

// startPath runs the program at path with args and --log-format json, as start does; configure,
// when not nil, adjusts the command before it starts.
func startPath(t *testing.T, label, path string, configure func(*exec.Cmd), args ...string) *process {
	t.Helper()
	cmd := exec.Command(path, append(args, "--log-format", "json")...)
	if configure != nil {
		configure(cmd)
	}
	return &process{testutil.StartProcess(t, label, cmd)}
}

// awaitLog waits for the first log record, from the start, whose msg is msg and that ok accepts
// (nil: any), and returns it.
func (p *process) awaitLog(t *testing.T, msg string, ok func(map[string]any) bool) map[string]any {
	t.Helper()
	return p.awaitLogFrom(t, 0, msg, ok)
}

// mark is the number of lines so far, for awaitLogFrom: what comes after it.
func (p *process) mark() int { return p.Mark() }

// awaitLogFrom is awaitLog from the line numbered from (a mark) on.
func (p *process) awaitLogFrom(t *testing.T, from int, msg string, ok func(map[string]any) bool) map[string]any {
	t.Helper()
	rec, _, err := p.findLog(from, msg, ok)
	if err != nil {
		t.Fatal(err)
	}
	return rec
}

// awaitLogRecord is awaitLogFrom that also returns where the lines after the record found begin.
func (p *process) awaitLogRecord(t *testing.T, from int, msg string, ok func(map[string]any) bool) (int, map[string]any) {
	t.Helper()
	rec, next, err := p.findLog(from, msg, ok)
	if err != nil {
		t.Fatal(err)
	}
	return next, rec
}

// awaitLogIndex is awaitLogRecord without the record.
func (p *process) awaitLogIndex(t *testing.T, from int, msg string) int {
	t.Helper()
	next, _ := p.awaitLogRecord(t, from, msg, nil)
	return next
}

// findLog is awaitLogFrom that returns an error rather than failing the test, and the number of
// the line after the record found. Lines that are not log records, such as "terminated", are
// passed over.
func (p *process) findLog(from int, msg string, ok func(map[string]any) bool) (map[string]any, int, error) {
	var rec map[string]any
	at, err := p.FindLine(from, wait, fmt.Sprintf("the log record %q", msg), func(line string) bool {
		rec = nil
		return json.Unmarshal([]byte(line), &rec) == nil && rec["msg"] == msg && (ok == nil || ok(rec))
	})
	if err != nil {
		return nil, 0, err
	}
	return rec, at + 1, nil
}

// kill sends SIGKILL and waits until the process and its output have ended.
func (p *process) kill(t *testing.T) {
	t.Helper()
	p.signal(t, syscall.SIGKILL)
	p.awaitExit(t)
}

func (p *process) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := syscall.Kill(p.Pid, sig); err != nil {
		t.Fatalf("%s: %v: %v", p.Label, sig, err)
	}
}

// awaitExit waits for the process to end and returns its exit status (-1: killed by a signal).
func (p *process) awaitExit(t *testing.T) int {
	t.Helper()
	code, err := p.AwaitExit(wait)
	if err != nil {
		t.Fatal(err)
	}
	return code
}

// ---- the CA ----

type caProcess struct {
	*process
	addr, monitoringAddr string
	stateDir             string
	manifestsDir         string
	cacerts              *testutil.SecretVolume // --cacerts-dir, empty at the start
}

// startCA runs `meshid ca` on loopback ports of its choosing, with the manifests and the xDS
// configuration given (none: no --xds-config), an empty --cacerts-dir, and a trust bundle that
// keeps a replaced root for an hour.
func startCA(t *testing.T, manifests, xdsConfig string) *caProcess {
	t.Helper()
	dir := t.TempDir()
	ca := &caProcess{
		stateDir:     filepath.Join(dir, "state"),
		manifestsDir: filepath.Join(dir, "manifests"),
		cacerts:      testutil.NewSecretVolume(t, filepath.Join(dir, "cacerts")),
	}
	ca.writeManifests(t, manifests)
	args := []string{"ca",
		"--state-dir", ca.stateDir,
		"--grpc-addr", "127.0.0.1:0",
		"--monitoring-addr", "127.0.0.1:0",
		"--manifests", ca.manifestsDir,
		"--cacerts-dir", ca.cacerts.Dir,
		"--trust-bundle-overlap", "1h",
	}
	if xdsConfig != "" {
		testutil.WriteFiles(t, dir, map[string][]byte{"xds.yaml": []byte(xdsConfig)})
		args = append(args, "--xds-config", filepath.Join(dir, "xds.yaml"))
	}
	ca.process = start(t, "meshid ca", "meshid", args...)
	started := ca.awaitLog(t, "CA started", nil)
	ca.addr, ca.monitoringAddr = started["address"].(string), started["monitoring_address"].(string)
	return ca
}

// writeManifests replaces the manifests the CA reads, in one rename, as a deploy tool would.
func (ca *caProcess) writeManifests(t *testing.T, manifests string) {
	t.Helper()
	testutil.WriteFiles(t, ca.manifestsDir, map[string][]byte{".mesh.yaml.tmp": []byte(manifests)})
	if err := os.Rename(filepath.Join(ca.manifestsDir, ".mesh.yaml.tmp"), filepath.Join(ca.manifestsDir, "mesh.yaml")); err != nil {
		t.Fatal(err)
	}
}

// rootFile is the trust bundle clients verify the CA with (Istio's CA_ROOT_CA).
func (ca *caProcess) rootFile() string { return filepath.Join(ca.stateDir, "root-cert.pem") }

// token mints a service-account token as a kube-apiserver would, with `meshid token`.
func (ca *caProcess) token(t *testing.T, namespace, serviceAccount string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "istio-token")
	out, err := exec.Command(filepath.Join(binDir, "meshid"), "token", "--state-dir", ca.stateDir,
		"--namespace", namespace, "--service-account", serviceAccount, "-o", path).CombinedOutput()
	if err != nil {
		t.Fatalf("meshid token: %v\n%s", err, out)
	}
	return path
}

// ---- agents ----

type workload struct {
	name, namespace, serviceAccount string
	// secretTTL is the lifetime the agent asks for; it renews at half of it.
	secretTTL time.Duration
}

type agentProcess struct {
	*process
	workload
	rootDir               string
	statusAddr, debugAddr string
	args                  []string        // its command line, for restart
	configure             func(*exec.Cmd) // how it is started, for restart
	path                  string          // the program run
	started               func(*process)  // checks a new process before it is waited for
}

// startAgent runs `meshid-agent agent` for w against ca, with its own token, every path under a
// root dir of its own, and loopback ports of its choosing.
func startAgent(t *testing.T, ca *caProcess, w workload) *agentProcess {
	t.Helper()
	return startAgentWith(t, ca, w, agentOptions{})
}

// agentOptions are what some tests change in how startAgentWith runs an agent.
type agentOptions struct {
	caAddr     string   // where the agent reaches the CA; default the CA's own address
	graceRatio string   // --grace-period-ratio; default 0.5
	extraArgs  []string // more flags
	// path and configure, when set, run the agent through another program (the tmpfs wrapper),
	// which gets the agent's path and arguments as its own.
	path      string
	configure func(*exec.Cmd)
	// started, when set, checks each new process before the agent is waited for.
	started func(*process)
}

// startAgentWith is startAgent with options.
func startAgentWith(t *testing.T, ca *caProcess, w workload, o agentOptions) *agentProcess {
	t.Helper()
	if o.caAddr == "" {
		o.caAddr = ca.addr
	}
	if o.graceRatio == "" {
		o.graceRatio = "0.5"
	}
	a := &agentProcess{workload: w, rootDir: testutil.ShortTempDir(t), path: o.path, configure: o.configure, started: o.started}
	a.args = append([]string{"agent",
		"--ca-addr", o.caAddr,
		"--ca-root-cert", ca.rootFile(),
		"--token-path", ca.token(t, w.namespace, w.serviceAccount),
		"--namespace", w.namespace,
		"--service-account", w.serviceAccount,
		"--root-dir", a.rootDir,
		"--status-addr", "127.0.0.1:0",
		"--debug-addr", "127.0.0.1:0",
		"--secret-ttl", w.secretTTL.String(),
		"--grace-period-ratio", o.graceRatio,
	}, o.extraArgs...)
	if a.path == "" {
		a.path = filepath.Join(binDir, "meshid-agent")
	} else {
		a.args = append([]string{filepath.Join(binDir, "meshid-agent")}, a.args...)
	}
	a.launch(t)
	return a
}

// launch starts the agent's process as its fields say, and waits until it has started.
func (a *agentProcess) launch(t *testing.T) {
	t.Helper()
	a.process = startPath(t, "meshid-agent "+a.name, a.path, a.configure, a.args...)
	if a.started != nil {
		a.started(a.process)
	}
	started := a.awaitLog(t, "agent started", nil)
	a.statusAddr, a.debugAddr = started["status_address"].(string), started["debug_address"].(string)
}

func (a *agentProcess) sdsSocket() string {
	return filepath.Join(a.rootDir, "var/run/secrets/workload-spiffe-uds/socket")
}

func (a *agentProcess) xdsSocket() string { return filepath.Join(a.rootDir, "etc/istio/proxy/XDS") }

// metric reads one sample from the /metrics of the server at addr; series is its name and its
// labels as the text format writes them: name{label="value",...}, labels sorted.
func metric(t *testing.T, addr, series string) float64 {
	t.Helper()
	body := httpGet(t, "http://"+addr+"/metrics")
	for line := range strings.Lines(body) {
		if value, ok := strings.CutPrefix(strings.TrimSpace(line), series+" "); ok {
			v, err := strconv.ParseFloat(value, 64)
			if err != nil {
				t.Fatalf("%s: %q: %v", series, line, err)
			}
			return v
		}
	}
	t.Fatalf("%s/metrics has no %s:\n%s", addr, series, body)
	return 0
}

// secretStatus is one entry of the agent's /debug/secrets.
type secretStatus struct {
	Name     string    `json:"name"`
	Valid    bool      `json:"valid"`
	Error    string    `json:"error"`
	SPIFFEID string    `json:"spiffe_id"`
	Serial   string    `json:"serial"`
	NotAfter time.Time `json:"not_after"`
}

func (a *agentProcess) debugSecret(t *testing.T, name string) secretStatus {
	t.Helper()
	body := httpGet(t, "http://"+a.debugAddr+"/debug/secrets")
	var doc struct {
		Secrets []secretStatus `json:"secrets"`
	}
	if err := json.Unmarshal([]byte(body), &doc); err != nil {
		t.Fatalf("/debug/secrets: %v\n%s", err, body)
	}
	for _, s := range doc.Secrets {
		if s.Name == name {
			return s
		}
	}
	t.Fatalf("%s's /debug/secrets has no %q:\n%s", a.name, name, body)
	return secretStatus{}
}

func httpGet(t *testing.T, url string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), wait)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %s %v", url, resp.StatusCode, body, err)
	}
	return string(body)
}

// ---- an Envoy-like client ----

// envoy stands where Envoy would, next to an agent: it takes its configuration over ADS on the
// agent's XDS socket and its secrets over SDS on the agent's SDS socket, following pushes as
// Envoy does, and speaks TLS as that configuration says, with those secrets.
type envoy struct {
	name string
	node *corev3.Node
	// inbound is the TLS a listener of its own requires of clients; outbound, the TLS its
	// outbound listener's cluster speaks to the server. Either may be nil.
	inbound, outbound *tlsPolicy

	mu      sync.Mutex
	secrets map[string]*tlsv3.Secret // the latest of each name
	pushed  chan struct{}            // closed and replaced at every push

	addr      string // where serve listens
	serveErrs []error
}

// tlsPolicy is what a transport socket of the configuration asks for.
type tlsPolicy struct {
	certName, rootsName string // SDS secrets: the key pair, the trusted roots
	peerID              string // the one URI SAN the peer must carry
	requireClientCert   bool
}

// startEnvoy connects to a's sockets: the configuration first, then the secrets it names.
func startEnvoy(t *testing.T, a *agentProcess) *envoy {
	t.Helper()
	e := &envoy{
		name: a.name,
		// The node as Istio's sidecar names itself; the discovery server picks the set by the
		// namespace of the agent's credential, not by this.
		node:    &corev3.Node{Id: fmt.Sprintf("sidecar~127.0.0.1~%s.%s~%s.svc.cluster.local", a.name, a.namespace, a.namespace), Cluster: a.name},
		secrets: map[string]*tlsv3.Secret{},
		pushed:  make(chan struct{}),
	}
	xds, sds := dial(t, a.xdsSocket()), dial(t, a.sdsSocket())
	// Registered after the connections' cleanups, so that it runs before them: the streams
	// end, and are waited for, before their connection closes.
	ctx, cancel := context.WithCancel(context.Background())
	var streams sync.WaitGroup
	t.Cleanup(func() {
		cancel()
		streams.Wait()
	})

	listeners, clusters := e.fetchConfig(t, ctx, xds)
	e.resolve(t, listeners, clusters)

	// One SDS stream per secret name, as Envoy opens them, kept open for pushes.
	client := sdsclient.New(sds, sdsclient.WithNode(e.node))
	names := map[string]bool{}
	for _, p := range []*tlsPolicy{e.inbound, e.outbound} {
		if p != nil {
			names[p.certName], names[p.rootsName] = true, true
		}
	}
	for name := range names {
		stream, err := client.StreamSecrets(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := stream.Subscribe(name); err != nil {
			t.Fatal(err)
		}
		streams.Go(func() { e.followSecrets(t, ctx, stream, name) })
	}
	for name := range names {
		e.awaitSecret(t, name, "a first "+name, func(*tlsv3.Secret) bool { return true })
	}
	return e
}

func dial(t *testing.T, socket string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// fetchConfig asks for clusters, then listeners (Envoy's order), on one ADS stream, and ACKs
// each answer.
func (e *envoy) fetchConfig(t *testing.T, ctx context.Context, conn *grpc.ClientConn) ([]*listenerv3.Listener, map[string]*clusterv3.Cluster) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	stream, err := discoveryv3.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var listeners []*listenerv3.Listener
	clusters := map[string]*clusterv3.Cluster{}
	for _, typeURL := range []string{resource.ClusterType, resource.ListenerType} {
		if err := stream.Send(&discoveryv3.DiscoveryRequest{Node: e.node, TypeUrl: typeURL}); err != nil {
			t.Fatal(err)
		}
		resp, err := stream.Recv()
		if err != nil {
			t.Fatalf("%s: ADS %s: %v", e.name, typeURL, err)
		}
		for _, r := range resp.GetResources() {
			m, err := r.UnmarshalNew()
			if err != nil {
				t.Fatal(err)
			}
			switch m := m.(type) {
			case *listenerv3.Listener:
				listeners = append(listeners, m)
			case *clusterv3.Cluster:
				clusters[m.GetName()] = m
			default:
				t.Fatalf("%s: ADS %s answered with a %T", e.name, typeURL, m)
			}
		}
		ack := &discoveryv3.DiscoveryRequest{TypeUrl: typeURL, VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()}
		if err := stream.Send(ack); err != nil {
			t.Fatal(err)
		}
	}
	return listeners, clusters
}

// resolve reads the TLS out of the configuration as Envoy would: a listener's filter chain
// with a TLS transport socket terminates TLS (inbound); a TCP proxy to a cluster with one
// originates it (outbound).
func (e *envoy) resolve(t *testing.T, listeners []*listenerv3.Listener, clusters map[string]*clusterv3.Cluster) {
	t.Helper()
	for _, l := range listeners {
		for _, fc := range l.GetFilterChains() {
			if ts := fc.GetTransportSocket(); ts != nil {
				down := &tlsv3.DownstreamTlsContext{}
				if err := ts.GetTypedConfig().UnmarshalTo(down); err != nil {
					t.Fatalf("%s: listener %s: %v", e.name, l.GetName(), err)
				}
				e.inbound = policyOf(t, down.GetCommonTlsContext())
				e.inbound.requireClientCert = down.GetRequireClientCertificate().GetValue()
			}
			for _, f := range fc.GetFilters() {
				proxy := &tcpproxyv3.TcpProxy{}
				if f.GetTypedConfig().UnmarshalTo(proxy) != nil {
					continue
				}
				c, ok := clusters[proxy.GetCluster()]
				if !ok {
					t.Fatalf("%s: listener %s names cluster %q, which ADS did not send", e.name, l.GetName(), proxy.GetCluster())
				}
				if ts := c.GetTransportSocket(); ts != nil {
					up := &tlsv3.UpstreamTlsContext{}
					if err := ts.GetTypedConfig().UnmarshalTo(up); err != nil {
						t.Fatalf("%s: cluster %s: %v", e.name, c.GetName(), err)
					}
					e.outbound = policyOf(t, up.GetCommonTlsContext())
				}
			}
		}
	}
}

// policyOf reads the secrets and the peer's identity from a transport socket's common context:
// one key pair by SDS, and a combined validation context of roots by SDS and one exact URI SAN.
func policyOf(t *testing.T, c *tlsv3.CommonTlsContext) *tlsPolicy {
	t.Helper()
	certs := c.GetTlsCertificateSdsSecretConfigs()
	validation := c.GetCombinedValidationContext()
	sans := validation.GetDefaultValidationContext().GetMatchTypedSubjectAltNames()
	if len(certs) != 1 || validation.GetValidationContextSdsSecretConfig() == nil || len(sans) != 1 ||
		sans[0].GetSanType() != tlsv3.SubjectAltNameMatcher_URI || sans[0].GetMatcher().GetExact() == "" {
		t.Fatalf("a TLS context this test does not speak: %v", c)
	}
	return &tlsPolicy{
		certName:  certs[0].GetName(),
		rootsName: validation.GetValidationContextSdsSecretConfig().GetName(),
		peerID:    sans[0].GetMatcher().GetExact(),
	}
}

// followSecrets keeps what the SDS stream pushes and ACKs it, until the test ends.
func (e *envoy) followSecrets(t *testing.T, ctx context.Context, stream *sdsclient.Stream, name string) {
	var sentOther error
	err := stream.Follow([]string{name}, func(r sdsclient.Response) error {
		for got, s := range r.Secrets {
			if got != name {
				sentOther = fmt.Errorf("sent %q", got)
				return sentOther
			}
			e.mu.Lock()
			e.secrets[name] = s
			close(e.pushed)
			e.pushed = make(chan struct{})
			e.mu.Unlock()
		}
		return nil
	})
	if sentOther != nil || ctx.Err() == nil {
		t.Errorf("%s: SDS stream for %s: %v", e.name, name, err)
	}
}

func (e *envoy) secret(name string) *tlsv3.Secret {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.secrets[name]
}

// awaitSecret waits until the latest push of name is one ok accepts, and returns it.
func (e *envoy) awaitSecret(t *testing.T, name, what string, ok func(*tlsv3.Secret) bool) *tlsv3.Secret {
	t.Helper()
	deadline := time.After(wait)
	for {
		e.mu.Lock()
		s, pushed := e.secrets[name], e.pushed
		e.mu.Unlock()
		if s != nil && ok(s) {
			return s
		}
		select {
		case <-pushed:
		case <-deadline:
			t.Fatalf("%s: no SDS push of %s within %s: waiting for %s", e.name, name, wait, what)
		}
	}
}

// certificate is the key pair of the latest push of name.
func (e *envoy) certificate(name string) (*tls.Certificate, error) {
	tc := e.secret(name).GetTlsCertificate()
	cert, err := tls.X509KeyPair(tc.GetCertificateChain().GetInlineBytes(), tc.GetPrivateKey().GetInlineBytes())
	if err != nil {
		return nil, fmt.Errorf("%s: secret %s: %w", e.name, name, err)
	}
	return &cert, nil
}

// verifyPeer checks a peer's chain as Envoy's certificate validator does: it verifies against
// the roots of the latest push of p.rootsName, and a URI SAN matches p.peerID. SPIFFE IDs are
// URI SANs, not host names, so this replaces crypto/tls's own check, host name included.
func (e *envoy) verifyPeer(p *tlsPolicy, usage x509.ExtKeyUsage, raw [][]byte) error {
	var chain []*x509.Certificate
	for _, der := range raw {
		c, err := x509.ParseCertificate(der)
		if err != nil {
			return err
		}
		chain = append(chain, c)
	}
	if len(chain) == 0 {
		return errors.New("no peer certificate")
	}
	roots := x509.NewCertPool()
	for _, r := range rootsOf(e.secret(p.rootsName)) {
		roots.AddCert(r)
	}
	intermediates := x509.NewCertPool()
	for _, c := range chain[1:] {
		intermediates.AddCert(c)
	}
	if _, err := chain[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: intermediates, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
		return fmt.Errorf("%s: peer %v: %w", e.name, chain[0].URIs, err)
	}
	for _, u := range chain[0].URIs {
		if u.String() == p.peerID {
			return nil
		}
	}
	return fmt.Errorf("%s: peer %v is not %s", e.name, chain[0].URIs, p.peerID)
}

// serve terminates TLS as its inbound listener says, on 127.0.0.1:0: the port in the
// configuration is Envoy's to bind, irrelevant here, and a fixed one would collide. Each
// connection reads a line and answers with the SPIFFE ID it verified the client as.
func (e *envoy) serve(t *testing.T) {
	t.Helper()
	p := e.inbound
	cfg := &tls.Config{
		MinVersion:     tls.VersionTLS13,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return e.certificate(p.certName) },
		ClientAuth:     tls.RequestClientCert,
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			if len(raw) == 0 && !p.requireClientCert {
				return nil
			}
			return e.verifyPeer(p, x509.ExtKeyUsageClientAuth, raw)
		},
	}
	if p.requireClientCert {
		cfg.ClientAuth = tls.RequireAnyClientCert
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.addr = ln.Addr().String()
	var conns sync.WaitGroup
	t.Cleanup(func() {
		_ = ln.Close()
		conns.Wait()
	})
	conns.Go(func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Go(func() { e.answer(conn.(*tls.Conn)) })
		}
	})
}

func (e *envoy) answer(conn *tls.Conn) {
	defer func() { _ = conn.Close() }()
	_ = conn.SetDeadline(time.Now().Add(wait))
	_, err := bufio.NewReader(conn).ReadString('\n')
	if err == nil {
		_, err = fmt.Fprintln(conn, conn.ConnectionState().PeerCertificates[0].URIs[0])
	}
	if err != nil {
		e.mu.Lock()
		e.serveErrs = append(e.serveErrs, err)
		e.mu.Unlock()
	}
}

func (e *envoy) lastServeError() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.serveErrs) == 0 {
		return nil
	}
	return e.serveErrs[len(e.serveErrs)-1]
}

// exchange is one connection's outcome: the SPIFFE ID each side verified the other as.
type exchange struct {
	server string // as the client verified it
	client string // as the server verified it, in its answer
}

// call opens a new TLS connection to server, as its outbound cluster says, with the secrets it
// holds now, and exchanges a line.
func (e *envoy) call(server *envoy) (exchange, error) {
	p := e.outbound
	cfg := &tls.Config{
		MinVersion:           tls.VersionTLS13,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return e.certificate(p.certName) },
		InsecureSkipVerify:   true, // verifyPeer instead: see there
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			return e.verifyPeer(p, x509.ExtKeyUsageServerAuth, raw)
		},
	}
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	conn, err := (&tls.Dialer{Config: cfg}).DialContext(ctx, "tcp", server.addr)
	if err != nil {
		return exchange{}, err
	}
	defer func() { _ = conn.Close() }()
	tlsConn := conn.(*tls.Conn)
	_ = tlsConn.SetDeadline(time.Now().Add(wait))
	// In TLS 1.3 the server checks the client's certificate after the client's handshake is
	// done: a refusal arrives as the answer.
	_, err = fmt.Fprintln(tlsConn, "hello from", e.name)
	var answer string
	if err == nil {
		answer, err = bufio.NewReader(tlsConn).ReadString('\n')
	}
	if err != nil {
		return exchange{}, fmt.Errorf("%s → %s: %w (%s says: %w)", e.name, server.name, err, server.name, server.lastServeError())
	}
	return exchange{server: tlsConn.ConnectionState().PeerCertificates[0].URIs[0].String(), client: strings.TrimSpace(answer)}, nil
}

// traffic calls from one envoy to another without pause, in the background, until stop.
type traffic struct {
	stop func() (calls int, failures []error)
}

func startTraffic(from, to *envoy, wantServer, wantClient string) *traffic {
	ctx, cancel := context.WithCancel(context.Background())
	var (
		done     = make(chan struct{})
		calls    int
		failures []error
	)
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			calls++
			got, err := from.call(to)
			if err == nil && (got.server != wantServer || got.client != wantClient) {
				err = fmt.Errorf("the peers verified each other as %+v", got)
			}
			if err != nil {
				failures = append(failures, err)
			}
		}
	}()
	return &traffic{stop: func() (int, []error) {
		cancel()
		<-done
		return calls, failures
	}}
}

// ---- certificates in secrets ----

func chainOf(t *testing.T, s *tlsv3.Secret) []*x509.Certificate {
	t.Helper()
	chain, err := pki.ParseCertificates(s.GetTlsCertificate().GetCertificateChain().GetInlineBytes())
	if err != nil || len(chain) == 0 {
		t.Fatalf("secret %s: chain %v: %v", s.GetName(), chain, err)
	}
	return chain
}

// rootsOf is the trusted roots of a validation context secret (ROOTCA).
func rootsOf(s *tlsv3.Secret) []*x509.Certificate {
	roots, _ := pki.ParseCertificates(s.GetValidationContext().GetTrustedCa().GetInlineBytes())
	return roots
}

// chainsTo says whether the key pair secret s verifies up to root, and to no other root.
func chainsTo(t *testing.T, s *tlsv3.Secret, root *x509.Certificate) bool {
	t.Helper()
	chain := chainOf(t, s)
	roots, intermediates := x509.NewCertPool(), x509.NewCertPool()
	roots.AddCert(root)
	for _, c := range chain[1:] {
		intermediates.AddCert(c)
	}
	_, err := chain[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: intermediates, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}})
	return err == nil
}

// trusts says whether the roots secret s holds root.
func trusts(s *tlsv3.Secret, root *x509.Certificate) bool {
	return slices.ContainsFunc(rootsOf(s), root.Equal)
}

func readRoots(t *testing.T, path string) []*x509.Certificate {
	t.Helper()
	roots, err := pki.ParseCertificates(readFile(t, path))
	if err != nil {
		t.Fatal(err)
	}
	return roots
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}
