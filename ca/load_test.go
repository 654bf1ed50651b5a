package ca_test

import (
	"bytes"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/pki"
	"github.com/meshid/meshid/internal/testutil"
)

func TestLoadPluggedInLayouts(t *testing.T) {
	t.Parallel()
	pemOf := testutil.CertPEM
	tests := []struct {
		name      string
		files     func(t *testing.T, h hierarchy) map[string][]byte
		signer    func(h hierarchy) *testutil.CA
		wantChain func(h hierarchy) []*x509.Certificate // signing certificate first, root last
	}{
		{
			name: "istio, cert-chain.pem is intermediate and root",
			files: func(t *testing.T, h hierarchy) map[string][]byte {
				return map[string][]byte{
					ca.CACertFile:    pemOf(h.int1.Cert),
					ca.CAKeyFile:     testutil.KeyPEM(t, h.int1.Key),
					ca.CertChainFile: pemOf(h.int1.Cert, h.root.Cert),
					ca.RootCertFile:  pemOf(h.root.Cert),
				}
			},
			signer:    func(h hierarchy) *testutil.CA { return h.int1 },
			wantChain: func(h hierarchy) []*x509.Certificate { return []*x509.Certificate{h.int1.Cert, h.root.Cert} },
		},
		{
			name: "istio, cert-chain.pem is the intermediate only",
			files: func(t *testing.T, h hierarchy) map[string][]byte {
				return map[string][]byte{
					ca.CACertFile:    pemOf(h.int1.Cert),
					ca.CAKeyFile:     testutil.KeyPEM(t, h.int1.Key),
					ca.CertChainFile: pemOf(h.int1.Cert),
					ca.RootCertFile:  pemOf(h.root.Cert),
				}
			},
			signer:    func(h hierarchy) *testutil.CA { return h.int1 },
			wantChain: func(h hierarchy) []*x509.Certificate { return []*x509.Certificate{h.int1.Cert, h.root.Cert} },
		},
		{
			name: "istio, two intermediates, cert-chain.pem ends with the root",
			files: func(t *testing.T, h hierarchy) map[string][]byte {
				return map[string][]byte{
					ca.CACertFile:    pemOf(h.int2.Cert),
					ca.CAKeyFile:     testutil.KeyPEM(t, h.int2.Key),
					ca.CertChainFile: pemOf(h.int2.Cert, h.int1.Cert, h.root.Cert),
					ca.RootCertFile:  pemOf(h.root.Cert),
				}
			},
			signer: func(h hierarchy) *testutil.CA { return h.int2 },
			wantChain: func(h hierarchy) []*x509.Certificate {
				return []*x509.Certificate{h.int2.Cert, h.int1.Cert, h.root.Cert}
			},
		},
		{
			name: "istio, two intermediates, cert-chain.pem holds only the upper intermediate",
			files: func(t *testing.T, h hierarchy) map[string][]byte {
				return map[string][]byte{
					ca.CACertFile:    pemOf(h.int2.Cert),
					ca.CAKeyFile:     testutil.KeyPEM(t, h.int2.Key),
					ca.CertChainFile: pemOf(h.int1.Cert),
					ca.RootCertFile:  pemOf(h.root.Cert),
				}
			},
			signer: func(h hierarchy) *testutil.CA { return h.int2 },
			wantChain: func(h hierarchy) []*x509.Certificate {
				return []*x509.Certificate{h.int2.Cert, h.int1.Cert, h.root.Cert}
			},
		},
		{
			name: "istio, ca-cert.pem carries the chain and cert-chain.pem is empty",
			files: func(t *testing.T, h hierarchy) map[string][]byte {
				return map[string][]byte{
					ca.CACertFile:    pemOf(h.int2.Cert, h.int1.Cert),
					ca.CAKeyFile:     testutil.KeyPEM(t, h.int2.Key),
					ca.CertChainFile: {},
					ca.RootCertFile:  pemOf(h.root.Cert),
				}
			},
			signer: func(h hierarchy) *testutil.CA { return h.int2 },
			wantChain: func(h hierarchy) []*x509.Certificate {
				return []*x509.Certificate{h.int2.Cert, h.int1.Cert, h.root.Cert}
			},
		},
		{
			name: "istio, the root signs",
			files: func(t *testing.T, h hierarchy) map[string][]byte {
				return map[string][]byte{
					ca.CACertFile:    pemOf(h.root.Cert),
					ca.CAKeyFile:     testutil.KeyPEM(t, h.root.Key),
					ca.CertChainFile: pemOf(h.root.Cert),
					ca.RootCertFile:  pemOf(h.root.Cert),
				}
			},
			signer:    func(h hierarchy) *testutil.CA { return h.root },
			wantChain: func(h hierarchy) []*x509.Certificate { return []*x509.Certificate{h.root.Cert} },
		},
		{
			name: "tls, tls.crt is the signing cert followed by its chain",
			files: func(t *testing.T, h hierarchy) map[string][]byte {
				return map[string][]byte{
					ca.TLSCertFile: pemOf(h.int2.Cert, h.int1.Cert),
					ca.TLSKeyFile:  testutil.KeyPEM(t, h.int2.Key),
					ca.TLSCAFile:   pemOf(h.root.Cert),
				}
			},
			signer: func(h hierarchy) *testutil.CA { return h.int2 },
			wantChain: func(h hierarchy) []*x509.Certificate {
				return []*x509.Certificate{h.int2.Cert, h.int1.Cert, h.root.Cert}
			},
		},
		{
			name: "tls, tls.crt chain ends with the root",
			files: func(t *testing.T, h hierarchy) map[string][]byte {
				return map[string][]byte{
					ca.TLSCertFile: pemOf(h.int1.Cert, h.root.Cert),
					ca.TLSKeyFile:  testutil.KeyPEM(t, h.int1.Key),
					ca.TLSCAFile:   pemOf(h.root.Cert),
				}
			},
			signer:    func(h hierarchy) *testutil.CA { return h.int1 },
			wantChain: func(h hierarchy) []*x509.Certificate { return []*x509.Certificate{h.int1.Cert, h.root.Cert} },
		},
		{
			name: "tls, empty ca.crt and a self-signed root in tls.crt",
			files: func(t *testing.T, h hierarchy) map[string][]byte {
				return map[string][]byte{
					ca.TLSCertFile: pemOf(h.root.Cert),
					ca.TLSKeyFile:  testutil.KeyPEM(t, h.root.Key),
					ca.TLSCAFile:   {},
				}
			},
			signer:    func(h hierarchy) *testutil.CA { return h.root },
			wantChain: func(h hierarchy) []*x509.Certificate { return []*x509.Certificate{h.root.Cert} },
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			now := baseTime()
			h := newHierarchy(t, now, defaultLifetimes())
			dir := writeDir(t, tc.files(t, h))

			b, err := ca.LoadPluggedIn(dir, now)
			if err != nil {
				t.Fatalf("LoadPluggedIn: %v", err)
			}
			want := tc.wantChain(h)
			if b.Source() != ca.SourcePluggedIn {
				t.Errorf("Source = %q, want %q", b.Source(), ca.SourcePluggedIn)
			}
			if !b.SigningCert().Equal(tc.signer(h).Cert) {
				t.Errorf("SigningCert = %q, want %q", b.SigningCert().Subject.CommonName, tc.signer(h).Cert.Subject.CommonName)
			}
			if !sameCerts(b.Chain(), want) {
				t.Fatalf("Chain = %v, want %v", names(b.Chain()), names(want))
			}
			if !b.Root().Equal(h.root.Cert) {
				t.Errorf("Root = %q, want the root", b.Root().Subject.CommonName)
			}
			if !sameCerts(b.Roots(), []*x509.Certificate{h.root.Cert}) {
				t.Errorf("Roots = %v, want [root]", names(b.Roots()))
			}
			verifyPath(t, b.Chain(), b.Roots(), now)

			// A leaf's response chain: leaf, intermediates, the root exactly once and last.
			a := ca.New(ca.Config{Clock: testutil.NewFakeClock(now)}, b)
			id := testID(t, "default", "web")
			csr, _ := workloadCSR(t, id)
			issued, err := a.SignWorkload(t.Context(), ca.WorkloadRequest{CSR: csr, Identity: id})
			if err != nil {
				t.Fatalf("SignWorkload: %v", err)
			}
			got := parseChainPEM(t, issued.ChainPEM())
			wantResp := append([]*x509.Certificate{issued.Leaf}, want...)
			if !sameCerts(got, wantResp) {
				t.Fatalf("ChainPEM = %v, want %v", names(got), names(wantResp))
			}
			if !sameCerts(issued.Chain(), wantResp) {
				t.Fatalf("Chain = %v, want %v", names(issued.Chain()), names(wantResp))
			}
			rootCount := 0
			for _, c := range got {
				if c.Equal(h.root.Cert) {
					rootCount++
				}
			}
			if rootCount != 1 || !got[len(got)-1].Equal(h.root.Cert) {
				t.Fatalf("response chain %v: root appears %d times or not last", names(got), rootCount)
			}
			verifyPath(t, got, b.Roots(), now)
		})
	}
}

func TestLoadPluggedInTLSNotSelfSignedWithoutRoot(t *testing.T) {
	t.Parallel()
	now := baseTime()
	h := newHierarchy(t, now, defaultLifetimes())
	dir := writeDir(t, map[string][]byte{
		ca.TLSCertFile: testutil.CertPEM(h.int1.Cert, h.root.Cert),
		ca.TLSKeyFile:  testutil.KeyPEM(t, h.int1.Key),
		ca.TLSCAFile:   {},
	})
	b, err := ca.LoadPluggedIn(dir, now)
	if err == nil {
		t.Fatalf("LoadPluggedIn accepted a non-self-signed tls.crt with an empty ca.crt (root %q)", b.Root().Subject.CommonName)
	}
	if !strings.Contains(err.Error(), "not self-signed") {
		t.Errorf("error %q does not say the signing certificate is not self-signed", err)
	}
}

func TestLoadPluggedInTwoRoots(t *testing.T) {
	t.Parallel()
	now := baseTime()
	h := newHierarchy(t, now, defaultLifetimes())
	other := testutil.NewRootCA(t, caOpts("other root", now, 5*year))
	dir := writeDir(t, map[string][]byte{
		ca.CACertFile:    testutil.CertPEM(h.int1.Cert),
		ca.CAKeyFile:     testutil.KeyPEM(t, h.int1.Key),
		ca.CertChainFile: testutil.CertPEM(h.int1.Cert, h.root.Cert),
		// The signing root is second in the file: Roots must still put it first.
		ca.RootCertFile: testutil.CertPEM(other.Cert, h.root.Cert),
	})
	b, err := ca.LoadPluggedIn(dir, now)
	if err != nil {
		t.Fatal(err)
	}
	want := []*x509.Certificate{h.root.Cert, other.Cert}
	if !sameCerts(b.Roots(), want) {
		t.Fatalf("Roots = %v, want %v", names(b.Roots()), names(want))
	}
	fromPEM, err := pki.ParseCertificates(b.RootsPEM())
	if err != nil {
		t.Fatal(err)
	}
	if !sameCerts(fromPEM, want) {
		t.Fatalf("RootsPEM holds %v, want %v", names(fromPEM), names(want))
	}
	if !b.Root().Equal(h.root.Cert) {
		t.Errorf("Root = %q, want the signing root", b.Root().Subject.CommonName)
	}
	verifyPath(t, b.Chain(), b.Roots(), now)
	// The pool trusts the other root too: a certificate under it verifies.
	otherLeaf := other.Issue(t, &x509.Certificate{
		NotBefore:   now.Add(-time.Hour),
		NotAfter:    now.Add(time.Hour),
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}, newKey(t).Public())
	if _, err := otherLeaf.Verify(x509.VerifyOptions{Roots: b.RootPool(), CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Errorf("RootPool does not trust the second root: %v", err)
	}
}

func TestLoadPluggedInIncomplete(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name          string
		present       []string
		wantMissing   []string
		wantUnnamed   []string // files of a layout of which nothing is present
		wantNoPlugged bool
	}{
		{
			name:        "ca-cert.pem and ca-key.pem only",
			present:     []string{ca.CACertFile, ca.CAKeyFile},
			wantMissing: []string{ca.CertChainFile, ca.RootCertFile},
			wantUnnamed: []string{ca.TLSCertFile, ca.TLSKeyFile, ca.TLSCAFile},
		},
		{
			name:        "istio layout without root-cert.pem",
			present:     []string{ca.CACertFile, ca.CAKeyFile, ca.CertChainFile},
			wantMissing: []string{ca.RootCertFile},
			wantUnnamed: []string{ca.TLSCertFile, ca.TLSKeyFile, ca.TLSCAFile},
		},
		{
			name:        "tls.crt only",
			present:     []string{ca.TLSCertFile},
			wantMissing: []string{ca.TLSKeyFile, ca.TLSCAFile},
			wantUnnamed: []string{ca.CACertFile, ca.CAKeyFile, ca.CertChainFile, ca.RootCertFile},
		},
		{
			name:        "tls layout without ca.crt",
			present:     []string{ca.TLSCertFile, ca.TLSKeyFile},
			wantMissing: []string{ca.TLSCAFile},
			wantUnnamed: []string{ca.CACertFile, ca.CAKeyFile, ca.CertChainFile, ca.RootCertFile},
		},
		{
			name:        "pieces of both layouts",
			present:     []string{ca.CAKeyFile, ca.TLSCertFile},
			wantMissing: []string{ca.CACertFile, ca.CertChainFile, ca.RootCertFile, ca.TLSKeyFile, ca.TLSCAFile},
		},
		{name: "empty directory", wantNoPlugged: true},
		{name: "unrelated files only", present: []string{"README", "key.pem"}, wantNoPlugged: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			now := baseTime()
			h := newHierarchy(t, now, defaultLifetimes())
			content := map[string][]byte{
				ca.CACertFile:    testutil.CertPEM(h.int1.Cert),
				ca.CAKeyFile:     testutil.KeyPEM(t, h.int1.Key),
				ca.CertChainFile: testutil.CertPEM(h.int1.Cert),
				ca.RootCertFile:  testutil.CertPEM(h.root.Cert),
				ca.TLSCertFile:   testutil.CertPEM(h.int1.Cert),
				ca.TLSKeyFile:    testutil.KeyPEM(t, h.int1.Key),
				ca.TLSCAFile:     testutil.CertPEM(h.root.Cert),
			}
			files := map[string][]byte{}
			for _, name := range tc.present {
				files[name] = content[name]
				if files[name] == nil {
					files[name] = []byte("unrelated\n")
				}
			}
			dir := writeDir(t, files)

			_, err := ca.LoadPluggedIn(dir, now)
			if err == nil {
				t.Fatal("LoadPluggedIn succeeded on an incomplete directory")
			}
			if got := errors.Is(err, ca.ErrNoPluggedInCA); got != tc.wantNoPlugged {
				t.Fatalf("errors.Is(%q, ErrNoPluggedInCA) = %v, want %v", err, got, tc.wantNoPlugged)
			}
			for _, name := range tc.wantMissing {
				if !strings.Contains(err.Error(), name) {
					t.Errorf("error %q does not name missing file %s", err, name)
				}
			}
			for _, name := range tc.wantUnnamed {
				if strings.Contains(err.Error(), name) {
					t.Errorf("error %q names %s, though nothing of its layout is present", err, name)
				}
			}
		})
	}
}

func TestLoadPluggedInMissingDir(t *testing.T) {
	t.Parallel()
	_, err := ca.LoadPluggedIn(filepath.Join(t.TempDir(), "does-not-exist"), baseTime())
	if !errors.Is(err, ca.ErrNoPluggedInCA) {
		t.Fatalf("err = %v, want ErrNoPluggedInCA", err)
	}
}

func TestLoadPluggedInInvalid(t *testing.T) {
	t.Parallel()
	garbage := []byte("this is not PEM\n")
	badBase64 := []byte("-----BEGIN CERTIFICATE-----\n!!!not base64!!!\n-----END CERTIFICATE-----\n")
	badDER := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: []byte{0x30, 0x03, 0x02, 0x01, 0x01}})

	// istio returns a valid Istio-layout bundle signed by int1, for mutation by a case.
	istio := func(t *testing.T, h hierarchy) map[string][]byte {
		return map[string][]byte{
			ca.CACertFile:    testutil.CertPEM(h.int1.Cert),
			ca.CAKeyFile:     testutil.KeyPEM(t, h.int1.Key),
			ca.CertChainFile: testutil.CertPEM(h.int1.Cert, h.root.Cert),
			ca.RootCertFile:  testutil.CertPEM(h.root.Cert),
		}
	}
	tls := func(t *testing.T, h hierarchy) map[string][]byte {
		return map[string][]byte{
			ca.TLSCertFile: testutil.CertPEM(h.int1.Cert),
			ca.TLSKeyFile:  testutil.KeyPEM(t, h.int1.Key),
			ca.TLSCAFile:   testutil.CertPEM(h.root.Cert),
		}
	}
	with := func(base func(*testing.T, hierarchy) map[string][]byte, name string, data []byte) func(*testing.T, hierarchy, time.Time) map[string][]byte {
		return func(t *testing.T, h hierarchy, _ time.Time) map[string][]byte {
			f := base(t, h)
			f[name] = data
			return f
		}
	}
	tests := []struct {
		name     string
		files    func(t *testing.T, h hierarchy, now time.Time) map[string][]byte
		wantText []string
		wantIs   error
	}{
		{
			name: "key of another CA",
			files: func(t *testing.T, h hierarchy, _ time.Time) map[string][]byte {
				f := istio(t, h)
				f[ca.CAKeyFile] = testutil.KeyPEM(t, h.int2.Key)
				return f
			},
			wantText: []string{"does not match"},
		},
		{
			name: "signing certificate is not a CA",
			files: func(t *testing.T, h hierarchy, now time.Time) map[string][]byte {
				notCA := h.root.NewIntermediate(t, testutil.CAOptions{CommonName: "workload", NotCA: true, NotBefore: now.Add(-time.Hour), NotAfter: now.Add(year)})
				f := istio(t, h)
				f[ca.CACertFile] = testutil.CertPEM(notCA.Cert)
				f[ca.CAKeyFile] = testutil.KeyPEM(t, notCA.Key)
				f[ca.CertChainFile] = testutil.CertPEM(notCA.Cert)
				return f
			},
			wantText: []string{"is not a CA certificate"},
		},
		{
			name: "signing certificate with certSign usage but no CA basic constraint",
			files: func(t *testing.T, h hierarchy, now time.Time) map[string][]byte {
				key := newKey(t)
				cert := h.root.Issue(t, &x509.Certificate{
					Subject:               pkix.Name{CommonName: "almost"},
					NotBefore:             now.Add(-time.Hour),
					NotAfter:              now.Add(year),
					KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
					BasicConstraintsValid: true,
				}, key.Public())
				f := istio(t, h)
				f[ca.CACertFile] = testutil.CertPEM(cert)
				f[ca.CAKeyFile] = testutil.KeyPEM(t, key)
				return f
			},
			wantText: []string{"is not a CA certificate"},
		},
		{
			name: "CA certificate without certSign key usage",
			files: func(t *testing.T, h hierarchy, now time.Time) map[string][]byte {
				key := newKey(t)
				cert := h.root.Issue(t, &x509.Certificate{
					Subject:               pkix.Name{CommonName: "no certsign"},
					NotBefore:             now.Add(-time.Hour),
					NotAfter:              now.Add(year),
					KeyUsage:              x509.KeyUsageDigitalSignature,
					BasicConstraintsValid: true,
					IsCA:                  true,
				}, key.Public())
				f := istio(t, h)
				f[ca.CACertFile] = testutil.CertPEM(cert)
				f[ca.CAKeyFile] = testutil.KeyPEM(t, key)
				return f
			},
			wantText: []string{"certSign"},
		},
		{
			name: "signing certificate does not chain to root-cert.pem",
			files: func(t *testing.T, h hierarchy, now time.Time) map[string][]byte {
				f := istio(t, h)
				f[ca.RootCertFile] = testutil.CertPEM(testutil.NewRootCA(t, caOpts("stranger", now, year)).Cert)
				return f
			},
			wantText: []string{"does not chain"},
		},
		{
			name: "intermediate between signing certificate and root is missing",
			files: func(t *testing.T, h hierarchy, _ time.Time) map[string][]byte {
				f := istio(t, h)
				f[ca.CACertFile] = testutil.CertPEM(h.int2.Cert)
				f[ca.CAKeyFile] = testutil.KeyPEM(t, h.int2.Key)
				f[ca.CertChainFile] = testutil.CertPEM(h.int2.Cert, h.root.Cert)
				return f
			},
			wantText: []string{"does not chain"},
		},
		{
			name: "expired signing certificate",
			files: func(t *testing.T, h hierarchy, now time.Time) map[string][]byte {
				old := h.root.NewIntermediate(t, testutil.CAOptions{CommonName: "old", NotBefore: now.Add(-2 * year), NotAfter: now.Add(-time.Second)})
				f := istio(t, h)
				f[ca.CACertFile] = testutil.CertPEM(old.Cert)
				f[ca.CAKeyFile] = testutil.KeyPEM(t, old.Key)
				return f
			},
			wantText: []string{`signing certificate "CN=old,O=meshid test" expired at`},
		},
		{
			name: "signing certificate not yet valid",
			files: func(t *testing.T, h hierarchy, now time.Time) map[string][]byte {
				future := h.root.NewIntermediate(t, testutil.CAOptions{CommonName: "future", NotBefore: now.Add(time.Hour), NotAfter: now.Add(year)})
				f := istio(t, h)
				f[ca.CACertFile] = testutil.CertPEM(future.Cert)
				f[ca.CAKeyFile] = testutil.KeyPEM(t, future.Key)
				return f
			},
			wantText: []string{"not valid before"},
		},
		{
			name: "expired intermediate above the signing certificate",
			files: func(t *testing.T, h hierarchy, now time.Time) map[string][]byte {
				oldInt := h.root.NewIntermediate(t, testutil.CAOptions{CommonName: "old int", NotBefore: now.Add(-2 * year), NotAfter: now.Add(-time.Second)})
				signer := oldInt.NewIntermediate(t, caOpts("signer", now, year))
				return map[string][]byte{
					ca.CACertFile:    testutil.CertPEM(signer.Cert),
					ca.CAKeyFile:     testutil.KeyPEM(t, signer.Key),
					ca.CertChainFile: testutil.CertPEM(signer.Cert, oldInt.Cert, h.root.Cert),
					ca.RootCertFile:  testutil.CertPEM(h.root.Cert),
				}
			},
			wantText: []string{"does not chain", "expired"},
		},
		{name: "garbage ca-cert.pem", files: with(istio, ca.CACertFile, garbage), wantText: []string{ca.CACertFile, "signing certificate"}, wantIs: pki.ErrNoPEM},
		{name: "bad base64 in ca-cert.pem", files: with(istio, ca.CACertFile, badBase64), wantText: []string{ca.CACertFile, "signing certificate"}, wantIs: pki.ErrNoPEM},
		{name: "garbage ca-key.pem", files: with(istio, ca.CAKeyFile, garbage), wantText: []string{ca.CAKeyFile, "signing key"}, wantIs: pki.ErrNoPEM},
		{
			name: "certificate instead of key in ca-key.pem",
			files: func(t *testing.T, h hierarchy, now time.Time) map[string][]byte {
				return with(istio, ca.CAKeyFile, testutil.CertPEM(h.int1.Cert))(t, h, now)
			},
			wantText: []string{"signing key"},
			wantIs:   pki.ErrNoPEM,
		},
		{name: "garbage cert-chain.pem", files: with(istio, ca.CertChainFile, garbage), wantText: []string{ca.CertChainFile}, wantIs: pki.ErrNoPEM},
		{name: "garbage root-cert.pem", files: with(istio, ca.RootCertFile, garbage), wantText: []string{ca.RootCertFile, "root certificates"}, wantIs: pki.ErrNoPEM},
		{name: "corrupt DER in root-cert.pem", files: with(istio, ca.RootCertFile, badDER), wantText: []string{ca.RootCertFile, "root certificates", "parse certificate"}},
		{name: "garbage tls.crt", files: with(tls, ca.TLSCertFile, garbage), wantText: []string{ca.TLSCertFile, "signing certificate"}, wantIs: pki.ErrNoPEM},
		{name: "garbage tls.key", files: with(tls, ca.TLSKeyFile, garbage), wantText: []string{ca.TLSKeyFile, "signing key"}, wantIs: pki.ErrNoPEM},
		{name: "garbage ca.crt", files: with(tls, ca.TLSCAFile, garbage), wantText: []string{ca.TLSCAFile, "root certificates"}, wantIs: pki.ErrNoPEM},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			now := baseTime()
			h := newHierarchy(t, now, defaultLifetimes())
			dir := writeDir(t, tc.files(t, h, now))
			b, err := ca.LoadPluggedIn(dir, now)
			if err == nil {
				t.Fatalf("LoadPluggedIn accepted it (signing %q)", b.SigningCert().Subject.CommonName)
			}
			if errors.Is(err, ca.ErrNoPluggedInCA) {
				t.Errorf("error %q claims there is no plugged-in CA", err)
			}
			if !strings.Contains(err.Error(), dir) {
				t.Errorf("error %q does not name the directory", err)
			}
			for _, s := range tc.wantText {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not mention %q", err, s)
				}
			}
			if tc.wantIs != nil && !errors.Is(err, tc.wantIs) {
				t.Errorf("errors.Is(%q, %v) = false", err, tc.wantIs)
			}
		})
	}
}

func fileMode(t *testing.T, path string) os.FileMode {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Mode().Perm()
}

func readCerts(t *testing.T, path string) []*x509.Certificate {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	certs, err := pki.ParseCertificates(data)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return certs
}

func assertAbsent(t *testing.T, dir string, files ...string) {
	t.Helper()
	for _, name := range files {
		if _, err := os.Stat(filepath.Join(dir, name)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s exists in %s (stat error %v), want nothing written", name, dir, err)
		}
	}
}

func TestLoadOrCreateGeneratesThenPersists(t *testing.T) {
	t.Parallel()
	now := baseTime()
	stateDir := filepath.Join(t.TempDir(), "state")
	cfg := ca.StartupConfig{
		StateDir:   stateDir,
		SelfSigned: ca.SelfSignedConfig{KeyAlgorithm: pki.ECDSA, Org: "example.org", TTL: 48 * time.Hour},
		Now:        now,
	}
	b, origin, err := ca.LoadOrCreate(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if origin != ca.OriginGenerated {
		t.Errorf("origin = %q, want %q", origin, ca.OriginGenerated)
	}
	if b.Source() != ca.SourceSelfSigned {
		t.Errorf("Source = %q, want %q", b.Source(), ca.SourceSelfSigned)
	}
	for name, want := range map[string]os.FileMode{
		".":             0o700,
		ca.CACertFile:   0o644,
		ca.CAKeyFile:    0o600,
		ca.RootCertFile: 0o644,
	} {
		if got := fileMode(t, filepath.Join(stateDir, name)); got != want {
			t.Errorf("mode of %s = %o, want %o", name, got, want)
		}
	}

	root := b.Root()
	if !b.SigningCert().Equal(root) || len(b.Chain()) != 1 {
		t.Errorf("a generated CA signs with its root; chain = %v", names(b.Chain()))
	}
	if got := root.Subject.Organization; len(got) != 1 || got[0] != "example.org" {
		t.Errorf("root Organization = %q, want [example.org]", got)
	}
	if !root.NotAfter.Equal(now.Add(48 * time.Hour)) {
		t.Errorf("root NotAfter = %s, want now+TTL = %s", root.NotAfter, now.Add(48*time.Hour))
	}
	if !root.NotBefore.Equal(now.Add(-ca.Backdate)) {
		t.Errorf("root NotBefore = %s, want now-Backdate = %s", root.NotBefore, now.Add(-ca.Backdate))
	}
	if !root.IsCA || root.KeyUsage&x509.KeyUsageCertSign == 0 {
		t.Errorf("root IsCA = %v, KeyUsage = %b: want a CA that signs certificates", root.IsCA, root.KeyUsage)
	}
	if err := root.CheckSignatureFrom(root); err != nil {
		t.Errorf("root is not self-signed: %v", err)
	}
	if got := readCerts(t, filepath.Join(stateDir, ca.CACertFile)); !sameCerts(got, []*x509.Certificate{root}) {
		t.Errorf("ca-cert.pem holds %v, want the root", names(got))
	}
	if got := readCerts(t, filepath.Join(stateDir, ca.RootCertFile)); !sameCerts(got, []*x509.Certificate{root}) {
		t.Errorf("root-cert.pem holds %v, want the root", names(got))
	}
	keyPEM, err := os.ReadFile(filepath.Join(stateDir, ca.CAKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	key, err := pki.ParsePrivateKey(keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	if !pki.KeyMatchesCertificate(key, root) {
		t.Error("ca-key.pem does not match ca-cert.pem")
	}

	// Restart an hour later: the same root comes back from disk.
	cfg.Now = now.Add(time.Hour)
	b2, origin2, err := ca.LoadOrCreate(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if origin2 != ca.OriginPersisted {
		t.Errorf("second origin = %q, want %q", origin2, ca.OriginPersisted)
	}
	if !bytes.Equal(b2.Root().Raw, root.Raw) {
		t.Error("second LoadOrCreate returned another root")
	}
	keyPEM2, err := os.ReadFile(filepath.Join(stateDir, ca.CAKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(keyPEM, keyPEM2) {
		t.Error("second LoadOrCreate rewrote ca-key.pem")
	}
}

func TestLoadOrCreateDefaultRootTTL(t *testing.T) {
	t.Parallel()
	now := baseTime()
	b, _, err := ca.LoadOrCreate(ca.StartupConfig{StateDir: t.TempDir(), Now: now})
	if err != nil {
		t.Fatal(err)
	}
	if want := now.Add(ca.DefaultSelfSignedRootTTL); !b.Root().NotAfter.Equal(want) {
		t.Errorf("root NotAfter = %s, want %s", b.Root().NotAfter, want)
	}
}

func TestLoadOrCreateRSA(t *testing.T) {
	t.Parallel()
	now := baseTime()
	stateDir := t.TempDir()
	cfg := ca.StartupConfig{
		StateDir:   stateDir,
		SelfSigned: ca.SelfSignedConfig{KeyAlgorithm: pki.RSA, RSAKeySize: 2048, Org: "rsa.example", TTL: year},
		Now:        now,
	}
	b, origin, err := ca.LoadOrCreate(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if origin != ca.OriginGenerated {
		t.Errorf("origin = %q, want %q", origin, ca.OriginGenerated)
	}
	pub, ok := b.Root().PublicKey.(*rsa.PublicKey)
	if !ok || pub.N.BitLen() != 2048 {
		t.Fatalf("root key is %s, want RSA 2048", pki.DescribeKey(b.Root().PublicKey))
	}
	// The RSA root signs workload leaves.
	a := ca.New(ca.Config{Clock: testutil.NewFakeClock(now)}, b)
	id := testID(t, "default", "web")
	csr, _ := workloadCSR(t, id)
	issued, err := a.SignWorkload(t.Context(), ca.WorkloadRequest{CSR: csr, Identity: id})
	if err != nil {
		t.Fatal(err)
	}
	verifyPath(t, issued.Chain(), b.Roots(), now)

	b2, origin2, err := ca.LoadOrCreate(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if origin2 != ca.OriginPersisted || !bytes.Equal(b2.Root().Raw, b.Root().Raw) {
		t.Errorf("reload: origin %q, same root %v; want persisted, same root", origin2, bytes.Equal(b2.Root().Raw, b.Root().Raw))
	}
}

func TestLoadOrCreateStartupOrder(t *testing.T) {
	t.Parallel()

	plugIn := func(t *testing.T, dir string, h hierarchy) {
		t.Helper()
		testutil.WriteFiles(t, dir, map[string][]byte{
			ca.CACertFile:    testutil.CertPEM(h.int1.Cert),
			ca.CAKeyFile:     testutil.KeyPEM(t, h.int1.Key),
			ca.CertChainFile: testutil.CertPEM(h.int1.Cert, h.root.Cert),
			ca.RootCertFile:  testutil.CertPEM(h.root.Cert),
		})
	}

	t.Run("plugged-in CA wins over the persisted self-signed CA", func(t *testing.T) {
		t.Parallel()
		now := baseTime()
		stateDir, cacerts := filepath.Join(t.TempDir(), "state"), t.TempDir() // empty until plugged in
		cfg := ca.StartupConfig{CACertsDir: cacerts, StateDir: stateDir, Now: now}
		self, origin, err := ca.LoadOrCreate(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if origin != ca.OriginGenerated {
			t.Fatalf("first start origin = %q, want %q", origin, ca.OriginGenerated)
		}
		selfCert, err := os.ReadFile(filepath.Join(stateDir, ca.CACertFile))
		if err != nil {
			t.Fatal(err)
		}

		h := newHierarchy(t, now, defaultLifetimes())
		plugIn(t, cacerts, h)
		b, origin, err := ca.LoadOrCreate(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if origin != ca.OriginPluggedIn || b.Source() != ca.SourcePluggedIn {
			t.Fatalf("origin = %q, source = %q; want the plugged-in CA", origin, b.Source())
		}
		if !b.SigningCert().Equal(h.int1.Cert) || !b.Root().Equal(h.root.Cert) {
			t.Fatalf("bundle signs with %q under %q, want int1 under root", b.SigningCert().Subject.CommonName, b.Root().Subject.CommonName)
		}
		// The plugged-in root comes first; the self-signed root stays trusted (retained) so that
		// workloads holding its certificates keep working through the migration.
		got := readCerts(t, filepath.Join(stateDir, ca.RootCertFile))
		if !sameCerts(got, []*x509.Certificate{h.root.Cert, self.Root()}) {
			t.Errorf("state root-cert.pem holds %v, want the plugged-in root, then the self-signed one", names(got))
		}
		if !sameCerts(b.Retained(), []*x509.Certificate{self.Root()}) {
			t.Errorf("retained roots %v, want the self-signed root", names(b.Retained()))
		}
		after, err := os.ReadFile(filepath.Join(stateDir, ca.CACertFile))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(selfCert, after) {
			t.Error("loading the plugged-in CA changed the persisted self-signed ca-cert.pem")
		}
	})

	t.Run("plugged-in CA on a fresh state dir", func(t *testing.T) {
		t.Parallel()
		now := baseTime()
		stateDir, cacerts := filepath.Join(t.TempDir(), "state"), filepath.Join(t.TempDir(), "cacerts")
		h := newHierarchy(t, now, defaultLifetimes())
		plugIn(t, cacerts, h)
		b, origin, err := ca.LoadOrCreate(ca.StartupConfig{CACertsDir: cacerts, StateDir: stateDir, Now: now})
		if err != nil {
			t.Fatal(err)
		}
		if origin != ca.OriginPluggedIn || !b.Root().Equal(h.root.Cert) {
			t.Fatalf("origin = %q, root %q; want the plugged-in root", origin, b.Root().Subject.CommonName)
		}
		assertAbsent(t, stateDir, ca.CACertFile, ca.CAKeyFile)
		if got := readCerts(t, filepath.Join(stateDir, ca.RootCertFile)); !sameCerts(got, []*x509.Certificate{h.root.Cert}) {
			t.Errorf("state root-cert.pem holds %v, want the plugged-in root", names(got))
		}
	})

	t.Run("empty cacerts dir falls back to self-signed", func(t *testing.T) {
		t.Parallel()
		cacerts := t.TempDir()
		stateDir := t.TempDir()
		b, origin, err := ca.LoadOrCreate(ca.StartupConfig{CACertsDir: cacerts, StateDir: stateDir, Now: baseTime()})
		if err != nil {
			t.Fatal(err)
		}
		if origin != ca.OriginGenerated || b.Source() != ca.SourceSelfSigned {
			t.Fatalf("origin = %q, source = %q; want a new self-signed CA", origin, b.Source())
		}
		if got := readCerts(t, filepath.Join(stateDir, ca.CACertFile)); !sameCerts(got, []*x509.Certificate{b.Root()}) {
			t.Errorf("state ca-cert.pem holds %v, want the generated root", names(got))
		}
	})

	t.Run("missing cacerts dir is refused, not a fallback", func(t *testing.T) {
		t.Parallel()
		cacerts := filepath.Join(t.TempDir(), "cacerts")
		stateDir := filepath.Join(t.TempDir(), "state")
		_, _, err := ca.LoadOrCreate(ca.StartupConfig{CACertsDir: cacerts, StateDir: stateDir, Now: baseTime()})
		if !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), cacerts) {
			t.Fatalf("error %v, want ErrNotExist naming %s", err, cacerts)
		}
		if _, err := os.Stat(stateDir); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("the refused start created the state dir (stat: %v)", err)
		}
	})

	t.Run("partial cacerts dir is an error, not a fallback", func(t *testing.T) {
		t.Parallel()
		now := baseTime()
		stateDir, cacerts := filepath.Join(t.TempDir(), "state"), filepath.Join(t.TempDir(), "cacerts")
		h := newHierarchy(t, now, defaultLifetimes())
		testutil.WriteFiles(t, cacerts, map[string][]byte{
			ca.CACertFile: testutil.CertPEM(h.int1.Cert),
			ca.CAKeyFile:  testutil.KeyPEM(t, h.int1.Key),
		})
		b, origin, err := ca.LoadOrCreate(ca.StartupConfig{CACertsDir: cacerts, StateDir: stateDir, Now: now})
		if err == nil {
			t.Fatalf("LoadOrCreate fell back (origin %q, root %q)", origin, b.Root().Subject.CommonName)
		}
		if !strings.Contains(err.Error(), ca.RootCertFile) {
			t.Errorf("error %q does not name the missing %s", err, ca.RootCertFile)
		}
		assertAbsent(t, stateDir, ca.CACertFile, ca.CAKeyFile, ca.RootCertFile)
	})

	t.Run("invalid plugged-in CA is an error, not a fallback", func(t *testing.T) {
		t.Parallel()
		now := baseTime()
		stateDir, cacerts := filepath.Join(t.TempDir(), "state"), filepath.Join(t.TempDir(), "cacerts")
		h := newHierarchy(t, now, defaultLifetimes())
		plugIn(t, cacerts, h)
		testutil.WriteFiles(t, cacerts, map[string][]byte{ca.CAKeyFile: testutil.KeyPEM(t, h.int2.Key)})
		if _, _, err := ca.LoadOrCreate(ca.StartupConfig{CACertsDir: cacerts, StateDir: stateDir, Now: now}); err == nil {
			t.Fatal("LoadOrCreate accepted a plugged-in CA whose key does not match")
		}
		assertAbsent(t, stateDir, ca.CACertFile, ca.CAKeyFile, ca.RootCertFile)
	})

	for _, tc := range []struct {
		name    string
		present string
		missing string
	}{
		{name: "state dir with ca-cert.pem but no ca-key.pem", present: ca.CACertFile, missing: ca.CAKeyFile},
		{name: "state dir with ca-key.pem but no ca-cert.pem", present: ca.CAKeyFile, missing: ca.CACertFile},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			now := baseTime()
			root := testutil.NewRootCA(t, caOpts("persisted", now, year))
			content := map[string][]byte{ca.CACertFile: testutil.CertPEM(root.Cert), ca.CAKeyFile: testutil.KeyPEM(t, root.Key)}
			stateDir := t.TempDir()
			testutil.WriteFiles(t, stateDir, map[string][]byte{tc.present: content[tc.present]})

			_, _, err := ca.LoadOrCreate(ca.StartupConfig{StateDir: stateDir, Now: now})
			if err == nil {
				t.Fatal("LoadOrCreate generated a new root over half a persisted CA")
			}
			if !strings.Contains(err.Error(), tc.missing) {
				t.Errorf("error %q does not name the missing %s", err, tc.missing)
			}
			assertAbsent(t, stateDir, tc.missing, ca.RootCertFile)
			got, err := os.ReadFile(filepath.Join(stateDir, tc.present))
			if err != nil || !bytes.Equal(got, content[tc.present]) {
				t.Errorf("%s was changed or removed (read error %v)", tc.present, err)
			}
		})
	}

	t.Run("corrupt persisted CA is an error and is not replaced", func(t *testing.T) {
		t.Parallel()
		now := baseTime()
		root := testutil.NewRootCA(t, caOpts("persisted", now, year))
		stateDir := t.TempDir()
		garbage := []byte("garbage\n")
		testutil.WriteFiles(t, stateDir, map[string][]byte{ca.CACertFile: garbage, ca.CAKeyFile: testutil.KeyPEM(t, root.Key)})
		if _, _, err := ca.LoadOrCreate(ca.StartupConfig{StateDir: stateDir, Now: now}); err == nil {
			t.Fatal("LoadOrCreate accepted a garbage ca-cert.pem")
		}
		got, err := os.ReadFile(filepath.Join(stateDir, ca.CACertFile))
		if err != nil || !bytes.Equal(got, garbage) {
			t.Errorf("ca-cert.pem was replaced (read error %v)", err)
		}
		assertAbsent(t, stateDir, ca.RootCertFile)
	})
}

// A restart with the same roots leaves root-cert.pem untouched: no rewrite wakes its watchers.
func TestRestartLeavesUnchangedTrustBundleAlone(t *testing.T) {
	t.Parallel()
	now := baseTime()
	cfg := ca.StartupConfig{StateDir: filepath.Join(t.TempDir(), "state"), Now: now}
	if _, _, err := ca.LoadOrCreate(cfg); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(cfg.StateDir, ca.RootCertFile)
	before, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := ca.LoadOrCreate(cfg); err != nil {
		t.Fatal(err)
	}
	after, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if !os.SameFile(before, after) {
		t.Fatal("root-cert.pem was replaced although its roots did not change")
	}
}
