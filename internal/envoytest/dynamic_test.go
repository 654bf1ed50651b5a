package envoytest_test

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/meshid/meshid/internal/envoytest"
)

func adsSource() *corev3.ConfigSource {
	return &corev3.ConfigSource{ResourceApiVersion: corev3.ApiVersion_V3, ConfigSourceSpecifier: &corev3.ConfigSource_Ads{Ads: &corev3.AggregatedConfigSource{}}}
}

func TestFollowsRoutesEndpointsAndSecretRotation(t *testing.T) {
	t.Parallel()
	cp := newControlPlane(t)
	p := envoytest.Start(t, "-c", envoytest.WriteBootstrap(t, envoytest.NewBootstrap(t, nodeID, cp.ads, cp.sds)))

	res := mesh(t)
	res[resource.ClusterType] = append(res[resource.ClusterType], &clusterv3.Cluster{
		Name:                 "eds",
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_EDS},
		ConnectTimeout:       durationpb.New(time.Second),
		EdsClusterConfig:     &clusterv3.Cluster_EdsClusterConfig{EdsConfig: adsSource(), ServiceName: "eds-service"},
	})
	hcm := &hcmv3.HttpConnectionManager{
		StatPrefix:     "http",
		RouteSpecifier: &hcmv3.HttpConnectionManager_Rds{Rds: &hcmv3.Rds{ConfigSource: adsSource(), RouteConfigName: "routes"}},
		HttpFilters: []*hcmv3.HttpFilter{{
			Name: "envoy.filters.http.router", ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: mustAny(t, &routerv3.Router{})},
		}},
	}
	httpListener := tcpListener(t, "http", corev3.TrafficDirection_OUTBOUND, false, corev3.ApiConfigSource_GRPC)
	httpListener.FilterChains[0].Filters = []*listenerv3.Filter{{
		Name: "envoy.filters.network.http_connection_manager", ConfigType: &listenerv3.Filter_TypedConfig{TypedConfig: mustAny(t, hcm)},
	}}
	res[resource.ListenerType] = append(res[resource.ListenerType], httpListener)
	res[resource.RouteType] = []types.Resource{&routev3.RouteConfiguration{Name: "routes"}}
	res[resource.EndpointType] = []types.Resource{&endpointv3.ClusterLoadAssignment{ClusterName: "eds-service"}}
	cp.set(t, "1", res)
	waitState(t, p.Admin, "LIVE")

	// The routes and endpoints the listeners and clusters name are asked of ADS, by name, and ACKed.
	for typ, name := range map[string]string{resource.RouteType: "routes", resource.EndpointType: "eds-service"} {
		envoytest.Eventually(t, wait, func() error {
			var named []*discoveryv3.DiscoveryRequest
			for _, r := range cp.requests(adsMethod, typ) {
				if slices.Equal(r.GetResourceNames(), []string{name}) {
					named = append(named, r)
				}
			}
			return acked(named, "1")
		})
	}

	// /config_dump shows what was accepted, the private key redacted.
	dump, err := p.Admin.ConfigDump(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, c := range dump.GetConfigs() {
		m, err := c.UnmarshalNew()
		if err != nil {
			t.Fatal(err)
		}
		switch d := m.(type) {
		case *adminv3.ClustersConfigDump:
			for _, dc := range d.GetDynamicActiveClusters() {
				cl := &clusterv3.Cluster{}
				if err := dc.GetCluster().UnmarshalTo(cl); err != nil {
					t.Fatal(err)
				}
				got = append(got, "cluster "+cl.GetName()+" "+dc.GetVersionInfo())
			}
		case *adminv3.ListenersConfigDump:
			for _, dl := range d.GetDynamicListeners() {
				got = append(got, "listener "+dl.GetName()+" "+dl.GetActiveState().GetVersionInfo())
			}
		case *adminv3.RoutesConfigDump:
			got = append(got, fmt.Sprintf("routes %d", len(d.GetDynamicRouteConfigs())))
		case *adminv3.EndpointsConfigDump:
			got = append(got, fmt.Sprintf("endpoints %d", len(d.GetDynamicEndpointConfigs())))
		case *adminv3.SecretsConfigDump:
			for _, ds := range d.GetDynamicActiveSecrets() {
				sec := &tlsv3.Secret{}
				if err := ds.GetSecret().UnmarshalTo(sec); err != nil {
					t.Fatal(err)
				}
				got = append(got, "secret "+ds.GetName()+" "+ds.GetVersionInfo())
				if k := sec.GetTlsCertificate().GetPrivateKey(); k != nil && k.GetInlineString() != "[redacted]" {
					t.Errorf("/config_dump shows the private key of %s: %v", ds.GetName(), k)
				}
			}
		}
	}
	slices.Sort(got)
	want := []string{"cluster backend 1", "cluster eds 1", "endpoints 1", "listener http 1", "listener inbound 1", "listener outbound 1", "routes 1", "secret ROOTCA 1", "secret default 1"}
	if !slices.Equal(got, want) {
		t.Errorf("/config_dump holds %v, want %v", got, want)
	}

	// A rotated certificate is taken and ACKed on its stream.
	res[resource.SecretType] = secrets(t)
	cp.set(t, "2", res)
	waitStat(t, p.Admin, "sds.default.update_success", 2)
	envoytest.Eventually(t, wait, func() error {
		var mine []*discoveryv3.DiscoveryRequest
		for _, r := range cp.requests(sdsMethod, resource.SecretType) {
			if slices.Equal(r.GetResourceNames(), []string{"default"}) {
				mine = append(mine, r)
			}
		}
		return acked(mine, "2")
	})
}

func TestLogPathReopenedOnSIGUSR1(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	logPath := filepath.Join(dir, "envoy.log")
	path := filepath.Join(dir, "envoy.yaml")
	if err := os.WriteFile(path, []byte("admin: {address: {socket_address: {address: 127.0.0.1, port_value: 0}}}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p := envoytest.Start(t, "-c", path, "--log-path", logPath)
	waitState(t, p.Admin, "LIVE")
	// As a log rotator does: move the file away, then ask for a new one.
	if err := os.Rename(logPath, logPath+".1"); err != nil {
		t.Fatal(err)
	}
	p.Signal(t, syscall.SIGUSR1)
	envoytest.Eventually(t, wait, func() error {
		b, err := os.ReadFile(logPath)
		if err != nil {
			return err
		}
		if !strings.Contains(string(b), "reopening logs") {
			return fmt.Errorf("new log file %q", b)
		}
		return nil
	})
	old, err := os.ReadFile(logPath + ".1")
	if err != nil || !strings.Contains(string(old), "admin address") || strings.Contains(string(old), "reopening logs") {
		t.Errorf("the rotated file %q (%v): want the lines before SIGUSR1 only", old, err)
	}
	if p.Stderr() != "" {
		t.Errorf("logged to stderr with --log-path: %q", p.Stderr())
	}
}

func TestIncrementalXDS(t *testing.T) {
	t.Parallel()
	cp := newControlPlane(t)
	boot := envoytest.NewBootstrap(t, nodeID, cp.ads, cp.sds)
	boot.DynamicResources.AdsConfig.ApiType = corev3.ApiConfigSource_DELTA_GRPC
	p := envoytest.Start(t, "-c", envoytest.WriteBootstrap(t, boot))
	res := meshOver(t, corev3.ApiConfigSource_DELTA_GRPC)
	cp.set(t, "1", res)
	waitState(t, p.Admin, "LIVE")

	// The node on each stream's first request only; every response ACKed by its nonce.
	for _, method := range []string{"/DeltaAggregatedResources", "/DeltaSecrets"} {
		envoytest.Eventually(t, wait, func() error {
			reqs := cp.deltas(method)
			for _, r := range reqs {
				if r.GetResponseNonce() != "" && r.GetErrorDetail() == nil {
					return nil
				}
			}
			return fmt.Errorf("%s: no ACK among %v", method, reqs)
		})
	}
	// One ADS stream; one SDS stream per secret. The node on each stream's first request only.
	withNode := map[string]int{}
	for _, method := range []string{"/DeltaAggregatedResources", "/DeltaSecrets"} {
		for _, r := range cp.deltas(method) {
			if r.GetNode() != nil {
				if r.GetNode().GetId() != nodeID {
					t.Errorf("%s: node %v", method, r.GetNode())
				}
				withNode[method]++
			}
		}
	}
	if withNode["/DeltaAggregatedResources"] != 1 || withNode["/DeltaSecrets"] != 2 {
		t.Errorf("requests with the node: %v, want one per stream (1 ADS, 2 SDS)", withNode)
	}

	// A removed listener is closed; a listener that fails its checks is NACKed and the rest kept.
	out := listenerAddr(t, p.Admin, "outbound")
	bad := tcpListener(t, "bad", corev3.TrafficDirection_OUTBOUND, false, corev3.ApiConfigSource_GRPC)
	bad.FilterChains[0].Filters[0].Name = "" // a filter must have a name
	res[resource.ListenerType] = []types.Resource{res[resource.ListenerType][0], bad}
	cp.set(t, "2", res)
	envoytest.Eventually(t, wait, func() error {
		for _, r := range cp.deltas("/DeltaAggregatedResources") {
			if r.GetTypeUrl() == resource.ListenerType && r.GetErrorDetail() != nil {
				return nil
			}
		}
		return fmt.Errorf("no NACK of the listeners yet")
	})
	res[resource.ListenerType] = res[resource.ListenerType][:1]
	cp.set(t, "3", res)
	envoytest.Eventually(t, wait, func() error {
		ls, err := p.Admin.Listeners(ctx(t))
		if err != nil {
			return err
		}
		if n := len(ls.GetListenerStatuses()); n != 1 || ls.GetListenerStatuses()[0].GetName() != "inbound" {
			return fmt.Errorf("listeners %v, want inbound only", ls)
		}
		return nil
	})
	if c, err := net.Dial("tcp", out); err == nil {
		_ = c.Close()
		t.Errorf("the removed outbound listener still accepts")
	}
	waitStat(t, p.Admin, "listener_manager.lds.update_success", 2)
}

func TestPreInitializingUntilTheControlPlaneAnswers(t *testing.T) {
	t.Parallel()
	cp := newControlPlane(t)
	cp.set(t, "1", mesh(t))
	cp.stop() // nothing listens on its sockets until serve
	p := envoytest.Start(t, "-c", envoytest.WriteBootstrap(t, envoytest.NewBootstrap(t, nodeID, cp.ads, cp.sds)))
	envoytest.Eventually(t, wait, func() error {
		if !strings.Contains(p.Stderr(), "config stream closed") {
			return fmt.Errorf("no failed stream logged yet")
		}
		return nil
	})
	if state, ok, err := p.Admin.Ready(ctx(t)); err != nil || ok || state != "PRE_INITIALIZING" {
		t.Errorf("/ready with no control plane = %s %v %v, want 503 PRE_INITIALIZING", state, ok, err)
	}
	cp.serve(t)
	waitState(t, p.Admin, "LIVE")
}

func TestHealthcheckFailAndOK(t *testing.T) {
	t.Parallel()
	_, p := startLive(t)
	for _, step := range []struct{ path, state string }{
		{"/healthcheck/fail", "DRAINING"},
		{"/healthcheck/ok", "LIVE"},
	} {
		if code, _, err := p.Admin.Post(ctx(t), step.path); err != nil || code != 200 {
			t.Fatalf("POST %s = %d %v", step.path, code, err)
		}
		if state, _, err := p.Admin.Ready(ctx(t)); err != nil || state != step.state {
			t.Errorf("/ready after %s = %s %v, want %s", step.path, state, err, step.state)
		}
	}
	if code, _, err := p.Admin.Do(ctx(t), "GET", "/healthcheck/fail"); err != nil || code != 405 {
		t.Errorf("GET /healthcheck/fail = %d %v, want 405", code, err)
	}
}
