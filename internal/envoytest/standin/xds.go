package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	statuspb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/anypb"
)

// xdsStream is what ADS's and SDS's state-of-the-world streams have in common.
type xdsStream interface {
	Send(*discoveryv3.DiscoveryRequest) error
	Recv() (*discoveryv3.DiscoveryResponse, error)
}

// deltaStream is what ADS's and SDS's incremental streams have in common.
type deltaStream interface {
	Send(*discoveryv3.DeltaDiscoveryRequest) error
	Recv() (*discoveryv3.DeltaDiscoveryResponse, error)
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
	// check tells whether one resource is acceptable, as an incremental update takes or
	// refuses each resource on its own.
	check(typeURL string, r *anypb.Any) error
	// done is told each response's outcome: nil for an ACK, the NACK's error otherwise.
	done(typeURL string, err error)
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
	// openDelta, when set, is used instead of open: the config source asks for incremental xDS.
	openDelta func(ctx context.Context) (deltaStream, error)
	sub       subscriber
	// connected is called once a stream is open and its first requests are sent.
	connected func()
}

const (
	backoffBase = 500 * time.Millisecond
	backoffMax  = 30 * time.Second
)

func (c *xdsClient) run(ctx context.Context) {
	versions := map[string]string{}
	held := map[string]map[string]*discoveryv3.Resource{}
	delay := backoffBase
	for {
		var received bool
		var err error
		if c.openDelta != nil {
			received, err = c.deltaSession(ctx, held)
		} else {
			received, err = c.session(ctx, versions)
		}
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
		c.sub.done(t, applyErr)
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

// deltaSession runs one incremental stream until it ends. held is what was accepted, by type and
// name: a new stream announces it in initial_resource_versions. Each response is merged into what
// is held and the merged set applied as a state-of-the-world update would be, so that a NACK
// keeps what was held before it.
func (c *xdsClient) deltaSession(ctx context.Context, held map[string]map[string]*discoveryv3.Resource) (bool, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.openDelta(ctx)
	if err != nil {
		return false, err
	}
	first := true
	send := func(req *discoveryv3.DeltaDiscoveryRequest) error {
		// The node on the first request of a stream only, as the incremental protocol has it.
		if first {
			req.Node = c.node
		}
		first = false
		return stream.Send(req)
	}
	sent := map[string][]string{}
	sync := func() error {
		for _, w := range c.sub.wanted() {
			prev, ok := sent[w.typeURL]
			if ok && slices.Equal(prev, w.names) {
				continue
			}
			req := &discoveryv3.DeltaDiscoveryRequest{TypeUrl: w.typeURL}
			if !ok {
				req.ResourceNamesSubscribe = w.names
				for name, r := range held[w.typeURL] {
					if req.InitialResourceVersions == nil {
						req.InitialResourceVersions = map[string]string{}
					}
					req.InitialResourceVersions[name] = r.GetVersion()
				}
			} else {
				for _, n := range w.names {
					if !slices.Contains(prev, n) {
						req.ResourceNamesSubscribe = append(req.ResourceNamesSubscribe, n)
					}
				}
				for _, n := range prev {
					if !slices.Contains(w.names, n) {
						req.ResourceNamesUnsubscribe = append(req.ResourceNamesUnsubscribe, n)
					}
				}
			}
			sent[w.typeURL] = slices.Clone(w.names)
			if err := send(req); err != nil {
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
		merged := maps.Clone(held[t])
		if merged == nil {
			merged = map[string]*discoveryv3.Resource{}
		}
		for _, r := range resp.GetResources() {
			if r.GetResource() != nil {
				merged[r.GetName()] = r
			}
		}
		for _, n := range resp.GetRemovedResources() {
			delete(merged, n)
		}
		// A resource refused keeps the version held before it, if any; the others are taken.
		var errs []error
		for name, r := range merged {
			if err := c.sub.check(t, r.GetResource()); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", name, err))
				if old, ok := held[t][name]; ok {
					merged[name] = old
				} else {
					delete(merged, name)
				}
			}
		}
		whole := &discoveryv3.DiscoveryResponse{TypeUrl: t, VersionInfo: resp.GetSystemVersionInfo(), Nonce: resp.GetNonce()}
		for _, name := range slices.Sorted(maps.Keys(merged)) {
			whole.Resources = append(whole.Resources, merged[name].GetResource())
		}
		req := &discoveryv3.DeltaDiscoveryRequest{TypeUrl: t, ResponseNonce: resp.GetNonce()}
		if applyErr := c.sub.apply(whole); applyErr != nil {
			errs = append(errs, applyErr)
		} else {
			held[t] = merged
		}
		nackErr := errors.Join(errs...)
		if nackErr != nil {
			c.log.Warn("gRPC config rejected", keyType, t, keyVersion, resp.GetSystemVersionInfo(), keyError, nackErr)
			req.ErrorDetail = &statuspb.Status{Code: int32(codes.InvalidArgument), Message: nackErr.Error()}
		}
		c.sub.done(t, nackErr)
		if err := send(req); err != nil {
			return received, err
		}
		if err := sync(); err != nil {
			return received, err
		}
	}
}
