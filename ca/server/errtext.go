package server

import (
	"strconv"
	"unicode/utf8"
)

// maxErrorText bounds a refusal's text, in the log and in the status sent back. The strings a
// client controls are bounded where they are quoted (logkey.Untrusted), but a library's error may
// quote more: x509's names the subject of a certificate the client presented.
const maxErrorText = 1024

func boundErrorText(s string) string {
	if len(s) <= maxErrorText {
		return s
	}
	cut := maxErrorText
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…(" + strconv.Itoa(len(s)) + " bytes)"
}
