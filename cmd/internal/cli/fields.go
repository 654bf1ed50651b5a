package cli

import (
	"strings"

	"github.com/meshid/meshid/internal/configerr"
)

// FieldNames names the fields of one command's Config as its user sets them: the flag of each
// field, by the field's path in the Config, and the variable of each flag that has one.
type FieldNames struct {
	Flags map[string]string // "CA.Address": "ca-addr"
	Env   map[string]string // "ca-addr": "CA_ADDR"
}

// Name is how a message names a field: "--ca-addr (CA_ADDR)", or with the value it is shown
// with, "--proxy-xds-debug-via-agent=false (PROXY_XDS_DEBUG_VIA_AGENT)". A field with no flag
// keeps its path.
func (n FieldNames) Name(field, value string) string {
	flag, ok := n.Flags[field]
	if !ok {
		if value != "" {
			return field + "=" + value
		}
		return field
	}
	name := "--" + flag
	if value != "" {
		name += "=" + value
	}
	if env := n.Env[flag]; env != "" {
		name += " (" + env + ")"
	}
	return name
}

// Around names a field whose value is shown within: --ca-addr "x" (CA_ADDR).
func (n FieldNames) Around(field string) (before, after string) {
	flag, ok := n.Flags[field]
	if !ok {
		return field, ""
	}
	if env := n.Env[flag]; env != "" {
		return "--" + flag, " (" + env + ")"
	}
	return "--" + flag, ""
}

// RenderConfigErrors renders each *configerr.FieldError in err with the flags and variables of
// names: a component names the fields of its Config by their path, and only cmd knows how a user
// sets them. The text around them (a wrapping error, the others joined) is kept, and the result
// still wraps err.
func RenderConfigErrors(err error, names FieldNames) error {
	fields := configerr.All(err)
	if len(fields) == 0 {
		return err
	}
	msg := err.Error()
	for _, fe := range fields {
		msg = strings.Replace(msg, fe.Error(), fe.Render(names), 1)
	}
	return renderedError{msg: msg, err: err}
}

// renderedError is an error shown as msg, still wrapping what it renders.
type renderedError struct {
	msg string
	err error
}

func (e renderedError) Error() string { return e.msg }
func (e renderedError) Unwrap() error { return e.err }
