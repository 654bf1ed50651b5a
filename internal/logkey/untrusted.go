package logkey

import (
	"fmt"
	"strconv"
	"unicode/utf8"
)

// MaxUntrusted is how much of a string a client controls (a token's kid, a resource name, a
// NACK's error detail) goes into one log line.
const MaxUntrusted = 256

// Untrusted bounds a client-controlled string for a log line: at most MaxUntrusted bytes, cut on
// a rune boundary and marked with the original length, so that a hostile client cannot turn each
// request into megabytes of log.
func Untrusted(s string) string {
	if len(s) <= MaxUntrusted {
		return s
	}
	cut := MaxUntrusted
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…(" + strconv.Itoa(len(s)) + " bytes)"
}

// UntrustedList bounds a client-controlled list for a log line: the first few items, each
// bounded, and how many there were.
func UntrustedList(items []string) []string {
	const most = 8
	out := make([]string, 0, min(len(items), most+1))
	for i, s := range items {
		if i == most {
			out = append(out, fmt.Sprintf("…(%d items)", len(items)))
			break
		}
		out = append(out, Untrusted(s))
	}
	return out
}
