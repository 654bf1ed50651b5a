package pki

import (
	"crypto/x509"
	"errors"
	"fmt"
	"time"
)

// MaxClockSkew bounds how far ahead of our clock a certificate's NotBefore may lie and still be
// taken for clock skew: our clock behind its issuer's. A day covers drift of minutes, and a clock
// kept in a local time zone as if it were UTC; further ahead, our clock (or the issuer's) is
// more likely simply wrong.
const MaxClockSkew = 24 * time.Hour

// ErrClockBehind reports a certificate whose NotBefore lies further ahead of our clock than
// MaxClockSkew.
var ErrClockBehind = errors.New("a certificate not valid for more than a day yet")

// ValidationTime returns when to check the validity of certs, received at now: now, or the latest
// NotBefore among them if it lies ahead of now, by MaxClockSkew at most. A certificate just issued
// by a CA whose clock is ahead of ours by minutes is not valid yet on our clock; peers judge it on
// theirs, as Envoy and Istio's agent let them. Checked at the returned time, which is never before
// now, a certificate that has expired at now is still refused.
func ValidationTime(now time.Time, certs ...*x509.Certificate) (time.Time, error) {
	at := now
	for _, c := range certs {
		if c.NotBefore.After(at) {
			at = c.NotBefore
		}
	}
	if ahead := at.Sub(now); ahead > MaxClockSkew {
		return now, fmt.Errorf("%w: valid from %s, %s after this host's clock (%s); is its clock wrong?",
			ErrClockBehind, at.UTC().Format(time.RFC3339), ahead, now.UTC().Format(time.RFC3339))
	}
	return at, nil
}
