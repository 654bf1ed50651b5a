// Package configerr is a refusal of one field of a component's Config, named by its path in the
// Config ("Certificate.GraceRatio"), never by a flag or a variable: only cmd knows those, and
// renders each FieldError with them (cmd/internal/cli).
package configerr

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
)

// FieldError is a problem with one field of a Config. Value, when not nil, is the value refused:
// text (an address) is shown quoted and followed by the cause, Err; a number or a duration is
// shown as it is and followed by what it must be, Err ("must be positive").
//
// A rule over several fields names the others in Err's text as {Path}, or {Path=value} for a
// field shown with its value ("{XDS.ProxyDebug=false}"). When that text names Field itself, it is
// the whole message ("{Identity.Namespace} is required with {CA.Address}"); otherwise the
// message is Field, Value and Err.
type FieldError struct {
	Field string
	Value any
	Err   error
}

// Errorf returns a FieldError for field whose message is format's, naming fields as {Path}.
func Errorf(field, format string, args ...any) *FieldError {
	return &FieldError{Field: field, Err: fmt.Errorf(format, args...)}
}

func (e *FieldError) Unwrap() error { return e.Err }

// Error is the message with every field named by its path in the Config.
func (e *FieldError) Error() string {
	return e.Render(func(field, value string) string {
		if value != "" {
			return field + "=" + value
		}
		return field
	}, func(string) string { return "" })
}

// Render returns the message with each field named by name (the field's path, and the value
// shown with it in the message, or ""); after, when not "", follows the refused field's own name
// where its value is shown (a variable after a flag: --ca-addr "x" (CA_ADDR): why).
func (e *FieldError) Render(name func(field, value string) string, after func(field string) string) string {
	text := e.Err.Error()
	if strings.Contains(text, "{"+e.Field+"}") || strings.Contains(text, "{"+e.Field+"=") {
		return expand(text, name)
	}
	field := name(e.Field, "")
	switch v := e.Value.(type) {
	case nil:
		return field + after(e.Field) + ": " + expand(text, name)
	case string:
		return fmt.Sprintf("%s %q%s: %s", field, v, after(e.Field), expand(text, name))
	default:
		return fmt.Sprintf("%s%s %v %s", field, after(e.Field), v, expand(text, name))
	}
}

// placeholder is a field named in a message: {Path} or {Path=value}.
var placeholder = regexp.MustCompile(`\{([A-Z][A-Za-z0-9]*(?:\.[A-Z][A-Za-z0-9]*)*)(?:=([^{}]*))?\}`)

func expand(text string, name func(field, value string) string) string {
	return placeholder.ReplaceAllStringFunc(text, func(m string) string {
		sub := placeholder.FindStringSubmatch(m)
		return name(sub[1], sub[2])
	})
}

// Fields returns the fields err names: every FieldError's Field, and the others their messages
// name, in the order met. A joined or wrapped error is searched through.
func Fields(err error) []string {
	var out []string
	for _, fe := range All(err) {
		out = append(out, fe.Field)
		for _, sub := range placeholder.FindAllStringSubmatch(fe.Err.Error(), -1) {
			out = append(out, sub[1])
		}
	}
	return out
}

// All returns every FieldError in err's tree, outermost first.
func All(err error) []*FieldError {
	var out []*FieldError
	var walk func(error)
	walk = func(err error) {
		if err == nil {
			return
		}
		if fe, ok := err.(*FieldError); ok {
			out = append(out, fe)
			return // a FieldError's cause is rendered with it
		}
		switch u := err.(type) {
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				walk(e)
			}
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		}
	}
	walk(err)
	return out
}

// ErrMustBePositive and ErrMustNotBeNegative are what a number or a duration refused must be.
var (
	ErrMustBePositive    = errors.New("must be positive")
	ErrMustNotBeNegative = errors.New("must not be negative")
)
