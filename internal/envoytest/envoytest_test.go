package envoytest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	tcpproxyv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/tcp_proxy/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	secretv3 "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/meshid/meshid/internal/envoytest"
	"github.com/meshid/meshid/internal/testutil"
)

// wait bounds, in real time, how long a test waits for the stand-in to do something.
const wait = 30 * time.Second

const nodeID = "sidecar~10.0.0.1~app.ns~ns.svc.cluster.local"

// controlPlane serves ADS and SDS from go-control-plane's snapshot cache on two Unix sockets,
// and records every request as it came on the wire.
type controlPlane struct {
	cache    cachev3.SnapshotCache
	ads, sds string

	mu   sync.Mutex
	reqs []recorded
	grpc *grpc.Server
}

type recorded struct {
	method string
	req    *discoveryv3.DiscoveryRequest
	delta  *discoveryv3.DeltaDiscoveryRequest
}

type recordingStream struct {
	grpc.ServerStream
	cp     *controlPlane
	method string
}

func (r *recordingStream) RecvMsg(m any) error {
	err := r.ServerStream.RecvMsg(m)
	if err != nil {
		return err
	}
	// A copy as it came: the server fills in the node of later requests.
	rec := recorded{method: r.method}
	switch req := m.(type) {
	case *discoveryv3.DiscoveryRequest:
		rec.req = proto.Clone(req).(*discoveryv3.DiscoveryRequest)
	case *discoveryv3.DeltaDiscoveryRequest:
		rec.delta = proto.Clone(req).(*discoveryv3.DeltaDiscoveryRequest)
	}
	r.cp.mu.Lock()
	r.cp.reqs = append(r.cp.reqs, rec)
	r.cp.mu.Unlock()
	return err
}

func newControlPlane(t *testing.T) *controlPlane {
	t.Helper()
	dir := testutil.ShortTempDir(t)
	cp := &controlPlane{
		// Not in ADS mode: that answers a request only when it names every resource of its type
		// in the snapshot, and Envoy asks for one secret per SDS stream.
		cache: cachev3.NewSnapshotCache(false, cachev3.IDHash{}, nil),
		ads:   filepath.Join(dir, "ads.sock"),
		sds:   filepath.Join(dir, "sds.sock"),
	}
	cp.serve(t)
	return cp
}

func (cp *controlPlane) serve(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	srv := serverv3.NewServer(ctx, cp.cache, nil)
	g := grpc.NewServer(grpc.StreamInterceptor(func(s any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		return h(s, &recordingStream{ServerStream: ss, cp: cp, method: info.FullMethod})
	}))
	discoveryv3.RegisterAggregatedDiscoveryServiceServer(g, srv)
	secretv3.RegisterSecretDiscoveryServiceServer(g, srv)
	for _, path := range []string{cp.ads, cp.sds} {
		ln, err := net.Listen("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		go func() { _ = g.Serve(ln) }()
	}
	cp.mu.Lock()
	cp.grpc = g
	cp.mu.Unlock()
	t.Cleanup(func() {
		g.Stop()
		cancel()
	})
}

// stop ends every stream and closes the sockets, as a control plane that restarts.
func (cp *controlPlane) stop() {
	cp.mu.Lock()
	g := cp.grpc
	cp.mu.Unlock()
	g.Stop()
}

func (cp *controlPlane) set(t *testing.T, version string, res map[resource.Type][]types.Resource) {
	t.Helper()
	snap, err := cachev3.NewSnapshot(version, res)
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.cache.SetSnapshot(context.Background(), nodeID, snap); err != nil {
		t.Fatal(err)
	}
}

// requests are the requests of typeURL received so far on streams of method (ADS or SDS).
func (cp *controlPlane) requests(method, typeURL string) []*discoveryv3.DiscoveryRequest {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	var out []*discoveryv3.DiscoveryRequest
	for _, r := range cp.reqs {
		if r.req != nil && strings.HasSuffix(r.method, method) && r.req.GetTypeUrl() == typeURL {
			out = append(out, r.req)
		}
	}
	return out
}

func (cp *controlPlane) all(method string) []*discoveryv3.DiscoveryRequest {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	var out []*discoveryv3.DiscoveryRequest
	for _, r := range cp.reqs {
		if r.req != nil && strings.HasSuffix(r.method, method) {
			out = append(out, r.req)
		}
	}
	return out
}

// deltas are the incremental requests received so far on streams of method.
func (cp *controlPlane) deltas(method string) []*discoveryv3.DeltaDiscoveryRequest {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	var out []*discoveryv3.DeltaDiscoveryRequest
	for _, r := range cp.reqs {
		if r.delta != nil && strings.HasSuffix(r.method, method) {
			out = append(out, r.delta)
		}
	}
	return out
}

const (
	adsMethod = "/StreamAggregatedResources"
	sdsMethod = "/StreamSecrets"
)

// sdsSecret names a secret of the sds-grpc cluster, taken with api (GRPC or DELTA_GRPC).
func sdsSecret(name string, api corev3.ApiConfigSource_ApiType) *tlsv3.SdsSecretConfig {
	src := envoytest.GRPCSource(envoytest.SDSCluster)
	src.ApiType = api
	return &tlsv3.SdsSecretConfig{Name: name, SdsConfig: &corev3.ConfigSource{
		ResourceApiVersion:    corev3.ApiVersion_V3,
		ConfigSourceSpecifier: &corev3.ConfigSource_ApiConfigSource{ApiConfigSource: src},
	}}
}

func mustAny(t *testing.T, m proto.Message) *anypb.Any {
	t.Helper()
	a, err := anypb.New(m)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func mtlsContext(api corev3.ApiConfigSource_ApiType) *tlsv3.CommonTlsContext {
	return &tlsv3.CommonTlsContext{
		TlsCertificateSdsSecretConfigs: []*tlsv3.SdsSecretConfig{sdsSecret("default", api)},
		ValidationContextType: &tlsv3.CommonTlsContext_CombinedValidationContext{CombinedValidationContext: &tlsv3.CommonTlsContext_CombinedCertificateValidationContext{
			DefaultValidationContext:         &tlsv3.CertificateValidationContext{},
			ValidationContextSdsSecretConfig: sdsSecret("ROOTCA", api),
		}},
	}
}

func backendCluster(t *testing.T, timeout time.Duration, api corev3.ApiConfigSource_ApiType) *clusterv3.Cluster {
	t.Helper()
	return &clusterv3.Cluster{
		Name:                 "backend",
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_STATIC},
		ConnectTimeout:       durationpb.New(timeout),
		LoadAssignment: &endpointv3.ClusterLoadAssignment{ClusterName: "backend", Endpoints: []*endpointv3.LocalityLbEndpoints{{
			LbEndpoints: []*endpointv3.LbEndpoint{{HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{
				Address: &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
					Address: "127.0.0.1", PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: 1},
				}}},
			}}}},
		}}},
		TransportSocket: &corev3.TransportSocket{Name: "envoy.transport_sockets.tls", ConfigType: &corev3.TransportSocket_TypedConfig{
			TypedConfig: mustAny(t, &tlsv3.UpstreamTlsContext{CommonTlsContext: mtlsContext(api)}),
		}},
	}
}

// tcpListener is a TCP proxy listener on 127.0.0.1:0; with tls, its certificates come over SDS.
func tcpListener(t *testing.T, name string, dir corev3.TrafficDirection, tls bool, api corev3.ApiConfigSource_ApiType) *listenerv3.Listener {
	t.Helper()
	fc := &listenerv3.FilterChain{Filters: []*listenerv3.Filter{{
		Name: "envoy.filters.network.tcp_proxy",
		ConfigType: &listenerv3.Filter_TypedConfig{TypedConfig: mustAny(t, &tcpproxyv3.TcpProxy{
			StatPrefix:       name,
			ClusterSpecifier: &tcpproxyv3.TcpProxy_Cluster{Cluster: "backend"},
		})},
	}}}
	if tls {
		fc.TransportSocket = &corev3.TransportSocket{Name: "envoy.transport_sockets.tls", ConfigType: &corev3.TransportSocket_TypedConfig{
			TypedConfig: mustAny(t, &tlsv3.DownstreamTlsContext{CommonTlsContext: mtlsContext(api)}),
		}}
	}
	return &listenerv3.Listener{
		Name:             name,
		TrafficDirection: dir,
		Address: &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
			Address: "127.0.0.1", PortSpecifier: &corev3.SocketAddress_PortValue{},
		}}},
		FilterChains: []*listenerv3.FilterChain{fc},
	}
}

func secrets(t *testing.T) []types.Resource {
	t.Helper()
	ca := testutil.NewRootCA(t, testutil.CAOptions{})
	leaf, key := ca.IssueWorkload(t, "spiffe://cluster.local/ns/ns/sa/app", time.Hour)
	inline := func(b []byte) *corev3.DataSource {
		return &corev3.DataSource{Specifier: &corev3.DataSource_InlineBytes{InlineBytes: b}}
	}
	return []types.Resource{
		&tlsv3.Secret{Name: "default", Type: &tlsv3.Secret_TlsCertificate{TlsCertificate: &tlsv3.TlsCertificate{
			CertificateChain: inline(testutil.CertPEM(leaf)), PrivateKey: inline(testutil.KeyPEM(t, key)),
		}}},
		&tlsv3.Secret{Name: "ROOTCA", Type: &tlsv3.Secret_ValidationContext{ValidationContext: &tlsv3.CertificateValidationContext{
			TrustedCa: inline(testutil.CertPEM(ca.Cert)),
		}}},
	}
}

// mesh is the configuration most tests use: a TLS cluster, an inbound TLS listener and an
// outbound plain one, and the two secrets they name.
func mesh(t *testing.T) map[resource.Type][]types.Resource {
	t.Helper()
	return meshOver(t, corev3.ApiConfigSource_GRPC)
}

// meshOver is mesh with its secrets taken over api.
func meshOver(t *testing.T, api corev3.ApiConfigSource_ApiType) map[resource.Type][]types.Resource {
	t.Helper()
	return map[resource.Type][]types.Resource{
		resource.ClusterType: {backendCluster(t, time.Second, api)},
		resource.ListenerType: {
			tcpListener(t, "inbound", corev3.TrafficDirection_INBOUND, true, api),
			tcpListener(t, "outbound", corev3.TrafficDirection_OUTBOUND, false, api),
		},
		resource.SecretType: secrets(t),
	}
}

func ctx(t *testing.T) context.Context {
	t.Helper()
	c, cancel := context.WithTimeout(context.Background(), wait)
	t.Cleanup(cancel)
	return c
}

func waitState(t *testing.T, admin *envoytest.Admin, want string) {
	t.Helper()
	envoytest.Eventually(t, wait, func() error {
		state, _, err := admin.Ready(ctx(t))
		if err != nil {
			return err
		}
		if state != want {
			return fmt.Errorf("state %s, want %s", state, want)
		}
		return nil
	})
}

func waitStat(t *testing.T, admin *envoytest.Admin, name string, want int64) {
	t.Helper()
	envoytest.Eventually(t, wait, func() error {
		stats, err := admin.Stats(ctx(t))
		if err != nil {
			return err
		}
		if got, ok := stats[name]; !ok || got != want {
			return fmt.Errorf("%s = %d (present %v), want %d", name, got, ok, want)
		}
		return nil
	})
}

// startLive starts a stand-in on cp with the mesh configuration and waits for LIVE.
func startLive(t *testing.T, args ...string) (*controlPlane, *envoytest.Process) {
	t.Helper()
	cp := newControlPlane(t)
	boot := envoytest.NewBootstrap(t, nodeID, cp.ads, cp.sds)
	p := envoytest.Start(t, append([]string{"-c", envoytest.WriteBootstrap(t, boot)}, args...)...)
	cp.set(t, "1", mesh(t))
	t.Cleanup(func() {
		if t.Failed() {
			st, _ := p.Admin.Stats(context.Background())
			t.Logf("stats %v\nstderr:\n%s\nsds %v", st, p.Stderr(), cp.all(sdsMethod))
		}
	})
	waitState(t, p.Admin, "LIVE")
	return cp, p
}

func listenerAddr(t *testing.T, admin *envoytest.Admin, name string) string {
	t.Helper()
	ls, err := admin.Listeners(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range ls.GetListenerStatuses() {
		if l.GetName() == name {
			sa := l.GetLocalAddress().GetSocketAddress()
			return net.JoinHostPort(sa.GetAddress(), strconv.Itoa(int(sa.GetPortValue())))
		}
	}
	t.Fatalf("listener %s not in /listeners: %v", name, ls)
	return ""
}

func TestReachesLiveWithListenersClustersAndSecrets(t *testing.T) {
	t.Parallel()
	cp := newControlPlane(t)
	boot := envoytest.NewBootstrap(t, nodeID, cp.ads, cp.sds)
	boot.DynamicResources.AdsConfig.SetNodeOnFirstMessageOnly = true
	p := envoytest.Start(t, "-c", envoytest.WriteBootstrap(t, boot))

	// Connected, nothing served yet: not ready.
	waitState(t, p.Admin, "INITIALIZING")
	code, body, err := p.Admin.Do(ctx(t), http.MethodGet, "/ready")
	if err != nil || code != http.StatusServiceUnavailable || body != "INITIALIZING\n" {
		t.Fatalf("/ready before configuration = %d %q, %v; want 503 INITIALIZING", code, body, err)
	}

	// Istio's agent reads readiness from the stats too: workers_started is written once LIVE.
	if _, body, err := p.Admin.Do(ctx(t), http.MethodGet, `/stats?usedonly&filter=^(server\.state|listener_manager\.workers_started)$`); err != nil || body != "server.state: 3\n" {
		t.Errorf("/stats?usedonly before configuration = %q %v, want the state INITIALIZING (3) alone", body, err)
	}

	cp.set(t, "1", mesh(t))
	waitState(t, p.Admin, "LIVE")
	if _, body, err := p.Admin.Do(ctx(t), http.MethodGet, `/stats?usedonly&filter=^(server\.state|listener_manager\.workers_started)$`); err != nil || body != "listener_manager.workers_started: 1\nserver.state: 0\n" {
		t.Errorf("/stats?usedonly once LIVE = %q %v", body, err)
	}

	ls, err := p.Admin.Listeners(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, l := range ls.GetListenerStatuses() {
		names = append(names, l.GetName())
		sa := l.GetLocalAddress().GetSocketAddress()
		if sa.GetAddress() != "127.0.0.1" || sa.GetPortValue() == 0 {
			t.Errorf("listener %s bound at %v, want 127.0.0.1 and a real port", l.GetName(), sa)
		}
		conn, err := net.Dial("tcp", net.JoinHostPort(sa.GetAddress(), strconv.Itoa(int(sa.GetPortValue()))))
		if err != nil {
			t.Errorf("listener %s does not accept: %v", l.GetName(), err)
		} else {
			_ = conn.Close()
		}
	}
	if !slices.Equal(names, []string{"inbound", "outbound"}) {
		t.Errorf("listeners %v, want inbound and outbound", names)
	}

	stats, err := p.Admin.Stats(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]int64{
		"cluster_manager.cds.update_success":      1,
		"listener_manager.lds.update_success":     1,
		"cluster_manager.active_clusters":         3, // xds-grpc, sds-grpc, backend
		"listener_manager.total_listeners_active": 2,
		"sds.default.update_success":              1,
		"sds.ROOTCA.update_success":               1,
		"server.state":                            int64(adminv3.ServerInfo_LIVE),
		"server.live":                             1,
	} {
		if stats[name] != want {
			t.Errorf("%s = %d, want %d", name, stats[name], want)
		}
	}

	// The node on the first ADS request only, as set_node_on_first_message_only asks.
	ads := cp.all(adsMethod)
	if len(ads) < 4 || ads[0].GetNode().GetId() != nodeID || ads[0].GetNode().GetUserAgentName() != "envoy" {
		t.Fatalf("ADS requests %v: want the node %s on the first", ads, nodeID)
	}
	for _, r := range ads[1:] {
		if r.GetNode() != nil {
			t.Errorf("ADS request %v carries the node after the first", r)
		}
	}
	// Each type ACKed with the version and nonce it was sent.
	for _, typ := range []string{resource.ClusterType, resource.ListenerType} {
		envoytest.Eventually(t, wait, func() error { return acked(cp.requests(adsMethod, typ), "1") })
	}
	// One SDS stream per secret, each ACKed, each with the node (sds_config does not ask otherwise).
	for _, name := range []string{"default", "ROOTCA"} {
		envoytest.Eventually(t, wait, func() error {
			var mine []*discoveryv3.DiscoveryRequest
			for _, r := range cp.requests(sdsMethod, resource.SecretType) {
				if slices.Equal(r.GetResourceNames(), []string{name}) {
					if r.GetNode().GetId() != nodeID {
						t.Fatalf("SDS request for %s without the node: %v", name, r)
					}
					mine = append(mine, r)
				}
			}
			return acked(mine, "1")
		})
	}

	info, err := p.Admin.ServerInfo(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if info.GetState() != adminv3.ServerInfo_LIVE || info.GetNode().GetId() != nodeID {
		t.Errorf("server_info state %v node %v, want LIVE and %s", info.GetState(), info.GetNode(), nodeID)
	}
}

// acked checks that among reqs is an ACK of version: that version, a nonce, no error.
func acked(reqs []*discoveryv3.DiscoveryRequest, version string) error {
	for _, r := range reqs {
		if r.GetVersionInfo() == version && r.GetResponseNonce() != "" && r.GetErrorDetail() == nil {
			return nil
		}
	}
	return fmt.Errorf("no ACK of version %s among %v", version, reqs)
}

func TestNACKsAnInvalidResource(t *testing.T) {
	t.Parallel()
	cp := newControlPlane(t)
	p := envoytest.Start(t, "-c", envoytest.WriteBootstrap(t, envoytest.NewBootstrap(t, nodeID, cp.ads, cp.sds)))
	bad := mesh(t)
	bad[resource.ClusterType] = []types.Resource{backendCluster(t, -time.Second, corev3.ApiConfigSource_GRPC)} // connect_timeout must be > 0
	cp.set(t, "1", bad)

	var nack *discoveryv3.DiscoveryRequest
	envoytest.Eventually(t, wait, func() error {
		for _, r := range cp.requests(adsMethod, resource.ClusterType) {
			if r.GetErrorDetail() != nil {
				nack = r
				return nil
			}
		}
		return fmt.Errorf("no NACK of the clusters yet")
	})
	if nack.GetVersionInfo() != "" || nack.GetResponseNonce() == "" || !strings.Contains(nack.GetErrorDetail().GetMessage(), "ConnectTimeout") {
		t.Errorf("NACK %v: want no accepted version, the response's nonce, and the failing field", nack)
	}
	// At least one: go-control-plane's cache answers a NACK with the same snapshot again.
	envoytest.Eventually(t, wait, func() error {
		stats, err := p.Admin.Stats(ctx(t))
		if err != nil {
			return err
		}
		if stats["cluster_manager.cds.update_rejected"] < 1 {
			return fmt.Errorf("cds.update_rejected %d", stats["cluster_manager.cds.update_rejected"])
		}
		return nil
	})
	if state, ok, err := p.Admin.Ready(ctx(t)); err != nil || ok || state != "INITIALIZING" {
		t.Errorf("/ready after a rejected CDS = %s %v %v, want INITIALIZING", state, ok, err)
	}

	cp.set(t, "2", mesh(t))
	waitState(t, p.Admin, "LIVE")
	envoytest.Eventually(t, wait, func() error { return acked(cp.requests(adsMethod, resource.ClusterType), "2") })
}

func TestGracefulDrainHoldsConnectionsAndRefusesNew(t *testing.T) {
	t.Parallel()
	_, p := startLive(t)
	in, out := listenerAddr(t, p.Admin, "inbound"), listenerAddr(t, p.Admin, "outbound")
	inStat := "listener." + strings.ReplaceAll(in, ":", "_") + ".downstream_cx_active"

	var held []net.Conn
	for range 2 {
		c, err := net.Dial("tcp", in)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		held = append(held, c)
	}
	waitStat(t, p.Admin, inStat, 2)

	if code, body, err := p.Admin.Do(ctx(t), http.MethodGet, "/drain_listeners?graceful"); err != nil || code != http.StatusMethodNotAllowed || !strings.Contains(body, "POST required") {
		t.Errorf("GET /drain_listeners = %d %q %v, want 405", code, body, err)
	}
	if code, _, err := p.Admin.Post(ctx(t), "/drain_listeners?graceful&inboundonly"); err != nil || code != http.StatusOK {
		t.Fatalf("POST /drain_listeners = %d %v", code, err)
	}
	if state, ok, err := p.Admin.Ready(ctx(t)); err != nil || ok || state != "DRAINING" {
		t.Errorf("/ready after a drain = %s %v %v, want 503 DRAINING", state, ok, err)
	}
	if c, err := net.Dial("tcp", in); err == nil {
		_ = c.Close()
		t.Errorf("the drained inbound listener still accepts")
	}
	c, err := net.Dial("tcp", out)
	if err != nil {
		t.Errorf("the outbound listener, not drained with inboundonly, refuses: %v", err)
	} else {
		_ = c.Close()
	}
	ls, err := p.Admin.Listeners(ctx(t))
	if err != nil || len(ls.GetListenerStatuses()) != 1 || ls.GetListenerStatuses()[0].GetName() != "outbound" {
		t.Errorf("/listeners after the drain = %v %v, want outbound only", ls, err)
	}

	// The connections it had stay, counted, until their clients close them.
	for _, c := range held {
		if _, err := c.Write([]byte("still here")); err != nil {
			t.Errorf("held connection: %v", err)
		}
	}
	waitStat(t, p.Admin, inStat, 2)
	_ = held[0].Close()
	waitStat(t, p.Admin, inStat, 1)
}

func TestQuitQuitQuitExitsZero(t *testing.T) {
	t.Parallel()
	// A YAML bootstrap with no ADS: LIVE at once, as Envoy with static configuration only.
	path := filepath.Join(t.TempDir(), "envoy.yaml")
	yaml := "admin:\n  address:\n    socket_address: {address: 127.0.0.1, port_value: 0}\nnode: {id: static, cluster: c}\n"
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	p := envoytest.Start(t, "-c", path)
	waitState(t, p.Admin, "LIVE")
	if code, _, err := p.Admin.Do(ctx(t), http.MethodGet, "/quitquitquit"); err != nil || code != http.StatusMethodNotAllowed {
		t.Errorf("GET /quitquitquit = %d %v, want 405", code, err)
	}
	waitStat(t, p.Admin, "standin.admin_refused", 1)
	code, body, err := p.Admin.Post(ctx(t), "/quitquitquit")
	if err != nil || code != http.StatusOK || body != "OK\n" {
		t.Errorf("POST /quitquitquit = %d %q %v, want 200 OK", code, body, err)
	}
	if exit := p.Wait(t, wait); exit != 0 {
		t.Errorf("exit %d after /quitquitquit, want 0\n%s", exit, p.Stderr())
	}
}

func TestSignals(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		sig  syscall.Signal
		logs string
	}{
		{syscall.SIGTERM, "caught SIGTERM"},
		{syscall.SIGINT, "caught SIGINT"},
	} {
		t.Run(tc.sig.String(), func(t *testing.T) {
			t.Parallel()
			_, p := startLive(t)
			// SIGHUP and SIGUSR1 are logged and survived.
			p.Signal(t, syscall.SIGHUP)
			p.Signal(t, syscall.SIGUSR1)
			envoytest.Eventually(t, wait, func() error {
				if s := p.Stderr(); !strings.Contains(s, "reopening logs") || !strings.Contains(s, "caught SIGHUP") {
					return fmt.Errorf("SIGHUP and SIGUSR1 not logged yet")
				}
				return nil
			})
			waitState(t, p.Admin, "LIVE")
			p.Signal(t, tc.sig)
			if exit := p.Wait(t, wait); exit != 0 {
				t.Errorf("exit %d on %v, want 0", exit, tc.sig)
			}
			if !strings.Contains(p.Stderr(), tc.logs) {
				t.Errorf("stderr does not say %q:\n%s", tc.logs, p.Stderr())
			}
		})
	}
}

func TestVersionAndHelp(t *testing.T) {
	t.Parallel()
	if exit, out := envoytest.Run(t, wait, "--version"); exit != 0 || !strings.Contains(out, "envoy  version: ") {
		t.Errorf("--version: exit %d, %q", exit, out)
	}
	if exit, out := envoytest.Run(t, wait, "--help"); exit != 0 || !strings.Contains(out, "USAGE: envoy") {
		t.Errorf("--help: exit %d, %q", exit, out)
	}
}

func TestRefusesABadCommandLine(t *testing.T) {
	t.Parallel()
	boot := envoytest.WriteBootstrap(t, envoytest.NewBootstrap(t, nodeID, "/nonexistent/ads.sock", "/nonexistent/sds.sock"))
	for name, args := range map[string][]string{
		"unknown flag":       {"-c", boot, "--no-such-flag"},
		"bad number":         {"-c", boot, "--concurrency", "two"},
		"bad drain strategy": {"-c", boot, "--drain-strategy", "sideways"},
		"bad log level":      {"-c", boot, "-l", "loud"},
		"bad ip version":     {"-c", boot, "--local-address-ip-version", "v5"},
		"extra argument":     {"-c", boot, "extra"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			exit, stderr := envoytest.Run(t, wait, args...)
			if exit != 1 || !strings.Contains(stderr, "PARSE ERROR") {
				t.Errorf("exit %d, stderr %q; want 1 and a PARSE ERROR", exit, stderr)
			}
		})
	}
}

func TestRefusesAnInvalidBootstrap(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	noADSCluster := envoytest.NewBootstrap(t, nodeID, "/a.sock", "/s.sock")
	noADSCluster.StaticResources.Clusters = nil
	badTimeout := envoytest.NewBootstrap(t, nodeID, "/a.sock", "/s.sock")
	badTimeout.StaticResources.Clusters[0].ConnectTimeout = durationpb.New(-time.Second)
	for name, tc := range map[string]struct {
		args []string
		want string
	}{
		"constraint":     {[]string{"-c", envoytest.WriteBootstrap(t, badTimeout)}, "ConnectTimeout"},
		"unknown field":  {[]string{"-c", write("unknown.json", `{"no_such_field": 1}`)}, "no_such_field"},
		"bad YAML":       {[]string{"-c", write("bad.yaml", "admin: [")}, "YAML"},
		"no ADS cluster": {[]string{"-c", envoytest.WriteBootstrap(t, noADSCluster)}, "xds-grpc"},
		"no config":      {nil, "config-path"},
		"missing file":   {[]string{"-c", filepath.Join(dir, "absent.json")}, "absent.json"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			exit, stderr := envoytest.Run(t, wait, tc.args...)
			if exit != 1 || !strings.Contains(stderr, tc.want) {
				t.Errorf("exit %d, stderr %q; want 1 naming %q", exit, stderr, tc.want)
			}
		})
	}

	// --mode validate checks a bootstrap as Envoy does, and exits.
	good := envoytest.WriteBootstrap(t, envoytest.NewBootstrap(t, nodeID, "/a.sock", "/s.sock"))
	if exit, out := envoytest.Run(t, wait, "--mode", "validate", "-c", good); exit != 0 || !strings.Contains(out, "' OK") {
		t.Errorf("--mode validate of a good bootstrap: exit %d, %q", exit, out)
	}
	if exit, out := envoytest.Run(t, wait, "--mode", "validate", "-c", envoytest.WriteBootstrap(t, badTimeout)); exit != 1 || !strings.Contains(out, "ConnectTimeout") {
		t.Errorf("--mode validate of a bad bootstrap: exit %d, %q", exit, out)
	}
	// --config-yaml is checked too, once merged over the file.
	if exit, out := envoytest.Run(t, wait, "--mode", "validate", "-c", good, "--config-yaml", "admin: {address: {socket_address: {port_value: 70000}}}"); exit != 1 || !strings.Contains(out, "PortValue") {
		t.Errorf("--mode validate with a bad --config-yaml: exit %d, %q", exit, out)
	}

	// --allow-unknown-static-fields takes what the same file is refused for without it.
	p := envoytest.Start(t, "-c", write("lenient.json", `{"no_such_field": 1, "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}}}`), "--allow-unknown-static-fields")
	waitState(t, p.Admin, "LIVE")
}

func TestServerInfoReflectsTheCommandLine(t *testing.T) {
	t.Parallel()
	_, p := startLive(t, "--concurrency", "3", "--drain-time-s", "17", "--parent-shutdown-time-s", "21",
		"--drain-strategy", "immediate", "-l", "debug", "--component-log-level", "upstream:debug,config:trace",
		"--local-address-ip-version", "v6", "--disable-hot-restart", "--file-flush-interval-msec", "250",
		"--service-cluster", "overridden")
	info, err := p.Admin.ServerInfo(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	o := info.GetCommandLineOptions()
	if o.GetConcurrency() != 3 || o.GetDrainTime().AsDuration() != 17*time.Second ||
		o.GetParentShutdownTime().AsDuration() != 21*time.Second || o.GetDrainStrategy() != adminv3.CommandLineOptions_Immediate ||
		o.GetLogLevel() != "debug" || o.GetComponentLogLevel() != "upstream:debug,config:trace" ||
		o.GetLocalAddressIpVersion() != adminv3.CommandLineOptions_v6 || !o.GetDisableHotRestart() ||
		o.GetFileFlushInterval().AsDuration() != 250*time.Millisecond {
		t.Errorf("command_line_options %v do not reflect the flags", o)
	}
	if info.GetHotRestartVersion() != "disabled" || info.GetNode().GetCluster() != "overridden" || info.GetNode().GetId() != nodeID {
		t.Errorf("server_info %v: want hot restart disabled and the cluster overridden", info)
	}

	// --config-yaml is merged over the file, as Istio's agent passes a user's bootstrap override.
	_, m := startLive(t, "--config-yaml", "node: {metadata: {OVERRIDE: \"yes\"}}")
	merged, err := m.Admin.ServerInfo(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if merged.GetNode().GetId() != nodeID || merged.GetNode().GetMetadata().GetFields()["OVERRIDE"].GetStringValue() != "yes" {
		t.Errorf("node %v: want the file's id and the --config-yaml metadata", merged.GetNode())
	}

	// Defaults are Envoy's.
	_, q := startLive(t)
	def, err := q.Admin.ServerInfo(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if d := def.GetCommandLineOptions(); d.GetDrainTime().AsDuration() != 600*time.Second || d.GetParentShutdownTime().AsDuration() != 900*time.Second ||
		d.GetDrainStrategy() != adminv3.CommandLineOptions_Gradual || d.GetLogLevel() != "info" || d.GetConcurrency() == 0 {
		t.Errorf("default command_line_options %v are not Envoy's", d)
	}
	// The JSON is Envoy's: field names as in the proto, the state named even when LIVE (zero).
	_, raw, err := q.Admin.Do(ctx(t), http.MethodGet, "/server_info")
	var fields map[string]any
	if err != nil || json.Unmarshal([]byte(raw), &fields) != nil || fields["state"] != "LIVE" || fields["command_line_options"] == nil {
		t.Errorf("/server_info JSON %q: want proto field names and the state", raw)
	}
	if err := protojson.Unmarshal([]byte(raw), &adminv3.ServerInfo{}); err != nil {
		t.Error(err)
	}
}

func TestPrometheusStatsParse(t *testing.T) {
	t.Parallel()
	_, p := startLive(t)
	in := listenerAddr(t, p.Admin, "inbound")
	c, err := net.Dial("tcp", in)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	waitStat(t, p.Admin, "server.total_connections", 1)

	text, err := p.Admin.Prometheus(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		t.Fatalf("/stats/prometheus does not parse: %v\n%s", err, text)
	}
	value := func(name string, typ dto.MetricType, labels map[string]string) (float64, error) {
		f, ok := families[name]
		if !ok {
			return 0, fmt.Errorf("no %s", name)
		}
		if f.GetType() != typ {
			return 0, fmt.Errorf("%s is %v, want %v", name, f.GetType(), typ)
		}
	metrics:
		for _, m := range f.GetMetric() {
			for k, v := range labels {
				if !slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool { return l.GetName() == k && l.GetValue() == v }) {
					continue metrics
				}
			}
			if typ == dto.MetricType_COUNTER {
				return m.GetCounter().GetValue(), nil
			}
			return m.GetGauge().GetValue(), nil
		}
		return 0, fmt.Errorf("no %s with %v", name, labels)
	}
	addrLabel := map[string]string{"envoy_listener_address": strings.ReplaceAll(in, ":", "_")}
	for _, tc := range []struct {
		name   string
		typ    dto.MetricType
		labels map[string]string
		want   func(float64) bool
	}{
		{"envoy_server_state", dto.MetricType_GAUGE, nil, func(v float64) bool { return v == 0 }},
		{"envoy_server_live", dto.MetricType_GAUGE, nil, func(v float64) bool { return v == 1 }},
		{"envoy_server_total_connections", dto.MetricType_GAUGE, nil, func(v float64) bool { return v == 1 }},
		{"envoy_cluster_manager_cds_update_success", dto.MetricType_COUNTER, nil, func(v float64) bool { return v == 1 }},
		{"envoy_cluster_manager_cds_update_rejected", dto.MetricType_COUNTER, nil, func(v float64) bool { return v == 0 }},
		{"envoy_listener_manager_lds_update_success", dto.MetricType_COUNTER, nil, func(v float64) bool { return v == 1 }},
		{"envoy_listener_manager_lds_update_rejected", dto.MetricType_COUNTER, nil, func(v float64) bool { return v == 0 }},
		{"envoy_listener_downstream_cx_active", dto.MetricType_GAUGE, addrLabel, func(v float64) bool { return v == 1 }},
		{"envoy_listener_downstream_cx_total", dto.MetricType_COUNTER, addrLabel, func(v float64) bool { return v == 1 }},
		{"envoy_http_downstream_cx_active", dto.MetricType_GAUGE, map[string]string{"envoy_http_conn_manager_prefix": "admin"}, func(v float64) bool { return v >= 1 }},
	} {
		v, err := value(tc.name, tc.typ, tc.labels)
		if err != nil || !tc.want(v) {
			t.Errorf("%s%v = %v, %v", tc.name, tc.labels, v, err)
		}
	}

	// filter and usedonly, as Envoy's /stats takes them.
	code, body, err := p.Admin.Do(ctx(t), http.MethodGet, `/stats?usedonly&filter=^server\.`)
	if err != nil || code != http.StatusOK || !strings.Contains(body, "server.live: 1\n") || strings.Contains(body, "cluster_manager") {
		t.Errorf("/stats?usedonly&filter = %d %q %v", code, body, err)
	}
	if code, _, err := p.Admin.Do(ctx(t), http.MethodGet, "/stats?filter=("); err != nil || code != http.StatusBadRequest {
		t.Errorf("/stats with a bad regex = %d %v, want 400", code, err)
	}
}

func TestReconnectsToTheControlPlane(t *testing.T) {
	t.Parallel()
	cp, p := startLive(t)
	cp.stop()
	cp.mu.Lock()
	before := len(cp.reqs)
	cp.mu.Unlock()
	cp.serve(t)
	// The new stream asks again with the versions it accepted, and no nonce.
	envoytest.Eventually(t, wait, func() error {
		cp.mu.Lock()
		defer cp.mu.Unlock()
		for _, r := range cp.reqs[before:] {
			if r.req != nil && strings.HasSuffix(r.method, adsMethod) && r.req.GetTypeUrl() == resource.ClusterType &&
				r.req.GetVersionInfo() == "1" && r.req.GetResponseNonce() == "" && r.req.GetNode().GetId() == nodeID {
				return nil
			}
		}
		return fmt.Errorf("no new ADS stream resuming version 1 yet")
	})
	waitState(t, p.Admin, "LIVE")
}
