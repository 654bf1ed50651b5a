package agent

import (
	"encoding/json"
	"net/http"
	"time"

	"github.com/meshid/meshid/internal/clock"
)

// secretStatus is one secret as /debug/secrets shows it.
type secretStatus struct {
	Name         string    `json:"name"`
	SPIFFEID     string    `json:"spiffe_id,omitempty"`
	Serial       string    `json:"serial,omitempty"`
	Version      string    `json:"version"`
	NotBefore    time.Time `json:"not_before,omitzero"`
	NotAfter     time.Time `json:"not_after,omitzero"`
	NextRotation time.Time `json:"next_rotation,omitzero"`
	TimeLeft     string    `json:"time_left,omitempty"`
	Roots        int       `json:"roots,omitempty"`
	Source       string    `json:"source"`
	Streams      int       `json:"subscribed_streams"`
}

func (a *Agent) debugHandler(clk clock.Clock) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /debug/secrets", func(w http.ResponseWriter, _ *http.Request) {
		out := []secretStatus{}
		if a.secrets != nil {
			subscribed := a.sds.Subscriptions()
			for _, s := range a.secrets.Snapshot() {
				st := secretStatus{Name: s.Name, Version: s.Version, Source: s.Source, Roots: len(s.Roots), Streams: subscribed[s.Name]}
				if len(s.Chain) > 0 {
					leaf := s.Chain[0]
					if len(leaf.URIs) == 1 {
						st.SPIFFEID = leaf.URIs[0].String()
					}
					st.Serial = leaf.SerialNumber.Text(16)
					st.NotBefore, st.NotAfter, st.NextRotation = leaf.NotBefore, leaf.NotAfter, s.RenewAt
					st.TimeLeft = leaf.NotAfter.Sub(clk.Now()).Round(time.Second).String()
				}
				out = append(out, st)
			}
		}
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(map[string]any{"source": a.source, "sds_socket": a.socketPath, "secrets": out})
	})
	return mux
}
