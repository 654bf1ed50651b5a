package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"regexp"
	"sort"
	"strconv"
	"time"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
)

// adminEndpoint is one admin path; mutating ones answer POST only, as Envoy's admin.
type adminEndpoint struct {
	mutates bool
	handle  func(http.ResponseWriter, *http.Request)
}

func (s *server) adminHandler() http.Handler {
	endpoints := map[string]adminEndpoint{
		"/ready":            {handle: s.handleReady},
		"/server_info":      {handle: s.handleServerInfo},
		"/stats":            {handle: s.handleStats},
		"/stats/prometheus": {handle: s.handlePrometheus},
		"/listeners":        {handle: s.handleListeners},
		"/config_dump":      {handle: s.handleConfigDump},
		"/drain_listeners":  {mutates: true, handle: s.handleDrain},
		"/healthcheck/fail": {mutates: true, handle: s.handleHealthcheck(true)},
		"/healthcheck/ok":   {mutates: true, handle: s.handleHealthcheck(false)},
		"/quitquitquit":     {mutates: true, handle: s.handleQuit},
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e, ok := endpoints[r.URL.Path]
		if !ok {
			s.refuse(w, r, http.StatusNotFound, "invalid path. admin commands are: /ready /server_info /stats /stats/prometheus /listeners /config_dump /drain_listeners /healthcheck/fail /healthcheck/ok /quitquitquit")
			return
		}
		if e.mutates && r.Method != http.MethodPost {
			s.refuse(w, r, http.StatusMethodNotAllowed, fmt.Sprintf("Method %s not allowed, POST required.", r.Method))
			return
		}
		e.handle(w, r)
	})
}

// refuse answers a request the admin does not serve, logs who asked and why, and counts it.
func (s *server) refuse(w http.ResponseWriter, r *http.Request, code int, body string) {
	s.stats.inc("standin.admin_refused")
	s.log.Warn("admin request refused", keyMethod, r.Method, keyPath, r.URL.Path, keyRemote, r.RemoteAddr, keyError, http.StatusText(code))
	w.Header().Set("Content-Type", "text/plain; charset=UTF-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(code)
	_, _ = fmt.Fprintln(w, body) //nolint:gosec // plain text, not sniffed: the method echoed is the asker's own, as Envoy's answer

}

func text(w http.ResponseWriter, code int, body string) {
	w.Header().Set("Content-Type", "text/plain; charset=UTF-8")
	w.WriteHeader(code)
	_, _ = fmt.Fprint(w, body)
}

func jsonBody(w http.ResponseWriter, m proto.Message) {
	b, err := protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true}.Marshal(m)
	var out bytes.Buffer
	if err == nil {
		// protojson varies its spacing on purpose; Envoy's admin prints the same JSON each time.
		err = json.Indent(&out, b, "", "  ")
	}
	if err != nil {
		text(w, http.StatusInternalServerError, err.Error()+"\n")
		return
	}
	out.WriteByte('\n')
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(out.Bytes())
}

func (s *server) handleReady(w http.ResponseWriter, _ *http.Request) {
	st := s.state()
	code := http.StatusServiceUnavailable
	if st == adminv3.ServerInfo_LIVE {
		code = http.StatusOK
	}
	text(w, code, st.String()+"\n")
}

func (s *server) handleServerInfo(w http.ResponseWriter, _ *http.Request) {
	uptime := durationpb.New(time.Since(s.started).Truncate(time.Second))
	hot := "11.104"
	if s.opts.disableHotRestart {
		hot = "disabled"
	}
	jsonBody(w, &adminv3.ServerInfo{
		Version:            version,
		State:              s.state(),
		UptimeCurrentEpoch: uptime,
		UptimeAllEpochs:    uptime,
		HotRestartVersion:  hot,
		CommandLineOptions: s.opts.commandLine(),
		Node:               s.node,
	})
}

// statsQuery reads /stats' filter (an RE2 regex over stat names) and usedonly.
func statsQuery(r *http.Request) (*regexp.Regexp, bool, error) {
	q := r.URL.Query()
	var filter *regexp.Regexp
	if f := q.Get("filter"); f != "" {
		re, err := regexp.Compile(f)
		if err != nil {
			return nil, false, fmt.Errorf("Invalid re2 regex: %w", err) //nolint:staticcheck // Envoy's own message
		}
		filter = re
	}
	return filter, q.Has("usedonly"), nil
}

func (s *server) handleStats(w http.ResponseWriter, r *http.Request) {
	if r.URL.Query().Get("format") == "prometheus" {
		s.handlePrometheus(w, r)
		return
	}
	filter, used, err := statsQuery(r)
	if err != nil {
		text(w, http.StatusBadRequest, err.Error()+"\n")
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=UTF-8")
	writeText(w, s.stats.snapshot(filter, used))
}

func (s *server) handlePrometheus(w http.ResponseWriter, r *http.Request) {
	filter, used, err := statsQuery(r)
	if err != nil {
		text(w, http.StatusBadRequest, err.Error()+"\n")
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=UTF-8")
	writePrometheus(w, s.stats.snapshot(filter, used))
}

func (s *server) handleListeners(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	out := &adminv3.Listeners{}
	for _, bl := range s.listeners {
		tcp, ok := bl.ln.Addr().(*net.TCPAddr)
		if !ok {
			continue
		}
		out.ListenerStatuses = append(out.ListenerStatuses, &adminv3.ListenerStatus{
			Name: bl.name,
			LocalAddress: &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
				Address:       tcp.IP.String(),
				PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: uint32(tcp.Port)}, //nolint:gosec // a port
			}}},
		})
	}
	s.mu.Unlock()
	sort.Slice(out.ListenerStatuses, func(i, j int) bool { return out.ListenerStatuses[i].GetName() < out.ListenerStatuses[j].GetName() })
	if r.URL.Query().Get("format") == "json" {
		jsonBody(w, out)
		return
	}
	var body []byte
	for _, l := range out.ListenerStatuses {
		sa := l.GetLocalAddress().GetSocketAddress()
		body = fmt.Appendf(body, "%s::%s\n", l.GetName(), net.JoinHostPort(sa.GetAddress(), strconv.Itoa(int(sa.GetPortValue()))))
	}
	text(w, http.StatusOK, string(body))
}

func (s *server) handleDrain(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	graceful, inbound := q.Has("graceful"), q.Has("inboundonly")
	s.log.Info("draining listeners", keyGraceful, graceful, keyInbound, inbound)
	s.drainListeners(inbound)
	text(w, http.StatusOK, "OK\n")
}

func (s *server) handleHealthcheck(fail bool) func(http.ResponseWriter, *http.Request) {
	return func(w http.ResponseWriter, _ *http.Request) {
		s.mu.Lock()
		s.healthFailed = fail
		s.updateStateLocked()
		st := s.stateLocked()
		s.mu.Unlock()
		s.log.Info("health check state set", keyState, st.String())
		text(w, http.StatusOK, "OK\n")
	}
}

func (s *server) handleQuit(w http.ResponseWriter, _ *http.Request) {
	s.log.Info("quitquitquit asked: shutting down")
	text(w, http.StatusOK, "OK\n")
	s.quitquitquit()
}
