package xdsproxy

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/logkey"
)

// Bounds of what clients on the socket can make the proxy hold. Envoy opens one ADS stream (two
// for a moment across a hot restart), and each stream costs about 41 kB here and one
// authenticated stream upstream (BenchmarkStreamMemory). With the proxy's own debug stream the
// default stays under the discovery server's cap of streams per credential (100), which the
// agent's upstream streams share.
const (
	DefaultMaxStreams              = 64
	DefaultMaxStreamsPerConnection = 10

	// maxRequestSize bounds one request from Envoy: a node and the names it subscribes to (an
	// EDS request of a gateway with 5,000 clusters is about 400 kB). Responses come from the
	// upstream, bounded there.
	maxRequestSize = 1 << 20
)

// The protocols of Envoy's streams, as logged and counted.
const (
	protocolSotW  = "sotw"
	protocolDelta = "delta"
	protocolDebug = "debug"
)

// Why the proxy refuses, as counted in meshid_xds_proxy_refusals_total.
const (
	reasonTooManyStreams     = "too_many_streams"
	reasonTooManyConnections = "too_many_connections"
	reasonUnknownDebugType   = "unknown_debug_type"
	reasonBadDebugRequest    = "bad_debug_request"
	// codeClosed counts a connection closed before it carried any stream.
	codeClosed = "closed"
)

// grpcOptions are the proxy's transport bounds and its admission of connections.
func (p *Proxy) grpcOptions() []grpc.ServerOption {
	return admission.LocalServerOptions(p.gate, p.cfg.MaxStreamsPerConnection, maxRequestSize, func(who string, _ error) {
		p.refuse(who, "", reasonTooManyConnections, codeClosed, nil)
	})
}

// admit lets one of Envoy's streams in while fewer than MaxStreams are open; the handler releases
// it. Each stream admitted opens one upstream, so this also bounds what the proxy asks of the
// discovery server.
func (p *Proxy) admit(ctx context.Context, protocol string) error {
	if err := p.gate.Admit(""); err != nil {
		st := status.Newf(codes.ResourceExhausted, "the xDS proxy has %d streams open, its limit", p.cfg.MaxStreams)
		p.refuse(admission.Peer(ctx), protocol, reasonTooManyStreams, st.Code().String(), st.Err())
		return st.Err()
	}
	return nil
}

// refuse counts a refusal and logs it with who asked and why, unless too many of its reason came
// too fast (the next line logged says how many were left out).
func (p *Proxy) refuse(peer, protocol, reason, code string, err error) {
	p.metrics.refusals.WithLabelValues(reason, code).Inc()
	ok, dropped := p.logs.Allow(reason)
	if !ok {
		return
	}
	msg := "xDS proxy request refused"
	attrs := []any{logkey.Peer, peer, logkey.Reason, reason, logkey.Code, code}
	if protocol != "" {
		attrs = append(attrs, logkey.Protocol, protocol)
	}
	if reason == reasonTooManyConnections {
		msg = "xDS proxy connection refused"
	}
	if err != nil {
		attrs = append(attrs, logkey.Error, logkey.Untrusted(status.Convert(err).Message()))
	}
	if dropped > 0 {
		attrs = append(attrs, logkey.Dropped, dropped)
	}
	p.log.Warn(msg, attrs...)
}
