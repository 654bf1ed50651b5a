package agent_test

import (
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/agent"
	"github.com/meshid/meshid/controlplane/controlplanetest"
	"github.com/meshid/meshid/secretmanager"
)

// externalToken is the agent's own token: the CA does not trust it, so that only the exchanged
// token can get the agent its certificate and configuration.
const externalToken = "external-identity-token"

// exchangeEndpoint is an RFC 8693 token endpoint over TLS on loopback: for the subject token,
// audience istio-ca and a JWT, it answers a token of the CA's own kind, minted with its token
// key for default/demo, good for an hour. It returns its URL, the file of its root, and the
// count of exchanges.
func exchangeEndpoint(t *testing.T, e *env, subject string) (url, rootFile string, exchanges *atomic.Int32) {
	t.Helper()
	exchanges = new(atomic.Int32)
	const jwtType = "urn:ietf:params:oauth:token-type:jwt"
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Path != "/v1/token" || r.ParseForm() != nil ||
			r.PostForm.Get("grant_type") != "urn:ietf:params:oauth:grant-type:token-exchange" ||
			r.PostForm.Get("subject_token") != subject || r.PostForm.Get("subject_token_type") != jwtType ||
			r.PostForm.Get("requested_token_type") != jwtType || r.PostForm.Get("audience") != "istio-ca" {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			_, _ = w.Write([]byte(`{"error":"invalid_request"}`))
			return
		}
		exchanges.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{
			"access_token":      controlplanetest.Token(t, e.stateDir, "default", "demo", e.clock.Now(), time.Hour),
			"issued_token_type": jwtType, "token_type": "N_A", "expires_in": 3600,
		})
	}))
	t.Cleanup(srv.Close)
	rootFile = filepath.Join(t.TempDir(), "sts-root.pem")
	if err := os.WriteFile(rootFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	return srv.URL + "/v1/token", rootFile, exchanges
}

// With a token exchange URL, the agent exchanges its token file's token and presents only the
// exchanged one: it gets its certificate, and Envoy's ADS through the agent gets its
// configuration, from one exchange shared by the CA client and the xDS proxy.
func TestTokenExchange(t *testing.T) {
	t.Parallel()
	e := newXDSEnv(t)
	url, rootFile, exchanges := exchangeEndpoint(t, e, externalToken)
	tokenPath := filepath.Join(e.dir, "external-token")
	if err := os.WriteFile(tokenPath, []byte(externalToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := e.config(t, tokenPath, nil)
	cfg.CA.TokenExchangeURL, cfg.CA.TokenExchangeRootCert = url, rootFile
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	certificateAndClusters(t, cfg)
	if n := exchanges.Load(); n != 1 {
		t.Fatalf("%d exchanges, want 1 shared by the CA client and the xDS proxy", n)
	}
}

// The GCE metadata server's identity token is exchanged as the token file's is: the CA does not
// trust it (it is unsigned), and the exchanged token alone gets the certificate.
func TestTokenExchangeOfGCEToken(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	enc := base64.RawURLEncoding
	gceToken := enc.EncodeToString([]byte(`{"alg":"none"}`)) + "." +
		enc.EncodeToString(fmt.Appendf(nil, `{"aud":"sts.example","exp":%d}`, e.clock.Now().Add(time.Hour).Unix())) + "."
	metadata := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Metadata-Flavor") != "Google" || r.URL.Query().Get("audience") != "sts.example" {
			http.Error(w, "refused", http.StatusForbidden)
			return
		}
		w.Header().Set("Metadata-Flavor", "Google")
		_, _ = fmt.Fprint(w, gceToken)
	}))
	t.Cleanup(metadata.Close)
	url, rootFile, exchanges := exchangeEndpoint(t, e, gceToken)
	cfg := e.config(t, filepath.Join(e.dir, "no-such-token"), nil)
	cfg.CA.CredentialFetcherType, cfg.CA.CredentialIdentityProvider = agent.CredentialFetcherGCE, "sts.example"
	cfg.CA.MetadataHost = strings.TrimPrefix(metadata.URL, "http://")
	cfg.CA.TokenExchangeURL, cfg.CA.TokenExchangeRootCert, cfg.CA.TokenExchangeAudience = url, rootFile, "istio-ca"
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	a := newAgent(t, cfg)
	certs := issued(t, a)
	runAgent(t, a)
	if s := receive(t, certs, "certificate"); s.KeyPair.Chain[0].URIs[0].String() != demoID {
		t.Fatalf("certificate for %v, want %s", s.KeyPair.Chain[0].URIs, demoID)
	}
	if n := exchanges.Load(); n != 1 {
		t.Fatalf("%d exchanges, want 1", n)
	}
}

// Without the exchange, the same token file gets nothing from the CA: the test above passes on
// the exchanged token alone.
func TestTokenExchangeSubjectAloneRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tokenPath := filepath.Join(e.dir, "external-token")
	if err := os.WriteFile(tokenPath, []byte(externalToken), 0o600); err != nil {
		t.Fatal(err)
	}
	ev := newEvents()
	cfg := e.config(t, tokenPath, ev)
	a := newAgent(t, cfg)
	runAgent(t, a)
	x := ev.await(t, "a failed signing", func(x secretmanager.Event) bool { return x.Kind == secretmanager.EventRenewalFailed })
	if status.Code(x.Err) != codes.Unauthenticated {
		t.Fatalf("signing with the external token: %v, want Unauthenticated", x.Err)
	}
}

func TestTokenExchangeConfigRefused(t *testing.T) {
	t.Parallel()
	cases := []refusal{
		{"http to another host", func(c *agent.Config) { withCA(c); c.CA.TokenExchangeURL = "http://sts.example/v1/token" },
			"CA.TokenExchangeURL", "in clear"},
		{"not a URL", func(c *agent.Config) { withCA(c); c.CA.TokenExchangeURL = "sts.example" }, "CA.TokenExchangeURL", "absolute URL"},
		{"embedded", func(c *agent.Config) { c.CA.TokenExchangeURL = "https://sts.example/v1/token" }, "CA.TokenExchangeURL", "needs CA.Address"},
		{"audience without URL", func(c *agent.Config) { withCA(c); c.CA.TokenExchangeAudience = "ca" }, "CA.TokenExchangeAudience", "has no effect"},
		{"root without URL", func(c *agent.Config) { withCA(c); c.CA.TokenExchangeRootCert = "/r.pem" }, "CA.TokenExchangeRootCert", "has no effect"},
		{"root with http", func(c *agent.Config) {
			withCA(c)
			c.CA.TokenExchangeURL, c.CA.TokenExchangeRootCert = "http://127.0.0.1:8080/token", "/r.pem"
		}, "CA.TokenExchangeRootCert", "nothing is verified"},
	}
	wantRefused(t, cases)
}
