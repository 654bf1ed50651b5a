package main

import (
	"net/http"
	"sort"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// handleConfigDump is the admin's /config_dump: the bootstrap, the clusters, listeners and routes
// accepted (endpoints too with include_eds), and the secrets with their private keys redacted,
// as Envoy prints them.
func (s *server) handleConfigDump(w http.ResponseWriter, r *http.Request) {
	dump, err := s.configDump(r.URL.Query().Has("include_eds"))
	if err != nil {
		text(w, http.StatusInternalServerError, err.Error()+"\n")
		return
	}
	jsonBody(w, dump)
}

func (s *server) configDump(includeEDS bool) (*adminv3.ConfigDump, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	pack := func(m proto.Message) *anypb.Any {
		a, err := anypb.New(m)
		if err != nil {
			errs = append(errs, err)
		}
		return a
	}

	clusters := &adminv3.ClustersConfigDump{VersionInfo: s.versions[typeCluster]}
	for _, c := range s.boot.GetStaticResources().GetClusters() {
		clusters.StaticClusters = append(clusters.StaticClusters, &adminv3.ClustersConfigDump_StaticCluster{Cluster: pack(c)})
	}
	for _, name := range sortedKeys(s.clusters) {
		clusters.DynamicActiveClusters = append(clusters.DynamicActiveClusters, &adminv3.ClustersConfigDump_DynamicCluster{
			VersionInfo: s.versions[typeCluster], Cluster: pack(s.clusters[name]), ClientStatus: adminv3.ClientResourceStatus_ACKED,
		})
	}
	listeners := &adminv3.ListenersConfigDump{VersionInfo: s.versions[typeListener]}
	for _, name := range sortedKeys(s.listenerCfg) {
		listeners.DynamicListeners = append(listeners.DynamicListeners, &adminv3.ListenersConfigDump_DynamicListener{
			Name:         name,
			ActiveState:  &adminv3.ListenersConfigDump_DynamicListenerState{VersionInfo: s.versions[typeListener], Listener: pack(s.listenerCfg[name])},
			ClientStatus: adminv3.ClientResourceStatus_ACKED,
		})
	}
	routes := &adminv3.RoutesConfigDump{}
	for _, name := range sortedKeys(s.routes) {
		routes.DynamicRouteConfigs = append(routes.DynamicRouteConfigs, &adminv3.RoutesConfigDump_DynamicRouteConfig{
			VersionInfo: s.versions[typeRoute], RouteConfig: pack(s.routes[name]), ClientStatus: adminv3.ClientResourceStatus_ACKED,
		})
	}
	secrets := &adminv3.SecretsConfigDump{}
	refs := make([]sdsRef, 0, len(s.secrets))
	for r := range s.secrets {
		refs = append(refs, r)
	}
	sort.Slice(refs, func(i, j int) bool { return refs[i].name < refs[j].name })
	for _, r := range refs {
		secrets.DynamicActiveSecrets = append(secrets.DynamicActiveSecrets, &adminv3.SecretsConfigDump_DynamicSecret{
			Name: r.name, VersionInfo: s.secretVersions[r], Secret: pack(redacted(s.secrets[r])),
		})
	}

	dump := &adminv3.ConfigDump{Configs: []*anypb.Any{
		pack(&adminv3.BootstrapConfigDump{Bootstrap: s.boot}),
		pack(clusters), pack(listeners), pack(routes), pack(secrets),
	}}
	if includeEDS {
		endpoints := &adminv3.EndpointsConfigDump{}
		for _, name := range sortedKeys(s.endpoints) {
			endpoints.DynamicEndpointConfigs = append(endpoints.DynamicEndpointConfigs, &adminv3.EndpointsConfigDump_DynamicEndpointConfig{
				VersionInfo: s.versions[typeEndpoint], EndpointConfig: pack(s.endpoints[name]), ClientStatus: adminv3.ClientResourceStatus_ACKED,
			})
		}
		dump.Configs = append(dump.Configs, pack(endpoints))
	}
	if len(errs) > 0 {
		return nil, errs[0]
	}
	return dump, nil
}

// redacted is a secret without its private key, as Envoy's admin never prints one.
func redacted(sec *tlsv3.Secret) *tlsv3.Secret {
	out := proto.Clone(sec).(*tlsv3.Secret)
	if c := out.GetTlsCertificate(); c != nil {
		if c.GetPrivateKey() != nil {
			c.PrivateKey = &corev3.DataSource{Specifier: &corev3.DataSource_InlineString{InlineString: "[redacted]"}}
		}
		if c.GetPassword() != nil {
			c.Password = &corev3.DataSource{Specifier: &corev3.DataSource_InlineString{InlineString: "[redacted]"}}
		}
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
