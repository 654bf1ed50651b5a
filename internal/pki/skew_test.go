package pki_test

import (
	"crypto/x509"
	"errors"
	"testing"
	"time"

	"github.com/meshid/meshid/internal/pki"
)

func TestValidationTime(t *testing.T) {
	t.Parallel()
	now := time.Date(2031, 3, 14, 9, 26, 0, 0, time.UTC)
	from := func(d time.Duration) *x509.Certificate { return &x509.Certificate{NotBefore: now.Add(d)} }
	tests := []struct {
		name  string
		certs []*x509.Certificate
		want  time.Time
		err   error
	}{
		{name: "valid already", certs: []*x509.Certificate{from(-2 * time.Minute), from(-time.Hour)}, want: now},
		{name: "none", want: now},
		{name: "minutes ahead", certs: []*x509.Certificate{from(3 * time.Minute), from(-time.Hour)}, want: now.Add(3 * time.Minute)},
		{name: "the latest counts", certs: []*x509.Certificate{from(3 * time.Minute), from(28 * time.Minute)}, want: now.Add(28 * time.Minute)},
		{name: "a day ahead", certs: []*x509.Certificate{from(pki.MaxClockSkew)}, want: now.Add(pki.MaxClockSkew)},
		{name: "more than a day ahead", certs: []*x509.Certificate{from(pki.MaxClockSkew + time.Second)}, want: now, err: pki.ErrClockBehind},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := pki.ValidationTime(now, tc.certs...)
			if !errors.Is(err, tc.err) || !got.Equal(tc.want) {
				t.Fatalf("ValidationTime = %s, %v; want %s, %v", got, err, tc.want, tc.err)
			}
		})
	}
}
