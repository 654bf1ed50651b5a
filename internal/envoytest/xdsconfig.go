package envoytest

// InboundMTLSConfig is a discovery configuration (meshid ca --xds-config, or the embedded
// control plane's xds.yaml) for a workload's Envoy: an inbound mTLS listener on a loopback port of
// the kernel's choosing, its certificate (default) and roots (ROOTCA) over SDS on the
// bootstrap's sds-grpc cluster, so that Envoy is LIVE only once both are in.
const InboundMTLSConfig = `
listeners:
- name: inbound
  address: {socket_address: {address: 127.0.0.1, port_value: 0}}
  traffic_direction: INBOUND
  filter_chains:
  - transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
        require_client_certificate: true
        common_tls_context:
          tls_certificate_sds_secret_configs:
          - name: default
            sds_config: &sds
              resource_api_version: V3
              api_config_source: {api_type: GRPC, transport_api_version: V3, grpc_services: [{envoy_grpc: {cluster_name: sds-grpc}}]}
          validation_context_sds_secret_config: {name: ROOTCA, sds_config: *sds}
    filters:
    - name: envoy.filters.network.http_connection_manager
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
        stat_prefix: inbound
        route_config: {name: local, virtual_hosts: [{name: all, domains: ["*"], routes: [{match: {prefix: /}, route: {cluster: app}}]}]}
        http_filters:
        - name: envoy.filters.http.router
          typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
clusters:
- {name: app, connect_timeout: 1s, type: STATIC, load_assignment: {cluster_name: app, endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8080}}}}]}]}}
`
