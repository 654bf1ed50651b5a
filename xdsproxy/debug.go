package xdsproxy

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/internal/logkey"
)

// maxDebugType bounds the <type> of GET /debug/<type>.
const maxDebugType = 64

// DebugTypes are the istio.io/debug types the proxy asks the discovery server for: what meshid's
// and istiod's answer for a proxy. GET /debug/<type> of another is refused before any upstream
// stream is opened.
func DebugTypes() []string { return []string{"config_dump", "syncz"} }

// DebugHandler answers GET /debug/<type>[?resourceName=a&resourceName=b] with the upstream's answer
// to a DiscoveryRequest of type istio.io/debug/<type> for the proxy's node, as JSON. The request
// goes on the proxy's own upstream stream, never inside one of Envoy's, so it works whether or not
// Envoy is connected. Mount it at /debug/. It shows this namespace's configuration and the other
// proxies of the namespace: serve it only to whoever may read them (the agent serves it on a Unix
// socket next to the XDS socket, with its mode). Refusals are counted and their logs paced.
func (p *Proxy) DebugHandler() http.Handler {
	return http.HandlerFunc(p.serveDebug)
}

func (p *Proxy) serveDebug(w http.ResponseWriter, r *http.Request) {
	refuse := func(reason, msg string, code int) {
		p.refuse(admission.Peer(r.Context()), protocolDebug, reason, strconv.Itoa(code), errors.New(msg))
		http.Error(w, msg, code)
	}
	if r.Method != http.MethodGet {
		w.Header().Set("Allow", http.MethodGet)
		refuse(reasonBadDebugRequest, "only GET is allowed", http.StatusMethodNotAllowed)
		return
	}
	name, ok := strings.CutPrefix(r.URL.Path, "/debug/")
	if !ok || !validDebugType(name) {
		refuse(reasonBadDebugRequest, "want /debug/<type>, the type made of letters, digits, '_', '-' and '.' (e.g. /debug/config_dump)", http.StatusBadRequest)
		return
	}
	if !slices.Contains(DebugTypes(), name) {
		refuse(reasonUnknownDebugType, fmt.Sprintf("unknown debug type %q: want /debug/%s", name, strings.Join(DebugTypes(), " or /debug/")), http.StatusNotFound)
		return
	}
	req := &discovery.DiscoveryRequest{
		TypeUrl:       DebugTypePrefix + name,
		Node:          p.cfg.Node,
		ResourceNames: r.URL.Query()["resourceName"],
	}
	resp, code, err := p.askDebug(r.Context(), req)
	if err != nil {
		p.debugFailed(r, req.TypeUrl, code, err)
		http.Error(w, err.Error(), code)
		return
	}
	body, err := debugJSON(resp)
	if err != nil {
		p.debugFailed(r, req.TypeUrl, http.StatusInternalServerError, err)
		http.Error(w, "encode the answer: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(body)
}

// debugFailed logs a debug request that could not be answered, paced as refusals are: whoever can
// reach the handler can repeat it as often as they like.
func (p *Proxy) debugFailed(r *http.Request, typeURL string, code int, err error) {
	ok, dropped := p.logs.Allow("debug failed")
	if !ok {
		return
	}
	attrs := []any{logkey.Peer, admission.Peer(r.Context()), logkey.TypeURL, typeURL, logkey.Code, code, logkey.Error, err.Error()}
	if dropped > 0 {
		attrs = append(attrs, logkey.Dropped, dropped)
	}
	p.log.Warn("xDS debug request failed", attrs...)
}

func validDebugType(s string) bool {
	if s == "" || len(s) > maxDebugType {
		return false
	}
	for _, c := range s {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '_', c == '-', c == '.':
		default:
			return false
		}
	}
	return true
}

// debugAsk is one debug request handed to Run's debug goroutine, which replies on reply.
type debugAsk struct {
	ctx   context.Context // the HTTP request's: an abandoned request stops waiting
	req   *discovery.DiscoveryRequest
	reply chan debugReply // buffered: the debug goroutine never blocks on it
}

type debugReply struct {
	resp *discovery.DiscoveryResponse
	code int // the HTTP status of a failure
	err  error
}

// askDebug hands req to Run's debug goroutine and returns its answer; on failure, the HTTP status
// to answer with. A request that comes as the agent starts waits for Run, at most the debug
// timeout.
func (p *Proxy) askDebug(ctx context.Context, req *discovery.DiscoveryRequest) (*discovery.DiscoveryResponse, int, error) {
	ask := debugAsk{ctx: ctx, req: req, reply: make(chan debugReply, 1)}
	timer := p.clock.NewTimer(p.cfg.DebugTimeout)
	select {
	case p.debugAsks <- ask:
		timer.Stop()
	case <-p.debugStopped:
		timer.Stop()
		return nil, http.StatusServiceUnavailable, errors.New("the xDS proxy is not running")
	case <-timer.C():
		return nil, http.StatusServiceUnavailable, errors.New("the xDS proxy is not running")
	case <-ctx.Done():
		timer.Stop()
		return nil, http.StatusServiceUnavailable, fmt.Errorf("the debug request was abandoned: %w", ctx.Err())
	}
	r := <-ask.reply // the debug goroutine replies within the debug timeout, or as the request or Run ends
	return r.resp, r.code, r.err
}

// debugLoop answers debug requests, one at a time, on the proxy's own upstream stream, until ctx
// (Run's) ends. It alone owns the stream, so no lock is held across a round trip; one request at
// a time means one answer awaited, and a request that fails or times out ends the stream (the
// next opens another), so that a late answer cannot be taken for the next request's.
func (p *Proxy) debugLoop(ctx context.Context) {
	var d *debugStream
	defer func() {
		if d != nil {
			d.cancel()
		}
		close(p.debugStopped)
	}()
	for {
		select {
		case <-ctx.Done():
			return
		case ask := <-p.debugAsks:
			var r debugReply
			d, r = p.roundTrip(ctx, d, ask)
			ask.reply <- r
		}
	}
}

// roundTrip sends ask on the debug stream d, opened first when nil, and waits for the answer of
// its type, at most the debug timeout. It returns the stream for the next request: nil when this
// one has ended.
func (p *Proxy) roundTrip(ctx context.Context, d *debugStream, ask debugAsk) (*debugStream, debugReply) {
	if d == nil {
		var err error
		if d, err = p.openDebug(ctx); err != nil {
			return nil, debugReply{code: http.StatusBadGateway, err: fmt.Errorf("open the upstream debug stream: %s", describeStatus(err))}
		}
	}
	timer := p.clock.NewTimer(p.cfg.DebugTimeout)
	defer timer.Stop()
	answer := d.await(ask.req.GetTypeUrl())
	// A Send that fails leaves the reason to the reader, which sees the stream end.
	_ = d.stream.Send(ask.req)
	var r debugReply
	select {
	case resp := <-answer:
		return d, debugReply{resp: resp}
	case <-d.done:
		r = debugReply{code: http.StatusBadGateway, err: fmt.Errorf("the upstream refused the debug request: %s", describeStatus(d.err))}
		if errors.Is(d.err, io.EOF) {
			r.err = errors.New("the upstream closed the debug stream without answering")
		}
	case <-timer.C():
		r = debugReply{code: http.StatusGatewayTimeout, err: fmt.Errorf("the upstream did not answer %s within %v", ask.req.GetTypeUrl(), p.cfg.DebugTimeout)}
	case <-ask.ctx.Done():
		r = debugReply{code: http.StatusServiceUnavailable, err: fmt.Errorf("the debug request was abandoned: %w", ask.ctx.Err())}
	case <-ctx.Done():
		r = debugReply{code: http.StatusServiceUnavailable, err: errors.New("the xDS proxy is stopping")}
	}
	d.cancel()
	return nil, r
}

func describeStatus(err error) string {
	st := status.Convert(err)
	return fmt.Sprintf("%s: %s", st.Code(), st.Message())
}

// debugStream is the proxy's own upstream ADS stream, for debug requests. Its reader goroutine
// hands the awaited answer over and drops anything else (pushes of a type no one waits for).
type debugStream struct {
	cancel context.CancelFunc
	stream grpc.BidiStreamingClient[discovery.DiscoveryRequest, discovery.DiscoveryResponse]
	// done is closed when the stream has ended, err then saying why.
	done chan struct{}
	err  error

	mu     sync.Mutex
	want   string
	answer chan *discovery.DiscoveryResponse // buffered: the reader never blocks on it
}

// openDebug opens a debug stream within ctx (Run's) and starts its reader, which Run waits for.
func (p *Proxy) openDebug(ctx context.Context) (*debugStream, error) {
	ctx, cancel := context.WithCancel(ctx)
	stream, err := p.upstream.StreamAggregatedResources(ctx, p.cfg.CallOptions...)
	if err != nil {
		cancel()
		return nil, err
	}
	d := &debugStream{cancel: cancel, stream: stream, done: make(chan struct{})}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			resp, err := stream.Recv()
			if err != nil {
				d.err = err
				close(d.done)
				return
			}
			d.deliver(resp)
		}
	}()
	return d, nil
}

func (d *debugStream) await(typeURL string) <-chan *discovery.DiscoveryResponse {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.want, d.answer = typeURL, make(chan *discovery.DiscoveryResponse, 1)
	return d.answer
}

func (d *debugStream) deliver(resp *discovery.DiscoveryResponse) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.answer == nil || resp.GetTypeUrl() != d.want {
		return
	}
	d.answer <- resp
	d.answer = nil
}

// debugJSON writes a debug answer as protojson. A resource whose type this binary does not link
// (istio's own debug types, say) is shown as its type URL and its bytes in base64, rather than
// failing the whole answer.
func debugJSON(resp *discovery.DiscoveryResponse) ([]byte, error) {
	head := &discovery.DiscoveryResponse{
		VersionInfo:  resp.GetVersionInfo(),
		TypeUrl:      resp.GetTypeUrl(),
		Nonce:        resp.GetNonce(),
		ControlPlane: resp.GetControlPlane(),
	}
	headJSON, err := protojson.Marshal(head)
	if err != nil {
		return nil, err
	}
	var out map[string]json.RawMessage
	if err := json.Unmarshal(headJSON, &out); err != nil {
		return nil, err
	}
	resources := make([]json.RawMessage, 0, len(resp.GetResources()))
	for _, res := range resp.GetResources() {
		resources = append(resources, resourceJSON(res))
	}
	raw, err := json.Marshal(resources)
	if err != nil {
		return nil, err
	}
	out["resources"] = raw
	return json.MarshalIndent(out, "", "  ")
}

// undecoded is how debugJSON shows a resource it cannot decode.
type undecoded struct {
	Type  string `json:"@type"`
	Value string `json:"value"` // base64
	Note  string `json:"note"`
}

func resourceJSON(res *anypb.Any) json.RawMessage {
	if b, err := protojson.Marshal(res); err == nil {
		return b
	}
	b, _ := json.Marshal(undecoded{
		Type:  res.GetTypeUrl(),
		Value: base64.StdEncoding.EncodeToString(res.GetValue()),
		Note:  "type not known to this agent: value shown in base64",
	})
	return b
}
