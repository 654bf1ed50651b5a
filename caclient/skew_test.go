package caclient_test

import (
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

// The CA's certificate is checked on the client's clock. The CA reissues it from its own clock,
// backdated by two minutes only: a client whose clock is behind by more finds its NotBefore in
// the future, and must reach the CA all the same, up to pki.MaxClockSkew. An expired certificate,
// or one valid only days from now, is refused.
func TestCACertificateCheckedOnTheClientClock(t *testing.T) {
	t.Parallel()
	now := time.Now().Truncate(time.Second)
	// The CA's root was made two days earlier, as in any CA long in service.
	caClock := testutil.NewFakeClock(now.Add(-48 * time.Hour))
	cfg := caConfig(t.TempDir(), "127.0.0.1:0")
	cfg.Clock = caClock
	ca := startCAWith(t, cfg)
	caClock.Set(now)
	tokenPath := t.TempDir() + "/token"
	writeFile(t, tokenPath, ca.token(t, "ns1", "sa1", now, 72*time.Hour))

	for _, tc := range []struct {
		name    string
		behind  time.Duration // the client's clock behind the CA's
		wantErr string        // "" for success
	}{
		{"in step", 0, ""},
		{"5m behind", 5 * time.Minute, ""},
		{"a day behind", pki.MaxClockSkew, ""},
		{"more than a day behind", pki.MaxClockSkew + 3*time.Minute, "is its clock wrong?"},
		{"ahead past the certificate's expiry", -25 * time.Hour, "expired"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := ca.config()
			c.TokenPath = tokenPath
			client := newClient(t, c)
			client.clock.Set(now.Add(-tc.behind))
			csr, _ := newCSR(t, pki.ECDSA, spiffeID("ns1", "sa1"))
			res := client.sign(t, csr, time.Hour)
			if tc.wantErr == "" {
				if res.err != nil {
					t.Fatal(res.err)
				}
				return
			}
			if res.err == nil || !strings.Contains(res.err.Error(), tc.wantErr) {
				t.Fatalf("Sign: %v, want an error naming %q", res.err, tc.wantErr)
			}
		})
	}
}
