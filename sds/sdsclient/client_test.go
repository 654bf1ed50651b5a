package sdsclient_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/meshid/meshid/sds/sdsclient"
)

var node = &core.Node{Id: "sidecar~10.0.0.1~cart-1.shop~shop.svc.cluster.local"}

// A SotW stream sends the node on its first request only, and its ACK and NACK answer the
// response's nonce: the ACK with the response's version, the NACK with the version accepted
// before and the reason.
func TestStreamAckNack(t *testing.T) {
	t.Parallel()
	path, stub := socketPath(t), newStub()
	serve(t, path, stub)
	st, err := dial(t, path, node).StreamSecrets(within(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Subscribe("default", "ROOTCA"); err != nil {
		t.Fatal(err)
	}
	srv := next(t, stub.sotw, "the stream")
	first := next(t, srv.reqs, "the subscription")
	if !proto.Equal(first.GetNode(), node) || first.GetTypeUrl() != sdsclient.TypeURL ||
		strings.Join(first.GetResourceNames(), ",") != "default,ROOTCA" || first.GetResponseNonce() != "" {
		t.Errorf("first request %v; want the node, the type and both names, no nonce", first)
	}

	srv.send <- response(t, "v1", "n1", "default", "ROOTCA")
	r, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if r.Version != "v1" || r.Nonce != "n1" || strings.Join(r.Names(), ",") != "ROOTCA,default" {
		t.Errorf("received %+v; want v1, n1, ROOTCA and default", r)
	}
	if err := st.Ack(r, "default", "ROOTCA"); err != nil {
		t.Fatal(err)
	}
	if ack := next(t, srv.reqs, "the ACK"); ack.GetNode() != nil || ack.GetVersionInfo() != "v1" || ack.GetResponseNonce() != "n1" ||
		ack.GetErrorDetail() != nil || len(ack.GetResourceNames()) != 2 || ack.GetTypeUrl() != sdsclient.TypeURL {
		t.Errorf("ACK %v; want v1, nonce n1, both names, no node", ack)
	}

	srv.send <- response(t, "v2", "n2", "default")
	r, err = st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Nack(r, "v1", "bad key", "default", "ROOTCA"); err != nil {
		t.Fatal(err)
	}
	nack := next(t, srv.reqs, "the NACK")
	if nack.GetNode() != nil || nack.GetVersionInfo() != "v1" || nack.GetResponseNonce() != "n2" ||
		nack.GetErrorDetail().GetMessage() != "bad key" || nack.GetErrorDetail().GetCode() != int32(codes.InvalidArgument) {
		t.Errorf("NACK %v; want v1 accepted, nonce n2, the reason, no node", nack)
	}

	// A second Subscribe is not a first request: no node.
	if err := st.Subscribe("default"); err != nil {
		t.Fatal(err)
	}
	if again := next(t, srv.reqs, "the new subscription"); again.GetNode() != nil || strings.Join(again.GetResourceNames(), ",") != "default" {
		t.Errorf("second subscription %v; want default, no node", again)
	}
}

// A delta stream sends the node first only, reads each resource's version, and answers nonces.
func TestDeltaStream(t *testing.T) {
	t.Parallel()
	path, stub := socketPath(t), newStub()
	serve(t, path, stub)
	d, err := dial(t, path, node).DeltaSecrets(within(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Subscribe("default", "ROOTCA"); err != nil {
		t.Fatal(err)
	}
	srv := next(t, stub.deltas, "the stream")
	if first := next(t, srv.reqs, "the subscription"); !proto.Equal(first.GetNode(), node) || len(first.GetResourceNamesSubscribe()) != 2 {
		t.Errorf("first request %v; want the node and both names", first)
	}
	srv.send <- &discovery.DeltaDiscoveryResponse{SystemVersionInfo: "s1", Nonce: "n1", TypeUrl: sdsclient.TypeURL, Resources: []*discovery.Resource{
		{Name: "default", Version: "a", Resource: secretAny(t, "default")},
	}}
	srv.send <- &discovery.DeltaDiscoveryResponse{SystemVersionInfo: "s2", Nonce: "n2", TypeUrl: sdsclient.TypeURL, Resources: []*discovery.Resource{
		{Name: "ROOTCA", Version: "b", Resource: secretAny(t, "ROOTCA")},
	}}
	last, versions, got, err := d.RecvAll("default", "ROOTCA")
	if err != nil {
		t.Fatal(err)
	}
	if last.Nonce != "n2" || versions["default"] != "a" || versions["ROOTCA"] != "b" || len(got) != 2 {
		t.Errorf("RecvAll: last %+v, versions %v, %d secrets; want n2, a and b, 2", last, versions, len(got))
	}
	if ack := next(t, srv.reqs, "the ACK of n1"); ack.GetResponseNonce() != "n1" || ack.GetNode() != nil || ack.GetErrorDetail() != nil {
		t.Errorf("ACK %v; want nonce n1, no node", ack)
	}
	if err := d.Nack(last, "bad roots"); err != nil {
		t.Fatal(err)
	}
	if nack := next(t, srv.reqs, "the NACK"); nack.GetResponseNonce() != "n2" || nack.GetErrorDetail().GetMessage() != "bad roots" || nack.GetNode() != nil {
		t.Errorf("NACK %v; want nonce n2 and the reason, no node", nack)
	}
	if err := d.Update(last, nil, []string{"ROOTCA"}); err != nil {
		t.Fatal(err)
	}
	if up := next(t, srv.reqs, "the update"); up.GetResponseNonce() != "n2" || strings.Join(up.GetResourceNamesUnsubscribe(), ",") != "ROOTCA" {
		t.Errorf("update %v; want nonce n2, ROOTCA unsubscribed", up)
	}
}

// Recv refuses what Envoy would: another type, no nonce, a resource that is not a secret, a
// secret twice, and (delta) a resource without a version or holding a secret of another name.
func TestRecvRefuses(t *testing.T) {
	t.Parallel()
	notSecret, err := anypb.New(durationpb.New(0))
	if err != nil {
		t.Fatal(err)
	}
	sotw := []struct {
		name string
		resp func(*discovery.DiscoveryResponse)
	}{
		{"another type", func(r *discovery.DiscoveryResponse) {
			r.TypeUrl = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
		}},
		{"no nonce", func(r *discovery.DiscoveryResponse) { r.Nonce = "" }},
		{"not a secret", func(r *discovery.DiscoveryResponse) { r.Resources = append(r.Resources, notSecret) }},
		{"a secret twice", func(r *discovery.DiscoveryResponse) { r.Resources = append(r.Resources, r.Resources[0]) }},
	}
	for _, tc := range sotw {
		t.Run("sotw/"+tc.name, func(t *testing.T) {
			t.Parallel()
			path, stub := socketPath(t), newStub()
			serve(t, path, stub)
			st, err := dial(t, path, node).StreamSecrets(within(t))
			if err != nil {
				t.Fatal(err)
			}
			if err := st.Subscribe("default"); err != nil {
				t.Fatal(err)
			}
			resp := response(t, "v1", "n1", "default")
			tc.resp(resp)
			next(t, stub.sotw, "the stream").send <- resp
			if _, err := st.Recv(); !errors.Is(err, sdsclient.ErrProtocol) {
				t.Errorf("Recv: %v; want ErrProtocol", err)
			}
		})
	}
	delta := []struct {
		name string
		res  func(*testing.T) *discovery.Resource
	}{
		{"no version", func(t *testing.T) *discovery.Resource {
			return &discovery.Resource{Name: "default", Resource: secretAny(t, "default")}
		}},
		{"another name", func(t *testing.T) *discovery.Resource {
			return &discovery.Resource{Name: "default", Version: "a", Resource: secretAny(t, "ROOTCA")}
		}},
	}
	for _, tc := range delta {
		t.Run("delta/"+tc.name, func(t *testing.T) {
			t.Parallel()
			path, stub := socketPath(t), newStub()
			serve(t, path, stub)
			d, err := dial(t, path, node).DeltaSecrets(within(t))
			if err != nil {
				t.Fatal(err)
			}
			if err := d.Subscribe("default"); err != nil {
				t.Fatal(err)
			}
			next(t, stub.deltas, "the stream").send <- &discovery.DeltaDiscoveryResponse{Nonce: "n1", TypeUrl: sdsclient.TypeURL,
				Resources: []*discovery.Resource{tc.res(t)}}
			if _, err := d.Recv(); !errors.Is(err, sdsclient.ErrProtocol) {
				t.Errorf("Recv: %v; want ErrProtocol", err)
			}
		})
	}
}

// Get asks with FetchSecrets, and reports a name the server did not send and the call's status.
func TestGetFetches(t *testing.T) {
	t.Parallel()
	path, stub := socketPath(t), newStub()
	stub.fetch = func(req *discovery.DiscoveryRequest) (*discovery.DiscoveryResponse, error) {
		if req.GetNode().GetId() != "meshid-test" {
			return nil, status.Error(codes.InvalidArgument, "no node")
		}
		if len(req.GetResourceNames()) == 1 && req.GetResourceNames()[0] == "failing" {
			return nil, status.Error(codes.Unavailable, "the certificate expired")
		}
		return response(t, "v1", "n1", "default", "ROOTCA"), nil
	}
	serve(t, path, stub)
	got, err := sdsclient.Get(within(t), path, "meshid-test", "default", "ROOTCA")
	if err != nil || got["default"] == nil || got["ROOTCA"] == nil {
		t.Fatalf("Get: %v, %v; want default and ROOTCA", got, err)
	}
	if _, err := sdsclient.Get(within(t), path, "meshid-test", "default", "spare"); err == nil || !strings.Contains(err.Error(), `"spare"`) {
		t.Errorf("Get of a name not sent: %v; want an error naming it", err)
	}
	if _, err := sdsclient.Get(within(t), path, "meshid-test", "failing"); status.Code(errors.Unwrap(err)) != codes.Unavailable {
		t.Errorf("Get of a failing name: %v; want Unavailable, wrapped once", err)
	}
}

// A server without FetchSecrets (Istio's agent) is asked over StreamSecrets, each response
// acknowledged, until every name has come.
func TestGetFallsBackToAStream(t *testing.T) {
	t.Parallel()
	path, stub := socketPath(t), newStub()
	serve(t, path, stub)
	type result struct {
		n   int
		err error
	}
	done := make(chan result, 1)
	go func() {
		got, err := sdsclient.Get(within(t), path, "meshid-test", "default", "ROOTCA")
		done <- result{len(got), err}
	}()
	srv := next(t, stub.sotw, "the stream")
	if sub := next(t, srv.reqs, "the subscription"); sub.GetNode().GetId() != "meshid-test" || len(sub.GetResourceNames()) != 2 {
		t.Errorf("subscription %v; want the node and both names", sub)
	}
	srv.send <- response(t, "v1", "n1", "default")
	if ack := next(t, srv.reqs, "the ACK of n1"); ack.GetResponseNonce() != "n1" || ack.GetVersionInfo() != "v1" {
		t.Errorf("ACK %v; want v1, n1", ack)
	}
	srv.send <- response(t, "v2", "n2", "default", "ROOTCA")
	if ack := next(t, srv.reqs, "the ACK of n2"); ack.GetResponseNonce() != "n2" || ack.GetVersionInfo() != "v2" {
		t.Errorf("ACK %v; want v2, n2", ack)
	}
	if r := next(t, done, "Get"); r.err != nil || r.n != 2 {
		t.Errorf("Get: %d secrets, %v; want 2", r.n, r.err)
	}
}

// Follow acknowledges every response and, when the server goes away, opens a new stream on the
// server that comes back, subscribes again with the node, and delivers what it sends.
func TestFollowReconnects(t *testing.T) {
	t.Parallel()
	path := socketPath(t)
	first := newStub()
	stopFirst := serve(t, path, first)
	c := dial(t, path, node)
	ctx, cancel := context.WithCancel(within(t))
	opened, received, ended := make(chan struct{}, 2), make(chan sdsclient.Response), make(chan error, 1)
	go func() {
		ended <- c.Follow(ctx, []string{"default"}, func() { opened <- struct{}{} }, func(r sdsclient.Response) error {
			select {
			case received <- r:
			case <-ctx.Done():
			}
			return nil
		})
	}()

	srv := next(t, first.sotw, "the first stream")
	next(t, opened, "the first stream opened")
	if sub := next(t, srv.reqs, "the subscription"); !proto.Equal(sub.GetNode(), node) {
		t.Errorf("subscription %v; want the node", sub)
	}
	srv.send <- response(t, "v1", "n1", "default")
	if r := next(t, received, "v1"); r.Version != "v1" {
		t.Errorf("received %s; want v1", r.Version)
	}
	if ack := next(t, srv.reqs, "the ACK"); ack.GetResponseNonce() != "n1" || ack.GetVersionInfo() != "v1" {
		t.Errorf("ACK %v; want v1, n1", ack)
	}

	stopFirst()
	second := newStub()
	serve(t, path, second)
	srv = next(t, second.sotw, "a stream on the restarted server")
	next(t, opened, "the second stream opened")
	if sub := next(t, srv.reqs, "the new subscription"); !proto.Equal(sub.GetNode(), node) || sub.GetResponseNonce() != "" {
		t.Errorf("subscription on the new stream %v; want the node and no nonce", sub)
	}
	srv.send <- response(t, "v2", "n1", "default")
	if r := next(t, received, "v2"); r.Version != "v2" {
		t.Errorf("received %s; want v2", r.Version)
	}
	if ack := next(t, srv.reqs, "the ACK on the new stream"); ack.GetVersionInfo() != "v2" {
		t.Errorf("ACK %v; want v2", ack)
	}
	cancel()
	if err := next(t, ended, "Follow's end"); !errors.Is(err, context.Canceled) {
		t.Errorf("Follow ended with %v; want its context's error", err)
	}
}

// Follow ends, without opening another stream, with the error of its callback, and with a
// response no stream would mend.
func TestFollowStops(t *testing.T) {
	t.Parallel()
	stop := errors.New("enough")
	for _, tc := range []struct {
		name string
		resp func(*discovery.DiscoveryResponse)
		want error
	}{
		{"the callback's error", func(*discovery.DiscoveryResponse) {}, stop},
		{"a protocol error", func(r *discovery.DiscoveryResponse) { r.Nonce = "" }, sdsclient.ErrProtocol},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			path, stub := socketPath(t), newStub()
			serve(t, path, stub)
			c := dial(t, path, node)
			ended := make(chan error, 1)
			go func() {
				ended <- c.Follow(within(t), []string{"default"}, nil, func(sdsclient.Response) error { return stop })
			}()
			srv := next(t, stub.sotw, "the stream")
			resp := response(t, "v1", "n1", "default")
			tc.resp(resp)
			srv.send <- resp
			if err := next(t, ended, "Follow's end"); !errors.Is(err, tc.want) {
				t.Errorf("Follow ended with %v; want %v", err, tc.want)
			}
			for req := range srv.reqs { // the stream ends with Follow, unacknowledged
				if req.GetResponseNonce() != "" {
					t.Errorf("Follow answered %v", req)
				}
			}
		})
	}
}
