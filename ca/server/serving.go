package server

import (
	"crypto"
	"crypto/tls"
	"fmt"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/clock"
	"github.com/meshid/meshid/internal/istio"
	"github.com/meshid/meshid/internal/pki"
)

// DefaultServingHosts are always in the serving certificate: the name Istio's agents verify by
// default (ISTIOD_SAN), Citadel's, and loopback.
func DefaultServingHosts() []string {
	return []string{istio.IstiodSAN, "istio-ca", "localhost", "127.0.0.1", "::1"}
}

// ServingSigner issues the CA endpoint's own TLS certificate.
type ServingSigner interface {
	SignServing(pub crypto.PublicKey, hosts []string, ttl time.Duration) (*ca.Issued, error)
	Bundle() *ca.Bundle
}

// ServingCertificate keeps the CA endpoint's TLS certificate issued by the CA itself. It reissues
// the certificate when the bundle in service changes or half of its lifetime has passed, so the
// endpoint always presents a chain to the current root.
type ServingCertificate struct {
	signer ServingSigner
	hosts  []string
	ttl    time.Duration
	clock  clock.Clock

	mu       sync.Mutex
	cert     *tls.Certificate
	issuedBy *ca.Bundle
	renewAt  time.Time
}

// DefaultServingTTL is the serving certificate's lifetime.
const DefaultServingTTL = 24 * time.Hour

// NewServingCertificate returns a ServingCertificate for DefaultServingHosts plus extraHosts.
func NewServingCertificate(signer ServingSigner, extraHosts []string, clk clock.Clock) *ServingCertificate {
	hosts := DefaultServingHosts()
	for _, h := range extraHosts {
		if h != "" && !slices.Contains(hosts, h) {
			hosts = append(hosts, h)
		}
	}
	return &ServingCertificate{signer: signer, hosts: hosts, ttl: DefaultServingTTL, clock: clock.OrReal(clk)}
}

// Hosts returns the names and addresses the certificate carries.
func (s *ServingCertificate) Hosts() []string { return s.hosts }

// GetCertificate is a tls.Config.GetCertificate callback.
func (s *ServingCertificate) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	current := s.signer.Bundle()
	if s.cert != nil && s.issuedBy == current && s.clock.Now().Before(s.renewAt) {
		return s.cert, nil
	}
	key, err := pki.GenerateKey(pki.ECDSA, 0)
	if err != nil {
		return nil, err
	}
	issued, err := s.signer.SignServing(key.Public(), s.hosts, s.ttl)
	if err != nil {
		return nil, fmt.Errorf("issue serving certificate: %w", err)
	}
	cert := &tls.Certificate{PrivateKey: key, Leaf: issued.Leaf}
	chain := issued.Chain()
	for _, c := range chain[:len(chain)-1] { // peers hold the root already
		cert.Certificate = append(cert.Certificate, c.Raw)
	}
	lifetime := issued.Leaf.NotAfter.Sub(issued.Leaf.NotBefore)
	s.cert, s.issuedBy, s.renewAt = cert, current, issued.Leaf.NotBefore.Add(lifetime/2)
	return cert, nil
}

// streamWorkers is the number of CA calls served on long-lived goroutines; more calls at once
// each get a goroutine of their own.
const streamWorkers = 16

// GRPCServerOptions are the options of the gRPC server that serves the CA, besides its
// credentials, which are always TLS.
//
// Stream workers: by default grpc runs each call on a new goroutine, whose stack starts small and
// is copied as it grows through the JWT, CSR and signing code, on every call. A few long-lived
// workers keep their grown stacks; grpc still starts a goroutine for a call when none is free, so
// a long-lived stream (the discovery server's) never queues a CreateCertificate behind it.
//
// No read buffer of grpc's own (issue 29): the framer reads from the TLS connection, which holds
// each record it decrypts, so a buffer in front of it saves no system call; grpc's 32 kB
// bufio.Reader per connection was most of what an idle agent's connection cost the CA. (grpc's
// pooled reads, which hold no buffer while idle, serve only bare TCP and Unix connections.)
func GRPCServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{grpc.NumStreamWorkers(streamWorkers), grpc.ReadBufferSize(0)}
}
