package logkey_test

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/meshid/meshid/internal/logkey"
)

func TestUntrustedIsBounded(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		in   string
	}{
		{"short", "kid-1"},
		{"at the limit", strings.Repeat("a", logkey.MaxUntrusted)},
		{"a megabyte kid", strings.Repeat("k", 1<<20)},
		{"multi-byte runes across the cut", strings.Repeat("é", logkey.MaxUntrusted)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got := logkey.Untrusted(tc.in)
			if len(tc.in) <= logkey.MaxUntrusted {
				if got != tc.in {
					t.Fatalf("a short string changed: %q", got)
				}
				return
			}
			if len(got) > logkey.MaxUntrusted+32 || !utf8.ValidString(got) || !strings.Contains(got, "bytes)") {
				t.Fatalf("bounded to %d bytes, valid UTF-8 %v: %q…", len(got), utf8.ValidString(got), got[:40])
			}
		})
	}
}

func TestUntrustedListIsBounded(t *testing.T) {
	t.Parallel()
	names := make([]string, 10000)
	for i := range names {
		names[i] = strings.Repeat("n", 1000)
	}
	got := logkey.UntrustedList(names)
	if len(got) != 9 || got[8] != "…(10000 items)" || len(got[0]) > logkey.MaxUntrusted+32 {
		t.Fatalf("bounded to %d items, last %q", len(got), got[len(got)-1])
	}
	if short := logkey.UntrustedList([]string{"default", "ROOTCA"}); len(short) != 2 || short[1] != "ROOTCA" {
		t.Fatalf("a short list changed: %q", short)
	}
}
