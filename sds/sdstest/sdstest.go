// Package sdstest is an Envoy-like SDS client for tests: it opens StreamSecrets, DeltaSecrets and
// FetchSecrets on a Unix socket, sends the node on a stream's first request only, and ACKs and
// NACKs as Envoy does, with every nonce and version in the test's hands. It is built on the
// generated stubs alone, independently of the server it tests.
package sdstest

import (
	"context"
	"crypto"
	"crypto/x509"
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	secretservice "github.com/envoyproxy/go-control-plane/envoy/service/secret/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/internal/pki"
)

// TypeURL is Envoy's type of an SDS resource, spelled out so that the client does not depend on
// the server's own constant.
const TypeURL = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"

// NodeID is the node a sidecar's Envoy sends.
const NodeID = "sidecar~10.0.0.1~cart-1.shop~shop.svc.cluster.local"

// WaitLimit bounds every stream and call: a response that never comes fails the test when it
// passes. No test waits on it to pass.
const WaitLimit = 30 * time.Second

// Envoy is one client connection to an SDS socket.
type Envoy struct {
	t      testing.TB
	conn   *grpc.ClientConn
	Client secretservice.SecretDiscoveryServiceClient
	// Node is sent on each stream's first request; nil sends none.
	Node *core.Node
}

// Dial connects to the SDS server on the Unix socket at path; the connection closes with the test.
func Dial(t testing.TB, socket string) *Envoy {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return &Envoy{t: t, conn: conn, Client: secretservice.NewSecretDiscoveryServiceClient(conn), Node: &core.Node{Id: NodeID, Cluster: "cart.shop"}}
}

// Close closes the connection now, ending its streams, rather than when the test ends; calling it
// again is harmless.
func (e *Envoy) Close() {
	_ = e.conn.Close()
}

// Push is one response as Envoy sees it.
type Push struct {
	Version string // version_info (SotW) or system_version_info (delta)
	Nonce   string
	Secrets map[string]*tlsv3.Secret
	// Versions are the per-resource versions (delta only).
	Versions map[string]string
}

// Names returns the names of the secrets pushed, sorted.
func (p Push) Names() []string { return slices.Sorted(maps.Keys(p.Secrets)) }

func (e *Envoy) streamContext() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), WaitLimit)
	e.t.Cleanup(cancel)
	return ctx
}

// Stream is a StreamSecrets (state of the world) stream.
type Stream struct {
	t      testing.TB
	node   *core.Node
	Stream secretservice.SecretDiscoveryService_StreamSecretsClient
}

// StreamSecrets opens a state-of-the-world stream; nothing is sent yet.
func (e *Envoy) StreamSecrets() *Stream {
	e.t.Helper()
	st, err := e.Client.StreamSecrets(e.streamContext())
	if err != nil {
		e.t.Fatal(err)
	}
	return &Stream{t: e.t, node: e.Node, Stream: st}
}

// Send sends req, filling in the type.
func (s *Stream) Send(req *discovery.DiscoveryRequest) {
	s.t.Helper()
	if req.TypeUrl == "" {
		req.TypeUrl = TypeURL
	}
	if err := s.Stream.Send(req); err != nil {
		s.t.Fatalf("Send: %v", err)
	}
}

// Subscribe sends the stream's first request: the node, and the names.
func (s *Stream) Subscribe(names ...string) {
	s.t.Helper()
	s.Send(&discovery.DiscoveryRequest{Node: s.node, ResourceNames: names})
}

// Ack accepts p and (re)states the names, without the node, as Envoy does.
func (s *Stream) Ack(p Push, names ...string) {
	s.t.Helper()
	s.Send(&discovery.DiscoveryRequest{VersionInfo: p.Version, ResponseNonce: p.Nonce, ResourceNames: names})
}

// Nack rejects p, naming the last version accepted and why.
func (s *Stream) Nack(p Push, accepted, detail string, names ...string) {
	s.t.Helper()
	s.Send(&discovery.DiscoveryRequest{
		VersionInfo: accepted, ResponseNonce: p.Nonce, ResourceNames: names,
		ErrorDetail: &rpcstatus.Status{Code: int32(codes.InvalidArgument), Message: detail},
	})
}

// Recv returns the next response. Call it from the test's goroutine.
func (s *Stream) Recv() Push {
	s.t.Helper()
	resp, err := s.Stream.Recv()
	if err != nil {
		s.t.Fatalf("StreamSecrets Recv: %v", err)
	}
	if resp.GetTypeUrl() != TypeURL {
		s.t.Fatalf("response of type %s", resp.GetTypeUrl())
	}
	if resp.GetNonce() == "" {
		s.t.Fatal("response without a nonce")
	}
	return Push{Version: resp.GetVersionInfo(), Nonce: resp.GetNonce(), Secrets: Decode(s.t, nil, resp.GetResources())}
}

// RecvAll receives responses, acknowledging each, until every name has come; it returns the last
// response (not acknowledged) and the latest secret of each name.
func (s *Stream) RecvAll(names ...string) (last Push, got map[string]*tlsv3.Secret) {
	s.t.Helper()
	got = map[string]*tlsv3.Secret{}
	for {
		last = s.Recv()
		maps.Copy(got, last.Secrets)
		if len(got) >= len(names) {
			return last, got
		}
		s.Ack(last, names...)
	}
}

// Collect is RecvAll that acknowledges the last response too.
func (s *Stream) Collect(names ...string) map[string]*tlsv3.Secret {
	s.t.Helper()
	last, got := s.RecvAll(names...)
	s.Ack(last, names...)
	return got
}

// CloseSend ends the client's side of the stream, as Envoy does when it lets a stream go.
func (s *Stream) CloseSend() {
	s.t.Helper()
	if err := s.Stream.CloseSend(); err != nil {
		s.t.Fatalf("CloseSend: %v", err)
	}
}

// RecvErr waits for the stream to end and returns its status.
func (s *Stream) RecvErr() *status.Status {
	s.t.Helper()
	resp, err := s.Stream.Recv()
	if err == nil {
		s.t.Fatalf("got a response (%d resources), want the stream to end", len(resp.GetResources()))
	}
	return status.Convert(err)
}

// DeltaStream is a DeltaSecrets stream.
type DeltaStream struct {
	t      testing.TB
	node   *core.Node
	Stream secretservice.SecretDiscoveryService_DeltaSecretsClient
}

// DeltaSecrets opens a delta stream; nothing is sent yet.
func (e *Envoy) DeltaSecrets() *DeltaStream {
	e.t.Helper()
	st, err := e.Client.DeltaSecrets(e.streamContext())
	if err != nil {
		e.t.Fatal(err)
	}
	return &DeltaStream{t: e.t, node: e.Node, Stream: st}
}

// Send sends req, filling in the type.
func (d *DeltaStream) Send(req *discovery.DeltaDiscoveryRequest) {
	d.t.Helper()
	if req.TypeUrl == "" {
		req.TypeUrl = TypeURL
	}
	if err := d.Stream.Send(req); err != nil {
		d.t.Fatalf("Send: %v", err)
	}
}

// Subscribe sends the stream's first request: the node, and the names.
func (d *DeltaStream) Subscribe(names ...string) {
	d.t.Helper()
	d.Send(&discovery.DeltaDiscoveryRequest{Node: d.node, ResourceNamesSubscribe: names})
}

// Ack accepts p, without the node (Istio's Envoy sets set_node_on_first_message_only for SDS).
func (d *DeltaStream) Ack(p Push) {
	d.t.Helper()
	d.Send(&discovery.DeltaDiscoveryRequest{ResponseNonce: p.Nonce})
}

// Nack rejects p with a reason, without the node.
func (d *DeltaStream) Nack(p Push, detail string) {
	d.t.Helper()
	d.Send(&discovery.DeltaDiscoveryRequest{ResponseNonce: p.Nonce, ErrorDetail: status.New(codes.InvalidArgument, detail).Proto()})
}

// Update changes the subscription, answering p (Envoy sends the latest nonce with it).
func (d *DeltaStream) Update(p Push, subscribe, unsubscribe []string) {
	d.t.Helper()
	d.Send(&discovery.DeltaDiscoveryRequest{ResponseNonce: p.Nonce, ResourceNamesSubscribe: subscribe, ResourceNamesUnsubscribe: unsubscribe})
}

// CloseSend ends the client's side of the stream.
func (d *DeltaStream) CloseSend() {
	d.t.Helper()
	if err := d.Stream.CloseSend(); err != nil {
		d.t.Fatalf("CloseSend: %v", err)
	}
}

// Recv returns the next response. Call it from the test's goroutine.
func (d *DeltaStream) Recv() Push {
	d.t.Helper()
	resp, err := d.Stream.Recv()
	if err != nil {
		d.t.Fatalf("DeltaSecrets Recv: %v", err)
	}
	if resp.GetTypeUrl() != TypeURL {
		d.t.Fatalf("response of type %s", resp.GetTypeUrl())
	}
	p := Push{Version: resp.GetSystemVersionInfo(), Nonce: resp.GetNonce(), Secrets: Decode(d.t, resp.GetResources(), nil), Versions: map[string]string{}}
	for _, r := range resp.GetResources() {
		if r.GetName() == "" || r.GetVersion() == "" {
			d.t.Fatalf("delta resource without a name or version: %v", r)
		}
		if got := p.Secrets[r.GetName()]; got == nil {
			d.t.Fatalf("delta resource %q holds a secret of another name", r.GetName())
		}
		p.Versions[r.GetName()] = r.GetVersion()
	}
	return p
}

// RecvAll receives responses, acknowledging each, until every name has come; the last one is not
// acknowledged. It returns the latest version and secret of each name.
func (d *DeltaStream) RecvAll(names ...string) (last Push, versions map[string]string, got map[string]*tlsv3.Secret) {
	d.t.Helper()
	versions, got = map[string]string{}, map[string]*tlsv3.Secret{}
	for {
		last = d.Recv()
		maps.Copy(got, last.Secrets)
		maps.Copy(versions, last.Versions)
		if len(got) >= len(names) {
			return last, versions, got
		}
		d.Ack(last)
	}
}

// RecvErr waits for the stream to end and returns its status.
func (d *DeltaStream) RecvErr() *status.Status {
	d.t.Helper()
	resp, err := d.Stream.Recv()
	if err == nil {
		d.t.Fatalf("got a response (%d resources), want the stream to end", len(resp.GetResources()))
	}
	return status.Convert(err)
}

// Fetch asks for names with FetchSecrets and returns the secrets, or the call's error.
func (e *Envoy) Fetch(ctx context.Context, names ...string) (map[string]*tlsv3.Secret, error) {
	resp, err := e.Client.FetchSecrets(ctx, &discovery.DiscoveryRequest{Node: e.Node, ResourceNames: names, TypeUrl: TypeURL})
	if err != nil {
		return nil, err
	}
	return Decode(e.t, nil, resp.GetResources()), nil
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
	out := map[string]*tlsv3.Secret{}
	for _, r := range resources {
		anys = append(anys, r.GetResource())
	}
	for _, a := range anys {
		if a.GetTypeUrl() != TypeURL {
			return nil, fmt.Errorf("resource of type %s", a.GetTypeUrl())
		}
		s := &tlsv3.Secret{}
		if err := a.UnmarshalTo(s); err != nil {
			return nil, err
		}
		if _, dup := out[s.GetName()]; dup {
			return nil, fmt.Errorf("secret %s twice in one response", s.GetName())
		}
		out[s.GetName()] = s
	}
	return out, nil
}

// KeyPair returns the chain and key of a tls_certificate secret, failing the test unless the key
// matches the leaf.
func KeyPair(t testing.TB, s *tlsv3.Secret) ([]*x509.Certificate, crypto.Signer) {
	t.Helper()
	tc := s.GetTlsCertificate()
	if tc == nil {
		t.Fatalf("secret %s holds no tls_certificate", s.GetName())
	}
	chain, err := pki.ParseCertificates(tc.GetCertificateChain().GetInlineBytes())
	if err != nil {
		t.Fatalf("secret %s: %v", s.GetName(), err)
	}
	key, err := pki.ParsePrivateKey(tc.GetPrivateKey().GetInlineBytes())
	if err != nil {
		t.Fatalf("secret %s: %v", s.GetName(), err)
	}
	if !pki.KeyMatchesCertificate(key, chain[0]) {
		t.Fatalf("secret %s: the key does not match the leaf", s.GetName())
	}
	return chain, key
}

// Roots returns the trusted roots of a validation_context secret.
func Roots(t testing.TB, s *tlsv3.Secret) []*x509.Certificate {
	t.Helper()
	vc := s.GetValidationContext()
	if vc == nil {
		t.Fatalf("secret %s holds no validation_context", s.GetName())
	}
	roots, err := pki.ParseCertificates(vc.GetTrustedCa().GetInlineBytes())
	if err != nil {
		t.Fatalf("secret %s: %v", s.GetName(), err)
	}
	return roots
}
