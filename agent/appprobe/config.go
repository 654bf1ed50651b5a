// Package appprobe answers the kubelet's probes of the workload's containers on the agent's
// status port, as Istio's pilot-agent does: the sidecar injector rewrites each HTTP, TCP and gRPC
// probe to GET /app-health/<container>/{livez,readyz,startupz} on the status port and hands the
// original probes over in ISTIO_KUBE_APP_PROBERS; the agent probes the application itself, over
// the pod's own loopback, where Envoy's mTLS does not stand in the way.
package appprobe

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// DefaultTimeout is a probe's timeout when its timeoutSeconds is 0, Istio's and Kubernetes'
// default.
const DefaultTimeout = time.Second

// pathPattern is the paths Istio's injector writes, as its status server accepts them.
var pathPattern = regexp.MustCompile(`^/app-health/[^/]+/(livez|readyz|startupz)$`)

// Probers maps a status-port path to the probe it runs.
type Probers map[string]Probe

// Probe is one of Istio's rewritten probes: exactly one of HTTPGet, TCPSocket and GRPC.
type Probe struct {
	HTTPGet   *HTTPGet
	TCPSocket *TCPSocket
	GRPC      *GRPC
	// Timeout bounds one probe (timeoutSeconds; DefaultTimeout when 0).
	Timeout time.Duration
}

// HTTPGet is Kubernetes' HTTPGetAction.
type HTTPGet struct {
	Path    string   `json:"path"`
	Port    Port     `json:"port"`
	Host    string   `json:"host"`   // empty: Config.Host
	Scheme  string   `json:"scheme"` // HTTP (default) or HTTPS, whose certificate is not verified, as the kubelet does
	Headers []Header `json:"httpHeaders"`
}

// Header is one of HTTPGet's headers; a Host header sets the request's host.
type Header struct {
	Name  string `json:"name"`
	Value string `json:"value"`
}

// TCPSocket is Kubernetes' TCPSocketAction: the probe passes when the port accepts a connection.
type TCPSocket struct {
	Port Port   `json:"port"`
	Host string `json:"host"`
}

// GRPC is Kubernetes' GRPCAction: the probe passes when grpc.health.v1 answers SERVING.
type GRPC struct {
	Port    Port    `json:"port"`
	Service *string `json:"service"`
}

// Port is a TCP port, given as a number or a numeric string (Kubernetes' IntOrString; the
// injector resolves named ports).
type Port int

// UnmarshalJSON takes 8080 or "8080".
func (p *Port) UnmarshalJSON(b []byte) error {
	s := string(b)
	if unq, err := strconv.Unquote(s); err == nil {
		s = unq
	}
	n, err := strconv.Atoi(s)
	if err != nil {
		return fmt.Errorf("%s is not a port number (a named port must be resolved to its number)", b)
	}
	if n < 1 || n > 65535 {
		return fmt.Errorf("%d is out of range 1-65535", n)
	}
	*p = Port(n)
	return nil
}

// Parse reads ISTIO_KUBE_APP_PROBERS strictly: a path Istio would not serve, an unknown field or
// probe kind, no or several kinds, a port out of range, a negative timeout or a header that
// cannot be sent is refused, the error naming the path and the field. An empty string is no
// probers.
func Parse(s string) (Probers, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal([]byte(s), &raw); err != nil {
		return nil, fmt.Errorf("not a JSON object of path: probe: %w", err)
	}
	probers := make(Probers, len(raw))
	var errs []error
	for _, path := range sortedKeys(raw) { // errors in a stable order
		p, err := parseProbe(raw[path])
		if err == nil && !pathPattern.MatchString(path) {
			err = errors.New("want /app-health/<container>/livez, readyz or startupz")
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%q: %w", path, err))
			continue
		}
		probers[path] = p
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return probers, nil
}

func parseProbe(raw json.RawMessage) (Probe, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil {
		return Probe{}, fmt.Errorf("not a probe object: %w", err)
	}
	var p Probe
	var kinds []string
	for _, name := range sortedKeys(fields) {
		var err error
		switch name {
		case "httpGet":
			p.HTTPGet = &HTTPGet{}
			err = decodeStrict(fields[name], p.HTTPGet)
			if err == nil {
				err = p.HTTPGet.check()
			}
			kinds = append(kinds, name)
		case "tcpSocket":
			p.TCPSocket = &TCPSocket{}
			err = decodeStrict(fields[name], p.TCPSocket)
			kinds = append(kinds, name)
		case "grpc":
			p.GRPC = &GRPC{}
			err = decodeStrict(fields[name], p.GRPC)
			kinds = append(kinds, name)
		case "timeoutSeconds":
			var secs int
			if err = json.Unmarshal(fields[name], &secs); err == nil && secs < 0 {
				err = fmt.Errorf("%d must not be negative", secs)
			}
			p.Timeout = time.Duration(secs) * time.Second
		default:
			err = errors.New("unknown field: want httpGet, tcpSocket or grpc, and timeoutSeconds")
		}
		if err != nil {
			return Probe{}, fmt.Errorf("%s: %w", name, err)
		}
	}
	if len(kinds) != 1 {
		return Probe{}, fmt.Errorf("want exactly one of httpGet, tcpSocket and grpc, got %d", len(kinds))
	}
	if p.Timeout == 0 {
		p.Timeout = DefaultTimeout
	}
	return p, nil
}

// decodeStrict decodes a probe kind, refusing unknown fields; a missing port is refused too.
func decodeStrict(raw json.RawMessage, v any) error {
	d := json.NewDecoder(bytes.NewReader(raw))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		return err
	}
	var port Port
	switch v := v.(type) {
	case *HTTPGet:
		port = v.Port
	case *TCPSocket:
		port = v.Port
	case *GRPC:
		port = v.Port
	}
	if port == 0 {
		return errors.New("port: required")
	}
	return nil
}

func (h *HTTPGet) check() error {
	switch strings.ToUpper(h.Scheme) {
	case "", "HTTP", "HTTPS":
	default:
		return fmt.Errorf("scheme: %q: want HTTP or HTTPS", h.Scheme)
	}
	if h.Path != "" && !strings.HasPrefix(h.Path, "/") {
		return fmt.Errorf("path: %q: want an absolute path", h.Path)
	}
	if strings.ContainsAny(h.Path, " \r\n") {
		return fmt.Errorf("path: %q: has a space or a line break", h.Path)
	}
	for i, hd := range h.Headers {
		if hd.Name == "" || strings.ContainsAny(hd.Name, " \t\r\n:") {
			return fmt.Errorf("httpHeaders[%d].name: %q is not a header name", i, hd.Name)
		}
		if strings.ContainsAny(hd.Value, "\r\n") {
			return fmt.Errorf("httpHeaders[%d].value: has a line break", i)
		}
	}
	return nil
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
