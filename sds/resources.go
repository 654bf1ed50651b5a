package sds

import (
	"errors"
	"fmt"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/secretmanager"
)

// SecretTypeURL is the type of every resource this server sends.
const SecretTypeURL = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"

// toResource checks a secret and turns it into Envoy's Secret resource: a tls_certificate for a
// key pair, a validation_context for a trust bundle. Nothing invalid is ever sent (istio#49575):
// a key pair must have a chain, a key that matches its leaf, and a leaf not expired at now (and
// valid from then, or from a NotBefore less than pki.MaxClockSkew ahead of it). notAfter
// is the leaf's expiry, zero for a trust bundle.
func toResource(s *secretmanager.Secret, now time.Time) (resource *anypb.Any, notAfter time.Time, err error) {
	out := &tlsv3.Secret{Name: s.Name}
	switch {
	case s.KeyPair != nil:
		// A NotBefore in our future is our clock behind the CA's: Envoy serves such a certificate
		// and its peers judge it on their clocks (see pki.ValidationTime). An expired one is not sent.
		at, err := pki.ValidationTime(now, s.KeyPair.Chain...)
		if err == nil {
			err = pki.CheckKeyPair(s.KeyPair.Chain, s.KeyPair.Key, "", at)
		}
		if err != nil {
			return nil, time.Time{}, err
		}
		out.Type = &tlsv3.Secret_TlsCertificate{TlsCertificate: &tlsv3.TlsCertificate{
			CertificateChain: inline(s.KeyPair.ChainPEM),
			PrivateKey:       inline(s.KeyPair.KeyPEM),
		}}
		notAfter = s.KeyPair.Leaf().NotAfter
	case s.Bundle != nil && len(s.Bundle.Roots) > 0:
		out.Type = &tlsv3.Secret_ValidationContext{ValidationContext: &tlsv3.CertificateValidationContext{
			TrustedCa: inline(s.Bundle.PEM),
		}}
	default:
		return nil, time.Time{}, errors.New("the secret holds neither a key pair nor a root")
	}
	resource, err = anypb.New(out)
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("marshal secret %s: %w", s.Name, err)
	}
	return resource, notAfter, nil
}

func inline(b []byte) *core.DataSource {
	return &core.DataSource{Specifier: &core.DataSource_InlineBytes{InlineBytes: b}}
}
