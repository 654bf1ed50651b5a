package agent

import (
	"encoding/json"
	"net/http"
	"time"

	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/secretmanager"
)

// secretStatus is one secret as /debug/secrets shows it.
type secretStatus struct {
	Name string `json:"name"`
	// Valid says whether it is served now (as /healthz/ready judges "default"); Error why not, or
	// why the last attempt to replace it failed.
	Valid        bool      `json:"valid"`
	Error        string    `json:"error,omitempty"`
	SPIFFEID     string    `json:"spiffe_id,omitempty"`
	Serial       string    `json:"serial,omitempty"`
	Version      string    `json:"version,omitempty"`
	NotBefore    time.Time `json:"not_before,omitzero"`
	NotAfter     time.Time `json:"not_after,omitzero"`
	NextRotation time.Time `json:"next_rotation,omitzero"`
	TimeLeft     string    `json:"time_left,omitempty"`
	Roots        int       `json:"roots,omitempty"`
	Source       string    `json:"source,omitempty"`
	Streams      int       `json:"subscribed_streams"`
}

func (a *Agent) debugHandler(clk clock.Clock, xdsDebug bool) http.Handler {
	mux := http.NewServeMux()
	if xdsDebug && a.xds != nil {
		// istio.io/debug/<type> from the discovery server, for this proxy's node.
		mux.Handle("/debug/", a.xds.DebugHandler())
	}
	mux.HandleFunc("GET /debug/secrets", func(w http.ResponseWriter, _ *http.Request) {
		out := []secretStatus{}
		if a.secrets != nil {
			subscribed := a.sds.Subscriptions()
			for _, st := range a.secrets.Snapshot() {
				out = append(out, describe(st.Name, st.Valid, st.Error, st.Secret, subscribed[st.Name], clk.Now()))
			}
		}
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(map[string]any{"source": a.source, "sds_socket": a.socketPath, "secrets": out})
	})
	return mux
}

func describe(name string, valid bool, why string, s *secretmanager.Secret, streams int, now time.Time) secretStatus {
	st := secretStatus{Name: name, Valid: valid, Error: why, Streams: streams}
	if s == nil {
		return st
	}
	st.Version, st.Source = s.Version, string(s.Source)
	if s.Bundle != nil {
		st.Roots = len(s.Bundle.Roots)
	}
	if s.KeyPair != nil {
		leaf := s.KeyPair.Leaf()
		if len(leaf.URIs) == 1 {
			st.SPIFFEID = leaf.URIs[0].String()
		}
		st.Serial = leaf.SerialNumber.Text(16)
		st.NotBefore, st.NotAfter, st.NextRotation = leaf.NotBefore, leaf.NotAfter, s.RenewAt
		st.TimeLeft = leaf.NotAfter.Sub(now).Round(time.Second).String()
	}
	return st
}
