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

// Names names the fields of a Config in a message as a user sets them.
type Names interface {
	// Name names a field; value, when not "", is the value it is named with ({Path=value}).
	Name(field, value string) string
	// Around names a field whose value is shown between what comes before and after it:
	// --ca-addr "x" (CA_ADDR).
	Around(field string) (before, after string)
}

// Paths names each field by its path in the Config.
type Paths struct{}

func (Paths) Name(field, value string) string {
	if value != "" {
		return field + "=" + value
	}
	return field
}

func (Paths) Around(field string) (string, string) { return field, "" }

// Error is the message with every field named by its path in the Config.
func (e *FieldError) Error() string { return e.Render(Paths{}) }

// Render returns the message with every field named by names.
func (e *FieldError) Render(names Names) string {
	text := e.Err.Error()
	if strings.Contains(text, "{"+e.Field+"}") || strings.Contains(text, "{"+e.Field+"=") {
		return expand(text, names)
	}
	switch v := e.Value.(type) {
	case nil:
		return names.Name(e.Field, "") + ": " + expand(text, names)
	case string:
		before, after := names.Around(e.Field)
		return fmt.Sprintf("%s %q%s: %s", before, v, after, expand(text, names))
	default:
		return fmt.Sprintf("%s %v %s", names.Name(e.Field, ""), v, expand(text, names))
	}
}

// placeholder is a field named in a message: {Path} or {Path=value}.
var placeholder = regexp.MustCompile(`\{([A-Z][A-Za-z0-9]*(?:\.[A-Z][A-Za-z0-9]*)*)(?:=([^{}]*))?\}`)

func expand(text string, names Names) string {
	return placeholder.ReplaceAllStringFunc(text, func(m string) string {
		sub := placeholder.FindStringSubmatch(m)
		return names.Name(sub[1], sub[2])
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
		// One level at a time, not errors.As: every FieldError of a joined tree is wanted.
		if fe, ok := err.(*FieldError); ok { //nolint:errorlint // see above
			out = append(out, fe)
			return // a FieldError's cause is rendered with it
		}
		switch u := err.(type) { //nolint:errorlint // see above
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
