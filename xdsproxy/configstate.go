package xdsproxy

import (
	"errors"
	"fmt"
	"strings"
	"sync"
)

// The types Envoy must have acknowledged before it can serve: without clusters and listeners it
// has nothing. Spelled out rather than taken from go-control-plane's resource package, which
// would link every resource type into the sidecar.
const (
	clusterType  = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
	listenerType = "type.googleapis.com/envoy.config.listener.v3.Listener"
)

// ErrUpstreamNoADS reports a discovery server that answers the proxy's streams Unimplemented: it
// serves no ADS, so Envoy gets no configuration however often it reconnects.
var ErrUpstreamNoADS = errors.New("the discovery server does not serve ADS")

// configState is what the proxy saw of Envoy's configuration: whether an Envoy stream was
// opened, which types Envoy has acknowledged (ever: Envoy keeps what it has when a stream
// ends), which it refused, and whether the upstream refuses ADS outright.
type configState struct {
	mu        sync.Mutex
	connected bool
	acked     map[string]bool
	nacked    map[string]bool
	// noADS is the upstream's Unimplemented message, until it answers a stream.
	noADS string
}

func (c *configState) streamOpened() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.connected = true
}

// answered records Envoy's answer to a response of typeURL: an ACK, or a NACK.
func (c *configState) answered(typeURL string, ack bool) {
	if typeURL != clusterType && typeURL != listenerType {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.acked == nil {
		c.acked, c.nacked = map[string]bool{}, map[string]bool{}
	}
	if ack {
		c.acked[typeURL] = true
	}
	c.nacked[typeURL] = !ack
}

func (c *configState) upstreamRefuses(msg string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.noADS = msg
}

func (c *configState) upstreamServes() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.noADS = ""
}

// problem says why Envoy has no configuration through the proxy, nil when it has acknowledged
// clusters and listeners. Until an Envoy stream is opened there is nothing to say, unless
// expectEnvoy: the agent runs Envoy, which will connect.
func (c *configState) problem(expectEnvoy bool) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.noADS != "" {
		return fmt.Errorf("%w (Unimplemented: %s): Envoy gets no configuration", ErrUpstreamNoADS, c.noADS)
	}
	if !c.connected {
		if expectEnvoy {
			return errors.New("no Envoy has connected to the xDS proxy yet")
		}
		return nil
	}
	var missing []string
	for _, t := range []struct{ url, name string }{{clusterType, "clusters (CDS)"}, {listenerType, "listeners (LDS)"}} {
		switch {
		case c.acked[t.url]:
		case c.nacked[t.url]:
			missing = append(missing, t.name+", which it refused")
		default:
			missing = append(missing, t.name)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	return fmt.Errorf("not yet acknowledged by Envoy through the xDS proxy: %s", strings.Join(missing, " and "))
}
