package main

import (
	"fmt"
	"slices"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// sdsRef is one secret a listener or cluster names, and where it comes from: a gRPC target, ADS,
// or the bootstrap's static secrets.
type sdsRef struct {
	name string
	// source is the SDS cluster's gRPC target, sourceADS or sourceStatic.
	source    string
	nodeFirst bool
	delta     bool
}

const (
	sourceADS    = "ads"
	sourceStatic = "static"
)

// secretRefs collects the secrets a TLS context's SDS configs name.
type secretRefs struct {
	boot *bootstrapv3.Bootstrap
	refs map[sdsRef]struct{}
}

func newSecretRefs(b *bootstrapv3.Bootstrap) *secretRefs {
	return &secretRefs{boot: b, refs: map[sdsRef]struct{}{}}
}

func (r *secretRefs) add(sc *tlsv3.SdsSecretConfig) error {
	if sc == nil {
		return nil
	}
	src := sc.GetSdsConfig()
	switch {
	case src == nil:
		if !slices.ContainsFunc(r.boot.GetStaticResources().GetSecrets(), func(s *tlsv3.Secret) bool { return s.GetName() == sc.GetName() }) {
			return fmt.Errorf("unknown static secret: %s", sc.GetName())
		}
		r.refs[sdsRef{name: sc.GetName(), source: sourceStatic}] = struct{}{}
	case src.GetAds() != nil:
		r.refs[sdsRef{name: sc.GetName(), source: sourceADS}] = struct{}{}
	case src.GetApiConfigSource() != nil:
		target, err := apiTarget(r.boot, src.GetApiConfigSource())
		if err != nil {
			return fmt.Errorf("secret %s: %w", sc.GetName(), err)
		}
		api := src.GetApiConfigSource()
		r.refs[sdsRef{name: sc.GetName(), source: target, nodeFirst: api.GetSetNodeOnFirstMessageOnly(), delta: isDelta(api)}] = struct{}{}
	default:
		return fmt.Errorf("secret %s: the stand-in takes SDS over gRPC or ADS only", sc.GetName())
	}
	return nil
}

func (r *secretRefs) common(c *tlsv3.CommonTlsContext) error {
	for _, sc := range c.GetTlsCertificateSdsSecretConfigs() {
		if err := r.add(sc); err != nil {
			return err
		}
	}
	if err := r.add(c.GetValidationContextSdsSecretConfig()); err != nil {
		return err
	}
	return r.add(c.GetCombinedValidationContext().GetValidationContextSdsSecretConfig())
}

func (r *secretRefs) transportSocket(ts *corev3.TransportSocket, downstream bool) error {
	tc := ts.GetTypedConfig()
	if tc == nil {
		return nil
	}
	switch {
	case downstream && tc.MessageIs(&tlsv3.DownstreamTlsContext{}):
		ctx := &tlsv3.DownstreamTlsContext{}
		if err := tc.UnmarshalTo(ctx); err != nil {
			return fmt.Errorf("transport socket: %w", err)
		}
		if err := ctx.ValidateAll(); err != nil {
			return fmt.Errorf("transport socket: %w", err)
		}
		return r.common(ctx.GetCommonTlsContext())
	case !downstream && tc.MessageIs(&tlsv3.UpstreamTlsContext{}):
		ctx := &tlsv3.UpstreamTlsContext{}
		if err := tc.UnmarshalTo(ctx); err != nil {
			return fmt.Errorf("transport socket: %w", err)
		}
		if err := ctx.ValidateAll(); err != nil {
			return fmt.Errorf("transport socket: %w", err)
		}
		return r.common(ctx.GetCommonTlsContext())
	}
	return nil
}

func (r *secretRefs) listener(l *listenerv3.Listener) error {
	chains := slices.Clone(l.GetFilterChains())
	if l.GetDefaultFilterChain() != nil {
		chains = append(chains, l.GetDefaultFilterChain())
	}
	for _, fc := range chains {
		if err := r.transportSocket(fc.GetTransportSocket(), true); err != nil {
			return fmt.Errorf("listener %s: %w", l.GetName(), err)
		}
	}
	return nil
}

func (r *secretRefs) cluster(c *clusterv3.Cluster) error {
	if err := r.transportSocket(c.GetTransportSocket(), false); err != nil {
		return fmt.Errorf("cluster %s: %w", c.GetName(), err)
	}
	for _, m := range c.GetTransportSocketMatches() {
		if err := r.transportSocket(m.GetTransportSocket(), false); err != nil {
			return fmt.Errorf("cluster %s: %w", c.GetName(), err)
		}
	}
	return nil
}

// routeNames are the route configurations a listener's HTTP connection managers ask of ADS.
func routeNames(l *listenerv3.Listener) ([]string, error) {
	var names []string
	chains := slices.Clone(l.GetFilterChains())
	if l.GetDefaultFilterChain() != nil {
		chains = append(chains, l.GetDefaultFilterChain())
	}
	for _, fc := range chains {
		for _, f := range fc.GetFilters() {
			tc := f.GetTypedConfig()
			if tc == nil || !tc.MessageIs(&hcmv3.HttpConnectionManager{}) {
				continue
			}
			hcm := &hcmv3.HttpConnectionManager{}
			if err := unmarshalValid(tc, hcm); err != nil {
				return nil, fmt.Errorf("listener %s: filter %s: %w", l.GetName(), f.GetName(), err)
			}
			if rds := hcm.GetRds(); rds != nil && rds.GetConfigSource().GetAds() != nil {
				names = append(names, rds.GetRouteConfigName())
			}
		}
	}
	return names, nil
}

// edsName is the name under which an EDS cluster's endpoints are asked of ADS ("" when the
// cluster takes none from ADS).
func edsName(c *clusterv3.Cluster) string {
	if c.GetType() != clusterv3.Cluster_EDS || c.GetEdsClusterConfig().GetEdsConfig().GetAds() == nil {
		return ""
	}
	if n := c.GetEdsClusterConfig().GetServiceName(); n != "" {
		return n
	}
	return c.GetName()
}

// validMessage is a message with protoc-gen-validate's checks.
type validMessage interface {
	proto.Message
	ValidateAll() error
}

func unmarshalValid(a *anypb.Any, m validMessage) error {
	if err := a.UnmarshalTo(m); err != nil {
		return err
	}
	return m.ValidateAll()
}
