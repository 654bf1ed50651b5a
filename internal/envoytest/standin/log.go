package main

import (
	"io"
	"log/slog"
)

// Log attribute keys.
const (
	keyError    = "error"
	keyRetryIn  = "retry_in"
	keyType     = "type_url"
	keyVersion  = "version"
	keyName     = "name"
	keyAddress  = "address"
	keyPath     = "path"
	keyMethod   = "method"
	keyRemote   = "remote"
	keyState    = "state"
	keyTarget   = "target"
	keyGraceful = "graceful"
	keyInbound  = "inbound_only"
)

// newLogger writes to stderr at Envoy's -l level; "off" writes nothing.
func newLogger(w io.Writer, level string) *slog.Logger {
	var l slog.Level
	switch level {
	case "off":
		w = io.Discard
	case "trace", "debug":
		l = slog.LevelDebug
	case "warning", "warn":
		l = slog.LevelWarn
	case "error", "critical":
		l = slog.LevelError
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l}))
}
