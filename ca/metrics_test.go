package ca_test

import (
	"crypto/x509"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshid/meshid/ca"
	"github.com/meshid/meshid/internal/testutil"
)

const (
	signingExpiryMetric = "meshid_ca_signing_cert_expiry_timestamp_seconds"
	rootExpiryMetric    = "meshid_ca_root_cert_expiry_timestamp_seconds"
)

type sample struct {
	labels map[string]string
	value  float64
}

func gather(t *testing.T, reg *prometheus.Registry) map[string][]sample {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]sample{}
	for _, mf := range families {
		for _, m := range mf.GetMetric() {
			s := sample{labels: map[string]string{}, value: m.GetGauge().GetValue()}
			for _, l := range m.GetLabel() {
				s.labels[l.GetName()] = l.GetValue()
			}
			out[mf.GetName()] = append(out[mf.GetName()], s)
		}
	}
	return out
}

func TestRegisterMetrics(t *testing.T) {
	t.Parallel()
	now := baseTime()
	// The signing certificate, its issuer and the roots all expire at different times, so that a
	// metric reporting the wrong certificate shows.
	h := newHierarchy(t, now, lifetimes{root: 3 * year, int1: 2 * year, int2: year})
	other := testutil.NewRootCA(t, caOpts("other root", now, 5*year))
	b := newBundle(t, h.int2, []*x509.Certificate{h.int1.Cert}, []*x509.Certificate{other.Cert, h.root.Cert}, now)

	a := ca.New(ca.Config{Clock: testutil.NewFakeClock(now)}, nil)
	reg := prometheus.NewRegistry()
	if err := ca.RegisterMetrics(reg, a); err != nil {
		t.Fatal(err)
	}

	got := gather(t, reg)
	if len(got[signingExpiryMetric])+len(got[rootExpiryMetric]) != 0 {
		t.Fatalf("metrics reported before any bundle: %v", got)
	}

	a.SetBundle(b)
	got = gather(t, reg)
	signing := got[signingExpiryMetric]
	if len(signing) != 1 {
		t.Fatalf("%s has %d samples, want 1", signingExpiryMetric, len(signing))
	}
	if want := float64(h.int2.Cert.NotAfter.Unix()); signing[0].value != want {
		t.Errorf("%s = %v, want the signing certificate's NotAfter %v", signingExpiryMetric, signing[0].value, want)
	}
	if src := signing[0].labels["source"]; src != string(ca.SourcePluggedIn) {
		t.Errorf("source label = %q, want %q", src, ca.SourcePluggedIn)
	}

	roots := got[rootExpiryMetric]
	if len(roots) != 2 {
		t.Fatalf("%s has %d samples, want one per root (2)", rootExpiryMetric, len(roots))
	}
	for _, root := range []*x509.Certificate{h.root.Cert, other.Cert} {
		found := false
		for _, s := range roots {
			if s.labels["serial"] == root.SerialNumber.Text(16) {
				found = true
				if want := float64(root.NotAfter.Unix()); s.value != want {
					t.Errorf("root %q: %s = %v, want %v", root.Subject.CommonName, rootExpiryMetric, s.value, want)
				}
				if s.labels["subject"] != root.Subject.String() {
					t.Errorf("root subject label = %q, want %q", s.labels["subject"], root.Subject.String())
				}
			}
		}
		if !found {
			t.Errorf("no %s sample for root %q", rootExpiryMetric, root.Subject.CommonName)
		}
	}

	// The metrics follow the bundle in service: they are read at scrape time.
	root2 := testutil.NewRootCA(t, caOpts("next root", now, 4*year))
	a.SetBundle(newBundle(t, root2, nil, nil, now))
	got = gather(t, reg)
	if s := got[signingExpiryMetric]; len(s) != 1 || s[0].value != float64(root2.Cert.NotAfter.Unix()) {
		t.Errorf("after SetBundle %s = %v, want %v", signingExpiryMetric, s, root2.Cert.NotAfter.Unix())
	}
	if s := got[rootExpiryMetric]; len(s) != 1 || s[0].value != float64(root2.Cert.NotAfter.Unix()) {
		t.Errorf("after SetBundle %s = %v, want one sample of %v", rootExpiryMetric, s, root2.Cert.NotAfter.Unix())
	}
}
