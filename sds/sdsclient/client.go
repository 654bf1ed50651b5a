// Package sdsclient is an SDS client as Envoy speaks it: StreamSecrets, DeltaSecrets and
// FetchSecrets on a Unix socket, the node on a stream's first request only (Istio's Envoy sets
// set_node_on_first_message_only for SDS), and ACKs and NACKs that answer each response's nonce.
// Every call returns its error; Follow keeps a subscription across a server's restarts.
//
// It serves `meshid certs` (Get, Inspect), the Envoy-like loops of the end-to-end, chaos, interop
// and benchmark tests, and sds/sdstest, a testing.TB wrapper over it. It is built on the
// generated stubs alone and imports nothing of the server package sds, which serves only, so
// that a test of the server checks it against an independent reading of the protocol.
package sdsclient

import (
	"context"
	"errors"
	"fmt"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	secretservice "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// TypeURL is Envoy's type of an SDS resource, spelled out so that the client does not depend on
// the server's own constant.
const TypeURL = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"

// The resource names of the workload's key pair and of its trust bundle, as Istio's Envoy asks
// for them.
const (
	WorkloadCertName = "default"
	RootCertName     = "ROOTCA"
)

// ErrProtocol marks a response that is not SDS as Envoy reads it: another type, no nonce, a
// resource that is not a secret, a secret twice in one response. It is the server's fault, not
// the connection's; Follow does not open another stream after it.
var ErrProtocol = errors.New("not an SDS response Envoy would accept")

func protocolErrorf(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrProtocol}, args...)...)
}

// Client is one connection to an SDS server.
type Client struct {
	conn *grpc.ClientConn // nil when New was given a connection the caller closes
	stub secretservice.SecretDiscoveryServiceClient
	// Node is sent on each stream's first request and with each Fetch; nil sends none.
	Node *core.Node
}

// Option configures Dial and New.
type Option func(*options)

type options struct {
	node *core.Node
	dial []grpc.DialOption
}

// WithNode makes the client send node, as Envoy sends its own.
func WithNode(node *core.Node) Option { return func(o *options) { o.node = node } }

// WithDialOptions adds to what Dial connects with (insecure credentials over a Unix socket), for
// example a faster reconnection backoff or WaitForReady on every call. New ignores them.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.dial = append(o.dial, opts...) }
}

func apply(opts []Option) options {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// Dial makes a client of the SDS server on the Unix socket at socketPath. It connects on the
// first call, as grpc.NewClient does; Close closes the connection.
func Dial(socketPath string, opts ...Option) (*Client, error) {
	o := apply(opts)
	dial := append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, o.dial...)
	conn, err := grpc.NewClient("unix://"+socketPath, dial...)
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn, stub: secretservice.NewSecretDiscoveryServiceClient(conn), Node: o.node}, nil
}

// New makes a client on a connection the caller made and closes.
func New(cc grpc.ClientConnInterface, opts ...Option) *Client {
	return &Client{stub: secretservice.NewSecretDiscoveryServiceClient(cc), Node: apply(opts).node}
}

// Close closes the connection Dial made, ending its streams; it does nothing for a client of New.
// Calling it again is harmless.
func (c *Client) Close() error {
	if c.conn == nil {
		return nil
	}
	err := c.conn.Close()
	if status.Code(err) == codes.Canceled { // already closed
		return nil
	}
	return err
}

// Stub is the generated client, for a request this package does not make.
func (c *Client) Stub() secretservice.SecretDiscoveryServiceClient { return c.stub }

// StreamSecrets opens a state-of-the-world stream that lives as long as ctx; nothing is sent yet.
func (c *Client) StreamSecrets(ctx context.Context, opts ...grpc.CallOption) (*Stream, error) {
	raw, err := c.stub.StreamSecrets(ctx, opts...)
	return opened(&Stream{requests: requests{node: c.Node}, Raw: raw}, err)
}

// DeltaSecrets opens a delta stream that lives as long as ctx; nothing is sent yet.
func (c *Client) DeltaSecrets(ctx context.Context, opts ...grpc.CallOption) (*DeltaStream, error) {
	raw, err := c.stub.DeltaSecrets(ctx, opts...)
	return opened(&DeltaStream{requests: requests{node: c.Node}, Raw: raw}, err)
}

// opened returns the stream made of a call that opened it, or the call's error.
func opened[S any](s *S, err error) (*S, error) {
	if err != nil {
		return nil, err
	}
	return s, nil
}

// Fetch asks for names with FetchSecrets and returns the secrets received, or the call's error
// as gRPC returned it (its status intact). It does not check that every name came.
func (c *Client) Fetch(ctx context.Context, names ...string) (map[string]*tlsv3.Secret, error) {
	resp, err := c.stub.FetchSecrets(ctx, &discovery.DiscoveryRequest{Node: c.Node, ResourceNames: names, TypeUrl: TypeURL})
	if err != nil {
		return nil, err
	}
	return Parse(nil, resp.GetResources())
}

// Get asks the SDS server on the Unix socket at socketPath for names and returns each secret.
// It asks with FetchSecrets, which a server that holds nothing valid answers at once with the
// reason; a server without FetchSecrets (Istio's agent) is asked over StreamSecrets, as Envoy
// does, until every name has arrived or ctx ends.
func Get(ctx context.Context, socketPath, nodeID string, names ...string) (map[string]*tlsv3.Secret, error) {
	c, err := Dial(socketPath, WithNode(&core.Node{Id: nodeID}))
	if err != nil {
		return nil, fmt.Errorf("SDS socket %s: %w", socketPath, err)
	}
	defer func() { _ = c.Close() }()
	got, err := c.Fetch(ctx, names...)
	switch {
	case status.Code(err) == codes.Unimplemented:
		return c.streamGet(ctx, names)
	case err != nil:
		return nil, fmt.Errorf("SDS at %s: %w", socketPath, err)
	}
	for _, n := range names {
		if got[n] == nil {
			return nil, fmt.Errorf("SDS at %s did not send %q", socketPath, n)
		}
	}
	return only(got, names), nil
}

// streamGet subscribes to names on a stream of its own and acknowledges every response, so that
// the rest is sent, until each name has come.
func (c *Client) streamGet(ctx context.Context, names []string) (map[string]*tlsv3.Secret, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := c.StreamSecrets(ctx)
	if err != nil {
		return nil, err
	}
	if err := st.Subscribe(names...); err != nil {
		return nil, err
	}
	got, err := st.Collect(names...)
	if err != nil {
		return nil, err
	}
	return only(got, names), nil
}

// only keeps the secrets named.
func only(got map[string]*tlsv3.Secret, names []string) map[string]*tlsv3.Secret {
	out := make(map[string]*tlsv3.Secret, len(names))
	for _, n := range names {
		if s, ok := got[n]; ok {
			out[n] = s
		}
	}
	return out
}

// hasAll says whether got holds every name.
func hasAll(got map[string]*tlsv3.Secret, names []string) bool {
	for _, n := range names {
		if _, ok := got[n]; !ok {
			return false
		}
	}
	return true
}
