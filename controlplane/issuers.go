package controlplane

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	caserver "github.com/meshid/meshid/ca/server"
	"github.com/meshid/meshid/ca/token"
	"github.com/meshid/meshid/internal/configerr"
	"github.com/meshid/meshid/internal/logkey"
	"github.com/meshid/meshid/internal/pki"
)

// Bounds of a JWKS fetch: an issuer's key set is a few kilobytes.
const (
	maxJWKSSize      = 1 << 20
	jwksFetchTimeout = 30 * time.Second
)

// newIssuers builds a verifier per JWT rule, each fetching its JWKS over HTTPS (verified against
// the system roots, or JWTRuleRootCert's alone when it is set), and counts the fetches.
func newIssuers(cfg Config, reg prometheus.Registerer) ([]*token.Issuer, error) {
	if len(cfg.JWTRules) == 0 {
		return nil, nil
	}
	client, err := jwksClient(cfg.JWTRuleRootCert)
	if err != nil {
		return nil, err
	}
	refreshes := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "meshid", Subsystem: "ca", Name: "jwks_refreshes_total",
		Help: "Fetches of the JWKS of the JWT rules' issuers, by issuer and result (ok, failed).",
	}, []string{"issuer", "result"})
	if err := reg.Register(refreshes); err != nil {
		return nil, err
	}
	issuers := make([]*token.Issuer, 0, len(cfg.JWTRules))
	for _, rule := range cfg.JWTRules {
		for _, result := range []string{"ok", "failed"} {
			refreshes.WithLabelValues(rule.Issuer, result) // shown at 0 before the first fetch
		}
		iss, err := token.NewIssuer(token.IssuerConfig{
			Rule:   rule,
			Fetch:  fetchJWKS(client, rule.JWKSURI),
			Clock:  cfg.Clock,
			Logger: cfg.Logger,
			OnRefresh: func(ok bool) {
				result := "ok"
				if !ok {
					result = "failed"
				}
				refreshes.WithLabelValues(rule.Issuer, result).Inc()
			},
		})
		if err != nil {
			return nil, err
		}
		cfg.Logger.Info("trusting an external token issuer", logkey.Issuer, rule.Issuer, logkey.URL, rule.JWKSURI,
			logkey.Audience, rule.Audiences)
		issuers = append(issuers, iss)
	}
	return issuers, nil
}

// jwksClient is an HTTPS client that verifies the issuer's certificate.
func jwksClient(rootFile string) (*http.Client, error) {
	tlsConfig := &tls.Config{MinVersion: tls.VersionTLS12}
	if rootFile != "" {
		data, err := os.ReadFile(rootFile)
		if err != nil {
			return nil, refused{configerr.Errorf("JWTRuleRootCert", "{JWTRuleRootCert}: %w", err)}
		}
		certs, err := pki.ParseCertificates(data)
		if err == nil && len(certs) == 0 {
			err = fmt.Errorf("no certificate in %s", rootFile)
		}
		if err != nil {
			return nil, refused{configerr.Errorf("JWTRuleRootCert", "{JWTRuleRootCert}: %w", err)}
		}
		pool := x509.NewCertPool()
		for _, c := range certs {
			pool.AddCert(c)
		}
		tlsConfig.RootCAs = pool
	}
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.TLSClientConfig = tlsConfig
	transport.Proxy = http.ProxyFromEnvironment
	return &http.Client{
		Transport: transport,
		Timeout:   jwksFetchTimeout,
		// A redirect to http:// would drop the verification the rule asked for.
		CheckRedirect: func(req *http.Request, via []*http.Request) error {
			if req.URL.Scheme != "https" {
				return fmt.Errorf("refusing a redirect to %s: the JWKS must come over https", req.URL.Redacted())
			}
			if len(via) >= 5 {
				return fmt.Errorf("stopped after %d redirects", len(via))
			}
			return nil
		},
	}, nil
}

func fetchJWKS(client *http.Client, uri string) token.JWKSFetcher {
	return func(ctx context.Context) ([]byte, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, uri, nil)
		if err != nil {
			return nil, err
		}
		req.Header.Set("Accept", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			return nil, err
		}
		defer func() { _ = resp.Body.Close() }()
		if resp.StatusCode != http.StatusOK {
			return nil, fmt.Errorf("GET %s: %s", uri, resp.Status)
		}
		body, err := io.ReadAll(io.LimitReader(resp.Body, maxJWKSSize+1))
		if err != nil {
			return nil, fmt.Errorf("GET %s: %w", uri, err)
		}
		if len(body) > maxJWKSSize {
			return nil, fmt.Errorf("GET %s: the JWKS is larger than %d bytes", uri, maxJWKSSize)
		}
		return body, nil
	}
}

// issuerVerifiers gives the issuers to the CA server's authenticator.
func issuerVerifiers(issuers []*token.Issuer) []caserver.IssuerVerifier {
	out := make([]caserver.IssuerVerifier, len(issuers))
	for i, iss := range issuers {
		out[i] = iss
	}
	return out
}
