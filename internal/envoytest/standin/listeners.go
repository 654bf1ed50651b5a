package main

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
)

// boundListener is an LDS listener with its socket: it accepts connections and holds each open,
// reading and discarding, until its client closes it.
type boundListener struct {
	name    string
	addr    string // as configured
	ln      net.Listener
	prefix  string // its stats' prefix, "listener.<address>."
	inbound bool
}

func hostPort(sa *corev3.SocketAddress) string {
	return net.JoinHostPort(sa.GetAddress(), strconv.FormatUint(uint64(sa.GetPortValue()), 10))
}

// bindLocked makes the bound listeners those of cfgs: a listener gone or moved is closed (its
// connections stay, as Envoy drains them), a new one bound. Listeners drained by the admin are
// not bound again. Only TCP socket addresses are bound.
func (s *server) bindLocked(cfgs map[string]*listenerv3.Listener) error {
	for name, bl := range s.listeners {
		cfg, ok := cfgs[name]
		if ok && listenAddr(cfg) == bl.addr {
			continue
		}
		_ = bl.ln.Close()
		delete(s.listeners, name)
		s.log.Info("listener removed", keyName, name, keyAddress, bl.addr)
	}
	var errs []error
	for name, cfg := range cfgs {
		addr := listenAddr(cfg)
		if _, ok := s.listeners[name]; ok || addr == "" || s.drained[name] || s.stopped {
			continue
		}
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			errs = append(errs, fmt.Errorf("listener %s: cannot bind '%s': %w", name, addr, err))
			continue
		}
		prefix := cfg.GetStatPrefix()
		if prefix == "" {
			prefix = strings.ReplaceAll(ln.Addr().String(), ":", "_")
		}
		bl := &boundListener{
			name:    name,
			addr:    addr,
			ln:      ln,
			prefix:  "listener." + prefix + ".",
			inbound: cfg.GetTrafficDirection() == corev3.TrafficDirection_INBOUND,
		}
		s.stats.declare(false, bl.prefix+"downstream_cx_total")
		s.stats.declare(true, bl.prefix+"downstream_cx_active")
		s.listeners[name] = bl
		s.log.Info("listener added", keyName, name, keyAddress, ln.Addr().String())
		s.wg.Go(func() { s.accept(bl) })
	}
	s.stats.set("listener_manager.total_listeners_active", int64(len(s.listeners)))
	return errors.Join(errs...)
}

// listenAddr is the TCP address a listener binds ("" when it binds none the stand-in serves).
func listenAddr(l *listenerv3.Listener) string {
	sa := l.GetAddress().GetSocketAddress()
	if sa == nil || sa.GetProtocol() != corev3.SocketAddress_TCP {
		return ""
	}
	return hostPort(sa)
}

func (s *server) accept(bl *boundListener) {
	for {
		c, err := bl.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		if s.stopped {
			s.mu.Unlock()
			_ = c.Close()
			return
		}
		s.heldConns[c] = struct{}{}
		s.mu.Unlock()
		s.stats.inc(bl.prefix + "downstream_cx_total")
		s.stats.gaugeAdd(bl.prefix+"downstream_cx_active", 1)
		s.stats.gaugeAdd("server.total_connections", 1)
		s.wg.Go(func() {
			_, _ = io.Copy(io.Discard, c)
			_ = c.Close()
			s.mu.Lock()
			delete(s.heldConns, c)
			s.mu.Unlock()
			s.stats.gaugeAdd(bl.prefix+"downstream_cx_active", -1)
			s.stats.gaugeAdd("server.total_connections", -1)
		})
	}
}

// drainListeners is the admin's /drain_listeners: the listeners (inbound ones only, if asked)
// stop accepting and are not bound again; the connections they hold stay open.
func (s *server) drainListeners(inboundOnly bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for name, bl := range s.listeners {
		if inboundOnly && !bl.inbound {
			continue
		}
		_ = bl.ln.Close()
		delete(s.listeners, name)
		s.drained[name] = true
	}
	for name, cfg := range s.listenerCfg {
		if !inboundOnly || cfg.GetTrafficDirection() == corev3.TrafficDirection_INBOUND {
			s.drained[name] = true
		}
	}
	s.draining = true
	s.stats.set("listener_manager.total_listeners_active", int64(len(s.listeners)))
	s.updateStateLocked()
}
