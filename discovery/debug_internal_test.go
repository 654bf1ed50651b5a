package discovery

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/pki"
)

type allowAll struct{}

func (allowAll) Authorize(context.Context) (Caller, error) { return prodCaller, nil }

func (allowAll) Serves(context.Context, Caller) error { return nil }

var prodCaller = Caller{Identity: pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "prod", ServiceAccount: "test"}}

// At most maxDebugAnswers debug answers are built at once over every stream (each can be as
// large as an answer may be); a request waiting for its turn waits only as long as its stream.
func TestDebugAnswersAreBuiltFewAtOnce(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "xds.yaml")
	if err := os.WriteFile(path, []byte("clusters: [{name: backend, connect_timeout: 1s}]"), 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := NewServer(ServerConfig{ConfigPath: path, Authorizer: allowAll{}})
	if err != nil {
		t.Fatal(err)
	}
	st := &stream{caller: prodCaller}
	req := &discoveryv3.DiscoveryRequest{TypeUrl: DebugConfigDump}
	// Every slot is taken, as by maxDebugAnswers answers being built.
	if !s.debugSlots.TryAcquire(maxDebugAnswers) {
		t.Fatal("the debug slots are not free at start")
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		_, err := s.debug(ctx, st, req)
		done <- err
	}()
	cancel() // the stream ends while its request waits
	if err := <-done; status.Code(err) != codes.Canceled {
		t.Fatalf("a debug request past the slots, its stream ended: %v, want Canceled", err)
	}
	s.debugSlots.Release(1)
	if resp, err := s.debug(t.Context(), st, req); err != nil || len(resp.GetResources()) != 1 {
		t.Fatalf("a debug request with a slot free: %v, %v", resp, err)
	}
}
