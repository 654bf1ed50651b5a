// Package sdstest is the Envoy-like SDS client of tests: sds/sdsclient behind a testing.TB, each
// method calling the client and failing the test on its error. It opens StreamSecrets,
// DeltaSecrets and FetchSecrets on a Unix socket, sends the node on a stream's first request
// only, and ACKs and NACKs as Envoy does, with every nonce and version in the test's hands. Like
// sdsclient it is independent of the server it tests.
package sdstest

import (
	"context"
	"crypto"
	"crypto/x509"
	"errors"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	secretservice "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/sds/sdsclient"
)

// TypeURL is Envoy's type of an SDS resource.
const TypeURL = sdsclient.TypeURL

// NodeID is the node a sidecar's Envoy sends.
const NodeID = "sidecar~10.0.0.1~cart-1.shop~shop.svc.cluster.local"

// WaitLimit bounds every stream and call: a response that never comes fails the test when it
// passes. No test waits on it to pass.
const WaitLimit = 30 * time.Second

// Push is one response as Envoy sees it.
type Push = sdsclient.Response

// Envoy is one client connection to an SDS socket.
type Envoy struct {
	t      testing.TB
	client *sdsclient.Client
	Client secretservice.SecretDiscoveryServiceClient
	// Node is sent on each stream's first request; nil sends none.
	Node *core.Node
}

// Dial connects to the SDS server on the Unix socket at path; the connection closes with the test.
func Dial(t testing.TB, socket string) *Envoy {
	t.Helper()
	c, err := sdsclient.Dial(socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return &Envoy{t: t, client: c, Client: c.Stub(), Node: &core.Node{Id: NodeID, Cluster: "cart.shop"}}
}

// Close closes the connection now, ending its streams, rather than when the test ends; calling it
// again is harmless.
func (e *Envoy) Close() {
	_ = e.client.Close()
}

// core is the client with the node the test set last: a copy, so that streams opened from
// several goroutines at once share no write.
func (e *Envoy) core() *sdsclient.Client {
	c := *e.client
	c.Node = e.Node
	return &c
}

func (e *Envoy) streamContext() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), WaitLimit)
	e.t.Cleanup(cancel)
	return ctx
}

// Stream is a StreamSecrets (state of the world) stream.
type Stream struct {
	t      testing.TB
	s      *sdsclient.Stream
	Stream secretservice.SecretDiscoveryService_StreamSecretsClient
}

// StreamSecrets opens a state-of-the-world stream; nothing is sent yet.
func (e *Envoy) StreamSecrets() *Stream {
	e.t.Helper()
	st, err := e.core().StreamSecrets(e.streamContext())
	if err != nil {
		e.t.Fatal(err)
	}
	return &Stream{t: e.t, s: st, Stream: st.Raw}
}

// Send sends req, filling in the type.
func (s *Stream) Send(req *discovery.DiscoveryRequest) {
	s.t.Helper()
	check(s.t, "Send", s.s.Send(req))
}

// Subscribe sends the stream's first request: the node, and the names.
func (s *Stream) Subscribe(names ...string) {
	s.t.Helper()
	check(s.t, "Send", s.s.Subscribe(names...))
}

// Ack accepts p and (re)states the names, without the node, as Envoy does.
func (s *Stream) Ack(p Push, names ...string) {
	s.t.Helper()
	check(s.t, "Send", s.s.Ack(p, names...))
}

// Nack rejects p, naming the last version accepted and why.
func (s *Stream) Nack(p Push, accepted, detail string, names ...string) {
	s.t.Helper()
	check(s.t, "Send", s.s.Nack(p, accepted, detail, names...))
}

// Recv returns the next response. Call it from the test's goroutine.
func (s *Stream) Recv() Push {
	s.t.Helper()
	p, err := s.s.Recv()
	check(s.t, "StreamSecrets Recv", err)
	return p
}

// RecvAll receives responses, acknowledging each, until every name has come; it returns the last
// response (not acknowledged) and the latest secret of each name.
func (s *Stream) RecvAll(names ...string) (last Push, got map[string]*tlsv3.Secret) {
	s.t.Helper()
	last, got, err := s.s.RecvAll(names...)
	check(s.t, "StreamSecrets", err)
	return last, got
}

// Collect is RecvAll that acknowledges the last response too.
func (s *Stream) Collect(names ...string) map[string]*tlsv3.Secret {
	s.t.Helper()
	got, err := s.s.Collect(names...)
	check(s.t, "StreamSecrets", err)
	return got
}

// CloseSend ends the client's side of the stream, as Envoy does when it lets a stream go.
func (s *Stream) CloseSend() {
	s.t.Helper()
	check(s.t, "CloseSend", s.s.CloseSend())
}

// RecvErr waits for the stream to end and returns its status.
func (s *Stream) RecvErr() *status.Status {
	s.t.Helper()
	st, err := s.s.RecvErr()
	check(s.t, "StreamSecrets", err)
	return st
}

// DeltaStream is a DeltaSecrets stream.
type DeltaStream struct {
	t      testing.TB
	d      *sdsclient.DeltaStream
	Stream secretservice.SecretDiscoveryService_DeltaSecretsClient
}

// DeltaSecrets opens a delta stream; nothing is sent yet.
func (e *Envoy) DeltaSecrets() *DeltaStream {
	e.t.Helper()
	d, err := e.core().DeltaSecrets(e.streamContext())
	if err != nil {
		e.t.Fatal(err)
	}
	return &DeltaStream{t: e.t, d: d, Stream: d.Raw}
}

// Send sends req, filling in the type.
func (d *DeltaStream) Send(req *discovery.DeltaDiscoveryRequest) {
	d.t.Helper()
	check(d.t, "Send", d.d.Send(req))
}

// Subscribe sends the stream's first request: the node, and the names.
func (d *DeltaStream) Subscribe(names ...string) {
	d.t.Helper()
	check(d.t, "Send", d.d.Subscribe(names...))
}

// Ack accepts p, without the node (Istio's Envoy sets set_node_on_first_message_only for SDS).
func (d *DeltaStream) Ack(p Push) {
	d.t.Helper()
	check(d.t, "Send", d.d.Ack(p))
}

// Nack rejects p with a reason, without the node.
func (d *DeltaStream) Nack(p Push, detail string) {
	d.t.Helper()
	check(d.t, "Send", d.d.Nack(p, detail))
}

// Update changes the subscription, answering p (Envoy sends the latest nonce with it).
func (d *DeltaStream) Update(p Push, subscribe, unsubscribe []string) {
	d.t.Helper()
	check(d.t, "Send", d.d.Update(p, subscribe, unsubscribe))
}

// CloseSend ends the client's side of the stream.
func (d *DeltaStream) CloseSend() {
	d.t.Helper()
	check(d.t, "CloseSend", d.d.CloseSend())
}

// Recv returns the next response. Call it from the test's goroutine.
func (d *DeltaStream) Recv() Push {
	d.t.Helper()
	p, err := d.d.Recv()
	check(d.t, "DeltaSecrets Recv", err)
	return p
}

// RecvAll receives responses, acknowledging each, until every name has come; the last one is not
// acknowledged. It returns the latest version and secret of each name.
func (d *DeltaStream) RecvAll(names ...string) (last Push, versions map[string]string, got map[string]*tlsv3.Secret) {
	d.t.Helper()
	last, versions, got, err := d.d.RecvAll(names...)
	check(d.t, "DeltaSecrets", err)
	return last, versions, got
}

// RecvErr waits for the stream to end and returns its status.
func (d *DeltaStream) RecvErr() *status.Status {
	d.t.Helper()
	st, err := d.d.RecvErr()
	check(d.t, "DeltaSecrets", err)
	return st
}

// Fetch asks for names with FetchSecrets and returns the secrets, or the call's error; a response
// Envoy would reject fails the test.
func (e *Envoy) Fetch(ctx context.Context, names ...string) (map[string]*tlsv3.Secret, error) {
	got, err := e.core().Fetch(ctx, names...)
	if errors.Is(err, sdsclient.ErrProtocol) {
		e.t.Fatal(err)
	}
	return got, err
}

// Decode reads the secrets of a response: delta resources, or SotW ones (anys). A secret twice in
// one response fails the test. Call it from the test's goroutine; other goroutines call Parse.
func Decode(t testing.TB, resources []*discovery.Resource, anys []*anypb.Any) map[string]*tlsv3.Secret {
	t.Helper()
	out, err := Parse(resources, anys)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// Parse is Decode that returns what is wrong instead of failing the test, for goroutines other
// than the test's.
func Parse(resources []*discovery.Resource, anys []*anypb.Any) (map[string]*tlsv3.Secret, error) {
	return sdsclient.Parse(resources, anys)
}

// KeyPair returns the chain and key of a tls_certificate secret, failing the test unless the key
// matches the leaf.
func KeyPair(t testing.TB, s *tlsv3.Secret) ([]*x509.Certificate, crypto.Signer) {
	t.Helper()
	chain, key, err := sdsclient.KeyPair(s)
	if err != nil {
		t.Fatal(err)
	}
	return chain, key
}

// Roots returns the trusted roots of a validation_context secret.
func Roots(t testing.TB, s *tlsv3.Secret) []*x509.Certificate {
	t.Helper()
	roots, err := sdsclient.Roots(s)
	if err != nil {
		t.Fatal(err)
	}
	return roots
}

// check fails the test when err is not nil, saying what failed.
func check(t testing.TB, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}
