package pki_test

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"

	"github.com/meshid/meshid/internal/pki"
)

func TestSPIFFEIDRoundTrip(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		id   pki.SPIFFEID
		want string
	}{
		{name: "istio default", id: pki.SPIFFEID{TrustDomain: "cluster.local", Namespace: "default", ServiceAccount: "sleep"}, want: "spiffe://cluster.local/ns/default/sa/sleep"},
		{name: "dotted SA", id: pki.SPIFFEID{TrustDomain: "example.org", Namespace: "istio-system", ServiceAccount: "ingress.gateway-1"}, want: "spiffe://example.org/ns/istio-system/sa/ingress.gateway-1"},
		{name: "underscore trust domain", id: pki.SPIFFEID{TrustDomain: "td_1", Namespace: "a", ServiceAccount: "b"}, want: "spiffe://td_1/ns/a/sa/b"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if got := tc.id.String(); got != tc.want {
				t.Fatalf("String() = %q, want %q", got, tc.want)
			}
			if got := tc.id.URL().String(); got != tc.want {
				t.Fatalf("URL().String() = %q, want %q", got, tc.want)
			}
			parsed, err := pki.ParseSPIFFEID(tc.want)
			if err != nil {
				t.Fatalf("ParseSPIFFEID(%q) error: %v", tc.want, err)
			}
			if parsed != tc.id {
				t.Fatalf("ParseSPIFFEID(%q) = %+v, want %+v", tc.want, parsed, tc.id)
			}
			fromURL, err := pki.SPIFFEIDFromURL(tc.id.URL())
			if err != nil || fromURL != tc.id {
				t.Fatalf("SPIFFEIDFromURL(URL()) = %+v, %v; want %+v", fromURL, err, tc.id)
			}
			built, err := pki.NewSPIFFEID(tc.id.TrustDomain, tc.id.Namespace, tc.id.ServiceAccount)
			if err != nil || built != tc.id {
				t.Fatalf("NewSPIFFEID() = %+v, %v; want %+v", built, err, tc.id)
			}
		})
	}
}

func TestParseSPIFFEIDRefusals(t *testing.T) {
	t.Parallel()
	tests := []struct{ name, in string }{
		{name: "empty", in: ""},
		{name: "https scheme", in: "https://cluster.local/ns/a/sa/b"},
		{name: "upper-case scheme path", in: "spiffe://cluster.local/NS/a/sa/b"},
		{name: "no scheme", in: "cluster.local/ns/a/sa/b"},
		{name: "opaque", in: "spiffe:cluster.local/ns/a/sa/b"},
		{name: "no trust domain", in: "spiffe:///ns/a/sa/b"},
		{name: "no path", in: "spiffe://cluster.local"},
		{name: "no sa part", in: "spiffe://cluster.local/ns/a"},
		{name: "empty sa", in: "spiffe://cluster.local/ns/a/sa/"},
		{name: "empty namespace", in: "spiffe://cluster.local/ns//sa/b"},
		{name: "swapped keywords", in: "spiffe://cluster.local/sa/b/ns/a"},
		{name: "extra segment", in: "spiffe://cluster.local/ns/a/sa/b/c"},
		{name: "trailing slash", in: "spiffe://cluster.local/ns/a/sa/b/"},
		{name: "escaped slash", in: "spiffe://cluster.local/ns/a%2Fb/sa/c"},
		{name: "upper-case namespace", in: "spiffe://cluster.local/ns/Default/sa/b"},
		{name: "dotted namespace", in: "spiffe://cluster.local/ns/a.b/sa/c"},
		{name: "upper-case SA", in: "spiffe://cluster.local/ns/a/sa/Sleep"},
		{name: "upper-case trust domain", in: "spiffe://Cluster.Local/ns/a/sa/b"},
		{name: "trust domain with space", in: "spiffe://clu ster/ns/a/sa/b"},
		{name: "trust domain with plus", in: "spiffe://a+b/ns/a/sa/b"},
		{name: "query", in: "spiffe://cluster.local/ns/a/sa/b?x=1"},
		{name: "empty query", in: "spiffe://cluster.local/ns/a/sa/b?"},
		{name: "fragment", in: "spiffe://cluster.local/ns/a/sa/b#f"},
		{name: "empty fragment", in: "spiffe://cluster.local/ns/a/sa/b#"},
		{name: "percent-encoded letter", in: "spiffe://cluster.local/ns/a/sa/b%61r"},
		{name: "port", in: "spiffe://cluster.local:8443/ns/a/sa/b"},
		{name: "empty port", in: "spiffe://cluster.local:/ns/a/sa/b"},
		{name: "userinfo", in: "spiffe://user@cluster.local/ns/a/sa/b"},
		{name: "userinfo with password", in: "spiffe://user:pw@cluster.local/ns/a/sa/b"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			id, err := pki.ParseSPIFFEID(tc.in)
			if err == nil {
				t.Fatalf("ParseSPIFFEID(%q) = %+v, want error", tc.in, id)
			}
			if !errors.Is(err, pki.ErrInvalidSPIFFEID) {
				t.Fatalf("ParseSPIFFEID(%q) error %v does not wrap ErrInvalidSPIFFEID", tc.in, err)
			}
			if id != (pki.SPIFFEID{}) {
				t.Fatalf("ParseSPIFFEID(%q) returned %+v with its error", tc.in, id)
			}
			// The same URI in a certificate's URI SAN must be refused too (when url.URL can
			// represent it: it does not record an empty fragment).
			if u, perr := url.Parse(tc.in); perr == nil && u.String() == tc.in {
				if _, err := pki.SPIFFEIDFromURL(u); !errors.Is(err, pki.ErrInvalidSPIFFEID) {
					t.Fatalf("SPIFFEIDFromURL(%q) error = %v, want ErrInvalidSPIFFEID", tc.in, err)
				}
			}
		})
	}
}

func TestNewSPIFFEIDRefusesBadParts(t *testing.T) {
	t.Parallel()
	tests := []struct{ name, td, ns, sa string }{
		{name: "empty trust domain", td: "", ns: "a", sa: "b"},
		{name: "trust domain with slash", td: "a/b", ns: "a", sa: "b"},
		{name: "bad namespace", td: "td", ns: "a_b", sa: "b"},
		{name: "bad SA", td: "td", ns: "a", sa: "b:c"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if id, err := pki.NewSPIFFEID(tc.td, tc.ns, tc.sa); err == nil {
				t.Fatalf("NewSPIFFEID(%q, %q, %q) = %v, want error", tc.td, tc.ns, tc.sa, id)
			}
		})
	}
}

func TestValidateTrustDomain(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in   string
		want bool
	}{
		{in: "cluster.local", want: true},
		{in: "td_1-x", want: true},
		{in: strings.Repeat("a", 255), want: true},
		{in: strings.Repeat("a", 256)},
		{in: ""},
		{in: "Cluster.local"},
		{in: "td:80"},
		{in: "td/x"},
	}
	for _, tc := range tests {
		t.Run(shortName(tc.in), func(t *testing.T) {
			t.Parallel()
			if err := pki.ValidateTrustDomain(tc.in); (err == nil) != tc.want {
				t.Fatalf("ValidateTrustDomain(%q) = %v, want ok=%v", tc.in, err, tc.want)
			}
		})
	}
}

func TestValidateNamespace(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in   string
		want bool
	}{
		{in: "default", want: true},
		{in: "a", want: true},
		{in: "0", want: true},
		{in: "istio-system", want: true},
		{in: "a1-b2", want: true},
		{in: strings.Repeat("a", 63), want: true},
		{in: strings.Repeat("a", 64)},
		{in: ""},
		{in: "a.b"},
		{in: "-a"},
		{in: "a-"},
		{in: "Default"},
		{in: "a_b"},
		{in: "a b"},
		{in: "a:b"},
	}
	for _, tc := range tests {
		t.Run(shortName(tc.in), func(t *testing.T) {
			t.Parallel()
			if err := pki.ValidateNamespace(tc.in); (err == nil) != tc.want {
				t.Fatalf("ValidateNamespace(%q) = %v, want ok=%v", tc.in, err, tc.want)
			}
		})
	}
}

func TestValidateServiceAccount(t *testing.T) {
	t.Parallel()
	label := strings.Repeat("a", 63)
	longest := label + "." + label + "." + label + "." + strings.Repeat("b", 61) // 253
	tests := []struct {
		in   string
		want bool
	}{
		{in: "default", want: true},
		{in: "a.b", want: true},
		{in: "sleep-v1.example", want: true},
		{in: "0", want: true},
		{in: longest, want: true},
		{in: longest + "b"},
		{in: ""},
		{in: ".a"},
		{in: "a."},
		{in: "a..b"},
		{in: "a.-b"},
		{in: "Sleep"},
		{in: "a_b"},
		{in: "a:b"},
		{in: "a/b"},
	}
	for _, tc := range tests {
		t.Run(shortName(tc.in), func(t *testing.T) {
			t.Parallel()
			if err := pki.ValidateServiceAccount(tc.in); (err == nil) != tc.want {
				t.Fatalf("ValidateServiceAccount(%q) (len %d) = %v, want ok=%v", tc.in, len(tc.in), err, tc.want)
			}
		})
	}
}

// shortName keeps subtest names readable for long inputs.
func shortName(s string) string {
	switch {
	case s == "":
		return "empty"
	case len(s) > 20:
		return fmt.Sprintf("%s..._len_%d", s[:8], len(s))
	default:
		return s
	}
}
