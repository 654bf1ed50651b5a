package caclient_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshid/meshid/caclient"
	"github.com/meshid/meshid/internal/pki"
)

// A trusted node account gets a certificate for the workload it names; an account the CA does
// not trust is refused, and the error says why.
func TestForIdentitySignsTheImpersonatedIdentity(t *testing.T) {
	t.Parallel()
	cfg := caConfig(t.TempDir(), "127.0.0.1:0")
	cfg.TrustedNodeAccounts = []string{"kube-system/node-agent"}
	ca := startCAWith(t, cfg)
	workload := pki.SPIFFEID{TrustDomain: trustDomain, Namespace: "ns1", ServiceAccount: "app"}

	tests := []struct {
		name    string
		ns, sa  string
		wantErr string // empty: signed for workload
	}{
		{name: "trusted node account", ns: "kube-system", sa: "node-agent"},
		{name: "untrusted account", ns: "ns1", sa: "other", wantErr: "not a trusted node account"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := ca.config()
			c.TokenPath = ca.tokenFile(t, tc.ns, tc.sa)
			client := newClient(t, c)
			signer, err := client.ForIdentity(workload)
			if err != nil {
				t.Fatal(err)
			}
			if signer.Identity() != workload {
				t.Fatalf("Identity() = %v", signer.Identity())
			}
			csr, _ := newCSR(t, pki.ECDSA, workload)
			chain, err := signer.Sign(t.Context(), csr, time.Hour)
			jwt, jwtErr := signer.MintJWTSVID(t.Context(), []string{"bank"}, time.Minute)
			if tc.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				if got := leafID(t, chain[0]); got != workload.String() {
					t.Fatalf("leaf is %s, want %s", got, workload)
				}
				if jwtErr != nil || jwt.SPIFFEID != workload.String() {
					t.Fatalf("JWT-SVID %+v, %v; want one of %s", jwt.SPIFFEID, jwtErr, workload)
				}
				return
			}
			if status.Code(jwtErr) != codes.PermissionDenied || !strings.Contains(jwtErr.Error(), tc.wantErr) {
				t.Errorf("JWT-SVID error %v, want PermissionDenied saying %q", jwtErr, tc.wantErr)
			}
			if !errors.Is(err, caclient.ErrRejected) || status.Code(err) != codes.PermissionDenied {
				t.Fatalf("error %v, want a PermissionDenied rejection", err)
			}
			for _, want := range []string{tc.wantErr, workload.String(), "refused to sign"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not say %q", err, want)
				}
			}
		})
	}
}

// The client's own Sign sends no impersonation: the trusted node account gets its own identity.
func TestSignWithoutImpersonationIsTheCallersIdentity(t *testing.T) {
	t.Parallel()
	cfg := caConfig(t.TempDir(), "127.0.0.1:0")
	cfg.TrustedNodeAccounts = []string{"kube-system/node-agent"}
	ca := startCAWith(t, cfg)
	c := ca.config()
	c.TokenPath = ca.tokenFile(t, "kube-system", "node-agent")
	client := newClient(t, c)
	self := pki.SPIFFEID{TrustDomain: trustDomain, Namespace: "kube-system", ServiceAccount: "node-agent"}
	csr, _ := newCSR(t, pki.ECDSA, self)
	if got := leafID(t, client.mustSign(t, csr, time.Hour)); got != self.String() {
		t.Fatalf("leaf is %s, want %s", got, self)
	}
}

// The Mesh CA's protocol has no metadata to name another identity in.
func TestForIdentityRefusesTheMeshCAProtocol(t *testing.T) {
	t.Parallel()
	client := newClient(t, caclient.Config{Address: "127.0.0.1:1", Provider: caclient.ProviderGoogleCA})
	_, err := client.ForIdentity(pki.SPIFFEID{TrustDomain: trustDomain, Namespace: "ns1", ServiceAccount: "app"})
	if !errors.Is(err, caclient.ErrNoImpersonation) {
		t.Fatalf("error %v, want ErrNoImpersonation", err)
	}
}
