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

// entry is a secret as Envoy receives it, marshaled once and shared by every stream.
type entry struct {
	version  string
	resource *anypb.Any
	notAfter time.Time // the leaf's expiry; zero for a trust bundle
}

// toEntry checks a secret and turns it into Envoy's Secret resource: a tls_certificate for a key
// pair, a validation_context for a trust bundle. Nothing invalid is ever sent (istio#49575): a
// key pair must have a chain, a key that matches its leaf, and a leaf valid at now.
func toEntry(s *secretmanager.Secret, now time.Time) (*entry, error) {
	out := &tlsv3.Secret{Name: s.Name}
	switch {
	case s.Key != nil || len(s.Chain) > 0:
		if err := pki.CheckKeyPair(s.Chain, s.Key, "", now); err != nil {
			return nil, err
		}
		out.Type = &tlsv3.Secret_TlsCertificate{TlsCertificate: &tlsv3.TlsCertificate{
			CertificateChain: inline(s.ChainPEM),
			PrivateKey:       inline(s.KeyPEM),
		}}
	case len(s.Roots) > 0:
		out.Type = &tlsv3.Secret_ValidationContext{ValidationContext: &tlsv3.CertificateValidationContext{
			TrustedCa: inline(s.RootsPEM),
		}}
	default:
		return nil, errors.New("the secret holds neither a key pair nor a root")
	}
	resource, err := anypb.New(out)
	if err != nil {
		return nil, fmt.Errorf("marshal secret %s: %w", s.Name, err)
	}
	e := &entry{version: s.Version, resource: resource}
	if len(s.Chain) > 0 {
		e.notAfter = s.Chain[0].NotAfter
	}
	return e, nil
}

func inline(b []byte) *core.DataSource {
	return &core.DataSource{Specifier: &core.DataSource_InlineBytes{InlineBytes: b}}
}
