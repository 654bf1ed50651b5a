package main

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"slices"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	statuspb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
)

// xdsStream is what ADS's and SDS's state-of-the-world streams have in common.
type xdsStream interface {
	Send(*discoveryv3.DiscoveryRequest) error
	Recv() (*discoveryv3.DiscoveryResponse, error)
}

// want is one subscription: a type and its resource names (none: wildcard).
type want struct {
	typeURL string
	names   []string
}

// subscriber is the stand-in's side of one stream: what it subscribes to, and how it takes a
// response. An error from apply is the NACK's error_detail.
type subscriber interface {
	wanted() []want
	apply(*discoveryv3.DiscoveryResponse) error
}

// xdsClient runs one state-of-the-world xDS stream as Envoy's gRPC mux does: it subscribes,
// ACKs each accepted response with its version and nonce, NACKs a rejected one with the last
// accepted version and an error_detail, and opens a new stream with backoff when one ends,
// asking again for what it holds with the versions it accepted.
type xdsClient struct {
	log           *slog.Logger
	node          *corev3.Node
	nodeFirstOnly bool
	open          func(ctx context.Context) (xdsStream, error)
	sub           subscriber
	// connected is called once a stream is open and its first requests are sent.
	connected func()
}

const (
	backoffBase = 500 * time.Millisecond
	backoffMax  = 30 * time.Second
)

func (c *xdsClient) run(ctx context.Context) {
	versions := map[string]string{}
	delay := backoffBase
	for {
		received, err := c.session(ctx, versions)
		if ctx.Err() != nil {
			return
		}
		if received {
			delay = backoffBase
		}
		c.log.Warn("config stream closed", keyError, err, keyRetryIn, delay)
		// Full jitter over the current step, as Envoy's JitteredExponentialBackOffStrategy.
		wait := delay/2 + rand.N(delay/2+1) //nolint:gosec // jitter, not a secret
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		delay = min(2*delay, backoffMax)
	}
}

// session runs one stream until it ends; received tells whether any response came on it.
func (c *xdsClient) session(ctx context.Context, versions map[string]string) (bool, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.open(ctx)
	if err != nil {
		return false, err
	}
	first := true
	nonces := map[string]string{}
	sent := map[string][]string{}
	send := func(w want, errDetail error) error {
		req := &discoveryv3.DiscoveryRequest{
			TypeUrl:       w.typeURL,
			VersionInfo:   versions[w.typeURL],
			ResponseNonce: nonces[w.typeURL],
			ResourceNames: w.names,
		}
		if first || !c.nodeFirstOnly {
			req.Node = c.node
		}
		if errDetail != nil {
			req.ErrorDetail = &statuspb.Status{Code: int32(codes.InvalidArgument), Message: errDetail.Error()}
		}
		first = false
		sent[w.typeURL] = slices.Clone(w.names)
		return stream.Send(req)
	}
	// sync asks for each subscription not yet asked for on this stream, or whose names changed.
	sync := func() error {
		for _, w := range c.sub.wanted() {
			if prev, ok := sent[w.typeURL]; ok && slices.Equal(prev, w.names) {
				continue
			}
			if err := send(w, nil); err != nil {
				return err
			}
		}
		return nil
	}
	if err := sync(); err != nil {
		return false, err
	}
	if c.connected != nil {
		c.connected()
	}
	received := false
	for {
		resp, err := stream.Recv()
		if err != nil {
			return received, err
		}
		received = true
		t := resp.GetTypeUrl()
		applyErr := c.sub.apply(resp)
		nonces[t] = resp.GetNonce()
		if applyErr == nil {
			versions[t] = resp.GetVersionInfo()
		} else {
			c.log.Warn("gRPC config rejected", keyType, t, keyVersion, resp.GetVersionInfo(), keyError, applyErr)
		}
		w := want{typeURL: t, names: sent[t]}
		for _, cur := range c.sub.wanted() {
			if cur.typeURL == t {
				w = cur
			}
		}
		if err := send(w, applyErr); err != nil {
			return received, err
		}
		if err := sync(); err != nil {
			return received, err
		}
	}
}
