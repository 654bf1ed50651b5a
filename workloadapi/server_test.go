package workloadapi_test

import (
	"bytes"
	"context"
	"crypto"
	"crypto/x509"
	"errors"
	"strings"
	"testing"

	"github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/internal/admission"
	"github.com/meshid/meshid/secretmanager"
	"github.com/meshid/meshid/workloadapi"
)

// recvErr returns the status a stream ends with, failing if it sends a response instead.
func recvErr[T any](t *testing.T, recv func() (*T, error)) *status.Status {
	t.Helper()
	resp, err := recv()
	if err == nil {
		t.Fatalf("got a response %v, want the stream to end", resp)
	}
	return status.Convert(err)
}

// A call without the workload.spiffe.io: true header (one a server-side request forgery could
// make) is refused with InvalidArgument and the standard's message, whatever its method, before
// anything is looked up; each is counted, and logged with the method and the reason, paced.
func TestSecurityHeaderRequired(t *testing.T) {
	t.Parallel()
	f := newFakeSecrets()
	p := newPKI(t)
	f.Publish(p.workload(t, workloadID))
	f.Publish(bundle(p.root.Cert))
	h := start(t, f)
	calls := map[string]func(ctx context.Context) error{
		"FetchX509SVID": func(ctx context.Context) error {
			s, err := h.client.FetchX509SVID(ctx, &workload.X509SVIDRequest{})
			if err != nil {
				return err
			}
			_, err = s.Recv()
			return err
		},
		"FetchX509Bundles": func(ctx context.Context) error {
			s, err := h.client.FetchX509Bundles(ctx, &workload.X509BundlesRequest{})
			if err != nil {
				return err
			}
			_, err = s.Recv()
			return err
		},
		"FetchJWTSVID": func(ctx context.Context) error {
			_, err := h.client.FetchJWTSVID(ctx, &workload.JWTSVIDRequest{Audience: []string{"a"}})
			return err
		},
		"FetchJWTBundles": func(ctx context.Context) error {
			s, err := h.client.FetchJWTBundles(ctx, &workload.JWTBundlesRequest{})
			if err != nil {
				return err
			}
			_, err = s.Recv()
			return err
		},
		"ValidateJWTSVID": func(ctx context.Context) error {
			_, err := h.client.ValidateJWTSVID(ctx, &workload.ValidateJWTSVIDRequest{Audience: "a", Svid: "x"})
			return err
		},
	}
	for method, call := range calls {
		err := call(bare(t))
		if st := status.Convert(err); st.Code() != codes.InvalidArgument || st.Message() != "security header missing from request" {
			t.Errorf("%s without the header: %v, want InvalidArgument", method, err)
		}
		if n := h.metric(t, "meshid_agent_workload_api_calls_total", map[string]string{"method": method}); n != 1 {
			t.Errorf("%s counted %v times, want 1", method, n)
		}
	}
	// A header of another value is no header.
	s, err := h.client.FetchX509SVID(bareWith(t, "workload.spiffe.io", "True"), &workload.X509SVIDRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if st := recvErr(t, s.Recv); st.Code() != codes.InvalidArgument {
		t.Fatalf("header True: %v, want InvalidArgument", st)
	}
	if n := h.refusals(t, "missing_security_header", "InvalidArgument"); n != float64(len(calls)+1) {
		t.Fatalf("%v refusals counted, want %d", n, len(calls)+1)
	}
	logs := h.logs.String()
	if !strings.Contains(logs, "reason=missing_security_header") || !strings.Contains(logs, "protocol=FetchX509SVID") {
		t.Fatalf("the refusals were not logged with their method and reason:\n%s", logs)
	}
}

// The SVID is the identity's: its SPIFFE ID; its chain, leaf first, without the root; its key,
// PKCS#8, the leaf's; and the bundle, every root of ROOTCA.
func TestX509SVIDContents(t *testing.T) {
	t.Parallel()
	f, p := newFakeSecrets(), newPKI(t)
	kp := p.workload(t, workloadID)
	other := newPKI(t).root.Cert // a second root, as during a root rotation
	f.Publish(kp)
	f.Publish(bundle(p.root.Cert, other))
	h := start(t, f)

	s, err := h.client.FetchX509SVID(ctx(t), &workload.X509SVIDRequest{})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := s.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.GetSvids()) != 1 {
		t.Fatalf("%d SVIDs, want 1", len(resp.GetSvids()))
	}
	svid := resp.GetSvids()[0]
	if svid.GetSpiffeId() != workloadID {
		t.Errorf("SPIFFE ID %q, want %q", svid.GetSpiffeId(), workloadID)
	}
	chain, err := x509.ParseCertificates(svid.GetX509Svid())
	if err != nil {
		t.Fatal(err)
	}
	if len(chain) != 2 || !chain[0].Equal(kp.KeyPair.Chain[0]) || !chain[1].Equal(p.inter.Cert) {
		t.Errorf("chain of %d certificates, want the leaf and the intermediate, in that order", len(chain))
	}
	key, err := x509.ParsePKCS8PrivateKey(svid.GetX509SvidKey())
	if err != nil {
		t.Fatalf("the key is not PKCS#8: %v", err)
	}
	type publicKey interface{ Equal(x crypto.PublicKey) bool }
	signer, ok := key.(crypto.Signer)
	if !ok || !signer.Public().(publicKey).Equal(chain[0].PublicKey) {
		t.Errorf("the key does not match the leaf")
	}
	roots, err := x509.ParseCertificates(svid.GetBundle())
	if err != nil {
		t.Fatal(err)
	}
	if len(roots) != 2 || !roots[0].Equal(p.root.Cert) || !roots[1].Equal(other) {
		t.Errorf("bundle of %d certificates, want both roots", len(roots))
	}
	pool := x509.NewCertPool()
	for _, r := range roots {
		pool.AddCert(r)
	}
	inter := x509.NewCertPool()
	inter.AddCert(chain[1])
	if _, err := chain[0].Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Errorf("the SVID does not verify against its bundle: %v", err)
	}
	if logs := h.logs.String(); strings.Contains(logs, "PRIVATE KEY") {
		t.Fatalf("a key was logged:\n%s", logs)
	}
}

// A stream stays open and gets the whole identity again the moment the key pair rotates or the
// roots change, and nothing for a publication that changes no version.
func TestRotationReachesAnOpenStream(t *testing.T) {
	t.Parallel()
	f, p := newFakeSecrets(), newPKI(t)
	first := p.workload(t, workloadID)
	f.Publish(first)
	f.Publish(bundle(p.root.Cert))
	h := start(t, f)
	s, err := h.client.FetchX509SVID(ctx(t), &workload.X509SVIDRequest{})
	if err != nil {
		t.Fatal(err)
	}
	leafOf := func() *x509.Certificate {
		t.Helper()
		resp, err := s.Recv()
		if err != nil {
			t.Fatal(err)
		}
		chain, err := x509.ParseCertificates(resp.GetSvids()[0].GetX509Svid())
		if err != nil {
			t.Fatal(err)
		}
		return chain[0]
	}
	if !leafOf().Equal(first.KeyPair.Leaf()) {
		t.Fatal("the first response is not the key pair")
	}
	if n := h.metric(t, "meshid_agent_workload_api_streams", map[string]string{"method": "FetchX509SVID"}); n != 1 {
		t.Fatalf("%v streams open, want 1", n)
	}

	f.Publish(first) // the same version: not sent again
	second := p.workload(t, workloadID)
	f.Publish(second)
	if !leafOf().Equal(second.KeyPair.Leaf()) {
		t.Fatal("the rotated key pair did not reach the stream (or the unchanged one was sent again)")
	}
	newRoot := newPKI(t).root.Cert
	f.Publish(bundle(p.root.Cert, newRoot))
	resp, err := s.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if roots, _ := x509.ParseCertificates(resp.GetSvids()[0].GetBundle()); len(roots) != 2 || !roots[1].Equal(newRoot) {
		t.Fatalf("the new roots did not reach the stream: %d roots", len(roots))
	}
	if n := h.metric(t, "meshid_agent_workload_api_responses_sent_total", map[string]string{"method": "FetchX509SVID"}); n != 3 {
		t.Fatalf("%v responses counted, want 3", n)
	}
}

// FetchX509Bundles streams the roots keyed by the trust domain's SPIFFE ID, again on a change.
func TestBundlesStream(t *testing.T) {
	t.Parallel()
	f, p := newFakeSecrets(), newPKI(t)
	f.Publish(p.workload(t, workloadID))
	f.Publish(bundle(p.root.Cert))
	h := start(t, f)
	s, err := h.client.FetchX509Bundles(ctx(t), &workload.X509BundlesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range [][]*x509.Certificate{{p.root.Cert}, {p.root.Cert, newPKI(t).root.Cert}} {
		if len(want) > 1 {
			f.Publish(bundle(want...))
		}
		resp, err := s.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.GetBundles()) != 1 {
			t.Fatalf("bundles of %d trust domains, want 1", len(resp.GetBundles()))
		}
		var wantDER []byte
		for _, c := range want {
			wantDER = append(wantDER, c.Raw...)
		}
		if got := resp.GetBundles()["spiffe://cluster.local"]; !bytes.Equal(got, wantDER) {
			t.Fatalf("bundle of spiffe://cluster.local: %d bytes, want the %d roots' %d", len(got), len(want), len(wantDER))
		}
	}
}

// Without a CA (file-mounted certificates), the JWT methods answer FailedPrecondition, saying
// why, and issue nothing.
func TestJWTMethodsWithoutACA(t *testing.T) {
	t.Parallel()
	h := start(t, newFakeSecrets())
	_, err1 := h.client.FetchJWTSVID(ctx(t), &workload.JWTSVIDRequest{Audience: []string{"a"}})
	_, err2 := h.client.ValidateJWTSVID(ctx(t), &workload.ValidateJWTSVIDRequest{Audience: "a", Svid: "x"})
	s, err := h.client.FetchJWTBundles(ctx(t), &workload.JWTBundlesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	_, err3 := s.Recv()
	for i, err := range []error{err1, err2, err3} {
		if st := status.Convert(err); st.Code() != codes.FailedPrecondition || !strings.Contains(st.Message(), "no CA signs JWT-SVIDs") {
			t.Errorf("JWT call %d: %v, want FailedPrecondition saying no CA signs JWT-SVIDs", i, err)
		}
	}
	if n := h.refusals(t, "no_jwt_issuer", "FailedPrecondition"); n != 3 {
		t.Fatalf("%v refusals counted, want 3", n)
	}
}

// Without an identity: a stream waits for the first one; when the source says there is none,
// Unavailable with the reason; a certificate that is not an SVID, or a caller Identify refuses,
// PermissionDenied, as the standard says for a caller with no identity.
func TestNoIdentity(t *testing.T) {
	t.Parallel()
	t.Run("waits for the first", func(t *testing.T) {
		t.Parallel()
		f, p := newFakeSecrets(), newPKI(t)
		h := start(t, f)
		s, err := h.client.FetchX509SVID(ctx(t), &workload.X509SVIDRequest{})
		if err != nil {
			t.Fatal(err)
		}
		kp := p.workload(t, workloadID)
		f.Publish(bundle(p.root.Cert))
		f.Publish(kp) // whether the stream has subscribed yet or not, it gets this
		resp, err := s.Recv()
		if err != nil || resp.GetSvids()[0].GetSpiffeId() != workloadID {
			t.Fatalf("%v, %v; want the first SVID", resp, err)
		}
	})
	t.Run("none to be had", func(t *testing.T) {
		t.Parallel()
		f, p := newFakeSecrets(), newPKI(t)
		f.Publish(bundle(p.root.Cert))
		f.Fail(dflt, errors.New("the CA refused: PermissionDenied"))
		h := start(t, f)
		s, err := h.client.FetchX509SVID(ctx(t), &workload.X509SVIDRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if st := recvErr(t, s.Recv); st.Code() != codes.Unavailable || !strings.Contains(st.Message(), "the CA refused") {
			t.Fatalf("%v, want Unavailable with the reason", st)
		}
		if n := h.refusals(t, "identity_unavailable", "Unavailable"); n != 1 {
			t.Fatalf("%v refusals counted, want 1", n)
		}
	})
	t.Run("not an SVID", func(t *testing.T) {
		t.Parallel()
		f, p := newFakeSecrets(), newPKI(t)
		f.Publish(bundle(p.root.Cert))
		leaf, key := p.inter.IssueWorkload(t, "https://example.com/not-spiffe", 0)
		f.Publish(keyPair(dflt, []*x509.Certificate{leaf, p.inter.Cert}, key))
		h := start(t, f)
		s, err := h.client.FetchX509SVID(ctx(t), &workload.X509SVIDRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if st := recvErr(t, s.Recv); st.Code() != codes.PermissionDenied {
			t.Fatalf("%v, want PermissionDenied", st)
		}
		if n := h.refusals(t, "not_an_svid", "PermissionDenied"); n != 1 {
			t.Fatalf("%v refusals counted, want 1", n)
		}
	})
	// A refusal Identify says it has logged (the attestor's, with the caller's process) is
	// counted, not logged again.
	for _, tc := range []struct {
		name   string
		logged bool
	}{{"caller refused", false}, {"caller refused and logged by the attestor", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := start(t, newFakeSecrets(), func(c *workloadapi.Config) {
				c.Identify = func(context.Context) (workloadapi.Names, error) {
					err := errors.New("no rule matches uid 1000")
					if tc.logged {
						err = admission.Logged(err)
					}
					return workloadapi.Names{}, err
				}
			})
			s, err := h.client.FetchX509Bundles(ctx(t), &workload.X509BundlesRequest{})
			if err != nil {
				t.Fatal(err)
			}
			if st := recvErr(t, s.Recv); st.Code() != codes.PermissionDenied || !strings.Contains(st.Message(), "uid 1000") {
				t.Fatalf("%v, want PermissionDenied with the reason", st)
			}
			if n := h.refusals(t, "no_identity", "PermissionDenied"); n != 1 {
				t.Fatalf("%v refusals counted, want 1", n)
			}
			if logged := strings.Contains(h.logs.String(), "Workload API call refused"); logged == tc.logged {
				t.Fatalf("refusal logged here: %t, want %t:\n%s", logged, !tc.logged, h.logs.String())
			}
		})
	}
}

// The identity Identify names is the one served.
func TestIdentifyChoosesTheSecrets(t *testing.T) {
	t.Parallel()
	f, p := newFakeSecrets(), newPKI(t)
	f.Publish(p.workload(t, workloadID))
	f.Publish(bundle(p.root.Cert))
	h := start(t, f, func(c *workloadapi.Config) {
		c.Identify = func(context.Context) (workloadapi.Names, error) {
			return workloadapi.Names{KeyPair: "file-cert:/x~/y", Bundle: secretmanager.RootCertName}, nil
		}
	})
	s, err := h.client.FetchX509SVID(ctx(t), &workload.X509SVIDRequest{})
	if err != nil {
		t.Fatal(err)
	}
	// The fake serves no file-cert: names: the source's refusal ends the call.
	if st := recvErr(t, s.Recv); st.Code() != codes.PermissionDenied || !strings.Contains(st.Message(), "file-cert:/x~/y") {
		t.Fatalf("%v, want PermissionDenied naming the refused secret", st)
	}
}
