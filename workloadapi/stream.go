package workloadapi

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"sync"

	"github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/logkey"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/secretmanager"
)

// follower follows the secrets of one stream: the secret manager tells it of every change (from
// its own goroutines, and must not be blocked), and it wakes the stream's handler, which reads
// the latest state and sends what changed. Changes that come faster than the client reads
// collapse into one wake-up: each response is complete, so only the latest matters.
type follower struct {
	wake    chan struct{} // buffered, one pending wake-up
	cancels []func()

	mu     sync.Mutex
	states []state // of each name, in order
}

type state struct {
	known  bool
	secret *secretmanager.Secret
	err    error
}

// follow subscribes to names; close ends the subscriptions.
func (s *Server) follow(names ...string) (*follower, error) {
	f := &follower{wake: make(chan struct{}, 1), states: make([]state, len(names))}
	for i, name := range names {
		cancel, err := s.cfg.Secrets.Subscribe(name, func(secret *secretmanager.Secret, err error) {
			f.mu.Lock()
			f.states[i] = state{known: true, secret: secret, err: err}
			f.mu.Unlock()
			select {
			case f.wake <- struct{}{}:
			default:
			}
		})
		if err != nil {
			f.close()
			return nil, fmt.Errorf("secret %q: %w", name, err)
		}
		f.cancels = append(f.cancels, cancel)
	}
	return f, nil
}

func (f *follower) close() {
	for _, cancel := range f.cancels {
		cancel()
	}
}

// current returns the secrets, once every one is known; why says why one is missing.
func (f *follower) current() (secrets []*secretmanager.Secret, known bool, why error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	secrets = make([]*secretmanager.Secret, len(f.states))
	for i, st := range f.states {
		if !st.known {
			return nil, false, nil
		}
		if st.secret == nil {
			return nil, true, st.err
		}
		secrets[i] = st.secret
	}
	return secrets, true, nil
}

// serve sends the caller's identity on a stream as build makes it from its key pair and bundle:
// as soon as both are known, and again whenever either's version changes, until the client goes
// or the server stops. Until the secret manager has said anything of them the stream waits (the
// first certificate is on its way); when it says there is none, the stream ends with Unavailable
// and the reason, and the standard's clients retry with a backoff.
func serve[T any](s *Server, ctx context.Context, method string, names Names, build func(keyPair, bundle *secretmanager.Secret) (*T, error), send func(*T) error) error {
	f, err := s.follow(names.KeyPair, names.Bundle)
	if err != nil {
		return s.refuse(ctx, method, reasonNoIdentity, status.Errorf(codes.PermissionDenied, "no identity issued: %s", err.Error()))
	}
	defer f.close()
	streams := s.metrics.streams.WithLabelValues(method)
	streams.Inc()
	defer streams.Dec()
	sent := make([]string, 2) // the versions the client has
	for {
		select {
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		case <-f.wake:
		}
		secrets, known, why := f.current()
		switch {
		case !known:
			continue
		case why != nil:
			return s.refuse(ctx, method, reasonUnavailable, status.Errorf(codes.Unavailable, "no identity issued: %s", why.Error()))
		case secrets[0].KeyPair == nil || secrets[1].Bundle == nil:
			return s.refuse(ctx, method, reasonNotAnSVID, status.Errorf(codes.PermissionDenied, "no identity issued: %q is not a key pair or %q not a trust bundle", names.KeyPair, names.Bundle))
		case secrets[0].Version == sent[0] && secrets[1].Version == sent[1]:
			continue
		}
		resp, err := build(secrets[0], secrets[1])
		if err != nil {
			return s.refuse(ctx, method, reasonNotAnSVID, status.Errorf(codes.PermissionDenied, "no identity issued: %s", err.Error()))
		}
		if err := send(resp); err != nil {
			return err
		}
		sent[0], sent[1] = secrets[0].Version, secrets[1].Version
		s.metrics.updates.WithLabelValues(method).Inc()
	}
}

// errNotAnSVID reports a certificate that is not an X.509-SVID.
var errNotAnSVID = errors.New("the certificate is not an X.509-SVID")

// x509SVIDResponse is the caller's one SVID: its SPIFFE ID, its chain (leaf first, without the
// root), its key (PKCS#8) and its trust domain's roots, each as concatenated DER.
func x509SVIDResponse(keyPair, bundle *secretmanager.Secret) (*workload.X509SVIDResponse, error) {
	kp := keyPair.KeyPair
	id, err := spiffeID(kp.Leaf())
	if err != nil {
		return nil, err
	}
	key, err := x509.MarshalPKCS8PrivateKey(kp.Key)
	if err != nil {
		return nil, fmt.Errorf("the private key: %w", err)
	}
	return &workload.X509SVIDResponse{Svids: []*workload.X509SVID{{
		SpiffeId:    id.String(),
		X509Svid:    concat(withoutRoot(kp.Chain)),
		X509SvidKey: key,
		Bundle:      concat(bundle.Bundle.Roots),
	}}}, nil
}

// x509BundlesResponse is the roots of the caller's trust domain, keyed by the trust domain's
// SPIFFE ID (spiffe://TRUST_DOMAIN).
func x509BundlesResponse(keyPair, bundle *secretmanager.Secret) (*workload.X509BundlesResponse, error) {
	id, err := spiffeID(keyPair.KeyPair.Leaf())
	if err != nil {
		return nil, err
	}
	return &workload.X509BundlesResponse{Bundles: map[string][]byte{"spiffe://" + id.Host: concat(bundle.Bundle.Roots)}}, nil
}

// spiffeID returns the leaf's SPIFFE ID: an X.509-SVID has exactly one URI SAN, a spiffe:// one
// with a trust domain.
func spiffeID(leaf *x509.Certificate) (*url.URL, error) {
	if len(leaf.URIs) != 1 {
		return nil, fmt.Errorf("%w: it has %d URI SANs, not one", errNotAnSVID, len(leaf.URIs))
	}
	u := leaf.URIs[0]
	if !isSPIFFEID(u) {
		return nil, fmt.Errorf("%w: its URI SAN is not a SPIFFE ID", errNotAnSVID)
	}
	return u, nil
}

func isSPIFFEID(u *url.URL) bool {
	return u.Scheme == "spiffe" && u.Host != "" && u.User == nil && u.Port() == "" && u.RawQuery == "" && u.Fragment == "" && !u.ForceQuery && u.Opaque == ""
}

// errNotASPIFFEID reports a JWT-SVID whose sub is not a SPIFFE ID.
var errNotASPIFFEID = errors.New("not a SPIFFE ID")

// parseSPIFFEID parses a JWT-SVID's sub.
func parseSPIFFEID(s string) (*url.URL, error) {
	u, err := url.Parse(s)
	if err != nil || !isSPIFFEID(u) {
		return nil, fmt.Errorf("sub %q: %w", logkey.Untrusted(s), errNotASPIFFEID)
	}
	return u, nil
}

// withoutRoot returns chain without a self-signed certificate at its end: the root is the
// bundle's, and the standard's chain carries the leaf and intermediates only.
func withoutRoot(chain []*x509.Certificate) []*x509.Certificate {
	if n := len(chain); n > 1 {
		last := chain[n-1]
		if pki.IsSelfSigned(last) {
			return chain[:n-1]
		}
	}
	return chain
}

func concat(certs []*x509.Certificate) []byte {
	var b []byte
	for _, c := range certs {
		b = append(b, c.Raw...)
	}
	return b
}
